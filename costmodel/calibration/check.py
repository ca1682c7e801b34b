"""A running job against its plan: measured step time and memory beside the prediction, part by
part where the log times them, and the likeliest cause of the difference.

The parts a log can time (:data:`costmodel.calibration.logs.TERM_PARTS`) each cover some of the cost
model's terms; a part's prediction is the sum of those terms in the plan's ``predicted.time``. The
likeliest cause is the timed part whose measured time is furthest, in seconds, from its price; a log
that times whole steps only says how far the step is, and which priced term is the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from costmodel.calibration.logs import TERM_PARTS, Steady

GIB = 1024.0**3
#: a step (or memory) within this relative difference of its prediction: nothing stands out
CLOSE = 0.05
LABELS = {"compute": "compute (forward and backward, with TP/CP/EP collectives)",
          "pipeline": "pipeline send/receive and bubble", "dp": "data-parallel reduction",
          "optimizer": "optimizer step"}
ADVICE = {"compute": "check the GPUs' clocks and kernels, or calibrate the cluster (shardplan calibrate)",
          "pipeline": "check the stage balance and the number of micro-batches",
          "dp": "check the bucket size / the inter-node bandwidth",
          "optimizer": "check the optimizer's kernels (fused or foreach) and any offload"}


@dataclass
class Comparison:
    """Rows of (what, measured, predicted, unit) and the likeliest cause, in one line each."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    cause: str = ""
    memory_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "cause": self.cause, "memory": self.memory_note}


def priced_terms(predicted: dict[str, Any]) -> dict[str, float]:
    """The cost model's terms of a plan's ``predicted`` report, in seconds per step."""
    t = predicted.get("time") or {}
    comm = t.get("comm_s") or {}
    out = {"compute": float(t.get("compute_s", 0.0)), "recompute": float(t.get("recompute_s", 0.0)),
           "bubble": float(t.get("bubble_s", 0.0)), "optimizer": float(t.get("optimizer_s", 0.0)),
           "offload": float(t.get("offload_s", 0.0))}
    out.update({axis: float(v) for axis, v in comm.items()})
    return out


def priced_parts(predicted: dict[str, Any]) -> dict[str, float]:
    """The plan's price of each part a log can time (:data:`TERM_PARTS`)."""
    terms = priced_terms(predicted)
    return {part: sum(terms.get(t, 0.0) for t in covers) for part, covers in TERM_PARTS.items()}


def _row(what: str, measured: float, predicted: float, unit: str) -> dict[str, Any]:
    ratio = measured / predicted if predicted > 0 else None
    return {"what": what, "measured": measured, "predicted": predicted, "unit": unit, "ratio": ratio,
            "difference": measured - predicted}


def compare(predicted: dict[str, Any], measured: Steady, fragmentation: float, context_bytes: float) -> Comparison:
    """``measured`` against the plan's ``predicted`` report, priced with these memory constants."""
    from costmodel.calibration.fit import MEMORY_OF

    out = Comparison()
    step = float(predicted["step_time_s"])
    out.rows.append(_row("step time", measured.step_time_s, step, "s"))
    parts = priced_parts(predicted)
    for part in TERM_PARTS:
        if part in measured.terms and (measured.terms[part] > 0 or parts[part] > 0):
            out.rows.append(_row(part, measured.terms[part], parts[part], "s"))
    out.cause = likeliest_cause(measured, step, parts, priced_terms(predicted))
    tensors = max(((st.get("total_gib", 0.0) - st.get("overhead_gib", 0.0)) * GIB
                   for st in predicted.get("stages") or []), default=float(predicted.get("memory_peak_gib", 0)) * GIB)
    for kind, value in sorted(measured.memory.items()):
        out.rows.append(_row(f"memory ({kind})", value, MEMORY_OF[kind](tensors, fragmentation, context_bytes), "B"))
    stages = predicted.get("stages") or []
    for name, key in (("params", "param_bytes"), ("grads", "grad_bytes"), ("optimizer", "optim_bytes")):
        if name in measured.states and stages:
            out.rows.append(_row(f"{name} state", measured.states[name], max(float(s.get(key, 0)) for s in stages), "B"))
    out.memory_note = _memory_note([r for r in out.rows if r["unit"] == "B"])
    return out


def likeliest_cause(measured: Steady, step: float, parts: dict[str, float], terms: dict[str, float]) -> str:
    """One line: the timed part furthest from its price, or how far a whole step is."""
    diff = measured.step_time_s - step
    timed = {p: measured.terms[p] - parts[p] for p in TERM_PARTS if p in measured.terms}
    if timed:
        part = max(timed, key=lambda p: abs(timed[p]))
        m, p = measured.terms[part], parts[part]
        if abs(timed[part]) < CLOSE * step:
            return (f"every timed part is within {CLOSE:.0%} of the step of its price (the step {diff / step:+.1%}): "
                    "nothing stands out")
        times = f"{m / p:.1f}x the priced time" if p > 0 else "not priced at all"
        return f"{LABELS[part]} {times} ({m:.4g} s against {p:.4g} s): {ADVICE[part]}"
    if abs(diff) < CLOSE * step:
        return f"the step is within {CLOSE:.0%} of its price ({diff / step:+.1%}): nothing stands out"
    largest = max(terms, key=lambda t: terms[t])
    need = 1 + diff / terms[largest] if terms[largest] > 0 else float("inf")
    return (f"the step is {diff / step:+.1%} of its price ({measured.step_time_s:.4g} s against {step:.4g} s), and "
            f"the log times whole steps only: the largest priced term, {largest} ({terms[largest]:.4g} s), would "
            f"explain it at {need:.2f}x; time the parts to tell (Megatron-LM --timing-log-level 2, DeepSpeed "
            "wall_clock_breakdown)")


def _memory_note(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "the log reports no memory"
    worst = max(rows, key=lambda r: abs(r["difference"]) / max(r["predicted"], 1.0))
    rel = worst["difference"] / worst["predicted"] if worst["predicted"] else float("inf")
    if abs(rel) < CLOSE * 2:
        return f"memory within {2 * CLOSE:.0%} of the prediction"
    return (f"{worst['what']} {worst['measured'] / GIB:.3g} GiB against {worst['predicted'] / GIB:.3g} GiB predicted "
            f"({rel:+.0%})" + (": calibrate fragmentation and context (shardplan calibrate)"
                               if worst["what"].startswith("memory") else ""))
