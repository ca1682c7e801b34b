"""Pipeline schedules: step time from per-stage times, and micro-batches each stage keeps alive.

``stage_fb[i]`` is the forward+backward time of one micro-batch on pipeline rank ``i`` (all of its
virtual stages together), ``m`` the number of micro-batches, ``p`` the number of ranks and ``v`` the
virtual stages per rank.

* GPipe and 1F1B: ``(m - 1)·max_i T_i + Σ_i T_i`` — the fill and drain pass through every stage
  once; equal stages give the familiar bubble ``(p - 1)·T``.
* Interleaved 1F1B: the bubble shrinks by ``v``: ``m·max T + (p - 1)·max T / v``.
* ZB-H1 (zero bubble, Qi et al. 2024): weight-gradient work fills the bubble, leaving
  ``(p - 1)·max(F + B - W)``, about a third of 1F1B's when F = B = W.

On a host whose ranks time-share fewer cores than they would use (CPU clusters; the device
model's ``share`` < 1 scales every stage time by ``1/share``), a rank idle in the bubble leaves
its cores to the others: the step is the longer of the schedule at full speed (``share`` × the
formula above) and the node's total work on its cores (``m``·mean_i T_i) — see
:func:`time_shared`. With ``share`` = 1 (GPUs) that is the formula above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def time_shared(pipe: Any, m: Any, sum_t: Any, p: Any, share: float) -> Any:
    """The pipeline part of a step when ``p`` ranks time-share cores at ``share`` of their speed:
    ``max(share·pipe, m·Σ T_i / p)`` (scalars or numpy arrays, ``p`` too); ``pipe`` itself when
    ``share`` is 1 or there is no pipeline (``p`` = 1). Lower bounds of ``pipe`` and ``Σ T`` give a
    lower bound."""
    if share >= 1.0:
        return pipe
    return np.where(np.asarray(p) > 1, np.maximum(share * pipe, m * sum_t / p), pipe)


def pipeline_time(
    schedule: str, stage_fb: Sequence[float], m: int, v: int = 1,
    stage_f: Sequence[float] | None = None, stage_w: Sequence[float] | None = None, share: float = 1.0,
) -> tuple[float, float]:
    """(step time of the pipeline part, bubble time) for ``m`` micro-batches (``share``: see
    :func:`time_shared`)."""
    total, _ = _pipeline_time(schedule, stage_fb, m, v, stage_f, stage_w)
    total = float(time_shared(total, m, sum(stage_fb), len(stage_fb), share))
    return total, max(0.0, total - m * max(stage_fb))


def _pipeline_time(
    schedule: str, stage_fb: Sequence[float], m: int, v: int = 1,
    stage_f: Sequence[float] | None = None, stage_w: Sequence[float] | None = None,
) -> tuple[float, float]:
    p = len(stage_fb)
    worst = max(stage_fb)
    busy = m * worst
    if p == 1:
        return busy, 0.0
    if schedule in ("gpipe", "1f1b"):
        total = (m - 1) * worst + sum(stage_fb)
    elif schedule == "interleaved":
        total = busy + (p - 1) * worst / v
    elif schedule == "zb":
        f = stage_f or [t / 3 for t in stage_fb]
        wgt = stage_w or [t / 3 for t in stage_fb]
        # ZB-H1: the bubble is (p-1)·(F + B - W) with B = backward minus W.
        fill = max(fi + (t - fi - wi) - wi for t, fi, wi in zip(stage_fb, f, wgt, strict=True))
        total = busy + (p - 1) * max(fill, 0.0)
    else:
        raise ValueError(f"unknown schedule '{schedule}'")
    return total, total - busy


def in_flight(schedule: str, stage: int, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak.

    GPipe keeps all ``m``; 1F1B and ZB-H1 keep ``p - stage`` (at most ``m``); interleaved 1F1B
    keeps ``p - stage + (p - 1)/v`` worth of its layers (Korthikanti et al., 2022: the first stage
    holds ``p·(1 + (p-1)/(p·v))`` micro-batches).
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), (p - stage) + (p - 1) / v)
    return float(min(m, p - stage))
