"""Pipeline meshes with per-layer sharding inside the stages, as a mixed-integer program (HiGHS).

Every unit (embedding, blocks, head) of a pipeline mesh picks its own (sharding, offload,
recompute) among the options of the given :class:`PipelineProblem` s (one problem per (sharding,
offload) pair, its costs per recomputation); with one virtual stage per rank the stage boundaries
are free (at least one block a stage; embedding on the first, head on the last). Everything the
step time and a stage's peak memory read is linear in how many blocks of each class take each
option on each stage, but for maxima, which are linearised:

* ``T_k`` (a stage's time per micro-batch), ``W_k`` (its weight-gradient part), ``S_k`` (its
  per-step gradient sync), ``Win_k`` (the backward that sync hides under), ``O_k`` (optimizer),
  ``F_k`` (offload copies): sums over the units it holds, plus its sends;
* the pipeline: 1F1B/GPipe ``(m-1)·τ + Σ T``, zero-bubble ``m·τ + (p-1)·max(0, φ)``, interleaved
  ``(m + (p-1)/v)·τ`` with ``τ >= T_k``, ``φ >= T_k - 2·W_k``; on time-shared cores
  ``max(share·pipe, m·Σ T / p)`` (:func:`costmodel.pipeline.time_shared`);
* the exposed sync ``max_k (S_k - (1-κ)·min(S_k, overlap·Win_k))`` as ``ε >= κ·S_k`` and
  ``ε >= S_k - (1-κ)·overlap·Win_k``; ``o >= O_k``, ``f >= F_k``;
* a stage's memory ``Σ (states + in-flight·activations) + G_k + R_k <= budget``, where the
  transients (one unit's gathered ZeRO-3 parameters, one unit's recomputation) are the largest
  among the options present on the stage: a binary per (stage, class, option) says "present".

This is the objective of :mod:`solvers.stages` (and :func:`costmodel.estimate.estimate`) exactly;
the plan found is re-priced in floating point before it is returned. A model whose head is tied
to the embedding keeps the two alike (the runtime sums the two copies' gradients).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.estimate import rank_blocks, rank_sends
from costmodel.pipeline import in_flight
from solvers.osdp_ilp import _Model
from solvers.stage_tables import INF, PipelineProblem, UnitView
from solvers.stages import PipelineSolution, pipeline_objective

__all__ = ["LayerMix", "solve_layers"]

CUTOFF_TOLERANCE = 1e-9  # relative: a plan must beat the incumbent by more to count
MEMORY_MARGIN = 1e-7  # of the budget: HiGHS's feasibility tolerance, so that the plan found fits exactly


@dataclass
class LayerMix:
    """A solved pipeline with per-unit options: the solution, the solver's status and bound."""

    solution: PipelineSolution | None
    status: str  # optimal, time_limit, cutoff, infeasible
    bound: float
    time_s: float = 0.0
    columns: int = 0


Opt = tuple[int, int]  # (problem: its sharding and offload, recomputation index)
_FIELDS = ("time", "weight", "sync", "window", "optim", "offload", "memory")


def _dominated(a: UnitView, b: UnitView, zb: bool) -> bool:
    """``b`` is no better than ``a`` in anything the objective or memory reads."""
    le = (a.time <= b.time and a.states <= b.states and a.activations <= b.activations
          and a.gathered <= b.gathered and a.recompute_peak <= b.recompute_peak and a.sync <= b.sync
          and a.optim <= b.optim and a.offload <= b.offload and a.window >= b.window)
    return le and (not zb or a.time - 2 * a.weight <= b.time - 2 * b.weight)


def block_options(qs: Sequence[PipelineProblem], k: int, zb: bool) -> list[Opt]:
    """The options of block class ``k`` that no other option beats in everything (first of equals)."""
    opts = [(s, r) for s in range(len(qs)) for r in range(len(qs[0].recomputes))]
    views = [qs[s].costs[k][r] for s, r in opts]
    keep = []
    for i, vi in enumerate(views):
        if not any(j != i and _dominated(vj, vi, zb) and (vj != vi or j < i) for j, vj in enumerate(views)):
            keep.append(opts[i])
    return keep


