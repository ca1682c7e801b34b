"""The four headline jobs on every target: plan, export, import back, and the published expert configs.

    python benchmarks/target_jobs.py            # both tables
    python benchmarks/target_jobs.py --jobs 70b

For each job and target: the plan searched for the target (step time, peak memory against the limit,
the mesh), its export, and the plan ``shardplan import`` reads back from the exported file (the step
time difference, which must be 0 to 1e-9). Then each job's published configuration, priced on the
target that runs it: what the target lacks to express it (if anything), its step time and whether it
fits. The tables go to ``docs/targets.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.api import plan as search  # noqa: E402
from planner.reprice import load_named_model, predicted_dict, price  # noqa: E402
from planner.trainers import export, import_plan, lacks, refusal  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402
from vocab.strategy import Strategy, Workload  # noqa: E402
from vocab.targets import ANY, load_target, target_names  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling scripts, after the packages
from solver_speed import CASES  # noqa: E402

#: the four headline jobs of solver_speed.py: name -> (model, cluster, seq_len, global batch) (its
#: speed-only cases, a reshaped 70B and 405B on 131,072 GB200, are not published jobs)
JOBS = {name: CASES[name][:4] for name in ("70b", "405b", "175b", "mixtral")}
#: every trainer's target
TARGETS = tuple(t for t in target_names() if t != ANY)


def exporter(target: str) -> str:
    """The export that writes for ``target`` (its file's ``exporter``)."""
    return str(load_target(target).exporter)

#: published configurations of the jobs (their mesh on the job's cluster), the target that runs them and
#: where they are stated
EXPERT: dict[str, tuple[str, dict[str, Any], str]] = {
    "70b": ("megatron", {"mesh": {"tp": 4, "pp": 4, "cp": 2, "dp_shard": 32}, "micro_batch": 1,
                         "schedule": "interleaved", "vpp": 5, "sequence_parallel": True,
                         "default": {"sharding": "zero1"}},
            "NVIDIA NeMo performance summary (24.07), Llama 3 70B pretraining: TP4 PP4 CP2 VP5, mb 1 "
            "(shared/calibration/published_runs.csv)"),
    "405b": ("torchtitan", {"mesh": {"tp": 8, "pp": 16, "dp_shard": 128}, "micro_batch": 1,
                            "schedule": "interleaved", "vpp": 2, "sequence_parallel": True,
                            "default": {"sharding": "zero3_keep"}},
             "Llama 3 paper (arXiv 2407.21783), Table 4: TP8 CP1 PP16 DP128 on 16,384 H100, 8K sequences, "
             "FSDP without resharding after forward, interleaved schedule (section 3.3.2; 2 stages per rank "
             "assumed)"),
    "175b": ("megatron", {"mesh": {"tp": 8, "pp": 16, "dp_shard": 8}, "micro_batch": 1, "schedule": "1f1b",
                          "sequence_parallel": False, "default": {"sharding": "replicate", "recompute": "full"}},
             "Narayanan et al. 2021 (arXiv 2104.04473), Table 1: GPT-3 175B on 1,024 A100, TP8 PP16, batch 1536, "
             "full recomputation"),
    "mixtral": ("megatron", {"mesh": {"tp": 2, "pp": 8, "dp_shard": 16, "ep": 8}, "micro_batch": 1,
                             "schedule": "1f1b", "sequence_parallel": True,
                             "default": {"sharding": "zero1", "recompute": "full"}},
                "Megatron-Core MoE guide: Mixtral 8x22B with TP2 PP8 EP8 and the distributed optimizer (as recalled; "
                "not in shared/calibration)"),
}


def _mesh(s: Any) -> str:
    out = " ".join(f"{k}={v}" for k, v in s.mesh.shown_degrees().items())
    return f"{out} mb={s.micro_batch} {s.schedule}{f'/vpp{s.vpp}' if s.vpp > 1 else ''} {s.default.sharding}"


def round_trip(job: str, target: str) -> dict[str, Any]:
    model, cluster, seq, gb = JOBS[job]
    t0 = time.perf_counter()
    try:
        p = search(model, cluster, seq, gb, target=target)
    except ShardplanError as e:
        return {"job": job, "target": target, "error": str(e)}
    wall = time.perf_counter() - t0
    e = export(p, exporter(target))
    problem = refusal(e)
    out = {"job": job, "target": target, "step": p.predicted.step_time_s, "mem": p.predicted.memory_peak_gib,
           "limit": predicted_dict(p)["memory_limit_gib"], "mesh": _mesh(p.strategy), "search_s": wall,
           "export": problem or "ok"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"plan{e.suffix}"
        path.write_text(e.text)
        back = import_plan(path, model=model, cluster=cluster, seq_len=seq,
                           ep=p.strategy.mesh.ep if target == "deepspeed" else None)
    out["delta"] = abs(back.predicted.step_time_s - p.predicted.step_time_s) / p.predicted.step_time_s
    return out


def expert(job: str) -> dict[str, Any]:
    target, fields, source = EXPERT[job]
    model, cluster, seq, gb = JOBS[job]
    t = load_target(target)
    w = Workload(seq_len=seq, global_batch=gb, **t.behaviour.workload())
    graph = load_named_model(model, seq)
    if t.recompute.scope == "blocks":  # the trainer checkpoints transformer blocks only
        d = fields.get("default", {})
        fields = {**fields, "layers": [{"unit": u, **d, "recompute": "none"} for u, _ in graph.blocks()
                                       if not u.startswith("layers.")]}
    p = price(graph, parse_cluster(cluster), Strategy.model_validate(fields), w, model=model)
    missing = [x.lacks for x in lacks(p, exporter(target)) if not x.behaviour]
    pred = predicted_dict(p)
    worst = max(pred["stages"], key=lambda st: st["total_gib"])
    parts = ", ".join(f"{k} {worst[k + '_gib']:.1f}" for k in ("params", "grads", "optimizer", "activations",
                                                                "buffers", "overhead"))
    return {"job": job, "target": target, "mesh": _mesh(p.strategy), "step": pred["step_time_s"],
            "mem": pred["memory_peak_gib"], "limit": pred["memory_limit_gib"], "fits": pred["fits"],
            "lacks": "; ".join(missing) or "-", "source": source,
            "worst": f"stage {worst['stage']}: {parts} GiB", "plan": p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    a = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    print(f"commit {rev}\n")
    print("| job | target | plan | step (s) | peak / limit (GiB) | export | import Δ step |")
    print("|---|---|---|---:|---:|---|---:|")
    for job in a.jobs:
        for target in a.targets:
            r = round_trip(job, target)
            if "error" in r:
                print(f"| {job} | {target} | no plan: {r['error'].split(' (pp=')[0]} | | | | |")
                continue
            print(f"| {job} | {target} | {r['mesh']} | {r['step']:.3f} | {r['mem']:.1f} / {r['limit']:.1f} | "
                  f"{r['export']} | {r['delta']:.1e} |", flush=True)
    print("\n| job | target | published config | step (s) | peak / limit (GiB) | fits | fullest GPU | target lacks "
          "| source |")
    print("|---|---|---|---:|---:|---|---|---|---|")
    for job in a.jobs:
        r = expert(job)
        print(f"| {job} | {r['target']} | {r['mesh']} | {r['step']:.3f} | {r['mem']:.1f} / {r['limit']:.1f} | "
              f"{'yes' if r['fits'] else 'NO'} | {r['worst']} | {r['lacks']} | {r['source']} |", flush=True)


if __name__ == "__main__":
    main()
