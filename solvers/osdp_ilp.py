"""OSDP as a mixed-integer program (:class:`solvers.mip.Model`: MathOpt, HiGHS by default).

Without transition costs, units of one class are interchangeable, so the program counts how many
units of each class take each option (``n[k,c]`` integer in ``0..N_k``) — exact, and tiny for an
80-layer model. With transition costs every unit gets one-hot binaries ``x[i,c]`` and every
adjacent pair a flow ``f[i,c,c']`` (``Σ_c' f = x[i,c]``, ``Σ_c f = x[i+1,c']``), the standard
linearisation of ``x[i,c]·x[i+1,c']``. The transient maxima become ``G >= g·y`` (``y`` says an
option is used), the clipped term ``e >= Σ d·n, e >= 0``. A problem with a ``tail`` gets its second
memory row, the end of backward: ``Σ end·n + G + tail <= budget``.
"""

from __future__ import annotations

import time
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
    budget = red.budget
    if budget < 0:
        return ChainSolution(None, np.inf, np.inf, "infeasible", time.perf_counter() - t0)
    scale = 1.0 / budget if budget > 0 else 1.0  # memory rows in units of the budget
    md = Model("osdp", solver)
    by_unit = aggregate and red.transitions is None
    groups: list[tuple[list[int], int]] = []  # (units, class) of each decision group
    if by_unit:
        counts: dict[int, list[int]] = {}
        for i, k in enumerate(red.classes):
            counts.setdefault(k, []).append(i)
        groups = [(units, k) for k, units in counts.items()]
    else:
        groups = [([i], k) for i, k in enumerate(red.classes)]
    all_opts = [o for opts in red.options for o in opts]
    d_mixed = any(o.d > 0 for o in all_opts) and any(o.d < 0 for o in all_opts)
    d_fold = not d_mixed and any(o.d > 0 for o in all_opts)  # always >= 0: objective is linear in d
    G = md.var() if any(o.g > 0 for o in all_opts) else None
    R = md.var() if any(o.r > 0 for o in all_opts) else None
    e = md.var(cost=1.0) if d_mixed else None
    mem_row: dict[int, float] = {}
    end_row: dict[int, float] = {}  # the end of backward (when the problem has a tail)
    d_row: dict[int, float] = {}
    cols: list[list[int]] = []
    for units, k in groups:
        n = len(units)
        opts = red.options[k]
        row_cols = []
        for o in opts:
            v = md.var(cost=o.a + (o.d if d_fold else 0.0), hi=n, integer=True)
            row_cols.append(v)
            mem_row[v] = o.mem * scale
            end_row[v] = o.end * scale
            if e is not None and o.d:
                d_row[v] = o.d
            for cap, val in ((G, o.g), (R, o.r)):
                if cap is None or val <= 0:
                    continue
                y = v if n == 1 else md.var(hi=1, integer=True)
                if y != v:
                    md.row({v: 1.0, y: -float(n)}, hi=0.0, family="used")
                md.row({y: val * scale, cap: -1.0}, hi=0.0, family="gathered" if cap == G else "remat")
        md.row(dict.fromkeys(row_cols, 1.0), lo=n, hi=n, family="assign")
        cols.append(row_cols)
    for cap in (G, R):
        if cap is not None:
            mem_row[cap] = 1.0
    md.row(mem_row, hi=budget * scale, family="memory")
    if red.host_binds:  # the offloaded states of the rank in its share of the node's host memory
        host_row = {v: o.host / red.host_budget for row_cols, (_, k) in zip(cols, groups, strict=True)
                    for v, o in zip(row_cols, red.options[k], strict=True) if o.host > 0}
        md.row(host_row, hi=1.0, family="host")
    if red.tail is not None:
        if G is not None:
            end_row[G] = 1.0
        md.row(end_row, hi=(budget - red.tail) * scale, family="memory_end")
    if e is not None:
        md.row({**d_row, e: -1.0}, hi=0.0, family="sync")
    if red.transitions is not None and not by_unit:
        for i, t in enumerate(red.transitions):
            a, b = cols[i], cols[i + 1]
            f = [[md.var(cost=float(t[c, c2]), hi=1.0) for c2 in range(len(b))] for c in range(len(a))]
            for c in range(len(a)):
                md.row({**{f[c][c2]: 1.0 for c2 in range(len(b))}, a[c]: -1.0}, lo=0.0, hi=0.0, family="flow_out")
            for c2 in range(len(b)):
                md.row({**{f[c][c2]: 1.0 for c in range(len(a))}, b[c2]: -1.0}, lo=0.0, hi=0.0, family="flow_in")
    if hint and by_unit:
        _hint(md, red, groups, cols, hint)
    status, x, _, bound = md.solve(red.const, time_limit, cutoff)
    dt = time.perf_counter() - t0
    info: dict[str, Any] = {"solver": solver, "columns": len(md.cost), "rows": len(md.rows)}
    if status == "cutoff":
        return ChainSolution(None, np.inf, bound, "cutoff", dt, info)
    if x is None:
        return ChainSolution(
            None,
            np.inf,
            bound if status == "time_limit" else np.inf,
            "infeasible" if status != "time_limit" else "time_limit",
            dt,
            info,
        )
    choice = [0] * red.units
    for (units, k), row_cols in zip(groups, cols, strict=True):
        counts_k = [int(round(x[v])) for v in row_cols]
        slots = [c for c, cnt in enumerate(counts_k) for _ in range(cnt)]
        for i, c in zip(units, slots, strict=True):
            choice[i] = maps[k][c]
    obj = prob.objective(choice)
    if not prob.fits(choice):  # rounding of a near-integral solution: should not happen
        return ChainSolution(
            None, np.inf, bound, "infeasible", dt, {**info, "error": "rounded solution does not fit"}
        )
    st = status if status in ("optimal", "time_limit") else "feasible"
    return ChainSolution(choice, obj, min(bound, obj), st, dt, info)