def solve_layers(qs: Sequence[PipelineProblem], incumbent: float = INF, nonuniform: bool = True,
                 tied: bool = False, time_limit: float | None = None) -> LayerMix:
    """The fastest pipeline plan with per-unit options that fits, or none better than ``incumbent``."""
    t0 = time.perf_counter()
    pp = qs[0]
    c, cfg = pp.dev.c, pp.cfg
    p, v, m, L = pp.p, pp.v, pp.m, len(pp.block_cls)
    sched = cfg.schedule
    budget = pp.budget - pp.bucket
    if budget <= 0:
        return LayerMix(None, "infeasible", INF, time.perf_counter() - t0)
    scale = 1.0 / budget  # memory rows in units of the budget
    # time in units that make the step about 1e4: HiGHS's absolute tolerances (1e-7) would otherwise
    # treat plans a fraction of a microsecond apart as equal
    unit = _time_unit(qs)
    free = nonuniform and v == 1 and p > 1
    R = len(pp.recomputes)
    all_opts: list[Opt] = [(s, r) for s in range(len(qs)) for r in range(R)]
    md = _Model()
    fly = [in_flight(sched, k, p, m, v) for k in range(p)]
    sends = rank_sends(p, v)
    # per stage: linear expressions (column -> coefficient) of what the step reads
    ex: list[dict[str, dict[int, float]]] = [{f: {} for f in _FIELDS} for _ in range(p)]
    G = [md.var() for _ in range(p)]  # the largest gathered ZeRO-3 unit on the stage
    Rm = [md.var() for _ in range(p)]  # the largest recomputation on the stage

    def add(k: int, col: int, u: UnitView, mult: float) -> None:
        vals = (u.time / unit, u.weight / unit, u.sync / unit, u.window / unit, u.optim / unit, u.offload / unit,
                (u.states + mult * u.activations) * scale)
        for f, val in zip(_FIELDS, vals, strict=True):
            if val:
                ex[k][f][col] = ex[k][f].get(col, 0.0) + val

    def transients(k: int, col: int, u: UnitView, hi: int) -> None:
        if u.gathered <= 0 and u.recompute_peak <= 0:
            return
        z = col
        if hi > 1:
            z = md.var(hi=1, integer=True)
            md.row({col: 1.0, z: -float(hi)}, hi=0.0)
        for cap, val in ((G[k], u.gathered), (Rm[k], u.recompute_peak)):
            if val > 0:
                md.row({z: val * scale, cap: -1.0}, hi=0.0)

    # blocks: per stage and class, how many take each option
    kinds = sorted(set(pp.block_cls))
    counts: dict[tuple[int, int], dict[int, float] | int] = {}  # (stage, class) -> fixed count or expression
    stage_of: dict[tuple[int, int], int] = {}  # (block, stage) -> binary, multi-class free boundaries
    if not free:
        held = rank_blocks(L, p, v)
        for k in range(p):
            for kind in kinds:
                counts[(k, kind)] = sum(pp.block_cls[i] == kind for i in held[k])
    elif len(kinds) == 1:
        n = [md.var(lo=1, hi=L - p + 1, integer=True) for _ in range(p)]
        md.row(dict.fromkeys(n, 1.0), lo=L, hi=L)
        for k in range(p):
            counts[(k, kinds[0])] = {n[k]: 1.0}
    else:
        idx = [md.var(lo=0, hi=p - 1, integer=True) for _ in range(L)]  # the stage of each block
        for i in range(L):
            cols = [md.var(hi=1, integer=True) for _ in range(p)]
            for k, col in enumerate(cols):
                stage_of[(i, k)] = col
            md.row(dict.fromkeys(cols, 1.0), lo=1, hi=1)
            md.row({**{col: float(k) for k, col in enumerate(cols) if k}, idx[i]: -1.0}, lo=0, hi=0)
            if i:
                md.row({idx[i]: 1.0, idx[i - 1]: -1.0}, lo=0, hi=1)
        md.row({idx[0]: 1.0}, hi=0)
        md.row({idx[-1]: 1.0}, lo=p - 1)
        for k in range(p):
            for kind in kinds:
                counts[(k, kind)] = {stage_of[(i, k)]: 1.0 for i in range(L) if pp.block_cls[i] == kind}
    ycols: dict[tuple[int, int], list[tuple[Opt, int]]] = {}
    kept = {kind: block_options(qs, kind, sched == "zb") for kind in kinds}
    for k in range(p):
        for kind in kinds:
            cnt = counts[(k, kind)]
            hi = cnt if isinstance(cnt, int) else L - p + 1
            if hi == 0:
                continue
            cols = []
            for o in kept[kind]:
                col = md.var(hi=hi, integer=True)
                cols.append((o, col))
                u = qs[o[0]].costs[kind][o[1]]
                add(k, col, u, fly[k])
                transients(k, col, u, hi)
            ycols[(k, kind)] = cols
            row = dict.fromkeys((col for _, col in cols), 1.0)
            if isinstance(cnt, int):
                md.row(row, lo=cnt, hi=cnt)
            else:
                md.row({**row, **{col: -a for col, a in cnt.items()}}, lo=0, hi=0)
    # embedding and head: one option each
    ends: dict[str, list[tuple[Opt, int]]] = {}
    for name, kind, k, mult in (("embedding", pp.emb, 0, fly[0]), ("head", pp.head, p - 1, fly[-1] + pp.w.loss_buffer)):
        if kind is None:
            continue
        cols = []
        for o in all_opts:
            col = md.var(hi=1, integer=True)
            cols.append((o, col))
            u = qs[o[0]].costs[kind][o[1]]
            add(k, col, u, mult)
            transients(k, col, u, 1)
        md.row({col: 1.0 for _, col in cols}, lo=1, hi=1)
        ends[name] = cols
    if tied and len(ends) == 2:
        for s in range(len(qs)):
            md.row({**{col: 1.0 for o, col in ends["embedding"] if o[0] == s},
                    **{col: -1.0 for o, col in ends["head"] if o[0] == s}}, lo=0, hi=0)
    for k in range(p):
        md.row({**ex[k]["memory"], G[k]: 1.0, Rm[k]: 1.0}, hi=1.0 - MEMORY_MARGIN)
    # the step
    base = [sends[k] * pp.p2p / unit for k in range(p)]
    tau = md.var()
    eps, opt, off = md.var(cost=1.0), md.var(cost=1.0), md.var(cost=1.0)
    kappa, ov = c.comm_interference, c.dp_overlap
    for k in range(p):
        e = ex[k]
        md.row({**e["time"], tau: -1.0}, hi=-base[k])
        md.row({**_scaled(e["sync"], kappa), eps: -1.0}, hi=0.0)
        md.row({**_plus(e["sync"], e["window"], -(1 - kappa) * ov), eps: -1.0}, hi=0.0)
        md.row({**e["optim"], opt: -1.0}, hi=0.0)
        md.row({**e["offload"], off: -1.0}, hi=0.0)
    sum_t: dict[int, float] = {}
    for k in range(p):
        sum_t = _plus(sum_t, ex[k]["time"], 1.0)
    sum_base = sum(base)
    pipe: dict[int, float]
    pipe_const = 0.0
    if sched == "interleaved":
        pipe = {tau: m + (p - 1) / v}
    elif sched == "zb":
        fill = md.var()
        for k in range(p):
            md.row({**_plus(ex[k]["time"], ex[k]["weight"], -2.0), fill: -1.0}, hi=-base[k])
        pipe = {tau: float(m), fill: float(p - 1)}
    else:
        pipe = {**sum_t, tau: float(m - 1)}
        pipe_const = sum_base
    share = pp.dev.share
    if share < 1.0:
        P = md.var(cost=1.0)
        md.row({**_scaled(pipe, share), P: -1.0}, hi=-share * pipe_const)
        md.row({**_scaled(sum_t, m / p), P: -1.0}, hi=-m * sum_base / p)
        offset = c.step_overhead_s / unit
    else:
        for col, a in pipe.items():
            md.cost[col] += a
        offset = c.step_overhead_s / unit + pipe_const
    # only plans strictly better than the incumbent (not the same plan again, up to rounding);
    # presolve costs more than it saves on these small models
    cutoff = incumbent * (1 - CUTOFF_TOLERANCE) / unit if np.isfinite(incumbent) else None
    status, x, _, bound = md.solve(offset, time_limit, cutoff, presolve=False)
    bound *= unit
    dt = time.perf_counter() - t0
    if x is None:
        return LayerMix(None, status, bound if status in ("cutoff", "time_limit") else INF, dt, len(md.cost))
    per_unit, ranks, sizes = _assignment(pp, x, ycols, ends, stage_of, free, kinds)
    sol = pipeline_objective(qs, per_unit, ranks, sizes)
    if sol.status == "infeasible":  # cannot happen within MEMORY_MARGIN; never return a plan that does not fit
        return LayerMix(None, "infeasible", INF, dt, len(md.cost))
    st = status if status in ("optimal", "time_limit") else "feasible"
    sol.status = st
    return LayerMix(sol, st, min(bound, sol.objective), dt, len(md.cost))


