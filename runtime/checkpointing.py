"""Activation checkpointing per unit: ``full`` and ``selective`` recomputation.

* ``full``: the unit's forward runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
  only its inputs are kept and the whole unit is recomputed in backward.
* ``selective``: the same checkpoint with a selective policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, op-level SAC as in torchtitan)
  that keeps the outputs of the weight GEMMs (``mm``/``addmm``, fp8 and grouped ones too) and of TP
  collectives and recomputes everything else: the attention core — the scaled-dot-product-attention
  op, whose ATen name depends on the device (:data:`SDPA_OPS`), or ``bmm``/``softmax`` in math
  attention — as Korthikanti et al.'s selective recomputation asks, and also the cheap norms and
  elementwise ops. The cost model prices it as the ``gemms`` policy (:mod:`costmodel.recompute`). (Saving *every* non-attention output is not possible with SAC: ops such as
  RMSNorm's in-place ``add_`` mutate cached tensors.)

The module keeps its name and parameters: its ``forward`` is wrapped on the instance, so this
composes with FSDP2 (apply checkpointing first, then ``fully_shard``; FSDP2 units nested inside a
selectively checkpointed unit too, :class:`_RecomputeUnsaved`) and with DTensor TP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

#: The fused attention op per device type, as dispatched by ``F.scaled_dot_product_attention``.
SDPA_OPS: dict[str, tuple[str, ...]] = {
    "cpu": ("_scaled_dot_product_flash_attention_for_cpu",),
    "cuda": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention"),
}
#: Ops of unfused (math) attention; recomputed under ``selective`` on every device.
MATH_ATTENTION_OPS = ("bmm", "_softmax", "baddbmm", "_safe_softmax")
#: Ops whose outputs ``selective`` saves: the weight GEMMs, and collectives (recomputing them
#: would repeat communication). Everything else is recomputed.
SAVE_OPS = ("mm", "addmm", "_scaled_mm", "_grouped_mm")
SAVE_COLLECTIVES = ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce")


def recompute_ops(device: str) -> set[Any]:
    """ATen overload packets of the attention core on ``device`` (always recomputed)."""
    names = SDPA_OPS.get(device, ()) + MATH_ATTENTION_OPS
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


def save_ops() -> set[Any]:
    """Overload packets whose outputs selective checkpointing keeps."""
    out = {getattr(aten, n) for n in SAVE_OPS if hasattr(aten, n)}
    funcol = getattr(torch.ops, "_c10d_functional", None)
    if funcol is not None:
        out |= {getattr(funcol, n) for n in SAVE_COLLECTIVES if hasattr(funcol, n)}
    return out


def selective_policy(device: str) -> Callable[..., CheckpointPolicy]:
    """Policy: keep weight-GEMM (and collective) outputs; recompute the attention core and the rest."""
    attention, keep = recompute_ops(device), save_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if packet in keep and packet not in attention:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _RecomputeUnsaved(TorchDispatchMode):
    """The recomputation side of selective checkpointing: an op whose output the policy never
    saves runs again without asking the cache; the saved ops go to ``cached`` (torch's mode, which
    hands back their outputs by their order of call).

    torch's own mode counts every op, saved or not, and fails on an op called more often than in
    forward. FSDP2 units nested inside the checkpointed unit run their hooks inside the region, and
    in backward they do different bookkeeping (``record_function`` markers, copies; the parameters
    are already gathered): counting those fails (``... not found in storage``). Saved ops (weight
    GEMMs, functional collectives) are the module's own and come in the same order both times.
    """

    def __init__(self, cached: TorchDispatchMode, saved: set[Any], attention: set[Any]) -> None:
        super().__init__()
        self.cached, self.saved, self.attention = cached, saved, attention

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = getattr(func, "overloadpacket", func)
        if packet not in self.saved or packet in self.attention:
            return func(*args, **(kwargs or {}))
        return self.cached.__torch_dispatch__(func, types, args, kwargs)


def selective_contexts(device: str) -> tuple[Any, Any]:
    """The forward and recomputation contexts of selective checkpointing on ``device``."""
    caching, cached = create_selective_checkpoint_contexts(selective_policy(device))
    return caching, _RecomputeUnsaved(cached, save_ops(), recompute_ops(device))


def wrap(module: nn.Module, mode: str, device: str) -> None:
    """Make ``module``'s forward recompute in backward (``mode``: ``full`` or ``selective``)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute '{mode}' is not one of none, full, selective")
    inner = module.forward
    if mode == "full":
        def forward(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    else:
        context_fn = functools.partial(selective_contexts, device)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    module._shardplan_recompute = mode  # type: ignore[attr-defined]
