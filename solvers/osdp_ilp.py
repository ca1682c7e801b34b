"""OSDP as a mixed-integer program (:class:`solvers.mip.Model`: MathOpt, HiGHS by default).

Without transition costs, units of one class are interchangeable, so the program counts how many
units of each class take each option (``n[k,c]`` integer in ``0..N_k``) — exact, and tiny for an
80-layer model. With transition costs every unit gets one-hot binaries ``x[i,c]`` and every
adjacent pair a flow ``f[i,c,c']`` (``Σ_c' f = x[i,c]``, ``Σ_c f = x[i+1,c']``), the standard
linearisation of ``x[i,c]·x[i+1,c']``. The transient maxima are levels (:func:`_levels`): a
binary per distinct value, the clipped term ``e >= Σ d·n, e >= 0``. A problem with a ``tail`` gets
its second memory row, the end of backward: ``Σ end·n + G + tail <= budget``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solvers.chain import ChainProblem, ChainSolution, reduced
from solvers.mip import DEFAULT_SOLVER, Model


def solve_ilp(
    prob: ChainProblem, time_limit: float | None = None, aggregate: bool = True, cutoff: float | None = None,
    solver: str = DEFAULT_SOLVER, hint: Any = None,
) -> ChainSolution:
    """Optimal choice per unit (or the best found within ``time_limit`` with its bound).

    With ``cutoff``, only plans strictly better than it are sought: status ``cutoff`` (no choice)
    says there are none. ``solver``: the MIP back-end (:data:`solvers.mip.SOLVERS`); ``hint``: the
    option keys to start from, in order of preference (each class takes the first it has; a class
    with none of them is left to the solver)."""
    t0 = time.perf_counter()
    red, maps = reduced(prob)
    if red.budget < 0:
        return ChainSolution(None, np.inf, np.inf, "infeasible", time.perf_counter() - t0)
    if cutoff is not None and np.isfinite(cutoff):
        lb = lagrange_bound(red)
        if lb >= cutoff * (1 + 1e-12):  # nothing strictly better: no program to build
            return ChainSolution(None, np.inf, lb, "cutoff", time.perf_counter() - t0, {"solver": "bound"})
    by_unit = aggregate and red.transitions is None
    prog = _program(red, by_unit, solver)
    if hint and by_unit:
        _hint(prog.md, red, prog.groups, prog.cols, hint)
    status, x, _, bound = prog.md.solve(red.const * prog.ts, time_limit, None if cutoff is None else cutoff * prog.ts)
    info: dict[str, Any] = {"solver": solver, "columns": len(prog.md.cost), "rows": len(prog.md.rows)}
    return _answer(prob, prog, (status, x, bound / prog.ts), maps, (time.perf_counter() - t0, info))


@dataclass
class _Program:
    """The OSDP program as built: the model, its decision groups (units, class), each group's count
    column per option, the objective's units of time per second, and how many units there are."""

    md: Model
    groups: list[tuple[list[int], int]]
    cols: list[list[int]]
    ts: float
    units: int


@dataclass(frozen=True)
class _Scales:
    """How an option's numbers enter the program: ``time`` units per second, ``memory`` units per
    byte (of the budget), whether ``d`` folds into the cost (``d_fold``: it is never negative) or
    enters the clipped sync's row (``clipped``)."""

    time: float
    memory: float
    d_fold: bool
    clipped: bool


@dataclass
class _Rows:
    """The rows a program's count columns enter as they are made: the memory at backward's start,
    at its end (when the problem has a tail) and the clipped sync ``Σ d·n``."""

    memory: dict[int, float] = field(default_factory=dict)
    end: dict[int, float] = field(default_factory=dict)
    sync: dict[int, float] = field(default_factory=dict)


