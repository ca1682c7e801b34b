"""python: a short script that applies the plan with the project's runtime inside torch.distributed.

It writes for the ``shardplan`` target (``vocab/targets/shardplan.yaml``): what the runtime runs. The
plan is embedded (without its alternatives) as data, a Python literal of the plan document that
``vocab.plan.parse_plan`` validates when the script starts; no document string becomes code (every
string is written by ``repr``). The script runs on its own:
``torchrun --nnodes N --nproc-per-node G plan.py [steps] [--data FILE] [--weights DIR] [--save DIR]
[--resume DIR]``: the model built on the meta device, each rank filling only its shards, at the
plan's precision; a model the reference model cannot build is refused (what it lacks named).
"""

from __future__ import annotations

import ast
import json
import pprint
from typing import Any

from planner.trainers.exporting import Nearest, header
from planner.trainers.python.keys import PYTHON
from vocab.errors import ShardplanError
from vocab.strategy import Strategy

SUFFIX = ".py"

TEMPLATE = '''"""Train the plan's model with the plan below, under torchrun. The model is built on the meta device
and each rank draws (or, with --weights, reads from a Hugging Face safetensors checkpoint) only the
shards it holds; batches come from a token file (--data: .npy, or nanoGPT's uint16 .bin) or seeded
random tokens; --save writes a torch.distributed.checkpoint after the last step and --resume starts
from one (written by this plan or another plan of the same model). --dry-run builds the model on
the meta device, allocating nothing, says its size and stops (no process group, no step)."""

import argparse

import torch
import torch.distributed as dist

from vocab.plan import parse_plan
from {apply_module} import {apply}, {optimizer}
from {model_module} import build, initializer, spec_for, spec_for_weights
from {train_module} import TrainSettings, batch, make_optimizer_kwargs, {batch}, {step}

PLAN_DOCUMENT = {plan_literal}
PLAN = parse_plan(PLAN_DOCUMENT)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split(chr(10))[0])
    ap.add_argument("steps", nargs="?", type=int, default=3, help="optimizer steps (default 3)")
    ap.add_argument("--data", help="token file to read the batches from (default: seeded random tokens)")
    ap.add_argument("--weights", help="Hugging Face checkpoint directory (config.json, *.safetensors) to start from")
    ap.add_argument("--save", help="checkpoint directory to write after the last step")
    ap.add_argument("--resume", help="checkpoint directory to start from")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the random tokens")
    ap.add_argument("--dry-run", action="store_true", help="build the model on the meta device and stop")
    return ap.parse_args()


def main() -> None:
    a = arguments()
    w = PLAN.inputs.workload
    spec = spec_for_weights(a.weights) if a.weights else spec_for(PLAN.inputs.model, init="seeded")
    model, vocab = build(spec, seed=a.seed, meta=True)  # shapes only: nothing allocated
    if a.dry_run:
        n = sum(p.numel() for p in model.parameters())
        on_meta = all(p.is_meta for p in model.parameters())
        print(f"{{spec['config']['name']}}: {{n:,}} parameters built on the meta device (all on meta: {{on_meta}})")
        return
    from runtime import dcp
    from runtime.precision import Precision

    dist.init_process_group()
    s = TrainSettings(steps=a.steps, global_batch=w.global_batch, seq_len=w.seq_len, seed=a.seed,
                      precision=w.precision, grad_dtype=w.grad_dtype, data=a.data)
    mp = s.mixed().fsdp_policy() if s.mixed().low else None  # bf16 compute, fp32 masters (runtime.precision)
    model = {apply}(model, PLAN, mixed_precision=mp, fp8_linears=w.precision == "fp8",
                    init=initializer(spec, a.seed))  # each rank fills its shards
    opt = {optimizer}(model, torch.optim.AdamW, **make_optimizer_kwargs(s))
    dev = next(p.device for p in model.parameters())
    rank = dist.get_rank()
    n_mb = PLAN.strategy.num_microbatches(w.global_batch)
    start = dcp.load(model, opt, a.resume) if a.resume else 0
    for k in range(start, start + a.steps):
        x, y = batch(k, s, vocab)
        # this rank's rows and, with context parallelism or TSP, its tokens of each sequence
        tokens, targets = {batch}(model, x).to(dev), {batch}(model, y).to(dev)
        loss = {step}(model, tokens, targets, n_mb)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss is not None:
            print(f"rank {{rank}} step {{k}}: loss {{float(loss):.4f}}", flush=True)
    if a.save:
        dcp.save(model, opt, a.save, start + a.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def adjust(n: Nearest) -> None:
    c = n.plan.inputs.cluster
    n.notes.append(f"run: torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} <script> [steps] "
                   "[--data FILE] [--weights DIR] [--save DIR] [--resume DIR] (--dry-run: build on meta, no step)")
    missing = _unbuildable(n.plan.inputs.model)
    if missing:
        n.lose("model", f"the runtime's reference model cannot build '{n.plan.inputs.model}'", lacks=missing)


def _unbuildable(model: str) -> str:
    """What of ``model`` the runtime's reference model lacks ("" when it builds it, or when the name
    does not resolve here: the script then says so when it starts)."""
    from profiler.models import resolve_config
    from runtime.features import unsupported_features

    try:
        cfg = resolve_config(model)
    except ShardplanError:
        return ""
    return "; ".join(unsupported_features(cfg))


def python_literal(data: Any) -> str:
    """JSON data as a Python literal (strings by ``repr``), checked to read back as the same data."""
    text = pprint.pformat(data, width=110, sort_dicts=False)
    if ast.literal_eval(text) != data:
        raise ShardplanError("the plan does not write as a Python literal of itself; nothing written")
    return text


def render(n: Nearest, s: Strategy, cost: str) -> str:
    plan = n.plan.model_copy(update={"strategy": s, "alternatives": []})
    text = TEMPLATE.format(apply_module=PYTHON["apply_module"], apply=PYTHON["apply"],
                           optimizer=PYTHON["optimizer"], model_module=PYTHON["model_module"],
                           model_cls=PYTHON["model"], config=PYTHON["config"], train_module=PYTHON["train_module"],
                           step=PYTHON["step"], batch=PYTHON["batch"],
                           plan_literal=python_literal(json.loads(plan.to_json())))
    return header(n.plan, n.label, n.losses, cost) + text
