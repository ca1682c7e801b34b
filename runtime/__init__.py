"""Run a plan: apply it to a PyTorch model with torch.distributed, train, and measure.

Public API::

    from runtime import apply_plan, build_optimizer, train_step, state_bytes
    model = apply_plan(model, plan)            # inside an initialised process group
    opt = build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = train_step(model, tokens, targets)  # forward + backward (any plan, pipelines too)
    opt.step(); opt.zero_grad()
    state_bytes(model, opt)                    # {param_bytes, grad_bytes, optim_bytes} of this rank

With tensor parallelism the model returns vocabulary-sharded logits (a DTensor): a loop of one's
own computes the loss and runs its backward inside ``loss_context(tp)`` (``loss_parallel``), as
``train_step`` does. Each rank passes its part of the global batch, ``local_batch(model, tokens)``:
its data-parallel rows and, with context parallelism or TSP, its tokens of each sequence.

Heavy modules (torch.distributed) load on first use of these names.
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply_plan", "build_optimizer", "train_step", "state_bytes", "loss_context", "local_batch", "shard_sequence",
           "Transformer", "PlanMismatchError"]

_WHERE = {
    "apply_plan": "runtime.apply",
    "build_optimizer": "runtime.apply",
    "train_step": "runtime.train",
    "local_batch": "runtime.train",
    "state_bytes": "runtime.memory",
    "loss_context": "runtime.tensor_parallel",
    "shard_sequence": "runtime.context_parallel",
    "Transformer": "runtime.model",
    "PlanMismatchError": "runtime.validate",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