def _program(red: ChainProblem, by_unit: bool, solver: str) -> _Program:
    """The program of a reduced problem: a count column per (group, option), the groups the unit
    classes when ``by_unit``, else one unit each (transition costs need them apart)."""
    scale = 1.0 / red.budget if red.budget > 0 else 1.0  # memory rows in units of the budget
    md = Model("osdp", solver)
    groups = _class_groups(red.classes) if by_unit else [([i], k) for i, k in enumerate(red.classes)]
    all_opts = [o for opts in red.options for o in opts]
    d_mixed = any(o.d > 0 for o in all_opts) and any(o.d < 0 for o in all_opts)
    d_fold = not d_mixed and any(o.d > 0 for o in all_opts)  # always >= 0: objective is linear in d
    # time in units that make the objective about 1e4: HiGHS's absolute tolerances (1e-7) would
    # otherwise take options a fraction of a microsecond apart for equal
    ref = red.const + sum(min(o.a for o in red.options[k]) for k in red.classes)
    ts = 1e4 / ref if ref > 0 else 1.0
    e = md.var(cost=ts, name="sync") if d_mixed else None
    rows = _Rows()
    scales = _Scales(ts, scale, d_fold, e is not None)
    cols = [_assign(md, units, red.options[k], scales, rows) for units, k in groups]
    opts_of = [red.options[k] for _, k in groups]
    sizes = [len(units) for units, _ in groups]
    _levels(md, sizes, cols, opts_of, "g", [rows.memory, rows.end], scale, "gathered")
    _levels(md, sizes, cols, opts_of, "r", [rows.memory], scale, "remat")
    _memory(md, red, rows, scale)
    _host(md, red, groups, cols)
    if red.tail is not None:
        md.row(rows.end, hi=(red.budget - red.tail) * scale, family="memory_end")
    if e is not None:
        md.row({**rows.sync, e: -1.0}, hi=0.0, family="sync")  # e >= Σ d·n (and e >= 0)
    if red.transitions is not None and not by_unit:
        _flows(md, red.transitions, cols, ts)
    return _Program(md, groups, cols, ts, red.units)


def _assign(md: Model, units: list[int], options: list[Any], scales: _Scales, rows: _Rows) -> list[int]:
    """The count columns of one group (how many of its ``units`` take each option), summing to the
    group's size (family ``assign``); each enters ``rows``."""
    n = len(units)
    row_cols = []
    for o in options:
        v = md.var(cost=(o.a + (o.d if scales.d_fold else 0.0)) * scales.time, hi=n, integer=True, name="count")
        row_cols.append(v)
        rows.memory[v] = o.mem * scales.memory
        rows.end[v] = o.end * scales.memory
        if scales.clipped and o.d:
            rows.sync[v] = o.d
    md.row(dict.fromkeys(row_cols, 1.0), lo=n, hi=n, family="assign")
    return row_cols


def _memory(md: Model, red: ChainProblem, rows: _Rows, scale: float) -> None:
    """Backward's start within the budget (family ``memory``): states, activations, transients."""
    md.row(rows.memory, hi=red.budget * scale, family="memory")


def _host(md: Model, red: ChainProblem, groups: list[tuple[list[int], int]], cols: list[list[int]]) -> None:
    """The offloaded states of the rank in its share of the node's host memory (family ``host``)."""
    if not red.host_binds:
        return
    host_row = {v: o.host / red.host_budget for row_cols, (_, k) in zip(cols, groups, strict=True)
                for v, o in zip(row_cols, red.options[k], strict=True) if o.host > 0}
    md.row(host_row, hi=1.0, family="host")


def _flows(md: Model, transitions: Any, cols: list[list[int]], ts: float) -> None:
    """Transition costs between adjacent units: a flow ``f[c, c']`` per pair of their options
    (families ``flow_out``: ``Σ_c' f = x[i, c]``, ``flow_in``: ``Σ_c f = x[i+1, c']``)."""
    for i, t in enumerate(transitions):
        a, b = cols[i], cols[i + 1]
        f = [[md.var(cost=float(t[c, c2]) * ts, hi=1.0, name="flow") for c2 in range(len(b))] for c in range(len(a))]
        for c in range(len(a)):
            md.row({**{f[c][c2]: 1.0 for c2 in range(len(b))}, a[c]: -1.0}, lo=0.0, hi=0.0, family="flow_out")
        for c2 in range(len(b)):
            md.row({**{f[c][c2]: 1.0 for c in range(len(a))}, b[c2]: -1.0}, lo=0.0, hi=0.0, family="flow_in")


