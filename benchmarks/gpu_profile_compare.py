"""Compare a measured GEMM curve with an accelerator file: peak, gemm_efficiency, the curve.

    python benchmarks/gpu_profile_compare.py PROFILE.json [--accelerator h200] [--json OUT.json]

Prints every GEMM point (forward, backward and training TFLOP/s, fraction of the dtype's peak),
the interpolated curve :meth:`Profile.gemm_flops_per_s` at round sizes, and the best measured
forward fraction of peak beside the file's ``gemm_efficiency``. Works for CPU profiles too
(against ``cpu.yaml``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiler.hardware import accelerator  # noqa: E402
from profiler.profile_schema import load_profile  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402


def compare(profile_path: str, acc_name: str | None = None) -> dict:
    prof = load_profile(profile_path)
    if prof.compute is None or not prof.compute.gemm:
        raise ShardplanError(f"profile '{profile_path}' has no GEMM measurements")
    name = acc_name or prof.device.accelerator
    if not name:
        raise ShardplanError(f"cannot tell which accelerator '{prof.device.name}' is; pass --accelerator")
    acc = accelerator(name)
    prof.check_kind(acc.kind, f"accelerator '{acc.name}'")
    dtype = prof.compute.dtype
    peak = acc.peak_flops(dtype if dtype in acc.peak_tflops else "bf16")
    rows = []
    for p in sorted(prof.compute.gemm, key=lambda p: p.flops):
        fwd, bwd = p.flops / p.fwd_s, 2 * p.flops / p.bwd_s
        rows.append({"m": p.m, "n": p.n, "k": p.k, "tag": p.tag, "gflop": p.flops / 1e9,
                     "fwd_tflops": fwd / 1e12, "bwd_tflops": bwd / 1e12, "train_tflops": p.flops_per_s / 1e12,
                     "fwd_of_peak": fwd / peak, "train_of_peak": p.flops_per_s / peak, "spread": p.spread})
    lo, hi = rows[0]["gflop"] * 1e9, rows[-1]["gflop"] * 1e9
    curve = []
    f = 1e6
    while f <= hi * 1.0001:
        if f >= lo:
            curve.append({"flops": f, "train_tflops": prof.gemm_flops_per_s(f) / 1e12,
                          "fwd_tflops": prof.gemm_flops_per_s(f, phase="fwd") / 1e12})
        f *= 10
    best_fwd = max(r["fwd_of_peak"] for r in rows)
    best_train = max(r["train_of_peak"] for r in rows)
    out = {
        "profile": str(profile_path), "device": prof.device.name, "accelerator": acc.name, "dtype": dtype,
        "peak_tflops": peak / 1e12, "gemm_efficiency_file": acc.gemm_efficiency,
        "best_fwd_of_peak": best_fwd, "best_train_of_peak": best_train,
        "largest": rows[-1], "points": rows, "curve": curve,
        "attention_best_tflops": max((a.flops_per_s for a in prof.compute.attention), default=0) / 1e12,
        "sweep_wall_s": prof.compute.wall_s,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--accelerator", default=None)
    ap.add_argument("--json", default=None, help="also write the comparison here")
    a = ap.parse_args(argv)
    try:
        r = compare(a.profile, a.accelerator)
    except ShardplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{r['device']} vs '{r['accelerator']}': {r['dtype']} peak {r['peak_tflops']:.1f} TFLOP/s, "
          f"file gemm_efficiency {r['gemm_efficiency_file']:.3f}; sweep {r['sweep_wall_s']:.0f} s")
    print(f"{'m':>6} {'n':>6} {'k':>6} {'tag':<16} {'GFLOP':>9} {'fwd TF/s':>9} {'bwd TF/s':>9} "
          f"{'train':>8} {'fwd/peak':>8} {'spread':>7}")
    for p in r["points"]:
        print(f"{p['m']:>6} {p['n']:>6} {p['k']:>6} {p['tag']:<16} {p['gflop']:>9.3g} {p['fwd_tflops']:>9.3f} "
              f"{p['bwd_tflops']:>9.3f} {p['train_tflops']:>8.3f} {p['fwd_of_peak']:>8.1%} {p['spread']:>7.1%}")
    print("interpolated curve (what the cost model reads):")
    for c in r["curve"]:
        print(f"  {c['flops']:.0e} FLOP: fwd {c['fwd_tflops']:.3f} TFLOP/s, fwd+bwd {c['train_tflops']:.3f} TFLOP/s")
    print(f"best forward fraction of peak {r['best_fwd_of_peak']:.1%} (fwd+bwd {r['best_train_of_peak']:.1%}) "
          f"vs gemm_efficiency {r['gemm_efficiency_file']:.1%} in the accelerator file")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
