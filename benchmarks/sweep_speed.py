"""A 54-point sweep, timed: Llama 3 70B on 256 to 8,192 H100 (nine sizes), two global batches,
three sequence lengths; the whole ``shardplan sweep`` command (start-up, the points, the table
and the throughput and cost plots; the heatmap timed apart).

    python benchmarks/sweep_speed.py              # target: the sweep under 30 s on two cores
    python benchmarks/sweep_speed.py --workers 1  # in one process

Prints the command's wall time, the points with a plan, the best point, and the heatmap's time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPUS = "256,512,768,1024,1536,2048,3072,4096,8192"
TARGET_S = 30.0


def run(workers: int | None, heatmap: bool, out: Path) -> float:
    cmd = [sys.executable, "-m", "planner.cli", "sweep", "-m", "llama3-70b", "--gpus", GPUS, "--global-batch",
           "1024,2048", "--seq-len", "4096,8192,16384", "--tokens", "15e12", "--gpu-hour-cost", "2.5",
           "-o", str(out / "sweep.csv"), "--plots", str(out / "plots"),
           "--heatmap" if heatmap else "--no-heatmap", *(["--workers", str(workers)] if workers else [])]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        wall = run(args.workers, False, out)
        df = pd.read_csv(out / "sweep.csv")
        with_heatmap = run(args.workers, True, out)
    ok = df[df["status"] == "ok"]
    best = ok.sort_values("tokens_per_s_per_gpu", ascending=False).iloc[0]
    print(f"sweep of {len(df)} points ({len(ok)} with a plan), workers {args.workers or 'default'}: "
          f"{wall:.1f} s (target < {TARGET_S:g} s: {'met' if wall < TARGET_S else 'MISSED'})")
    print(f"with the tp x pp heatmap at the best point: {with_heatmap:.1f} s (+{with_heatmap - wall:.1f} s)")
    print(f"best tokens/s/GPU: {best['tokens_per_s_per_gpu']:,.0f} on {best['gpus']} GPUs, batch "
          f"{best['global_batch']}, seq {best['seq_len']}: {best['mesh']} (MFU {best['mfu']:.1%})")
    fastest = ok.sort_values("train_days").iloc[0]
    print(f"fastest to 15T tokens: {fastest['train_days']:.1f} days on {fastest['gpus']} GPUs "
          f"(${fastest['cost'] / 1e6:.2f}M at $2.5/GPU-hour)")


if __name__ == "__main__":
    main()