def _answer(prob: ChainProblem, prog: _Program, result: tuple[str, np.ndarray | None, float],
            maps: list[list[int]], run: tuple[float, dict[str, Any]]) -> ChainSolution:
    """The solution of a solved program: ``result`` (status, column values, lower bound in
    seconds), ``run`` (seconds taken, solver information)."""
    status, x, bound = result
    dt, info = run
    if status == "cutoff":
        return ChainSolution(None, np.inf, bound, "cutoff", dt, info)
    if x is None:
        timed_out = status == "time_limit"
        return ChainSolution(None, np.inf, bound if timed_out else np.inf, "time_limit" if timed_out else "infeasible",
                             dt, info)
    choice = _choice(x, prog.groups, prog.cols, prog.units, maps)
    obj = prob.objective(choice)
    if not prob.fits(choice):  # rounding of a near-integral solution: should not happen
        return ChainSolution(None, np.inf, bound, "infeasible", dt, {**info, "error": "rounded solution does not fit"})
    st = status if status in ("optimal", "time_limit") else "feasible"
    return ChainSolution(choice, obj, min(bound, obj), st, dt, info)


def lagrange_bound(red: ChainProblem) -> float:
    """A lower bound on the optimum of ``red`` (reduced, without transitions; -inf with them): the
    Lagrangian dual of one memory row at a time. Each class uses some option, so the transients are
    at least ``G0 = max_k min_c g``, ``R0`` alike; for ``λ >= 0`` every plan that fits costs at
    least ``const + Σ_k N_k·min_c (a_c + λ·mem_c) − λ·(budget − G0 − R0)`` (the end-of-backward
    row with ``end``, ``budget − tail − G0``), with ``a`` taking ``d`` where no ``d`` is negative
    (else ``max(0, Σd) >= 0``). Its maximum over ``λ`` is at a ratio of two options' time and
    memory differences; every such ratio is tried. The host row is left out (a relaxation)."""
    if red.transitions is not None:
        return -np.inf
    counts = np.bincount(np.asarray(red.classes, dtype=int), minlength=len(red.options))
    used = [k for k in range(len(red.options)) if counts[k]]
    fold = all(o.d >= 0 for k in used for o in red.options[k])
    a = [np.array([o.a + (o.d if fold else 0.0) for o in red.options[k]]) for k in used]
    g0 = max(min(o.g for o in red.options[k]) for k in used)
    r0 = max(min(o.r for o in red.options[k]) for k in used)
    rows = [("mem", red.budget - g0 - r0)] + ([("end", red.budget - red.tail - g0)] if red.tail is not None else [])
    best = -np.inf
    for attr, room in rows:
        m = [np.array([getattr(o, attr) for o in red.options[k]]) for k in used]
        lam = [np.zeros(1)]
        for ak, mk in zip(a, m, strict=True):
            da, dm = ak[:, None] - ak[None, :], mk[None, :] - mk[:, None]
            ok = (dm > 0) & (da > 0)
            lam.append(da[ok] / dm[ok])
        lams = np.unique(np.concatenate(lam))
        total = red.const - lams * room
        for k, ak, mk in zip(used, a, m, strict=True):
            total = total + counts[k] * np.min(ak[None, :] + lams[:, None] * mk[None, :], axis=1)
        best = max(best, float(total.max()))
    return best


