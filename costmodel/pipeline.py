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
its cores to the others, and the ranks still busy run faster: see :func:`time_shared`. With
``share`` = 1 (GPUs) that is the formula above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def time_shared(pipe: Any, m: Any, sum_t: Any, p: Any, share: float, ramp: Any) -> Any:
    """The pipeline part of a step when ``p`` ranks time-share cores at ``share`` of their speed.

    ``pipe`` is the schedule's time at ``share`` (the formulas above), ``sum_t`` the ranks' summed
    micro-batch time ``Σ T``, ``ramp`` one step of the fill (and of the drain): ``Σ T / p`` for
    GPipe and 1F1B, the slowest rank's ``T / v`` interleaved, the zero-bubble fill. Scalars or
    numpy arrays, ``m`` and ``p`` too.

    Under processor sharing every busy rank runs at the same rate, ``min(1, c / k)`` of its full
    speed with ``k`` of a pipeline's ``p`` ranks busy and ``c = share·p`` ranks' worth of cores per
    pipeline (replicas run the same phase at the same time), so the step is the full-speed
    schedule with each stretch of ``k`` busy ranks slowed by ``max(1, k / c)``. The schedule's
    ranks fill one ramp step at a time (``1, 2, …, K - 1`` busy, ``K = min(m, p)``), run a plateau
    with ``K`` busy and drain the same way: ``2·ramp·Σ_{k<K} max(1, k / c)`` (full speed) plus the
    plateau, the longer of its full-speed length and its work over ``c``. For equal stages that
    is exactly GPipe or 1F1B simulated at those rates (interleaved idles more mid-schedule: up to
    5% long; ``tests/test_plots.py``). The result is never below the schedule at full speed
    (``share·pipe``) nor below the node's work on its cores (``m·Σ T / p``). It grows with the
    slowest stage, ``Σ T`` and the ramp (every branch does: the ramp's negative terms are
    outweighed), so lower bounds of them give a lower bound. ``pipe`` itself when ``share`` is 1
    or ``p`` = 1.
    """
    if share >= 1.0:
        return pipe
    p_arr = np.asarray(p, dtype=float)
    k, stretch = ramp_stretch(m, p_arr, share)
    full_ramp = share * ramp
    plateau = np.maximum(share * pipe - 2 * (k - 1) * full_ramp, (m * sum_t - k * (k - 1) * ramp) / p_arr)
    shared = np.maximum(2 * full_ramp * stretch + plateau, np.maximum(share * pipe, m * sum_t / p_arr))
    return np.where(p_arr > 1, shared, pipe)


def ramp_stretch(m: Any, p: Any, share: float) -> tuple[Any, Any]:
    """(``K = min(m, p)``, ``Σ_{k=1}^{K-1} max(1, k / c)`` with ``c = share·p``): the busy ranks at
    a time-shared pipeline's plateau and how much its fill (or drain) is slowed, in ramp steps."""
    p = np.asarray(p, dtype=float)
    k = np.minimum(np.asarray(m, dtype=float), p)
    c = share * p
    j = np.clip(np.floor(c), 0.0, k - 1)  # up to j busy ranks run at full speed
    return k, j + (k * (k - 1) - j * (j + 1)) / (2 * c)


def ramp_step(schedule: Any, sum_t: Any, worst: Any, fill: Any, p: Any, v: Any) -> Any:
    """One step of a schedule's fill and drain (``ramp`` of :func:`time_shared`), per schedule:
    ``Σ T / p`` (GPipe, 1F1B), ``max T / v`` (interleaved), the zero-bubble fill (at least 0)."""
    per_rank = np.asarray(sum_t) / p
    return _select_schedule(schedule, per_rank, np.asarray(worst) / v, np.maximum(fill, 0.0), per_rank)


def _number(x: Any) -> Any:
    """A float, or a float array."""
    return x.astype(float) if isinstance(x, np.ndarray) else float(x)


def _select_schedule(schedule: Any, gpipe: Any, interleaved: Any, zb: Any, other: Any) -> Any:
    """Per schedule (a name, or an array of names over configurations) the matching value."""
    if isinstance(schedule, str):  # one schedule: its branch
        out = np.asarray({"gpipe": gpipe, "interleaved": interleaved, "zb": zb}.get(schedule, other))
    else:
        sched = np.asarray(schedule)
        out = np.select([sched == "gpipe", sched == "interleaved", sched == "zb"], [gpipe, interleaved, zb], other)
    return float(out) if out.ndim == 0 else out


def schedule_time(schedule: Any, stage_fb: Any, m: Any, p: int, v: int, stage_f: Any, stage_w: Any,
                  share: float = 1.0, weights: Any = None) -> tuple[Any, Any]:
    """(step time of the pipeline part, bubble time) over configurations: ``stage_fb``, ``stage_f``
    and ``stage_w`` are (..., ranks) arrays of a micro-batch's forward+backward, forward and
    weight-gradient seconds per pipeline rank (or per distinct rank, ``weights`` counting how many
    ranks each stands for), ``schedule`` and ``m`` scalars or arrays broadcasting against
    ``stage_fb[..., 0]``."""
    t = np.asarray(stage_fb, dtype=float)
    worst = t.max(axis=-1)
    m = np.asarray(m, dtype=float)
    busy = m * worst
    if p == 1:
        return busy, np.zeros_like(busy)
    mult = np.ones(t.shape[-1]) if weights is None else np.asarray(weights, dtype=float)
    sum_t = (t * mult).sum(axis=-1)
    f, wgt = np.asarray(stage_f, dtype=float), np.asarray(stage_w, dtype=float)
    fill = (f + (t - f - wgt) - wgt).max(axis=-1)  # ZB-H1: the bubble is (p-1)·(F + B - W)
    total = _select_schedule(schedule, (m - 1) * worst + sum_t, busy + (p - 1) * worst / v,
                             busy + (p - 1) * np.maximum(fill, 0.0), (m - 1) * worst + sum_t)
    total = time_shared(total, m, sum_t, p, share, ramp_step(schedule, sum_t, worst, fill, p, v))
    return total, np.maximum(0.0, total - busy)