def least_memory(prob: ChainProblem, solver: str = DEFAULT_SOLVER) -> tuple[float, list[int]]:
    """(least memory of any choice, that choice): :meth:`ChainProblem.memory` minimised exactly, both
    moments (``M >= Σ mem + G + R``, ``M >= Σ end + G + tail``) in one program; inf when the
    program has no solution."""
    md = Model("least_memory", solver)
    ref = max((max(o.mem, o.end) for row in prob.options for o in row), default=1.0) or 1.0
    scale = 1.0 / ref
    M = md.var(cost=1.0)
    G, R = md.var(), md.var()
    run_row: dict[int, float] = {G: 1.0, R: 1.0, M: -1.0}
    end_row: dict[int, float] = {G: 1.0, M: -1.0}
    counts: dict[int, list[int]] = {}
    for i, k in enumerate(prob.classes):
        counts.setdefault(k, []).append(i)
    cols: list[tuple[list[int], list[int]]] = []
    for k, units in counts.items():
        row_cols = []
        for o in prob.options[k]:
            v = md.var(hi=len(units), integer=True)
            y = md.var(hi=1, integer=True)  # the option is used
            md.row({v: 1.0, y: -float(len(units))}, hi=0.0, family="used")
            md.row({y: o.g * scale, G: -1.0}, hi=0.0, family="gathered")
            md.row({y: o.r * scale, R: -1.0}, hi=0.0, family="remat")
            run_row[v] = o.mem * scale
            end_row[v] = o.end * scale
            row_cols.append(v)
        md.row(dict.fromkeys(row_cols, 1.0), lo=len(units), hi=len(units), family="assign")
        cols.append((units, row_cols))
    md.row(run_row, hi=0.0, family="memory")
    if prob.tail is not None:
        md.row(end_row, hi=-prob.tail * scale, family="memory_end")
    x = md.solve(0.0, None)[1]
    if x is None:
        return np.inf, []
    choice = [0] * prob.units
    for units, row_cols in cols:
        slots = [c for c, v in enumerate(row_cols) for _ in range(int(round(x[v])))]
        for i, c in zip(units, slots, strict=True):
            choice[i] = c
    return prob.memory(choice), choice


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
