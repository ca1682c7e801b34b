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

Each schedule is one :class:`Schedule` of :data:`SCHEDULES` (its step, ramp, in-flight and pending
micro-batches); the cost model and the solvers read the schedules only through this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


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


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: everything the cost model and the solvers read of it, for ``p > 1``
    ranks, each function taking scalars or numpy arrays.

    * ``step(m, p, v, worst, sum_t, fill)``: the pipeline part of a step at full speed, from the
      slowest rank's micro-batch time ``worst``, the ranks' sum ``Σ T`` and the zero-bubble fill
      ``fill`` (the largest ``F + B - W``, read clipped at 0); linear in (``worst``, ``sum_t``,
      ``fill >= 0``), which the solvers' linear programs read as coefficients (:func:`step_terms`);
    * ``ramp(p, v, worst, sum_t, fill)``: one step of its fill and drain (:func:`time_shared`),
      linear in the same;
    * ``in_flight(stage, p, m, v)``: micro-batches whose activations rank ``stage`` holds at its
      peak (:func:`in_flight`);
    * ``pending(stage, p, m, v)``: micro-batches whose weight gradients wait on rank ``stage``
      (:func:`weights_pending`).
    """

    step: Callable[..., Any]
    ramp: Callable[..., Any]
    in_flight: Callable[..., Any]
    pending: Callable[..., Any]


def _none_pending(stage: Any, p: Any, m: Any, v: Any) -> Any:
    """No weight gradient waits: they are computed with the input gradients."""
    return 0.0 * m


#: GPipe's and 1F1B's step: the fill and drain pass through every stage once
_FILL_DRAIN = Schedule(
    step=lambda m, p, v, worst, sum_t, fill: (m - 1) * worst + sum_t,
    ramp=lambda p, v, worst, sum_t, fill: sum_t / p,
    in_flight=lambda stage, p, m, v: np.minimum(m, p - stage + 0.0),
    pending=_none_pending)

#: the schedules by name (:data:`vocab.strategy.SCHEDULES`); an unknown name reads as 1F1B
SCHEDULES: dict[str, Schedule] = {
    "gpipe": replace(_FILL_DRAIN, in_flight=lambda stage, p, m, v: m),
    "1f1b": _FILL_DRAIN,
    "interleaved": Schedule(
        step=lambda m, p, v, worst, sum_t, fill: m * worst + (p - 1) * worst / v,
        ramp=lambda p, v, worst, sum_t, fill: worst / v,
        in_flight=lambda stage, p, m, v: np.minimum(m, (p - stage) + (p - 1) / v),
        pending=_none_pending),
    "zb": Schedule(
        step=lambda m, p, v, worst, sum_t, fill: m * worst + (p - 1) * np.maximum(fill, 0.0),
        ramp=lambda p, v, worst, sum_t, fill: np.maximum(fill, 0.0),
        in_flight=lambda stage, p, m, v: np.minimum(m, float(p)),
        pending=lambda stage, p, m, v: np.minimum(m * v, stage + 1.0) / v),
}
DEFAULT_SCHEDULE = "1f1b"


def by_schedule(schedule: Any, value: Callable[[Schedule], Any]) -> Any:
    """``value`` of the schedule named ``schedule`` (a float where that is a scalar), or, for an
    array of names over configurations, of each one's schedule."""
    if isinstance(schedule, str):
        out = np.asarray(value(SCHEDULES.get(schedule, SCHEDULES[DEFAULT_SCHEDULE])))
    else:
        sched = np.asarray(schedule)
        names = list(SCHEDULES)
        values = [value(SCHEDULES[name]) for name in names]
        out = np.select([sched == name for name in names], values, values[names.index(DEFAULT_SCHEDULE)])
    return float(out) if out.ndim == 0 else out


def pipeline_step(schedule: Any, m: Any, p: Any, v: Any, worst: Any, sum_t: Any, fill: Any) -> Any:
    """The pipeline part of a step at full speed (:attr:`Schedule.step`); ``m·worst`` without a
    pipeline (``p`` = 1). Scalars or arrays over configurations."""
    out = by_schedule(schedule, lambda s: s.step(m, p, v, worst, sum_t, fill))
    if np.ndim(p) == 0:
        return m * worst if p == 1 else out
    return np.where(np.asarray(p) == 1, m * worst, out)


