"""Per-layer measured times against the cost model, before and after calibrating it with a profile.

    python benchmarks/calibration_cpu.py [--profile P.json] [--out calibration.json] [--tiny] [--threads 1]

1. A compute profile of this CPU: read from ``--profile`` if the file exists, else measured now
   (``--quick`` grid, about a minute; ``--tiny`` a much smaller one) and written there. A profile
   measured now is measured again after the models and the two are averaged (the host's speed
   drifts; bracketing cancels a linear drift); each of ``--runs`` runs does it all again.
2. Two small models, a GPT-2 (the preset: LayerNorm, GELU, eager attention with dropout) and a
   Llama-like one (RMSNorm, SwiGLU, GQA, SDPA), ``--layers`` blocks each, are run for real
   (:func:`profiler.measure_model.measure_layers`): forward/backward time and saved bytes per node.
3. The cost model (:func:`costmodel.compute.layer_times`) predicts the same nodes from the
   spec sheet (``cpu.yaml``, *before*) and from the profile (*after*); the median relative error
   per node kind and for whole blocks is reported for both, and everything goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from costmodel.compute import with_predicted_times
from profiler.hardware import accelerator
from profiler.measure_compute import Timing, profile_compute
from profiler.measure_model import layers_graph, measure_layers
from profiler.model_config import TransformerConfig
from profiler.models import preset
from profiler.profile_schema import LayerMeasurement, Profile, load_profile
from vocab.errors import ShardplanError

LLAMA_SMALL = TransformerConfig(name="llama-small", layers=2, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
                                vocab=32000, activation="swiglu", norm="rmsnorm", position="rope", max_seq=2048)
TINY_GRID = {
    "gemm_shapes": [(128, 128, 128), (256, 768, 768), (512, 1024, 1024), (512, 3072, 1024), (512, 1024, 4096)],
    "attn_shapes": [(1, 8, 128, 64, False), (1, 8, 512, 64, False), (1, 8, 512, 64, True)],
    "bw_cases": [("norm", "layernorm", (512, 1024)), ("norm", "rmsnorm", (512, 1024)),
                 ("activation", "gelu", (512, 4096)), ("activation", "swiglu", (512, 2816)),
                 ("elementwise", "add", (512, 1024)), ("softmax", "softmax", (1024, 512))],
}


def get_profile(path: Path | None, tiny: bool, dtype: str) -> Profile:
    if path is not None and path.exists():
        prof = load_profile(path)
        prof.check_kind("cpu", "this benchmark")
        if prof.compute is None or prof.compute.dtype != dtype:
            raise ShardplanError(f"{path} is not a {dtype} compute profile")
        return prof
    t0 = time.perf_counter()
    kw = dict(TINY_GRID, timing=Timing(warmup=1, min_reps=3, max_reps=8, target_s=0.1)) if tiny else {}
    info, comp = profile_compute("cpu", dtype, quick=True, progress=sys.stderr.isatty(), **kw)
    prof = Profile(device=info, compute=comp)
    print(f"compute profile: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if path is not None:
        prof.save(path)
    return prof


def rel_errors(rows: list[LayerMeasurement]) -> dict[str, dict[str, float | None]]:
    """Median |predicted / measured - 1| of forward and backward time, per node kind."""
    out: dict[str, dict[str, float | None]] = {}
    for kind in sorted({r.kind for r in rows}):
        sel = [r for r in rows if r.kind == kind and r.predicted_fwd_s is not None and r.fwd_s > 0 and r.bwd_s > 0]
        out[kind] = {
            "fwd": statistics.median(abs(r.predicted_fwd_s / r.fwd_s - 1) for r in sel) if sel else None,
            "bwd": statistics.median(abs(r.predicted_bwd_s / r.bwd_s - 1) for r in sel) if sel else None,
        }
    return out


def measure_model(cfg: TransformerConfig, layers: int, seq_len: int, micro_batch: int, repeats: int,
                  dtype: str) -> list[LayerMeasurement]:
    """Measured per-node and per-block times, with the spec-sheet predictions (*before*)."""
    rows = measure_layers(cfg, torch.device("cpu"), layers=layers, micro_batch=micro_batch, seq_len=seq_len,
                          dtype=dtype, repeats=repeats)
    return with_predicted_times(rows, layers_graph(cfg, layers, seq_len), accelerator("cpu"))


def calibrated(cfg: TransformerConfig, before: list[LayerMeasurement], prof: Profile, layers: int, seq_len: int,
               micro_batch: int, dtype: str) -> dict:
    """The measurements next to the predictions from ``prof`` (*after*)."""
    after = with_predicted_times(before, layers_graph(cfg, layers, seq_len), accelerator("cpu"), prof)
    return {"model": cfg.name, "dtype": dtype, "layers": layers, "seq_len": seq_len, "micro_batch": micro_batch,
            "error_before": rel_errors(before), "error_after": rel_errors(after),
            "rows": [{**b.model_dump(), "calibrated_fwd_s": a.predicted_fwd_s, "calibrated_bwd_s": a.predicted_bwd_s}
                     for b, a in zip(before, after, strict=True)]}


def bracket(p1: Profile, p2: Profile) -> Profile:
    """The geometric mean of two profiles of the same grid, taken before and after the model runs:
    a host whose speed drifts linearly in between is then measured at the models' midpoint."""
    c1, c2 = p1.compute, p2.compute
    assert c1 is not None and c2 is not None

    def mean(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (a * b) ** 0.5

    def timed(pts1: list, pts2: list, work: str, rate: str, t_fwd: str) -> list:
        out = []
        for x, y in zip(pts1, pts2, strict=True):
            f, b = mean(getattr(x, t_fwd), getattr(y, t_fwd)), mean(x.bwd_s, y.bwd_s)
            upd = {t_fwd: f, "bwd_s": b}
            upd[rate] = (3 * getattr(x, work) / (f + b) if b is not None and t_fwd == "fwd_s"
                         else getattr(x, work) / f)
            out.append(x.model_copy(update=upd))
        return out

    comp = c1.model_copy(update={
        "gemm": timed(c1.gemm, c2.gemm, "flops", "flops_per_s", "fwd_s"),
        "attention": timed(c1.attention, c2.attention, "flops", "flops_per_s", "fwd_s"),
        "bandwidth": {k: timed(v, c2.bandwidth[k], "bytes", "bytes_per_s", "seconds") for k, v in c1.bandwidth.items()},
    })
    return p1.model_copy(update={"compute": comp})


def block_summary(results: list[dict]) -> dict[str, dict[str, float]]:
    """Median |pred/meas - 1| over the transformer layers of every model: forward, backward, both."""
    out: dict[str, dict[str, float]] = {}
    for when, f_key, b_key in (("before", "predicted_fwd_s", "predicted_bwd_s"),
                               ("after", "calibrated_fwd_s", "calibrated_bwd_s")):
        rows = [r for res in results for r in res["rows"] if r["kind"] == "block"]
        out[when] = {
            "fwd": statistics.median(abs(r[f_key] / r["fwd_s"] - 1) for r in rows),
            "bwd": statistics.median(abs(r[b_key] / r["bwd_s"] - 1) for r in rows),
            "step": statistics.median(abs((r[f_key] + r[b_key]) / (r["fwd_s"] + r["bwd_s"]) - 1) for r in rows),
        }
    return out


def show(res: dict) -> None:
    def ms(x: float | None) -> str:
        return "     -" if x is None else f"{x * 1e3:8.3f}"

    print(f"\n{res['model']} ({res['dtype']}): {res['layers']} layer(s), seq {res['seq_len']}, micro-batch {res['micro_batch']} "
          "(ms; spec = cpu.yaml, cal = with the profile)")
    print(f"{'layer':<28}{'fwd':>9}{'spec':>9}{'cal':>9}{'bwd':>9}{'spec':>9}{'cal':>9}{'saved KiB':>10}{'graph':>8}")
    for r in res["rows"]:
        print(f"{r['layer']:<28}{ms(r['fwd_s'])}{ms(r['predicted_fwd_s'])}{ms(r['calibrated_fwd_s'])}"
              f"{ms(r['bwd_s'])}{ms(r['predicted_bwd_s'])}{ms(r['calibrated_bwd_s'])}"
              f"{r['saved_bytes'] / 1024:>10.0f}{r['predicted_saved_bytes'] / 1024:>8.0f}")
    print("median |pred/meas - 1| per kind   before (fwd, bwd)    after (fwd, bwd)")
    for kind, b in res["error_before"].items():
        a = res["error_after"][kind]

        def pc(x: float | None) -> str:
            return "   -" if x is None else f"{x:5.0%}"
        print(f"  {kind:<30} {pc(b['fwd'])} {pc(b['bwd'])}          {pc(a['fwd'])} {pc(a['bwd'])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=None, help="compute profile to read, or to write if missing")
    ap.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    ap.add_argument("--tiny", action="store_true", help="a tiny compute grid (seconds, for smoke tests)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="profile + measure this many times; errors pooled")
    ap.add_argument("--no-bracket", dest="bracket", action="store_false",
                    help="profile only before the models, not before and after (drift not cancelled)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (1: as each rank of `shardplan train` runs; steadier on a shared host)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 by default: CPUs without AVX512-BF16/AMX run bf16 GEMMs on slow fallback kernels")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    runs: list[dict] = []
    try:
        for k in range(a.runs):  # a shared host's speed drifts: each run re-profiles, errors are pooled
            path = a.profile if k == 0 else None  # later runs measure a fresh profile
            measured_now = path is None or not path.exists()
            first = get_profile(path, a.tiny, a.dtype)
            models = (preset("gpt2"), LLAMA_SMALL)
            measured = [measure_model(cfg, a.layers, a.seq_len, a.micro_batch, a.repeats, a.dtype) for cfg in models]
            prof = first
            if a.bracket and measured_now:  # profile again after the models; use the mean of both
                prof = bracket(first, get_profile(None, a.tiny, a.dtype))
            runs.append({"device": prof.device.model_dump(), "models": [
                calibrated(cfg, rows, prof, a.layers, a.seq_len, a.micro_batch, a.dtype)
                for cfg, rows in zip(models, measured, strict=True)]})
    except ShardplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for res in runs[-1]["models"]:
        show(res)
    per_run = [block_summary(r["models"]) for r in runs]
    summary = block_summary([m for r in runs for m in r["models"]])
    print(f"\ntransformer layers of both models ({torch.get_num_threads()} thread(s), {len(runs)} run(s)), "
          "median |pred/meas - 1|:")
    for k, e in enumerate(per_run):
        print(f"  run {k + 1}  after: forward {e['after']['fwd']:5.1%}  backward {e['after']['bwd']:5.1%}  "
              f"forward+backward {e['after']['step']:5.1%}")
    for when, e in summary.items():
        print(f"  pooled {when:<7} forward {e['fwd']:5.1%}  backward {e['bwd']:5.1%}  forward+backward {e['step']:5.1%}")
    ok = max(summary["after"].values()) <= 0.10
    print(f"target after calibration <= 10% (pooled): {'met' if ok else 'missed'}")
    if a.out:
        a.out.write_text(json.dumps({"runs": runs, "per_run": per_run, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
