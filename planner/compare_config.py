"""A trainer's configuration priced beside a plan: ``shardplan explain PLAN --compare-with CONFIG``.

The configuration (a torchtitan TOML, Megatron-LM arguments, a DeepSpeed JSON or a nanotron YAML:
:func:`planner.trainers.import_plan`) is read as its trainer runs it and priced for the plan's model,
cluster, sequence length and memory limit, on its own trainer's target. The two are compared by
tokens per second per GPU (their global batches may differ), with the memory each needs, and by
where their steps differ: the parts of the cost model's breakdown (compute, each axis's exposed
communication, the bubble, ...) that the plan saves or spends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.compare import mesh_text
from planner.explain import time_breakdown
from vocab.plan import Plan

#: a part of the step that differs by less than this share of the plan's step is not named
NAMED_SHARE = 0.02


def time_differences(mine: dict[str, Any], theirs: dict[str, Any], scale: float = 1.0) -> list[tuple[str, float]]:
    """Where two predicted steps differ, by the cost model's own parts (``explain``'s breakdown):
    ``(part, seconds theirs - mine)``, ``theirs`` scaled by ``scale`` (the ratio of the global
    batches, so both train the plan's tokens), largest first; parts within ``NAMED_SHARE`` of the
    plan's step are left out."""
    a = {c["name"]: c["seconds"] for c in time_breakdown(mine)["components"]}
    b = {c["name"]: c["seconds"] * scale for c in time_breakdown(theirs)["components"]}
    floor = NAMED_SHARE * mine["step_time_s"]
    diffs = [(k, b.get(k, 0.0) - a.get(k, 0.0)) for k in dict.fromkeys([*a, *b])]
    return sorted(((k, d) for k, d in diffs if abs(d) >= floor), key=lambda x: -abs(x[1]))


def differences_text(diffs: list[tuple[str, float]]) -> str:
    """``exposed ep comm 4.31 s less, compute 1.20 s more``: what the plan saves and spends."""
    return ", ".join(f"{k} {abs(d):.3g} s {'less' if d > 0 else 'more'}" for k, d in diffs) or "no part differs by 2%"


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
    scale = inp.workload.global_batch / other.inputs.workload.global_batch
    diffs = time_differences(mine.model_dump(), theirs.model_dump(), scale)
    if other.inputs.target.name != inp.target.name:
        verdict += (f" (the configuration priced as {other.inputs.target.name} runs it, the plan as "
                    f"{inp.target.name} does)")
    return {"file": path.name, "target": other.inputs.target.name, "mesh": mesh_text(other.strategy),
            "global_batch": other.inputs.workload.global_batch, "step_time_s": theirs.step_time_s,
            "tokens_per_s_per_gpu": theirs.tokens_per_s_per_gpu, "memory_peak_gib": theirs.memory_peak_gib,
            "fits": fits, "throughput_ratio": ratio, "verdict": verdict,
            "time_differences": [{"part": k, "seconds": d} for k, d in diffs],
            "where": f"the plan, per {inp.workload.global_batch} samples: {differences_text(diffs)}"}
