"""Pipeline meshes with per-layer sharding inside the stages, as a mixed-integer program
(:class:`solvers.mip.Model`: MathOpt, HiGHS by default).

Every unit (embedding, blocks, head) of a pipeline mesh picks its own (sharding, offload,
recompute) among the options of the given :class:`PipelineProblem` s (one problem per (sharding,
offload) pair, its costs per recomputation); with one virtual stage per rank the stage boundaries
are free (at least one block a stage; embedding on the first, head on the last). Everything the
step time and a stage's peak memory read is linear in how many blocks of each class take each
option on each stage, but for maxima, which are linearised:

* ``T_k`` (a stage's time per micro-batch), ``W_k`` (its weight-gradient part), ``S_k`` (its
  per-step gradient sync), ``Win_k`` (the backward that sync hides under), ``O_k`` (optimizer),
  ``F_k`` (offload copies): sums over the units it holds, plus its sends;
* the pipeline: the schedule's step, linear in ``τ >= T_k``, ``Σ T`` and ``φ >= T_k - 2·W_k``
  (:func:`costmodel.pipeline.step_terms`); on time-shared cores the full-speed schedule stretched
  where more ranks are busy than there are cores, a maximum of linear terms
  (:func:`costmodel.pipeline.time_shared`);
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

from costmodel.estimate import rank_sends
from costmodel.pipeline import pipeline_step, ramp_step, ramp_stretch, ramp_terms, step_terms
from solvers.mip import DEFAULT_SOLVER, Model
from solvers.stage_tables import INF, PipelineProblem, UnitView
from solvers.stages import PipelineSolution, pipeline_objective
from vocab.strategy import rank_blocks

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
    le = (a.time <= b.time and a.states <= b.states and a.activations <= b.activations and a.pending <= b.pending
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
                 tied: bool = False, time_limit: float | None = None, solver: str = DEFAULT_SOLVER) -> LayerMix:
    """The fastest pipeline plan with per-unit options that fits, or none better than ``incumbent``
    (``solver``: the MIP back-end, :data:`solvers.mip.SOLVERS`)."""
    t0 = time.perf_counter()
    pp = qs[0]
    if pp.budget - pp.bucket <= 0:
        return LayerMix(None, "infeasible", INF, time.perf_counter() - t0)
    f = _Formulation(qs, nonuniform and pp.v == 1 and pp.p > 1, solver)
    f.blocks()
    f.ends(tied)
    f.memory()
    offset = f.step()
    # only plans strictly better than the incumbent (not the same plan again, up to rounding);
    # presolve costs more than it saves on these small models
    cutoff = incumbent * (1 - CUTOFF_TOLERANCE) / f.unit if np.isfinite(incumbent) else None
    status, x, _, bound = f.md.solve(offset, time_limit, cutoff, presolve=False)
    bound *= f.unit
    dt, columns = time.perf_counter() - t0, len(f.md.cost)
    if x is None:
        return LayerMix(None, status, bound if status in ("cutoff", "time_limit") else INF, dt, columns)
    sol = pipeline_objective(qs, *f.assignment(x))
    if sol.status == "infeasible":  # cannot happen within MEMORY_MARGIN; never return a plan that does not fit
        return LayerMix(None, "infeasible", INF, dt, columns)
    sol.status = status if status in ("optimal", "time_limit") else "feasible"
    return LayerMix(sol, sol.status, min(bound, sol.objective), dt, columns)


class _Formulation:
    """The MIP of one pipeline mesh, built part by part (see the module's docstring)."""

    def __init__(self, qs: Sequence[PipelineProblem], free: bool, solver: str = DEFAULT_SOLVER):
        pp = self.pp = qs[0]
        self.qs, self.free = qs, free
        self.p, self.L = pp.p, len(pp.block_cls)
        self.kinds = sorted(set(pp.block_cls))
        self.md = Model("stage_mix", solver)
        self.scale = 1.0 / (pp.budget - pp.bucket)  # memory rows in units of the budget
        # time in units that make the step about 1e4: HiGHS's absolute tolerances (1e-7) would
        # otherwise treat plans a fraction of a microsecond apart as equal
        self.unit = _time_unit(qs)
        self.fly = [pp.held(k) for k in range(pp.p)]  # (in flight, awaiting weight gradients) per stage
        # per stage: linear expressions (column -> coefficient) of what the step reads
        self.ex: list[dict[str, dict[int, float]]] = [{f: {} for f in _FIELDS} for _ in range(pp.p)]
        self.gathered = [self.md.var(name="gathered_cap") for _ in range(pp.p)]  # the largest gathered ZeRO-3 unit
        self.remat = [self.md.var(name="remat_cap") for _ in range(pp.p)]  # the largest recomputation
        self.ycols: dict[tuple[int, int], list[tuple[Opt, int]]] = {}  # (stage, class) -> option counts
        self.stage_of: dict[tuple[int, int], int] = {}  # (block, stage) -> binary (several classes, free)
        self.end_cols: dict[str, list[tuple[Opt, int]]] = {}
        self.host: list[dict[int, float]] = [{} for _ in range(pp.p)]  # per stage: offloaded states' host bytes

    def _unit(self, k: int, col: int, u: UnitView, held: float, hi: int) -> None:
        """Column ``col`` counts units costing ``u`` on stage ``k`` (``held`` bytes of micro-batches
        in flight each), at most ``hi`` of them."""
        vals = (u.time, u.weight, u.sync, u.window, u.optim, u.offload)
        for f, val in zip(_FIELDS[:-1], vals, strict=True):  # all but memory
            if val:
                self.ex[k][f][col] = self.ex[k][f].get(col, 0.0) + val / self.unit
        mem = (u.states + held) * self.scale
        if mem:
            self.ex[k]["memory"][col] = self.ex[k]["memory"].get(col, 0.0) + mem
        if u.host:
            self.host[k][col] = self.host[k].get(col, 0.0) + u.host
        if u.gathered <= 0 and u.recompute_peak <= 0:
            return
        z = col  # present on the stage
        if hi > 1:
            z = self.md.var(hi=1, integer=True, name="present")
            self.md.row({col: 1.0, z: -float(hi)}, hi=0.0, family="used")
        for cap, val in ((self.gathered[k], u.gathered), (self.remat[k], u.recompute_peak)):
            if val > 0:
                self.md.row({z: val * self.scale, cap: -1.0}, hi=0.0,
                            family="gathered" if cap == self.gathered[k] else "remat")

    def _counts(self) -> dict[tuple[int, int], dict[int, float] | int]:
        """(stage, class) -> how many blocks it holds: a number (even split), or an expression of
        the stage sizes (one class) or of which stage each block is on (several)."""
        md, p, L, kinds, pp = self.md, self.p, self.L, self.kinds, self.pp
        if not self.free:
            held = rank_blocks(L, p, pp.v)
            return {(k, kind): sum(pp.block_cls[i] == kind for i in held[k]) for k in range(p) for kind in kinds}
        if len(kinds) == 1:
            n = [md.var(lo=1, hi=L - p + 1, integer=True, name="stage_size") for _ in range(p)]
            md.row(dict.fromkeys(n, 1.0), lo=L, hi=L, family="stage_sizes")
            return {(k, kinds[0]): {n[k]: 1.0} for k in range(p)}
        idx = [md.var(lo=0, hi=p - 1, integer=True, name="stage_of") for _ in range(L)]  # the stage of each block
        for i in range(L):
            cols = [md.var(hi=1, integer=True, name="on_stage") for _ in range(p)]
            self.stage_of.update({(i, k): col for k, col in enumerate(cols)})
            md.row(dict.fromkeys(cols, 1.0), lo=1, hi=1, family="block_stage")
            md.row({**{col: float(k) for k, col in enumerate(cols) if k}, idx[i]: -1.0}, lo=0, hi=0,
                   family="stage_index")
            if i:  # contiguous stages, none empty: the stage index steps by 0 or 1 from 0 to p-1
                md.row({idx[i]: 1.0, idx[i - 1]: -1.0}, lo=0, hi=1, family="contiguous")
        md.row({idx[0]: 1.0}, hi=0, family="contiguous")
        md.row({idx[-1]: 1.0}, lo=p - 1, family="contiguous")
        return {(k, kind): {self.stage_of[(i, k)]: 1.0 for i in range(L) if pp.block_cls[i] == kind}
                for k in range(p) for kind in kinds}

    def blocks(self) -> None:
        """Per stage and block class, how many blocks take each (undominated) option."""
        counts = self._counts()
        kept = {kind: block_options(self.qs, kind, self.pp.cfg.schedule == "zb") for kind in self.kinds}
        for (k, kind), cnt in counts.items():
            hi = cnt if isinstance(cnt, int) else self.L - self.p + 1
            if hi == 0:
                continue
            cols = [(o, self.md.var(hi=hi, integer=True, name="count")) for o in kept[kind]]
            for o, col in cols:
                u = self.qs[o[0]].costs[kind][o[1]]
                self._unit(k, col, u, u.held(*self.fly[k]), hi)
            self.ycols[(k, kind)] = cols
            row = dict.fromkeys((col for _, col in cols), 1.0)
            if isinstance(cnt, int):
                self.md.row(row, lo=cnt, hi=cnt, family="assign")
            else:
                self.md.row({**row, **{col: -a for col, a in cnt.items()}}, lo=0, hi=0, family="assign")

    def ends(self, tied: bool) -> None:
        """The embedding (first stage) and head (last) take one option each; tied, the same pair."""
        pp, md = self.pp, self.md
        opts = [(s, r) for s in range(len(self.qs)) for r in range(len(pp.recomputes))]
        for name, kind, k in (("embedding", pp.emb, 0), ("head", pp.head, self.p - 1)):
            if kind is None:
                continue
            cols = [(o, md.var(hi=1, integer=True, name=name)) for o in opts]
            for o, col in cols:
                u = self.qs[o[0]].costs[kind][o[1]]
                held = pp.ends_held(u, None, *self.fly[k]) if name == "embedding" else pp.ends_held(None, u, *self.fly[k])
                self._unit(k, col, u, held, 1)
            md.row({col: 1.0 for _, col in cols}, lo=1, hi=1, family="ends")
            self.end_cols[name] = cols
        if tied and len(self.end_cols) == 2:
            for s in range(len(self.qs)):
                md.row({**{col: 1.0 for o, col in self.end_cols["embedding"] if o[0] == s},
                        **{col: -1.0 for o, col in self.end_cols["head"] if o[0] == s}}, lo=0, hi=0, family="tied")

    def memory(self) -> None:
        for k in range(self.p):
            self.md.row({**self.ex[k]["memory"], self.gathered[k]: 1.0, self.remat[k]: 1.0},
                        hi=1.0 - MEMORY_MARGIN - self.pp.recv(k) * self.scale, family="memory")
        budgets = [q.host_budget for q in self.qs if q.host_budget is not None]
        for k in range(self.p):  # a stage's offloaded states in its share of the node's host memory
            if self.host[k] and budgets:
                self.md.row({col: h / budgets[0] for col, h in self.host[k].items()}, hi=1.0 - MEMORY_MARGIN,
                            family="host")

    def step(self) -> float:
        """The objective's rows and costs; returns its constant."""
        pp, md, ex, p = self.pp, self.md, self.ex, self.p
        c, m, v, sched = pp.dev.c, pp.m, pp.v, pp.cfg.schedule
        base = [n * pp.p2p / self.unit for n in rank_sends(p, v)]
        tau = md.var(name="slowest_stage")
        eps = md.var(cost=1.0, name="exposed_sync")
        opt, off = md.var(cost=1.0, name="optimizer"), md.var(cost=1.0, name="offload")
        kappa, ov = c.comm_interference, c.dp_overlap
        sum_t: dict[int, float] = {}
        for k in range(p):
            e = ex[k]
            md.row({**e["time"], tau: -1.0}, hi=-base[k], family="stage_time")
            md.row({**_scaled(e["sync"], kappa), eps: -1.0}, hi=0.0, family="sync")
            md.row({**_plus(e["sync"], e["window"], -(1 - kappa) * ov), eps: -1.0}, hi=0.0, family="sync")
            md.row({**e["optim"], opt: -1.0}, hi=0.0, family="optimizer")
            md.row({**e["offload"], off: -1.0}, hi=0.0, family="offload")
            sum_t = _plus(sum_t, e["time"], 1.0)
        # the schedule's step, linear in (τ, Σ T, φ) (costmodel.pipeline.step_terms)
        on_max, on_sum, on_fill = (float(a) for a in step_terms(sched, m, p, v))
        ramp_on_fill = pp.dev.share < 1.0 and ramp_terms(sched, p, v)[2] != 0
        fill = md.var(name="fill") if on_fill or ramp_on_fill else None
        if fill is not None:
            for k in range(p):
                md.row({**_plus(ex[k]["time"], ex[k]["weight"], -2.0), fill: -1.0}, hi=-base[k], family="fill")
        pipe = {**(_scaled(sum_t, on_sum) if on_sum else {}), tau: on_max}
        if on_fill:
            pipe[fill] = on_fill  # type: ignore[index]
        pipe_const = float(pipeline_step(sched, m, p, v, 0.0, sum(base), 0.0))  # the sends in Σ T
        if pp.dev.share < 1.0:  # time-shared cores (costmodel.pipeline.time_shared)
            self._time_shared(pipe, pipe_const, sum_t, sum(base), tau, fill)
            return c.step_overhead_s / self.unit
        for col, a in pipe.items():
            md.cost[col] += a
        return c.step_overhead_s / self.unit + pipe_const

    def _time_shared(self, pipe: dict[int, float], pipe_const: float, sum_t: dict[int, float],
                     sum_const: float, tau: int, fill: int | None) -> None:
        """The objective's ``max(2·share·stretch·ramp + plateau, share·pipe, m·Σ T / p)`` with
        ``plateau >= share·(pipe - 2(K-1)·ramp)`` and ``plateau >= (m·Σ T - K(K-1)·ramp) / p``."""
        pp, md, p, m, share = self.pp, self.md, self.p, self.pp.m, self.pp.dev.share
        k, stretch = (float(x) for x in ramp_stretch(m, p, share))
        sched = pp.cfg.schedule
        on_max, on_sum, on_fill = (float(a) for a in ramp_terms(sched, p, pp.v))
        ramp = {**(_scaled(sum_t, on_sum) if on_sum else {}), **({tau: on_max} if on_max else {}),
                **({fill: on_fill} if on_fill and fill is not None else {})}
        ramp_const = float(ramp_step(sched, sum_const, 0.0, 0.0, p, pp.v))
        shared = md.var(cost=1.0, name="time_shared")
        plateau = md.var(lo=-np.inf, name="plateau")  # as time_shared: no floor of its own
        fam = "time_shared"
        md.row({**_scaled(pipe, share), shared: -1.0}, hi=-share * pipe_const, family=fam)
        md.row({**_scaled(sum_t, m / p), shared: -1.0}, hi=-m * sum_const / p, family=fam)
        cut = 2 * (k - 1) * share
        md.row({**_plus(_scaled(pipe, share), ramp, -cut), plateau: -1.0},
               hi=-(share * pipe_const - cut * ramp_const), family=fam)
        cut = k * (k - 1) / p
        md.row({**_plus(_scaled(sum_t, m / p), ramp, -cut), plateau: -1.0}, hi=-(m * sum_const / p - cut * ramp_const),
               family=fam)
        lift = 2 * share * stretch
        md.row({**_scaled(ramp, lift), plateau: 1.0, shared: -1.0}, hi=-lift * ramp_const, family=fam)

    def assignment(self, x: np.ndarray) -> tuple[list[Opt], list[list[int]], list[int] | None]:
        """Per unit (embedding, blocks, head) its option, the blocks of each rank, the stage sizes."""
        pp, p, L = self.pp, self.p, self.L
        counts = {key: {o: int(round(x[col])) for o, col in cols} for key, cols in self.ycols.items()}
        if not self.free:
            ranks, sizes = rank_blocks(L, p, pp.v), None
        else:
            if self.stage_of:
                owner = [max(range(p), key=lambda k, i=i: x[self.stage_of[(i, k)]]) for i in range(L)]
                sizes = [owner.count(k) for k in range(p)]
            else:
                sizes = [sum(counts.get((k, self.kinds[0]), {}).values()) for k in range(p)]
            ranks = rank_blocks(L, p, 1, sizes)
        per_block: list[Opt] = [(0, 0)] * L
        for k, held in enumerate(ranks):
            pools = {kind: [o for o, n in sorted(counts.get((k, kind), {}).items()) for _ in range(n)]
                     for kind in self.kinds}
            for i in held:
                per_block[i] = pools[pp.block_cls[i]].pop(0)
        pick = {name: next(o for o, col in cols if x[col] > 0.5) for name, cols in self.end_cols.items()}
        out = ([pick["embedding"]] if "embedding" in pick else []) + per_block + (
            [pick["head"]] if "head" in pick else [])
        return out, ranks, sizes


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
