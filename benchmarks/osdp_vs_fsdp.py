"""OSDP against plain FSDP at equal memory limits (GPT-2 1.5B class on 8 GPUs), and DP vs ILP.

    python benchmarks/osdp_vs_fsdp.py

For each limit: the best FSDP/HSDP plan (uniform ZeRO-2/3, recomputation, parameter offload), the
best OSDP plan (per unit and per large operator: replicate ... ZeRO-3, splitting, recomputation,
offload) and the predicted speed-up; then both OSDP solvers on the winning mesh (they must agree).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.device import DeviceModel  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from solvers.chain import mesh_problem  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from solvers.osdp_dp import solve_dp  # noqa: E402
from solvers.osdp_ilp import solve_ilp  # noqa: E402
from solvers.space import SPACES  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402
from vocab.strategy import MeshConfig, Workload  # noqa: E402

MODEL, CLUSTER, SEQ, BATCH = "gpt2-xl", "8xh100", 1024, 64
LIMITS = (8.0, 10.0, 12.0, 16.0, 24.0)


def main() -> None:
    g, cl = load_model(MODEL, SEQ), parse_cluster(CLUSTER)
    w = Workload(seq_len=SEQ, global_batch=BATCH)
    dev = DeviceModel(cl)
    print(f"{MODEL} ({g.total_params / 1e9:.2f} B parameters) on {CLUSTER}, seq {SEQ}, global batch {BATCH}")
    print(f"{'limit GiB':>9} {'FSDP step s':>11} {'OSDP step s':>11} {'speed-up':>8}  OSDP plan | DP vs ILP")
    for limit in LIMITS:
        try:
            fsdp = search(g, cl, w, "fsdp", memory_limit_gib=limit, device=dev, top_k=1)
            f_s = f"{fsdp.objective:11.4f}"
        except ShardplanError:
            fsdp, f_s = None, f"{'none fits':>11}"
        try:
            osdp = search(g, cl, w, "osdp", memory_limit_gib=limit, device=dev, top_k=1)
        except ShardplanError:
            print(f"{limit:9.1f} {f_s} {'none fits':>11}")
            continue
        s = osdp.best.strategy
        up = f"{fsdp.objective / osdp.objective:7.3f}x" if fsdp else "   (inf)"
        shards = sorted({e.sharding for e in s.layers} | {s.default.sharding})
        splits = sorted({e.split for e in s.layers if e.split > 1})
        cfg = MeshConfig(
            1, s.mesh.dp_replicate, s.mesh.dp_shard, 1, 1, 1, s.micro_batch, s.schedule, 1, False
        )
        prob = mesh_problem(g, dev, cfg, w, SPACES["osdp"], limit)
        t0 = time.perf_counter()
        ilp = solve_ilp(prob)
        t1 = time.perf_counter()
        dp = solve_dp(prob)
        t2 = time.perf_counter()
        agree = abs(dp.objective - ilp.objective) <= 1e-9 * ilp.objective
        print(
            f"{limit:9.1f} {f_s} {osdp.objective:11.4f} {up}  dp_shard={s.mesh.dp_shard} dp_rep="
            f"{s.mesh.dp_replicate} mb={s.micro_batch} shardings={shards} splits={splits} "
            f"recompute={s.default.recompute} ({len(s.layers)} entries) | ILP {ilp.status} {t1 - t0:.2f} s, "
            f"DP "
            f"{dp.status} {t2 - t1:.2f} s, gap {dp.gap:.1e}, {'agree' if agree else 'DP within its gap'}"
        )


if __name__ == "__main__":
    main()
