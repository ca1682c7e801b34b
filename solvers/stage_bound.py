"""A lower bound on a pipeline mesh's step time when every unit takes its own option (the MIP's space).

Cheap enough to run before every MIP of :mod:`solvers.stage_ilp`, tight enough to skip most:

* a rank holding ``n`` blocks (one block class) takes at least the time of the linear relaxation
  of "``n`` blocks, each its own option, within the rank's memory": ``min Σ t_o·y_o`` subject to
  ``Σ y_o = n``, ``Σ (states_o + in-flight·activations_o)·y_o <= room``, ``y >= 0``, whose
  optimum mixes at most two options (so every option and every pair is tried, for all ``n`` at
  once); the embedding and head take their options whole; transients are dropped (they only add
  memory);
* over the stage boundaries, the least slowest stage and the least sum of stage times, each
  minimised alone; the per-step maxima (optimizer, offload, exposed sync) of the ranks' least
  sums where the ranks' units are known (interleaved, even splits), else at least their means
  (the exposed sync is convex in the sync and window it is priced from); the schedule's formula.

Splitting operators only shrinks transients and adds time, so the bound holds for those options too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from costmodel.estimate import rank_sends
from costmodel.pipeline import ramp_step, step_terms, time_shared
from solvers.stage_tables import INF, PipelineProblem, best_splits, pareto_front
from vocab.strategy import rank_blocks

__all__ = ["mixed_bound"]


def mixed_bound(qs: Sequence[PipelineProblem], nonuniform: bool = True) -> float:
    """Step time no plan of the MIP's space beats (0 where the bound does not apply: several block
    classes); ``inf`` when no rank's blocks can fit however they are split."""
    pp = qs[0]
    if not pp.single or pp.p < 2:
        return 0.0
    p, v, m, L = pp.p, pp.v, pp.m, len(pp.block_cls)
    c, sched = pp.dev.c, pp.cfg.schedule
    fixed = v > 1 or not nonuniform
    held = [len(b) for b in rank_blocks(L, p, v)]

    def best(table: np.ndarray, join) -> float:  # type: ignore[no-untyped-def]
        """The least max (or sum) of the ranks' values over the splits the space allows."""
        if fixed:
            vals = table[np.arange(p), held]
            return float(vals.max() if join is np.maximum else vals.sum())
        return float(best_splits(table, join)[0, 0])

    times = _tables(qs, lambda u: u.time, 1.0)
    max_t, sum_t = best(times, np.maximum), best(times, np.add)
    if not np.isfinite(max_t):
        return INF
    # the schedule's step as (per second of the slowest T, of Σ T); the zero-bubble fill is at least 0
    scale, on_sum, _ = step_terms(sched, m, p, v)
    pipe = scale * max_t + on_sum * sum_t
    ramp = ramp_step(sched, sum_t, max_t, 0.0, p, v)
    bound = float(time_shared(pipe, m, sum_t, p, pp.dev.share, ramp)) + _per_step(qs, fixed)
    if pp.dev.share >= 1.0:
        # the step is at least any rank's scale·T + optimizer + offload + exposed sync (plus the
        # Σ T term), the exposed sync at least κ·S and at least S - (1-κ)·overlap·window
        k, ov = c.comm_interference, c.dp_overlap
        for exposed in (lambda u: k * u.sync, lambda u: u.sync - (1 - k) * ov * u.window):
            table = _tables(qs, lambda u, e=exposed: scale * u.time + u.optim + u.offload + e(u), scale)
            bound = max(bound, best(table, np.maximum) + on_sum * sum_t)
    return bound + c.step_overhead_s


def _tables(qs: Sequence[PipelineProblem], value, send_scale: float) -> np.ndarray:  # type: ignore[no-untyped-def]
    """(ranks × block counts): the relaxation's least sum of ``value`` over a rank's units within
    its memory (inf where nothing fits, and for no blocks), its sends weighted by ``send_scale``."""
    pp = qs[0]
    p, L, R = pp.p, len(pp.block_cls), len(pp.recomputes)
    blocks = [q.costs[pp.kinds[0]][r] for q in qs for r in range(R)]
    val = np.array([value(u) for u in blocks])
    states = np.array([u.states for u in blocks])
    acts = np.array([u.activations for u in blocks])
    pend = np.array([u.pending for u in blocks])
    g_min = min(u.gathered for u in blocks)  # every rank holds a block: its transient is at least this
    budget = pp.budget - pp.bucket - g_min
    sends = rank_sends(p, pp.v)
    n = np.arange(L + 1, dtype=float)
    table = np.full((p, L + 1), INF)
    for r in range(p):
        fly, pe = pp.held(r)
        mem = states + fly * acts + pe * pend
        hull = _lower_hull(val, mem)  # the relaxation only ever uses these
        ends = np.array(_ends(qs, r, (fly, pe), value, g_min))  # (options of the embedding/head, 2)
        lp = _relaxed_blocks(val[hull], mem[hull], n, budget - pp.recv(r) - ends[:, 1])  # (ends, counts)
        table[r] = (ends[:, :1] + lp).min(axis=0) + send_scale * sends[r] * pp.p2p
    table[:, 0] = INF  # every stage holds a block
    return table


