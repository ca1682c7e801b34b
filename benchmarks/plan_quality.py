"""Planned vs published: does the search find at least what experts ran (both priced by the model)?

    python benchmarks/plan_quality.py           # a representative run per source and model family
    python benchmarks/plan_quality.py --all     # every distinct published run the cost model prices

For each published run (``costmodel.published.runs``: CSV row -> model, cluster, strategy, workload) the
same model, cluster, sequence length and global batch are planned over the ``full`` space, with the
memory limit the published configuration itself needs if the model says it needs more than the GPU
has. The ratio planned-throughput / published-throughput (predicted, same tokens per step) must be
>= 1.0 whenever the published configuration lies in the space; the script says when it does not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.estimate import estimate  # noqa: E402
from costmodel.published.runs import build_graph, load_published  # noqa: E402
from costmodel.report import GIB  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from solvers.space import SPACES, mesh_configs  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402
from vocab.strategy import MeshConfig  # noqa: E402


def in_space(graph, cluster, w, s) -> bool:  # type: ignore[no-untyped-def]
    """Whether the published strategy is one of the full space's plans (see solvers.hybrid)."""
    opts = SPACES["full"]
    m = s.mesh
    cfg = MeshConfig.of(s)
    if cfg not in set(mesh_configs(graph, cluster, w, opts)):
        return False
    units = [name for name, _ in graph.blocks()]
    if any(e.unit not in units for e in s.layers):  # operator entries: only OSDP's own forms are searched
        return False
    eff = [s.for_unit(u) for u in units]
    if any(
        e.split != 1
        or e.sharding not in opts.shardings
        or e.recompute not in opts.recomputes
        or e.offload not in opts.offloads
        for e in eff
    ):
        return False
    if m.pp == 1:
        return s.stage_layers is None
    one = len({(e.sharding, e.offload) for e in eff}) == 1  # pipelines: one sharding and offload
    return one and (s.stage_layers is None or (s.vpp == 1 and min(s.stage_layers) >= 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every distinct run, not one per source and model")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per plan")
    a = ap.parse_args()
    rows, _ = load_published()
    runs, seen = [], set()
    for r in rows:
        key = r.key if a.all else (r.source.split(" ")[0], r.model.split(" (")[0], r.cluster.world_size > 512)
        if key not in seen:
            seen.add(key)
            runs.append(r)
    print(f"{len(runs)} published runs")
    worst = float("inf")
    for r in runs:
        g = build_graph(r.config, r.workload.seq_len)
        pub = estimate(g, r.cluster, r.strategy, r.workload)
        limit = max(r.cluster.memory_bytes / GIB, pub.memory_peak_gib)
        t0 = time.perf_counter()
        try:
            res = search(
                g, r.cluster, r.workload, "full", memory_limit_gib=limit, time_limit=a.time_limit, top_k=1
            )
        except ShardplanError as e:
            print(f"  {r.model[:34]:34s} {r.cluster.name:>16s}: no plan ({e})")
            continue
        wall = time.perf_counter() - t0
        ratio = pub.step_time_s / res.objective  # same tokens per step: throughput ratio
        member = in_space(g, r.cluster, r.workload, r.strategy)
        if member:
            worst = min(worst, ratio)
        s, m, wl = res.best.strategy, r.strategy.mesh, r.workload
        needs = "" if pub.fits else f" (needs {pub.memory_peak_gib:.0f} GiB)"
        outside = "" if member else " (published plan outside the space)"
        print(
            f"  {r.model[:34]:34s} {r.cluster.name:>16s} seq {wl.seq_len:>6} gb {wl.global_batch:>5}:"
            f" published tp{m.tp} pp{m.pp} cp{m.cp} dp{m.dp} {r.strategy.default.sharding} -> "
            f"{pub.step_time_s:.3f} s{needs}; planned "
            f"tp{s.mesh.tp} pp{s.mesh.pp} cp{s.mesh.cp} dp{s.mesh.dp} {s.default.sharding} {s.schedule} -> "
            f"{res.objective:.3f} s | ratio {ratio:.3f}{outside} [{res.status}, {wall:.1f} s]"
        )
    print(
        f"worst ratio over runs inside the space: {worst:.3f} ({'ok' if worst >= 1 - 1e-9 else 'BELOW 1.0'})"
    )


if __name__ == "__main__":
    main()
