"""How fast the searches are: vectorized pricing throughput and full-space plans at scale.

    python benchmarks/solver_speed.py              # everything
    python benchmarks/solver_speed.py --cases 70b  # one case
    python benchmarks/solver_speed.py --space staged  # every unit of a pipeline its own sharding

Targets (full space, default memory): Llama-3 70B on 1,024 H100 <= 5 s; Llama-3.1 405B on 16,384
H100 <= 30 s; GPT-3 175B on 1,024 A100-80GB <= 5 s; Mixtral 8x22B on 256 H100 (with EP) <= 10 s;
uniform-plan pricing >= 100,000 candidates/s for an 80-layer model.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.vectorized import price_grid  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from solvers.space import SPACES, mesh_configs  # noqa: E402
from vocab.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Workload  # noqa: E402

CASES = {  # name: (model, cluster, seq_len, global batch, target seconds)
    "70b": ("llama3-70b", "1024xh100", 8192, 1024, 5.0),
    "405b": ("llama3.1-405b", "16384xh100", 8192, 2048, 30.0),
    "175b": ("gpt3-175b", "1024xa100-80gb", 2048, 1536, 5.0),
    "mixtral": ("mixtral-8x22b", "256xh100", 4096, 512, 10.0),
}


def vectorized_throughput(n_configs: int = 4000) -> float:
    g, cl = load_model("llama3-70b", 8192), parse_cluster("1024xh100")
    w = Workload(seq_len=8192, global_batch=1024)
    configs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))[:n_configs]
    options = [
        LayerStrategy(sharding=a, recompute=b, offload=c)  # type: ignore[arg-type]
        for a, b, c in itertools.product(SHARDINGS, RECOMPUTES, OFFLOADS)
    ]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        gr = price_grid(g, cl, w, configs, options)
        best = min(best, time.perf_counter() - t0)
    rate = gr.size / best
    print(
        f"vectorized pricing, {g.model_id} ({g.num_blocks} layers): {gr.size:,} candidates in {best:.2f} s = "
        f"{rate:,.0f} candidates/s (target >= 100,000: {'met' if rate >= 1e5 else 'MISSED'})"
    )
    return rate


def run_case(name: str, space: str = "full") -> float:
    model, cluster, seq, gb, target = CASES[name]
    g, cl = load_model(model, seq), parse_cluster(cluster)
    w = Workload(seq_len=seq, global_batch=gb)
    t0 = time.perf_counter()
    r = search(g, cl, w, space, top_k=5)
    wall = time.perf_counter() - t0
    s = r.best.strategy
    mesh = " ".join(f"{k}={v}" for k, v in s.mesh.axes().items() if v > 1) + (
        f" ep={s.mesh.ep}" if s.mesh.ep > 1 else ""
    )
    met = "met" if wall <= target else "MISSED"
    print(
        f"{name:8s} {model} on {cluster} [{space}]: {wall:6.2f} s (target {target:g} s: {met})"
        f" | {r.status}, step {r.objective:.3f} s, MFU {r.best.report.mfu:.1%}, "
        f"{r.options['configurations']:,} meshes, {r.options['configurations_priced']:,} priced, "
        f"{r.candidates:,} candidates | {mesh} "
        f"mb={s.micro_batch} {s.schedule}{'/vpp' + str(s.vpp) if s.vpp > 1 else ''} {s.default.sharding} "
        f"recompute={s.default.recompute} (+{len(s.layers)} entries) [{r.solver}, {r.best.family}]"
    )
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--no-vectorized", action="store_true")
    ap.add_argument("--space", default="full", choices=list(SPACES), help="search space (targets are for full)")
    a = ap.parse_args()
    if not a.no_vectorized:
        vectorized_throughput()
    for name in a.cases:
        run_case(name, a.space)


if __name__ == "__main__":
    main()