def _per_step(qs: Sequence[PipelineProblem], fixed: bool) -> float:
    """At least the per-step maxima (optimizer, offload, exposed sync): of the ranks' least sums
    where the ranks' units are known, else of their means (exposed sync: convex in its sums)."""
    pp = qs[0]
    c, p, R = pp.dev.c, pp.p, len(pp.recomputes)
    classes = set(pp.block_cls) | {k for k in (pp.emb, pp.head) if k is not None}
    low = {k: np.array([min(getattr(q.costs[k][r], f) for q in qs for r in range(R))
                        for f in ("optim", "offload", "sync")]
                       + [max(q.costs[k][r].window for q in qs for r in range(R))]) for k in classes}
    if fixed:
        per_rank = [sum((low[pp.block_cls[i]] for i in b), np.zeros(4))
                    for b in rank_blocks(len(pp.block_cls), p, pp.v)]
        if pp.emb is not None:
            per_rank[0] = per_rank[0] + low[pp.emb]
        if pp.head is not None:
            per_rank[-1] = per_rank[-1] + low[pp.head]
    else:
        units = Counter(pp.block_cls + [k for k in (pp.emb, pp.head) if k is not None])
        per_rank = [sum(cnt * low[k] for k, cnt in units.items()) / p]
    return (max(x[0] for x in per_rank) + max(x[1] for x in per_rank)
            + max(c.exposed(x[2], c.dp_overlap * x[3]) for x in per_rank))


def _ends(qs: Sequence[PipelineProblem], r: int, fly: tuple[float, float], value, g_min: float  # type: ignore[no-untyped-def]
          ) -> list[tuple[float, float]]:
    """(value, memory) of the embedding and head options rank ``r`` may hold, none dominated;
    the memory counts what their transient adds above ``g_min`` (the blocks' least)."""
    pp = qs[0]
    R = len(pp.recomputes)
    emb = [(value(u), u.states + pp.ends_held(u, None, *fly), u.gathered) for q in qs for i in range(R)
           for u in [q.costs[pp.emb][i]]] if r == 0 and pp.emb is not None else [(0.0, 0.0, 0.0)]
    head = [(value(u), u.states + pp.ends_held(None, u, *fly), u.gathered) for q in qs for i in range(R)
            for u in [q.costs[pp.head][i]]] if r == pp.p - 1 and pp.head is not None else [(0.0, 0.0, 0.0)]
    front = pareto_front([(a[0] + b[0], a[1] + b[1] + max(0.0, a[2] - g_min, b[2] - g_min), ())
                          for a in emb for b in head])
    return [(v, mem) for v, mem, _ in front]


def _lower_hull(t: np.ndarray, mem: np.ndarray) -> np.ndarray:
    """Indices of the options on the lower convex hull of (memory, time), leanest first: the
    relaxation's optimum mixes two neighbours of it (or takes one)."""
    order = sorted(range(len(t)), key=lambda i: (mem[i], t[i]))
    hull: list[int] = []
    for i in order:
        if hull and t[i] >= t[hull[-1]]:
            continue  # leaner and no slower already kept
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]  # drop b when it lies on or above the segment a..i
            if (t[b] - t[a]) * (mem[i] - mem[a]) >= (t[i] - t[a]) * (mem[b] - mem[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.array(hull, dtype=int)


def _relaxed_blocks(t: np.ndarray, mem: np.ndarray, n: np.ndarray, rooms: np.ndarray) -> np.ndarray:
    """(rooms × block counts): the least ``Σ t·y`` with ``Σ y = n``, ``Σ mem·y <= room``, ``y >= 0``."""
    nn, rr = n[None, :, None], rooms[:, None, None]  # (rooms, counts, options)
    best = np.where(mem * nn <= rr, t * nn, INF).min(axis=2)
    ma, mb = mem[:, None], mem[None, :]  # pairs: a over the room per block, b under it
    nn, rr = nn[..., None], rr[..., None]  # (rooms, counts, a, b)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ya = (rr - nn * mb) / (ma - mb)  # blocks on option a
        ok = (ma > mb) & (ya >= 0) & (ya <= nn)
        ya = np.where(ok, ya, 0.0)
        cost = np.where(ok, t[:, None] * ya + t[None, :] * (nn - ya), INF)
    return np.minimum(best, cost.reshape(cost.shape[:2] + (-1,)).min(axis=2, initial=INF))
