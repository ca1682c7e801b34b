"""Published MoE throughput (costmodel/data/calibration/moe_runs.csv: DeepSeek-V3 and Kimi-K2 on
B200, B300, GB200 and GB300, NVIDIA's Megatron-Bridge performance summaries) against the cost model,
each row priced as the megatron target runs it.

    python benchmarks/moe_runs.py                # the table
    python benchmarks/moe_runs.py --write-band   # and the MoE band into costmodel/data/moe_band.yaml

A row is mapped as ``benchmarks/recipes.py`` maps a recipe (the preset by name, the mesh, virtual
stages from its notes' ``VP=``, micro and global batch, the distributed optimizer and no
recomputation as the rows do not state them, gradients in bf16, the dispatcher the Megatron-Bridge
recipe applies: ``recipes.FLEX_DISPATCH``) and priced with ``estimate``; the
table gives the published and predicted tokens/s per GPU and the signed error (published over
predicted time, less 1: positive means the model is too fast). Measurement only: nothing is fitted
to these rows. ``--write-band`` records the 10th and 90th percentiles of those errors (numpy's
linear interpolation), which widen the step-time band of every MoE plan
(:func:`costmodel.constants.error_band`).
"""

from __future__ import annotations

import csv
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.benchmark_scripts import benchmark_script  # noqa: E402

CSV = Path(__file__).resolve().parents[1] / "costmodel" / "data" / "calibration" / "moe_runs.csv"
recipes = benchmark_script("recipes")


def recipe_row(r: dict[str, str]) -> dict[str, str]:
    """A moe_runs.csv row in recipes.csv's columns."""
    vp = re.search(r"VP=(\d+)", r["notes"])
    ga = re.search(r"GA=(\d+)", r["notes"])
    precision = {"fp8-mx": "MXFP8"}.get(r["precision"].lower(), r["precision"])
    return {**{k: r[k] for k in ("model", "layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len", "global_batch",
                                  "micro_batch", "gpus", "gpu_type", "tp", "pp", "cp", "ep")},
            "precision": precision, "vp": vp.group(1) if vp else "n/a", "grad_accum": ga.group(1) if ga else "n/a",
            "sharding": r["zero_stage/fsdp"], "recompute": r["recompute"], "source": r["source"],
            "release": r["notes"].split(";")[0]}


def write_band(errors: list[float], accelerators: list[str]) -> None:
    """The MoE band file: the rows' error percentiles, where they ran, and the commit that priced them."""
    import subprocess

    import numpy as np
    import yaml

    from costmodel.constants import MOE_BAND_PATH

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=CSV.parents[3], check=False).stdout.strip() or "unknown"
    doc = {"rows": len(errors), "low": round(float(np.percentile(errors, 10)), 4),
           "high": round(float(np.percentile(errors, 90)), 4), "accelerators": sorted(set(accelerators)),
           "source": "costmodel/data/calibration/moe_runs.csv (Megatron-Bridge performance summaries), priced on the "
                     "megatron target by benchmarks/moe_runs.py; nothing is fitted to these rows",
           "commit": commit}
    text = ("# The published MoE runs' step-time errors (published over predicted, less 1), 10th and 90th\n"
            "# percentiles: written by `python benchmarks/moe_runs.py --write-band`.\n") + yaml.safe_dump(doc, sort_keys=False)
    tmp = MOE_BAND_PATH.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(MOE_BAND_PATH)
    print(f"\nwrote {MOE_BAND_PATH.name}: low {doc['low']:+.1%}, high {doc['high']:+.1%} over {len(errors)} rows")


def main() -> None:
    rows = [r for r in csv.DictReader(CSV.open()) if r["metric"] == "tokens_per_s_per_gpu"]
    accelerators = []
    print("| model | GPUs | precision | mesh | published tok/s/GPU | predicted | error | note |")
    print("|---|---|---|---|---:|---:|---:|---|")
    errors = []
    for i, r in enumerate(rows):
        x = recipes.assess(recipes.map_row(i, recipe_row(r)))
        m = x.mapped
        mesh = recipes._mesh(m.row)
        if x.step_s is None:
            print(f"| {r['model']} | {r['gpus']}x {r['gpu_type'].split()[0]} | {r['precision']} | {mesh} | {r['value']} | "
                  f"| | {'; '.join(x.reasons)} |")
            continue
        w = m.workload
        predicted = w.global_batch * w.seq_len / (x.step_s * int(r["gpus"]))
        err = predicted / float(r["value"]) - 1  # published time over predicted, less 1
        errors.append(err)
        accelerators.append(m.cluster.accelerator.name)
        note = "; ".join(x.reasons) or ("" if x.fits else "does not fit as mapped")
        print(f"| {r['model']} | {r['gpus']}x {r['gpu_type'].split()[0]} | {r['precision']} | {mesh} | {r['value']} | "
              f"{predicted:,.0f} | {err:+.1%} | {note} |")
    if errors:
        print(f"\n{len(errors)} rows priced: signed median {statistics.median(errors):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%}")
    if "--write-band" in sys.argv[1:] and errors:
        write_band(errors, accelerators)


if __name__ == "__main__":
    main()
