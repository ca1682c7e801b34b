"""Calibrate the cost model from real runs of shardplan's runtime on this CPU, and hold each plan out.

    python benchmarks/calibration_runs.py [--work DIR] [--steps 8] [--repeats 1] [--reuse] [--save DIR] [--json]

1. Five plans of a 16.9M-parameter GPT (4 layers, hidden 512, 8 heads, vocabulary 8192; the graph of
   what the runtime runs: SDPA attention, no dropout) at sequence length 128, fp32, on ``4xcpu``: DDP,
   FSDP, TP 2 x DP 2, PP 2 x DP 2 and TP 4, at global batches 8 and 16 (the step's fixed and per-sample
   parts differ between them).
2. Each plan trains ``--steps`` steps with ``shardplan train --nproc 4 -o RUN.json`` (``--repeats``
   launches, round robin; ``--reuse`` keeps reports already in the work directory).
3. ``costmodel.calibration`` reads every report (its steady state: warm-up and the memory-tracked step
   dropped), calibrates on all five runs, then leave one plan out: fitted on the four others, the held-out
   plan's predicted step time and peak memory against the measured, before (the spec sheet) and after.
``--save DIR`` copies the plans and reports there (tests/data/calibration/cpu-runs holds a run's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from costmodel.calibration.fit import CalibrationError, calibrate, memory_of, report
from costmodel.calibration.knobs import base_constants
from planner.calibration import load_run
from planner.reprice import price
from profiler.hardware import parse_cluster
from profiler.models import resolve_config
from profiler.transformer import build_graph
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

NPROC = 4
SEQ = 128


def plans() -> dict[str, tuple[Strategy, int]]:
    rep, z3 = LayerStrategy(sharding="replicate"), LayerStrategy(sharding="zero3")
    return {
        "ddp": (Strategy(mesh=Mesh(dp_shard=4), micro_batch=2, default=rep), 8),
        "fsdp": (Strategy(mesh=Mesh(dp_shard=4), micro_batch=4, default=z3), 16),
        "tp2dp2": (Strategy(mesh=Mesh(dp_shard=2, tp=2), micro_batch=4, default=rep), 8),
        "pp2dp2": (Strategy(mesh=Mesh(pp=2, dp_shard=2), micro_batch=1, schedule="1f1b", default=rep), 8),
        "tp4": (Strategy(mesh=Mesh(tp=4), micro_batch=16, default=rep), 16),
    }


def write_plans(work: Path) -> tuple[Path, dict[str, Path]]:
    cfg_path = work / "gpt-small.json"
    cfg_path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 4, "n_embd": 512, "n_head": 8,
                                    "vocab_size": 8192, "n_positions": SEQ, "resid_pdrop": 0.0}))
    written = resolve_config(str(cfg_path))
    cfg = replace(written, attention_impl="flash", dropout=0.0)  # what the runtime runs
    graph = build_graph(cfg, SEQ)
    cluster = parse_cluster(f"{NPROC}xcpu")
    out = {}
    for name, (s, gb) in plans().items():
        w = Workload(seq_len=SEQ, global_batch=gb, precision="fp32")
        plan = price(graph, cluster, s, w, model=None)  # records the graph it was priced on: calibrate's config
        p = work / f"{name}.plan.json"
        plan.save(p)
        # the runtime checks the plan against the model it builds from the config file
        inputs = plan.inputs.model_copy(update={"model": str(cfg_path), "model_graph": None,
                                                "model_hash": build_graph(written, SEQ).content_hash()})
        plan.model_copy(update={"inputs": inputs}).save(work / f"{name}.train-plan.json")
        out[name] = p
    return cfg_path, out


def train(model: Path, plan: Path, out: Path, steps: int) -> None:
    plan = plan.with_name(plan.name.replace(".plan.json", ".train-plan.json"))
    cmd = ["shardplan", "train", "--model", str(model), "--plan", str(plan), "--nproc", str(NPROC), "--steps",
           str(steps), "--json", "-o", str(out)]
    print(f"[load {os.getloadavg()[0]:.1f}] $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)


def held_out(runs: list[Any], names: list[str] | None) -> list[dict[str, Any]]:
    """Each run predicted by a calibration of the others (before: the spec sheet)."""
    rows = []
    for i, r in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        try:
            fitted = calibrate(others, names)
        except CalibrationError as e:
            rows.append({"run": r.config, "refused": str(e)})
            continue
        base = base_constants(r.cluster)
        before, after = report(r), report(r, fitted.overrides, fitted.network)
        kind = r.memory_kind
        row = {"run": Path(r.config).name, "measured_s": r.measured.step_time_s, "before_s": before.step_time_s,
               "after_s": after.step_time_s, "values": fitted.values}
        if kind:
            row.update(memory_kind=kind, measured_memory=r.measured.memory[kind],
                       before_memory=memory_of(before, kind, base),
                       after_memory=memory_of(after, kind, base.with_overrides(fitted.overrides)))
        rows.append(row)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    ok = [x for x in rows if "refused" not in x]
    out = {}
    for what, m, b, a in (("time", "measured_s", "before_s", "after_s"),
                          ("memory", "measured_memory", "before_memory", "after_memory")):
        have = [x for x in ok if m in x]
        if have:
            out[f"{what}_before"] = statistics.median(abs(x[b] / x[m] - 1) for x in have)
            out[f"{what}_after"] = statistics.median(abs(x[a] / x[m] - 1) for x in have)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardplan-calibration-runs"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reuse", action="store_true", help="keep train reports already in the work directory")
    ap.add_argument("--save", type=Path, default=None, help="copy the plans and reports here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    model, plan_paths = write_plans(a.work)
    reports: dict[str, list[Path]] = {}
    names = list(plan_paths)
    for k in range(a.repeats):
        for name in names if k % 2 == 0 else names[::-1]:
            out = a.work / f"{name}.run{k}.json"
            if not (a.reuse and out.exists()):
                train(model, plan_paths[name], out, a.steps)
            reports.setdefault(name, []).append(out)
    runs = [load_run(plan_paths[n], reports[n][k]) for n in names for k in range(a.repeats)]
    fitted = calibrate(runs)
    result = {"load_avg": os.getloadavg(), "fitted": fitted.values, "priors": fitted.priors,
              "runs": fitted.runs, "held_out": {}}
    for label, knobs in (("default", None), ("compute+overhead", ["compute", "overhead", "fragmentation", "context"])):
        rows = held_out(runs, knobs)
        result["held_out"][label] = {"rows": rows, **summary(rows)}
    (a.work / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if a.save is not None:
        a.save.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copy(plan_paths[n], a.save / plan_paths[n].name)
            for r in reports[n]:
                shutil.copy(r, a.save / r.name)
    if a.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print("fitted on all runs: " + ", ".join(f"{k} {v:.4g} (prior {fitted.priors[k]:.4g})"
                                            for k, v in fitted.values.items()))
    for label, h in result["held_out"].items():
        print(f"\nleave one plan out, fitting {label}:")
        print(f"{'run':<22}{'measured s':>11}{'spec s':>9}{'err':>7}{'calib s':>9}{'err':>7}{'mem err':>16}")
        for x in h["rows"]:
            if "refused" in x:
                print(f"{Path(x['run']).name:<22} refused: {x['refused']}")
                continue
            mem = (f"{x['before_memory'] / x['measured_memory'] - 1:+.0%} -> {x['after_memory'] / x['measured_memory'] - 1:+.0%}"
                   if "measured_memory" in x else "-")
            print(f"{x['run']:<22}{x['measured_s']:>11.3f}{x['before_s']:>9.3f}{x['before_s'] / x['measured_s'] - 1:>+7.0%}"
                  f"{x['after_s']:>9.3f}{x['after_s'] / x['measured_s'] - 1:>+7.0%}{mem:>16}")
        print("median |error| held out: step time {:.1%} -> {:.1%}, memory {:.1%} -> {:.1%}".format(
            h.get("time_before", float("nan")), h.get("time_after", float("nan")),
            h.get("memory_before", float("nan")), h.get("memory_after", float("nan"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
