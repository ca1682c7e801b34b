"""Lower bounds on the step time of every per-layer plan of a mesh, from its price grid.

The search (:mod:`solvers.hybrid`) solves a mesh's per-layer problem only while such a bound is
below the best plan found, so each bound must never exceed the true optimum of its space:

* :func:`grid_bounds` — every unit at its fastest option, memory ignored, stages as balanced as
  the pipeline allows;
* :func:`flat_lagrange` — without a pipeline, the memory limit priced by a multiplier;
* :func:`pipeline_lagrange` — with a 1F1B or zero-bubble pipeline, the stages' memory limits
  priced together by one multiplier;
* :func:`interleaved_lagrange` — with interleaved stages (the split is the even one), the memory
  limit of each rank priced by a multiplier under each (sharding, offload) it may take, the
  slowest rank's least bound taken.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from costmodel.device import DeviceModel
from costmodel.estimate import rank_sends
from costmodel.pipeline import (
    balanced_coef,
    in_flight,
    pipeline_step,
    ramp_step,
    step_terms,
    time_shared,
    with_ends,
)
from costmodel.vectorized import GridReport
from solvers.chain import memory_budget
from vocab.strategy import MeshConfig, Workload, rank_blocks

#: multipliers (seconds per byte) tried by the Lagrangian bounds; 0 is the memory-free bound
LAMBDAS = np.concatenate([[0.0], np.logspace(-16, -6, 31)])


@dataclass(frozen=True)
class MeshRows:
    """Mesh configurations (a grid's rows) and what the bounds read of them, gathered once."""

    cfgs: list[MeshConfig]
    m: np.ndarray  # micro-batches per step
    p: np.ndarray  # pipeline ranks
    v: np.ndarray  # virtual stages per rank
    sched: np.ndarray  # schedule names
    budget: np.ndarray  # bytes of states, activations and transients a rank may hold
    loss_buffer: float  # the loss's transients as a multiple of the head's activations

    @classmethod
    def of(cls, cfgs: list[MeshConfig], w: Workload, dev: DeviceModel, limit_gib: float) -> MeshRows:
        return cls(cfgs, np.array([w.global_batch / (c.dp * c.micro_batch) for c in cfgs]),
                   np.array([c.pp for c in cfgs], dtype=float), np.array([c.vpp for c in cfgs], dtype=float),
                   np.array([c.schedule for c in cfgs], dtype=object),
                   np.array([memory_budget(dev, c, limit_gib) for c in cfgs]), w.loss_buffer)

    def __len__(self) -> int:
        return len(self.cfgs)


def grid_bounds(gr: GridReport, rows: MeshRows, dev: DeviceModel, layout: tuple, mask: np.ndarray | None = None,
                best: float = np.inf, serves: np.ndarray | None = None) -> np.ndarray:
    """Per row: no per-layer plan of the configuration is faster than this.

    Every unit at its fastest of the options in ``mask`` (times only grow with operator
    splitting), memory ignored; with a pipeline the slowest stage is at least the least possible
    maximum over stage boundaries of those times (each stage holds a block), and at least 1/p of
    the total. ``layout``: (embedding class, the block class if there is one, head class, blocks).
    The stage balance is only worked out for rows whose 1/p bound is below ``best`` (and that
    ``serves`` selects, when given).
    """
    emb, block, head, L = layout
    counts = np.bincount(np.array(gr.unit_index), minlength=len(gr.units))
    sel = slice(None) if mask is None else mask
    fast = [u.time[:, sel].min(axis=1) for u in gr.units]
    t = sum(counts[k] * fast[k] for k in range(len(gr.units)))
    extra = sum(counts[k] * (u.optim[:, sel].min(axis=1) + u.offload[:, sel].min(axis=1))
                for k, u in enumerate(gr.units))
    if gr.p2p_total is not None and block is not None:  # every stage boundary sends one block's output
        t = t + gr.p2p_total
    m, p, v, sched = rows.m, rows.p, rows.v, rows.sched
    # zero-bubble: the largest fill (T - 2W) is at least the mean over the stages
    weight = sum(counts[k] * u.bwd_weight[:, 0] for k, u in enumerate(gr.units))
    fill = np.maximum(0.0, (t - 2 * weight) / p)

    def bound(worst: np.ndarray) -> np.ndarray:  # grows with the slowest stage
        pipe = pipeline_step(sched, m, p, v, worst, t, fill)
        ramp = ramp_step(sched, t, worst, fill, p, v)
        return time_shared(pipe, m, t, p, dev.share, ramp) + extra / p + dev.c.step_overhead_s

    worst = t / p
    if block is None or gr.p2p_total is None:
        return bound(worst)
    alive = (p > 1) & (bound(worst) < best) & (True if serves is None else serves)
    if alive.any():
        zero = np.zeros(len(rows))
        hop = np.where(p > 1, gr.p2p_total / np.maximum(p * v - 1, 1), 0.0)
        worst = np.maximum(worst, max_stage(fast[block], zero if emb is None else fast[emb],
                                            zero if head is None else fast[head], hop, p, v, sched, L, alive))
    return bound(worst)


def max_stage(tb: np.ndarray, te: np.ndarray, th: np.ndarray, hop: np.ndarray, p: np.ndarray, v: np.ndarray,
              sched: np.ndarray, L: int, alive: np.ndarray) -> np.ndarray:
    """Least possible slowest stage (embedding on the first, head on the last, >= 1 block each),
    for the ``alive`` rows (0 elsewhere)."""
    out = np.zeros(len(tb))
    for pv in {(int(a), int(b)) for a, b in zip(p[alive], v[alive], strict=True) if a > 1}:
        rows = np.flatnonzero((p == pv[0]) & (v == pv[1]) & alive)
        P, V = pv
        if V > 1:  # interleaved: the even split
            n_r = np.array([len(held) for held in rank_blocks(L, P, V)], dtype=float)
            b_r = np.array(rank_sends(P, V), dtype=float)
            stage = tb[rows, None] * n_r + hop[rows, None] * b_r
            stage[:, 0] += te[rows]
            stage[:, -1] += th[rows]
            out[rows] = stage.max(axis=1)
            continue
        # first, middle (P-2 alike) and last stage: extra time besides the blocks
        ext = np.stack([te[rows] + hop[rows], hop[rows], th[rows]], axis=1)
        weight = np.array([1.0, P - 2.0, 1.0]) if P > 2 else np.array([1.0, 0.0, 1.0])
        b = tb[rows, None]
        lo = (ext + b).max(axis=1)
        hi = (ext + b * (L - P + 1)).max(axis=1)
        for _ in range(30):  # lo only ever rises to values shown infeasible: a valid bound at any point
            mid = (lo + hi) / 2
            cap = np.floor((mid[:, None] - ext) / b)
            ok = (cap >= 1).all(axis=1) & ((cap * weight).sum(axis=1) >= L)
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid)
        out[rows] = lo
    return out


