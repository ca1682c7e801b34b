"""python: a short script that applies the plan with the project's runtime inside torch.distributed.

It writes for the ``shardplan`` target (``vocab/targets/shardplan.yaml``): what the runtime runs. The
plan is embedded (without its alternatives) as data, a Python literal of the plan document that
``vocab.plan.parse_plan`` validates when the script starts; no document string becomes code (every
string is written by ``repr``). The script runs on its own:
``torchrun --nnodes N --nproc-per-node G plan.py [steps]``.
"""

from __future__ import annotations

import ast
import json
import pprint
from typing import Any

from planner.exports.base import Nearest, header
from planner.exports.keys import PYTHON
from vocab.errors import ShardplanError
from vocab.strategy import Strategy

SUFFIX = ".py"

TEMPLATE = '''"""Train the plan's model for a few steps on random tokens with the plan below (run under torchrun)."""

import sys

import torch
import torch.distributed as dist

from vocab.plan import parse_plan
from {apply_module} import {apply}, {optimizer}
from {model_module} import {model_cls}, {config}
from {train_module} import {batch}, {step}

PLAN_DOCUMENT = {plan_literal}
PLAN = parse_plan(PLAN_DOCUMENT)


def main(steps: int = 3) -> None:
    dist.init_process_group()
    m, w = PLAN.strategy.mesh, PLAN.inputs.workload
    cfg = {config}(PLAN.inputs.model)
    torch.manual_seed(0)  # every rank builds the same model; {apply} keeps this rank's part
    model = {apply}({model_cls}(cfg), PLAN)
    opt = {optimizer}(model, torch.optim.AdamW, lr=1e-4)
    dev = next(p.device for p in model.parameters())
    rank = dist.get_rank()
    n_mb = PLAN.strategy.num_microbatches(w.global_batch)
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        data = torch.randint(0, cfg.vocab, (w.global_batch, w.seq_len + 1), generator=g)
        # this rank's rows and, with context parallelism or TSP, its tokens of each sequence
        tokens, targets = {batch}(model, data[:, :-1]).to(dev), {batch}(model, data[:, 1:]).to(dev)
        loss = {step}(model, tokens, targets, n_mb)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if loss is not None:
            print(f"rank {{rank}} step {{k}}: loss {{float(loss):.4f}}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
'''


def adjust(n: Nearest) -> None:
    c = n.plan.inputs.cluster
    n.notes.append(f"run: torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} <script> [steps]")


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