def _time_unit(qs: Sequence[PipelineProblem]) -> float:
    """Seconds per unit of the MIP's time: about 1e-4 of the step (every unit at its fastest)."""
    pp = qs[0]
    units = pp.block_cls + [k for k in (pp.emb, pp.head) if k is not None]
    fastest = sum(min(u.time for q in qs for u in q.costs[k]) for k in units)
    return max(pp.m * fastest, 1e-12) * 1e-4


def _scaled(expr: dict[int, float], a: float) -> dict[int, float]:
    return {col: a * x for col, x in expr.items()}


def _plus(expr: dict[int, float], other: dict[int, float], a: float) -> dict[int, float]:
    """``expr + a·other``."""
    out = dict(expr)
    for col, x in other.items():
        out[col] = out.get(col, 0.0) + a * x
    return out


def _assignment(pp: PipelineProblem, x: np.ndarray, ycols: dict, ends: dict, stage_of: dict, free: bool,
                kinds: list[int]) -> tuple[list[Opt], list[list[int]], list[int] | None]:
    """Per unit (embedding, blocks, head) its option, the blocks of each rank, the stage sizes."""
    p, L = pp.p, len(pp.block_cls)
    counts = {key: {o: int(round(x[col])) for o, col in cols} for key, cols in ycols.items()}
    if not free:
        ranks, sizes = rank_blocks(L, p, pp.v), None
    elif stage_of:
        owner = [max(range(p), key=lambda k, i=i: x[stage_of[(i, k)]]) for i in range(L)]
        sizes = [owner.count(k) for k in range(p)]
        ranks = rank_blocks(L, p, 1, sizes)
    else:
        sizes = [sum(counts.get((k, kinds[0]), {}).values()) for k in range(p)]
        ranks = rank_blocks(L, p, 1, sizes)
    per_block: list[Opt] = [(0, 0)] * L
    for k, held in enumerate(ranks):
        pools = {kind: [o for o, n in sorted(counts.get((k, kind), {}).items()) for _ in range(n)] for kind in kinds}
        for i in held:
            per_block[i] = pools[pp.block_cls[i]].pop(0)
    pick = {name: next(o for o, col in cols if x[col] > 0.5) for name, cols in ends.items()}
    out = ([pick["embedding"]] if "embedding" in pick else []) + per_block + ([pick["head"]] if "head" in pick else [])
    return out, ranks, sizes
