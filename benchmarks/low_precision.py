"""fp8 and MXFP8 against bf16 for the same plan, priced as each target runs them.

    python benchmarks/low_precision.py

Each job is priced by ``shardplan estimate`` (``planner.commands.estimate.price_args``) twice: in bf16
and in the low precision, same mesh, same target. The table shows both step times, their ratio and the
notes the output carries for the low precision (casts that outweigh the GEMMs, experts in bf16). Then
NVIDIA's fp8/MXFP8 recipe rows (``benchmarks/recipes.py``) priced on the megatron target in their
precision and in bf16: how many price slower in the low precision.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner.commands.estimate import price_args  # noqa: E402

LLAMA_8B = dict(model="llama3.1-8b", cluster="8xh100", seq_len=8192, global_batch=128, micro_batch=1, cp=2)
MIXTRAL = dict(model="mixtral-8x7b", cluster="16xh100", seq_len=2048, global_batch=32, micro_batch=1, ep=8)
#: (job, its arguments, the low precision)
JOBS: list[tuple[str, dict[str, Any], str]] = [
    ("Llama 3.1 8B, 8 H100, 8K, CP2, ZeRO-3", {**LLAMA_8B, "zero": 3, "target": "torchtitan"}, "fp8"),
    ("Llama 3.1 8B, 8 H100, 8K, CP2, ZeRO-1", {**LLAMA_8B, "zero": 1, "target": "megatron"}, "fp8"),
    ("Llama 3.1 8B, 8 B200, 8K, CP2, ZeRO-1", {**LLAMA_8B, "cluster": "8xb200", "zero": 1, "target": "megatron"},
     "mxfp8"),
    ("Llama 3.1 8B, 8 B200, 8K, CP2, ZeRO-3", {**LLAMA_8B, "cluster": "8xb200", "zero": 3, "target": "torchtitan"},
     "mxfp8"),
    ("Mixtral 8x7B, 16 H100, EP8, ZeRO-3", {**MIXTRAL, "dp_shard": 16, "zero": 3, "target": "torchtitan"}, "fp8"),
    ("Mixtral 8x7B, 16 H100, PP2 EP8, ZeRO-3", {**MIXTRAL, "pp": 2, "dp_shard": 8, "zero": 3, "target": "torchtitan"},
     "fp8"),
    ("Mixtral 8x7B, 16 H100, PP2 EP8, ZeRO-1", {**MIXTRAL, "pp": 2, "dp_shard": 8, "zero": 1, "target": "megatron"},
     "fp8"),
]


def job_row(name: str, args: dict[str, Any], low: str) -> str:
    bf16 = price_args({**args, "precision": "bf16"})
    rep = price_args({**args, "precision": low})
    notes = [n.split(":")[0] for n in rep["notes"] if "bf16" in n]
    ratio = rep["step_time_s"] / bf16["step_time_s"]
    return (f"| {name} | {args['target']} | {low} | {bf16['step_time_s']:.3f} | {rep['step_time_s']:.3f} | "
            f"{ratio:.3f} | {'; '.join(notes) or '-'} |")


def recipe_count() -> tuple[int, int]:
    """(fp8/MXFP8 recipe rows the megatron target prices, those slower than the same plan in bf16)."""
    import recipes

    from costmodel.estimate import estimate
    from profiler.models import load_model

    low = [m for m in (recipes.map_row(i, r) for i, r in enumerate(recipes.load_rows()))
           if not m.error and m.workload is not None and m.workload.precision in ("fp8", "mxfp8")]
    slower = 0
    for m in low:
        graph = load_model(m.spec, m.workload.seq_len)
        step = estimate(graph, m.cluster, m.strategy, m.workload).step_time_s
        bf16 = estimate(graph, m.cluster, m.strategy, m.workload.model_copy(update={"precision": "bf16"})).step_time_s
        slower += step > bf16
    return len(low), slower


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"`python benchmarks/low_precision.py` (commit {commit}):\n")
    print("| job | target | low precision | bf16 step (s) | low step (s) | low / bf16 | notes |")
    print("|---|---|---|---:|---:|---:|---|")
    for name, args, low in JOBS:
        print(job_row(name, args, low))
    n, slower = recipe_count()
    print(f"\nNVIDIA's fp8/MXFP8 recipe rows priced on the megatron target: {n}; slower than bf16: {slower}.")


if __name__ == "__main__":
    main()