def sub_grid(gr: GridReport, rows: np.ndarray, more: GridReport | None = None) -> GridReport:
    """The grid's unit arrays of some rows only (what the bounds read), with the options of
    ``more`` (priced for exactly those rows) appended."""
    fields = ("time", "optim", "offload", "states", "state_grads", "activations", "bwd_weight", "pending")

    def pick(u: Any, k: int) -> SimpleNamespace:
        out = {f: getattr(u, f)[rows] for f in fields}
        if more is not None:
            out = {f: np.concatenate([v, getattr(more.units[k], f)], axis=1) for f, v in out.items()}
        return SimpleNamespace(**out)

    units = [pick(u, k) for k, u in enumerate(gr.units)]
    return replace(gr, units=units, p2p_total=None if gr.p2p_total is None else gr.p2p_total[rows])


def flat_lagrange(gr: GridReport, rows: MeshRows, dev: DeviceModel, head: int | None) -> np.ndarray:
    """Per row without a pipeline: max over λ >= 0 of Σ_units min_option (a + λ·mem) - λ·budget.

    The memory constraint priced by λ is backward's start (transients dropped, they only add
    memory; gradients only where micro-batches accumulate); splitting operators changes only the
    transients and adds time, so the grid's options bound it too."""
    counts = np.bincount(np.array(gr.unit_index), minlength=len(gr.units))
    m = rows.m[:, None]
    unheld = m <= 1  # one micro-batch: its gradients replace its activations
    parts = [(counts[k], m * u.time + u.optim + u.offload,
              u.states - np.where(unheld, u.state_grads, 0.0) + u.activations * (1 + rows.loss_buffer if k == head else 1.0))
             for k, u in enumerate(gr.units)]
    return _dual(parts, rows.budget, dev.c.step_overhead_s)