def ramp_step(schedule: Any, sum_t: Any, worst: Any, fill: Any, p: Any, v: Any) -> Any:
    """One step of a schedule's fill and drain (``ramp`` of :func:`time_shared`,
    :attr:`Schedule.ramp`): ``Σ T / p`` (GPipe, 1F1B), ``max T / v`` (interleaved), the zero-bubble
    fill (at least 0)."""
    return by_schedule(schedule, lambda s: s.ramp(p, v, worst, sum_t, fill))


#: (slowest rank's T, Σ T, fill) at which a linear formula reads each coefficient
_UNITS = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def step_terms(schedule: Any, m: Any, p: Any, v: Any) -> tuple[Any, Any, Any]:
    """:func:`pipeline_step` as coefficients of (the slowest rank's ``T``, ``Σ T``, the zero-bubble
    fill ``>= 0``): the formula read at unit values (it is linear in them)."""
    a, b, c = (pipeline_step(schedule, m, p, v, *unit) for unit in _UNITS)
    return a, b, c


def ramp_terms(schedule: Any, p: Any, v: Any) -> tuple[Any, Any, Any]:
    """:func:`ramp_step` as coefficients of (the slowest rank's ``T``, ``Σ T``, the fill ``>= 0``)."""
    a, b, c = (ramp_step(schedule, s, w, f, p, v) for w, s, f in _UNITS)
    return a, b, c


def balanced_coef(schedule: Any, m: Any, p: Any, v: Any) -> Any:
    """The pipeline part per second of ``Σ T`` when every rank takes ``Σ T / p`` and nothing
    fills the zero bubble: ``m`` without a pipeline, ``(m-1)/p + 1`` for GPipe and 1F1B,
    ``(m + (p-1)/v) / p`` interleaved, ``m / p`` zero bubble."""
    a_worst, a_sum, _ = step_terms(schedule, m, p, v)
    return a_worst / p + a_sum


def with_ends(stages: Sequence[Sequence[T]], first: Sequence[T], last: Sequence[T]) -> list[list[T]]:
    """The units of each pipeline stage, ``stages`` holding its blocks: the embedding (``first``,
    the units before the blocks) rides on the first stage, the head (``last``) on the last."""
    out = [list(s) for s in stages]
    out[0] = list(first) + out[0]
    out[-1] = out[-1] + list(last)
    return out


def _number(x: Any) -> Any:
    """A float, or a float array."""
    return x.astype(float) if isinstance(x, np.ndarray) else float(x)


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
    total = pipeline_step(schedule, m, p, v, worst, sum_t, fill)
    total = time_shared(total, m, sum_t, p, share, ramp_step(schedule, sum_t, worst, fill, p, v))
    return total, np.maximum(0.0, total - busy)


def pipeline_time(
    schedule: str, stage_fb: Sequence[float], m: int, v: int = 1,
    stage_f: Sequence[float] | None = None, stage_w: Sequence[float] | None = None, share: float = 1.0,
) -> tuple[float, float]:
    """(step time of the pipeline part, bubble time) of one configuration for ``m`` micro-batches
    (``share``: see :func:`time_shared`); without ``stage_f``/``stage_w`` a third of each stage's
    time each."""
    if schedule not in SCHEDULES:
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
    return by_schedule(schedule, lambda s: s.in_flight(stage, p, m, v))


def weights_pending(schedule: Any, stage: Any, p: int, m: Any, v: int = 1) -> Any:
    """Micro-batches (in units of the rank's layers) whose input gradients pipeline rank ``stage``
    has computed and whose weight gradients wait, at its peak: ``min(m·v, stage + 1) / v`` under
    zero bubble, none otherwise. Each holds, beyond its activations, the gradients at the outputs of
    its weight-carrying ops (``UnitCost.pending``). Counted from torch's zero-bubble schedule
    (``tests/test_runtime_memory_model.py`` replays it)."""
    m = _number(m)
    if p == 1:
        return m * 0.0
    return by_schedule(schedule, lambda s: s.pending(stage, p, m, v))


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
