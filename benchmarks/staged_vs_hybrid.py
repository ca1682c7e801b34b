"""Per-layer sharding inside pipeline stages (``staged``) against one sharding per pipeline (``hybrid``).

    python benchmarks/staged_vs_hybrid.py
    python benchmarks/staged_vs_hybrid.py --model llama3-8b --cluster 16xh100 --seq 8192 --batch 32

For each memory limit: the best plan of each space, the predicted speed-up of ``staged`` (every
unit of a pipeline its own sharding, offload, recomputation and operator options, solved per mesh
as a MIP) over ``hybrid`` (the search's default for pipelines: one sharding and offload per mesh,
per-layer recomputation, free stage boundaries), what the staged plan mixes, and both search times.
Both are exact within their spaces, so the speed-up is never below 1.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.device import DeviceModel  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402
from vocab.strategy import Strategy, Workload  # noqa: E402


def describe(s: Strategy) -> str:
    m = s.mesh
    mesh = " x ".join(f"{k} {v}" for k, v in (("pp", m.pp), ("dp_shard", m.dp_shard), ("dp_rep", m.dp_replicate),
                                              ("cp", m.cp), ("tp", m.tp), ("ep", m.ep)) if v > 1) or "1 GPU"
    units = Counter(e.sharding for e in s.layers if e.unit.count(".") <= 1)
    splits = sum(e.split > 1 for e in s.layers)
    ops = sum(e.unit.count(".") > 1 for e in s.layers)
    return (f"{mesh}, {s.schedule}, mb {s.micro_batch}, default {s.default.sharding}/{s.default.recompute}; "
            f"{dict(units) or 'no'} units apart, {ops} operator entries ({splits} split)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cluster", default="16xh100")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--limits", default="20,24,28,32,40")
    a = ap.parse_args()
    g, cl = load_model(a.model, a.seq), parse_cluster(a.cluster)
    w = Workload(seq_len=a.seq, global_batch=a.batch)
    dev = DeviceModel(cl)
    print(f"{a.model} on {a.cluster}, seq {a.seq}, global batch {a.batch}")
    print(f"{'limit GiB':>9} {'hybrid s':>9} {'staged s':>9} {'speed-up':>8} {'t hybrid':>8} {'t staged':>8}  staged plan")
    for limit in (float(x) for x in a.limits.split(",")):
        res = {}
        for space in ("hybrid", "staged"):
            try:
                res[space] = search(g, cl, w, space, memory_limit_gib=limit, device=dev, top_k=1)
            except ShardplanError:
                res[space] = None
        h, s = res["hybrid"], res["staged"]
        if s is None:
            print(f"{limit:9.1f} {'none fits':>9}")
            continue
        hs = f"{h.objective:9.3f}" if h else f"{'none':>9}"
        up = f"{h.objective / s.objective:7.3f}x" if h else "   (inf)"
        th = f"{h.time_s:7.1f}s" if h else f"{'':>8}"
        print(f"{limit:9.1f} {hs} {s.objective:9.3f} {up} {th} {s.time_s:7.1f}s  {describe(s.best.strategy)}")


if __name__ == "__main__":
    main()