def pipeline_lagrange(gr: GridReport, rows: MeshRows, dev: DeviceModel, head: int | None, mask: np.ndarray,
                      alive: np.ndarray) -> np.ndarray:
    """Per ``alive`` row with a 1F1B or zero-bubble pipeline (0 elsewhere): the memory limits of all
    stages priced together by one multiplier.

    The step is at least ``c·Σ T`` (1F1B: ``(m-1)·max T + Σ T`` with ``max T >= Σ T / p``; ZB-H1:
    ``m·max T``) plus the per-step maxima, at least their means; every stage keeps at least one
    micro-batch in flight, so the stages' memories sum to at least the units' states and
    activations (zero bubble: ``fly·A + pend·P >= A + min(P, 0)``, as ``fly >= max(1, pend)`` and
    ``A + P >= 0``: the loss frees no more than it saved), and to at most ``p`` budgets. Each unit
    choosing its option alone relaxes the stages' (sharding, offload) and their boundaries."""
    out = np.zeros(len(rows))
    use = alive & (rows.p > 1) & ((rows.sched == "1f1b") | (rows.sched == "zb"))
    if not use.any() or gr.p2p_total is None:
        return out
    idx = np.flatnonzero(use)
    p, m = rows.p[idx, None], rows.m[idx, None]
    coef = balanced_coef(rows.sched[idx, None], m, p, rows.v[idx, None])
    counts = np.bincount(np.array(gr.unit_index), minlength=len(gr.units))
    parts = []
    for k, u in enumerate(gr.units):
        time = coef * u.time[idx][:, mask] + (u.optim[idx][:, mask] + u.offload[idx][:, mask]) / p
        mem = u.states[idx][:, mask] + u.activations[idx][:, mask] * (1 + rows.loss_buffer if k == head else 1.0)
        mem = mem + np.where(rows.sched[idx, None] == "zb", np.minimum(u.pending[idx][:, mask], 0.0), 0.0)
        parts.append((counts[k], time, mem))
    room = rows.p[idx] * rows.budget[idx]
    best = _dual(parts, room)
    leanest = sum(n * mem.min(axis=1) for n, _, mem in parts)
    best = np.where(leanest > room, np.inf, best)
    out[idx] = (best + coef[:, 0] * gr.p2p_total[idx] + dev.c.step_overhead_s) * min(1.0, dev.share)
    return out


def _dual(parts: list[tuple[int, np.ndarray, np.ndarray]], room: np.ndarray, base: float = 0.0) -> np.ndarray:
    """Per row: the best over :data:`LAMBDAS` of ``base - λ·room + Σ_parts n·min_option (time + λ·mem)``;
    ``parts`` holds (units of a class, time, memory), each (rows, options)."""
    best = np.full(len(room), -np.inf)
    for lam in LAMBDAS:
        val = base - lam * room
        for n, time, mem in parts:
            val = val + n * (time + lam * mem).min(axis=1)
        best = np.maximum(best, val)
    return best