def least_memory(prob: ChainProblem, solver: str = DEFAULT_SOLVER) -> tuple[float, list[int]]:
    """(least memory of any choice, that choice): :meth:`ChainProblem.memory` minimised exactly, both
    moments (``M >= Σ mem + G + R``, ``M >= Σ end + G + tail``) in one program; inf when the
    program has no solution."""
    md = Model("least_memory", solver)
    ref = max((max(o.mem, o.end) for row in prob.options for o in row), default=1.0) or 1.0
    scale = 1.0 / ref
    M = md.var(cost=1.0, name="peak")
    run_row: dict[int, float] = {M: -1.0}
    end_row: dict[int, float] = {M: -1.0}
    groups = _class_groups(prob.classes)
    cols: list[list[int]] = []
    for units, k in groups:
        row_cols = []
        for o in prob.options[k]:
            v = md.var(hi=len(units), integer=True, name="count")
            run_row[v] = o.mem * scale
            end_row[v] = o.end * scale
            row_cols.append(v)
        md.row(dict.fromkeys(row_cols, 1.0), lo=len(units), hi=len(units), family="assign")
        cols.append(row_cols)
    sizes = [len(units) for units, _ in groups]
    opts_of = [prob.options[k] for _, k in groups]
    _levels(md, sizes, cols, opts_of, "g", [run_row, end_row], scale, "gathered")
    _levels(md, sizes, cols, opts_of, "r", [run_row], scale, "remat")
    md.row(run_row, hi=0.0, family="memory")
    if prob.tail is not None:
        md.row(end_row, hi=-prob.tail * scale, family="memory_end")
    x = md.solve(0.0, None)[1]
    if x is None:
        return np.inf, []
    choice = _choice(x, groups, cols, prob.units)
    return prob.memory(choice), choice


def _class_groups(classes: list[int]) -> list[tuple[list[int], int]]:
    """(units, class) per class, in the order classes first appear: the units one count column
    of each option stands for."""
    units: dict[int, list[int]] = {}
    for i, k in enumerate(classes):
        units.setdefault(k, []).append(i)
    return [(members, k) for k, members in units.items()]


def _choice(x: np.ndarray, groups: list[tuple[list[int], int]], cols: list[list[int]], n_units: int,
            maps: list[list[int]] | None = None) -> list[int]:
    """Every unit's option from the count columns' values ``x``: a group's units take the options
    in order of their index, as many of each as its column counts (``maps``: back to the options
    before :func:`solvers.chain.reduced`)."""
    choice = [0] * n_units
    for (units, k), row_cols in zip(groups, cols, strict=True):
        slots = [c for c, v in enumerate(row_cols) for _ in range(int(round(x[v])))]
        for i, c in zip(units, slots, strict=True):
            choice[i] = c if maps is None else maps[k][c]
    return choice


def _levels(md: Model, sizes: list[int], cols: list[list[int]], options: list[list[Any]], attr: str,
            rows: list[dict[int, float]], scale: float, family: str) -> None:
    """The largest ``attr`` (``g`` or ``r``) of the options used, added to each of ``rows``.

    One binary ``u_j`` per distinct positive value ``v_1 < … < v_m`` ("the largest is at least
    ``v_j``"), the maximum ``Σ_j (v_j − v_(j−1))·u_j``; a group of ``N`` units (columns ``cols``,
    options ``options``) forces it by ``Σ_(c: attr_c >= v_j) n_c <= N·u_j`` (family ``family``),
    and ``u_j >= u_(j+1)`` (``family_order``). Exact, and a handful of binaries: with a binary per option HiGHS branches
    between options that differ in the fourth digit."""
    levels = sorted({float(getattr(o, attr)) for opts in options for o in opts if getattr(o, attr) > 0})
    prev, last = 0.0, None
    for lv in levels:
        u = md.var(hi=1, integer=True, name=f"{family}_level")
        for row in rows:
            row[u] = (lv - prev) * scale
        if last is not None:
            md.row({u: 1.0, last: -1.0}, hi=0.0, family=f"{family}_order")
        for n, row_cols, opts in zip(sizes, cols, options, strict=True):
            link = {v: 1.0 for v, o in zip(row_cols, opts, strict=True) if getattr(o, attr) >= lv}
            if link:
                md.row({**link, u: -float(n)}, hi=0.0, family=family)
        prev, last = lv, u


def _hint(md: Model, red: ChainProblem, groups: list[tuple[list[int], int]], cols: list[list[int]],
          keys: Any) -> None:
    """Start from the plan where every unit of a class takes the first of ``keys`` its class has."""
    values: dict[int, float] = {}
    for (units, k), row_cols in zip(groups, cols, strict=True):
        have = [o.key for o in red.options[k]]
        hit = next((have.index(key) for key in keys if key in have), None)
        if hit is not None:
            values.update({v: float(len(units)) if c == hit else 0.0 for c, v in enumerate(row_cols)})
    if values:
        md.hint(values)
