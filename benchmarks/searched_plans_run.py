"""The plans the search picks for the runtime run, and train like one process.

    python benchmarks/searched_plans_run.py                    # GPT-2 on 4 CPU ranks, three memory limits
    python benchmarks/searched_plans_run.py --limits 4 1.2 --steps 2
    python benchmarks/searched_plans_run.py --limits --forced  # only the forced plans

For each memory limit, ``shardplan plan --target shardplan`` (the default) searches the full space
for GPT-2 (seq 256, global batch 8) on ``4xcpu``; ``shardplan train --check-parity`` then runs
the plan on 4 local processes and, in one process, the same training; the table shows the plan,
whether the losses agree (``rtol`` of ``shardplan train``), the largest loss gap, and rank 0's
parameter, gradient and optimizer bytes as measured and as the plan's cost model predicts them.
With ``--forced``, plans the search may pick are forced the same way (:data:`FORCED`: context
parallelism ring and Ulysses, expert parallelism on ``tiny-mixtral``, TSP, OSDP splits with TP).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.estimate import estimate  # noqa: E402
from planner.reprice import plan_from_strategy  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from profiler.transformer import build_graph  # noqa: E402
from runtime.model import TINY_MODELS  # noqa: E402
from runtime.plans import hand_plan  # noqa: E402
from vocab.plan import load_plan  # noqa: E402
from vocab.strategy import LayerStrategy as L  # noqa: E402
from vocab.strategy import Mesh, Strategy, Workload  # noqa: E402


def _shardplan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True, cwd=ROOT)


def _describe(s: object) -> str:
    m = s.mesh  # type: ignore[attr-defined]
    mesh = " ".join(f"{k}={v}" for k, v in {**m.axes(), "ep": m.ep}.items() if v > 1) or "one rank"
    modes = [x for x, on in (("TSP", s.tp_mode == "tsp"), ("SP", s.sequence_parallel),  # type: ignore[attr-defined]
                             ("Ulysses", m.cp > 1 and s.cp_mode == "ulysses"),  # type: ignore[attr-defined]
                             ("split", any(ls.split > 1 for ls in [s.default, *s.layers]))) if on]  # type: ignore[attr-defined]
    mesh += "".join(f" {x}" for x in modes)
    shard = {ls.sharding for ls in [s.default, *s.layers]}  # type: ignore[attr-defined]
    rc = {ls.recompute for ls in [s.default, *s.layers]}  # type: ignore[attr-defined]
    return f"{mesh}, mb {s.micro_batch}, {'/'.join(sorted(shard))}, recompute {'/'.join(sorted(rc))}"  # type: ignore[attr-defined]


#: forced plans: (model, strategy) on the benchmark's cluster
FORCED = {
    "cp=2 ring": ("gpt2", Strategy(mesh=Mesh(dp_shard=2, cp=2), default=L(sharding="zero3"))),
    "cp=2 Ulysses": ("gpt2", Strategy(mesh=Mesh(dp_shard=2, cp=2), cp_mode="ulysses", default=L(sharding="zero2"))),
    "ep=2": ("tiny-mixtral", Strategy(mesh=Mesh(dp_shard=4, ep=2), default=L(sharding="zero3"))),
    "TSP tp=2": ("gpt2", Strategy(mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", default=L(sharding="zero3"))),
    "split=2 + tp=2": ("gpt2", Strategy(mesh=Mesh(dp_shard=2, tp=2), sequence_parallel=True,
                                        default=L(sharding="zero3", split=2))),
}


def run(model: str, cluster: str, seq: int, batch: int, limit: float | None, steps: int, tmp: Path,
        forced: Strategy | None = None) -> dict:
    plan_file = tmp / f"plan-{limit}.json"
    if forced is not None:  # a tiny runtime model has no preset to price: its plan is written as given
        plan = (hand_plan(model, forced, seq, batch) if model in TINY_MODELS else
                plan_from_strategy(model, cluster, forced, seq, batch, precision="fp32"))
        plan.save(plan_file)
    else:
        args = ["plan", "--model", model, "--cluster", cluster, "--seq-len", str(seq), "--global-batch", str(batch),
                "-o", str(plan_file)] + (["--memory-limit", str(limit)] if limit else [])
        r = _shardplan(*args)
        if r.returncode:
            return {"limit": limit, "error": r.stderr.strip().splitlines()[-1]}
    plan = load_plan(plan_file)
    world = plan.strategy.mesh.world_size
    t0 = time.perf_counter()
    r = _shardplan("train", "--model", model, "--plan", str(plan_file), "--nproc", str(world), "--steps", str(steps),
                   "--seq-len", str(seq), "--global-batch", str(batch), "--check-parity", "--json")
    wall = time.perf_counter() - t0
    if r.returncode:
        return {"limit": limit, "plan": _describe(plan.strategy), "error": (r.stderr or r.stdout).strip()[-300:]}
    rep = json.loads(r.stdout)
    w = Workload(seq_len=seq, global_batch=batch, precision="fp32")
    graph = build_graph(TINY_MODELS[model], seq) if model in TINY_MODELS else load_model(model, seq)
    pred = estimate(graph, parse_cluster(cluster), plan.strategy, w).stages[0]
    r0 = rep["steps"][-1]["ranks"][0]
    return {"limit": limit, "plan": _describe(plan.strategy), "parity": rep["parity"],
            "max_loss_diff": rep["max_loss_diff"], "loss": rep["steps"][-1]["loss"],
            "measured": (r0["param_bytes"], r0["grad_bytes"], r0["optim_bytes"]),
            "predicted": (pred.param_bytes, pred.grad_bytes, pred.optim_bytes), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--cluster", default="4xcpu")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--limits", type=float, nargs="*", default=[0.0, 1.2, 0.95],
                    help="GiB per rank; 0 = the default (the device's memory less the reserve)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--forced", action="store_true", help="also train the forced plans (FORCED)")
    a = ap.parse_args()
    print(f"{a.model} on {a.cluster}, seq {a.seq_len}, global batch {a.global_batch}, {a.steps} steps, fp32")
    print("| memory limit | plan | parity | largest loss gap | rank 0 bytes (params, grads, optimizer) measured | "
          "predicted | train wall |")
    print("|---|---|---|---|---|---|---|")
    rows = [(f"{limit:g} GiB" if limit else "default", a.model, limit or None, None) for limit in a.limits]
    if a.forced:
        rows += [(f"forced {name} ({model})", model, None, s) for name, (model, s) in FORCED.items()]
    with tempfile.TemporaryDirectory() as d:
        for label, model, limit, forced in rows:
            res = run(model, a.cluster, a.seq_len, a.global_batch, limit, a.steps, Path(d), forced)
            if "error" in res:
                print(f"| {label} | {res.get('plan', '-')} | error: {res['error']} | | | | |", flush=True)
                continue
            print(f"| {label} | {res['plan']} | {res['parity']} | {res['max_loss_diff']:.2e} | "
                  f"{', '.join(f'{x:,}' for x in res['measured'])} | {', '.join(f'{x:,}' for x in res['predicted'])} | "
                  f"{res['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