def interleaved_lagrange(gr: GridReport, rows: MeshRows, dev: DeviceModel, layout: tuple, block_cls: list[int],
                         masks: list[np.ndarray], alive: np.ndarray) -> np.ndarray:
    """Per row with interleaved stages: a bound that prices each rank's memory limit (0 elsewhere,
    and for rows not ``alive``).

    ``masks``: the options a rank may take, one mask per (sharding, offload) when all its units
    share one, or one mask for all when each unit takes its own. The even split fixes the units of
    every rank; under one mask a rank's least time within its limit is at least ``max over λ >= 0
    of Σ_units min_option (time + λ·(states + in-flight·activations)) - λ·budget`` (transients
    dropped: they only add memory). That dual is concave and piecewise linear in λ, so its maximum
    lies at 0 or where some unit switches between two options: those λ are tried (see
    :func:`_rank_duals`). A rank takes the least of its masks' bounds; the step is
    ``(m + (p-1)/v)`` times the slowest rank plus the per-step terms, which are at least their
    mean over the ranks. A rank that fits under no mask makes the row infeasible (inf).
    """
    emb, _, head, L = layout
    out = np.zeros(len(rows))
    union = np.logical_or.reduce(masks)
    pp, vpp = rows.p, rows.v
    inter = alive & (pp > 1) & (vpp > 1) & (rows.sched == "interleaved")
    if gr.p2p_total is None or not union.any() or not inter.any():
        return out
    counts = np.bincount(np.array(gr.unit_index), minlength=len(gr.units))
    extra = sum(counts[k] * (u.optim[:, union] + u.offload[:, union]).min(axis=1) for k, u in enumerate(gr.units))
    for P, V in sorted({(int(a), int(b)) for a, b in zip(pp[inter], vpp[inter], strict=True)}):
        idx = np.flatnonzero(inter & (pp == P) & (vpp == V))
        held = _held(block_cls, emb, head, L, P, V, len(gr.units))
        m = rows.m[idx]
        flies = {mi: [in_flight("interleaved", r, P, int(mi), V) for r in range(P)] for mi in set(m.tolist())}
        mult = np.repeat(np.array([flies[mi] for mi in m.tolist()])[:, :, None], len(gr.units), axis=2)
        if head is not None:
            mult[:, P - 1, head] += rows.loss_buffer  # the loss's transients beside the kept softmax
        hops = np.array(rank_sends(P, V))
        base = hops[None, :] * (gr.p2p_total[idx] / (P * V - 1))[:, None]
        ranks = np.full((len(idx), P), np.inf)
        for mask in masks:
            cols = np.flatnonzero(mask)
            time = np.stack([u.time[np.ix_(idx, cols)] for u in gr.units], axis=1)  # (rows, classes, options)
            acts = np.stack([u.activations[np.ix_(idx, cols)] for u in gr.units], axis=1)
            states = np.stack([u.states[np.ix_(idx, cols)] for u in gr.units], axis=1)
            mem = mult[..., None] * acts[:, None] + states[:, None]  # (rows, ranks, classes, options)
            room = np.repeat(rows.budget[idx, None], P, axis=1)  # (rows, ranks)
            ranks = np.minimum(ranks, _rank_duals(time, mem, held, base, room))
        slowest = step_terms("interleaved", m, P, V)[0]  # per second of the slowest rank
        out[idx] = slowest * ranks.max(axis=1) + extra[idx] / P + dev.c.step_overhead_s
    return out * min(1.0, dev.share)  # time-shared cores: at least share × the full-speed bound


def _rank_duals(time: np.ndarray, mem: np.ndarray, held: np.ndarray, base: np.ndarray, room: np.ndarray
                ) -> np.ndarray:
    """(rows, ranks): the best Lagrangian bound on each rank's time (inf where nothing fits).

    ``time``: (rows, classes, options); ``mem``: (rows, ranks, classes, options) a unit's states and
    in-flight activations under each option; ``held``: (ranks, classes); ``base``: (rows, ranks)
    fixed time; ``room``: (rows, ranks). Every λ >= 0 gives a bound: with few options every λ where
    two options cost alike is tried (the exact maximum), with many those where the fastest or the
    leanest option ties with another."""
    t, a = time[:, None], mem  # (rows, ranks, classes, options)
    leanest = (held[None] * a.min(axis=3)).sum(axis=2)
    if t.shape[-1] <= 9:  # where unit options i and j cost alike: λ = (t_j - t_i) / (a_i - a_j), kept when positive
        dt = t[..., None, :] - t[..., :, None]
        da = a[..., :, None] - a[..., None, :]
    else:
        ends = np.stack([np.argmin(np.broadcast_to(t, a.shape), axis=-1), np.argmin(a, axis=-1)], axis=-1)
        te = np.take_along_axis(np.broadcast_to(t, a.shape), ends, axis=-1)  # (rows, ranks, classes, 2)
        ae = np.take_along_axis(a, ends, axis=-1)
        dt = t[..., None, :] - te[..., :, None]
        da = ae[..., :, None] - a[..., None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = np.where(da > 0, dt / da, 0.0)
    lam = np.concatenate([np.zeros(lam.shape[:2] + (1,)), lam.reshape(lam.shape[:2] + (-1,))], axis=2)
    lam = np.maximum(lam, 0.0)  # (rows, ranks, candidates)
    cost = (t[:, :, None] + lam[..., None, None] * a[:, :, None]).min(axis=4)  # (rows, ranks, cand, classes)
    dual = base[..., None] + (held[None, :, None] * cost).sum(axis=3) - lam * room[..., None]
    return np.where(leanest > room, np.inf, dual.max(axis=2))


def _held(block_cls: list[int], emb: int | None, head: int | None, L: int, P: int, V: int, K: int) -> np.ndarray:
    """(ranks, unit classes): how many units of each class each rank holds under the even split."""
    held = np.zeros((P, K))
    ranks = with_ends([[block_cls[b] for b in blocks] for blocks in rank_blocks(L, P, V)],
                      [] if emb is None else [emb], [] if head is None else [head])
    for r, classes in enumerate(ranks):
        for k in classes:
            held[r, k] += 1
    return held