def pipeline_time(
    schedule: str, stage_fb: Sequence[float], m: int, v: int = 1,
    stage_f: Sequence[float] | None = None, stage_w: Sequence[float] | None = None, share: float = 1.0,
) -> tuple[float, float]:
    """(step time of the pipeline part, bubble time) of one configuration for ``m`` micro-batches
    (``share``: see :func:`time_shared`); without ``stage_f``/``stage_w`` a third of each stage's
    time each."""
    if schedule not in ("gpipe", "1f1b", "interleaved", "zb"):
        raise ValueError(f"unknown schedule '{schedule}'")
    t = np.asarray(stage_fb, dtype=float)
    f = t / 3 if stage_f is None else stage_f
    wgt = t / 3 if stage_w is None else stage_w
    total, bubble = schedule_time(schedule, t, m, len(t), v, f, wgt, share)
    return float(total), float(bubble)


def in_flight(schedule: Any, stage: Any, p: int, m: Any, v: int = 1) -> Any:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak (scalars, or
    arrays of schedules and micro-batch counts over configurations, or of ranks).

    GPipe keeps all ``m``; 1F1B keeps ``p - stage`` (at most ``m``); interleaved 1F1B keeps
    ``p - stage + (p - 1)/v`` worth of its layers (Korthikanti et al., 2022: the first stage holds
    ``p·(1 + (p-1)/(p·v))`` micro-batches). Zero bubble keeps ``min(m, p)`` on every rank: rank
    ``stage`` runs ``p - 1 - stage`` warm-up forwards and then defers each micro-batch's weight
    gradients by ``stage`` more, and until they are computed the micro-batch's autograd graph, its
    saved activations included, stays alive (torch's ``ScheduleInterleavedZeroBubble`` retains it;
    the ZB paper's bound, ``p`` micro-batches' worth on every rank, is the same). See
    :func:`weights_pending` for what the deferred micro-batches hold besides.
    """
    m = _number(m)
    if p == 1:
        return m * 0.0 + 1.0
    return _select_schedule(schedule, m, np.minimum(m, (p - stage) + (p - 1) / v), np.minimum(m, float(p)),
                            np.minimum(m, p - stage + 0.0))


def weights_pending(schedule: Any, stage: Any, p: int, m: Any, v: int = 1) -> Any:
    """Micro-batches (in units of the rank's layers) whose input gradients pipeline rank ``stage``
    has computed and whose weight gradients wait, at its peak: ``min(m·v, stage + 1) / v`` under
    zero bubble, none otherwise. Each holds, beyond its activations, the gradients at the outputs of
    its weight-carrying ops (``UnitCost.pending``). Counted from torch's zero-bubble schedule
    (``tests/test_runtime_memory_model.py`` replays it)."""
    m = _number(m)
    if p == 1:
        return m * 0.0
    zb = np.minimum(m * v, stage + 1.0) / v
    return _select_schedule(schedule, 0.0 * m, 0.0 * m, zb, 0.0 * m)


def recv_buffers(schedule: Any, stage: Any, p: int, m: Any, v: int = 1, kind: str = "per_micro_batch"
                 ) -> tuple[Any, Any]:
    """(forward, gradient) receive buffers pipeline rank ``stage`` holds beyond what the activations
    count, per virtual stage with a previous (forward) or next (gradient) stage, as the trainer keeps
    them (``Workload.recv_buffers``):

    * ``per_micro_batch``: torch's ``PipelineStage`` allocates one activation-sized buffer per
      micro-batch for the inputs it receives and one per micro-batch for the output gradients, and
      keeps them between steps. The ``in_flight`` micro-batches' input buffers are already counted
      (the stage's first op saves its input), as are the output gradients of those awaiting weight
      gradients (``weights_pending``: the last op's output gradient is the received one).
    * ``one``: DeepSpeed's ``PipelineEngine`` receives into one buffer each way and clones it into
      the micro-batch's input (``pipe_recv_buf``, ``grad_layer``): one of each beyond the activations.
    * ``none``: Megatron-LM and nanotron allocate each received tensor when it arrives
      (``p2p_communication._communicate``, ``P2PTensorMetaData.create_empty_storage``); it is the
      micro-batch's input, freed with its activations: nothing beyond them."""
    zero = 0.0 * np.asarray(m, dtype=float)
    if p == 1 or kind == "none":
        return zero, zero
    if kind == "one":
        return zero + 1.0, zero + 1.0
    return m - in_flight(schedule, stage, p, m, v), m - weights_pending(schedule, stage, p, m, v)
