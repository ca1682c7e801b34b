"""A trainer's configuration priced beside a plan: ``shardplan explain PLAN --compare-with CONFIG``.

The configuration (a torchtitan TOML, Megatron-LM arguments, a DeepSpeed JSON or a nanotron YAML:
:func:`planner.trainers.import_plan`) is read as its trainer runs it and priced for the plan's model,
cluster, sequence length and memory limit, on its own trainer's target. The two are compared by
tokens per second per GPU (their global batches may differ), with the memory each needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.compare import mesh_text
from vocab.plan import Plan


def compared_config(plan: Plan, path: Path) -> dict[str, Any]:
    """The configuration at ``path`` priced beside ``plan``: its mesh, step, throughput, memory, the
    target it was priced on, and a verdict (raises the importer's one-line errors)."""
    from planner.trainers import import_plan

    inp = plan.inputs
    other = import_plan(path, model=inp.model, cluster=inp.cluster.model_dump(), seq_len=inp.workload.seq_len,
                        memory_limit_gib=inp.memory_limit_gib)
    mine, theirs = plan.predicted, other.predicted
    ratio = mine.tokens_per_s_per_gpu / theirs.tokens_per_s_per_gpu if theirs.tokens_per_s_per_gpu else float("inf")
    fits = theirs.memory_peak_gib <= (inp.memory_limit_gib or float("inf"))
    verdict = (f"this plan trains {ratio:.2f}x the configuration's tokens/s per GPU" if ratio >= 1 else
               f"the configuration trains {1 / ratio:.2f}x this plan's tokens/s per GPU")
    if not fits:
        verdict += f"; the configuration needs {theirs.memory_peak_gib:.1f} GiB per GPU, over the limit"
    if other.inputs.target.name != inp.target.name:
        verdict += (f" (the configuration priced as {other.inputs.target.name} runs it, the plan as "
                    f"{inp.target.name} does)")
    return {"file": path.name, "target": other.inputs.target.name, "mesh": mesh_text(other.strategy),
            "global_batch": other.inputs.workload.global_batch, "step_time_s": theirs.step_time_s,
            "tokens_per_s_per_gpu": theirs.tokens_per_s_per_gpu, "memory_peak_gib": theirs.memory_peak_gib,
            "fits": fits, "throughput_ratio": ratio, "verdict": verdict}
