"""OSDP as a mixed-integer program, solved by HiGHS (``highspy``).

Without transition costs, units of one class are interchangeable, so the program counts how many
units of each class take each option (``n[k,c]`` integer in ``0..N_k``) — exact, and tiny for an
80-layer model. With transition costs every unit gets one-hot binaries ``x[i,c]`` and every
adjacent pair a flow ``f[i,c,c']`` (``Σ_c' f = x[i,c]``, ``Σ_c f = x[i+1,c']``), the standard
linearisation of ``x[i,c]·x[i+1,c']``. The transient maxima become ``G >= g·y`` (``y`` says an
option is used), the clipped term ``e >= Σ d·n, e >= 0``. A problem with a ``tail`` gets its second
memory row, the end of backward: ``Σ end·n + G + tail <= budget``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from solvers.chain import ChainProblem, ChainSolution, reduced

_BANNER_DONE = False


def new_highs() -> Any:
    """A silent HiGHS instance (its one-time banner goes to /dev/null, not to our stdout)."""
    global _BANNER_DONE
    import highspy

    if _BANNER_DONE:
        h = highspy.Highs()
    else:
        fd = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(fd, 1)
            os.close(fd)
        _BANNER_DONE = True
    for k, v in (
        ("output_flag", False),
        ("threads", 1),
        ("random_seed", 0),
        ("mip_rel_gap", 1e-10),
        ("mip_abs_gap", 1e-12),
    ):
        h.setOptionValue(k, v)
    return h


class _Model:
    """Columns and rows, then one ``passModel``."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost: float = 0.0, lo: float = 0.0, hi: float = np.inf, integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coefs: dict[int, float], lo: float = -np.inf, hi: float = np.inf) -> None:
        self.rows.append((coefs, lo, hi))

    def solve(
        self, offset: float, time_limit: float | None, cutoff: float | None = None, presolve: bool = True
    ) -> tuple[str, np.ndarray | None, float, float]:
        import highspy

        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.cost), len(self.rows)
        lp.col_cost_ = np.array(self.cost)
        lp.col_lower_ = np.array(self.lo)
        lp.col_upper_ = np.where(np.isinf(self.hi), inf, self.hi)
        lp.offset_ = offset
        starts, idx, vals = [0], [], []
        for coefs, _, _ in self.rows:
            for j in sorted(coefs):
                idx.append(j)
                vals.append(coefs[j])
            starts.append(len(idx))
        lp.row_lower_ = np.array([inf * -1 if np.isinf(lo) else lo for _, lo, _ in self.rows])
        lp.row_upper_ = np.array([inf if np.isinf(hi) else hi for _, _, hi in self.rows])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(starts)
        lp.a_matrix_.index_ = np.array(idx, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(vals)
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer
        ]
        h = new_highs()
        if not presolve:
            h.setOptionValue("presolve", "off")
        if time_limit is not None:
            h.setOptionValue("time_limit", max(float(time_limit), 1e-3))
        if cutoff is not None and np.isfinite(cutoff):
            h.setOptionValue("objective_bound", float(cutoff))
        h.passModel(lp)
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        S = highspy.HighsModelStatus
        has = info.primal_solution_status == 2  # kSolutionStatusFeasible
        x = np.array(h.getSolution().col_value) if has else None
        bound = float(info.mip_dual_bound) if any(self.integer) else float(info.objective_function_value)
        # With an objective bound HiGHS may report a model whose every solution it cuts off as
        # infeasible (seen when the optimum lies exactly at the bound): either way no plan beats
        # the cutoff, which stays a valid lower bound.
        if status == S.kObjectiveBound or (cutoff is not None and status == S.kInfeasible) or (
            cutoff is not None and status == S.kOptimal and float(info.objective_function_value) >= cutoff
        ):
            return "cutoff", None, np.inf, float(cutoff)  # type: ignore[arg-type]
        if status == S.kOptimal:
            return "optimal", x, float(info.objective_function_value), bound
        if status == S.kInfeasible:
            return "infeasible", None, np.inf, np.inf
        if status == S.kTimeLimit:
            return "time_limit", x, float(info.objective_function_value) if has else np.inf, bound
        return "feasible" if has else "infeasible", x, np.inf, bound


def solve_ilp(
    prob: ChainProblem, time_limit: float | None = None, aggregate: bool = True, cutoff: float | None = None
) -> ChainSolution:
    """Optimal choice per unit (or the best found within ``time_limit`` with its bound).

    With ``cutoff``, only plans strictly better than it are sought: status ``cutoff`` (no choice)
    says there are none."""
    t0 = time.perf_counter()
    red, maps = reduced(prob)
    budget = red.budget
    if budget < 0:
        return ChainSolution(None, np.inf, np.inf, "infeasible", time.perf_counter() - t0)
    scale = 1.0 / budget if budget > 0 else 1.0  # memory rows in units of the budget
    md = _Model()
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
                    md.row({v: 1.0, y: -float(n)}, hi=0.0)
                md.row({y: val * scale, cap: -1.0}, hi=0.0)
        md.row(dict.fromkeys(row_cols, 1.0), lo=n, hi=n)
        cols.append(row_cols)
    for cap in (G, R):
        if cap is not None:
            mem_row[cap] = 1.0
    md.row(mem_row, hi=budget * scale)
    if red.host_binds:  # the offloaded states of the rank in its share of the node's host memory
        host_row = {v: o.host / red.host_budget for row_cols, (_, k) in zip(cols, groups, strict=True)
                    for v, o in zip(row_cols, red.options[k], strict=True) if o.host > 0}
        md.row(host_row, hi=1.0)
    if red.tail is not None:
        if G is not None:
            end_row[G] = 1.0
        md.row(end_row, hi=(budget - red.tail) * scale)
    if e is not None:
        md.row({**d_row, e: -1.0}, hi=0.0)
    if red.transitions is not None and not by_unit:
        for i, t in enumerate(red.transitions):
            a, b = cols[i], cols[i + 1]
            f = [[md.var(cost=float(t[c, c2]), hi=1.0) for c2 in range(len(b))] for c in range(len(a))]
            for c in range(len(a)):
                md.row({**{f[c][c2]: 1.0 for c2 in range(len(b))}, a[c]: -1.0}, lo=0.0, hi=0.0)
            for c2 in range(len(b)):
                md.row({**{f[c][c2]: 1.0 for c in range(len(a))}, b[c2]: -1.0}, lo=0.0, hi=0.0)
    status, x, _, bound = md.solve(red.const, time_limit, cutoff)
    dt = time.perf_counter() - t0
    info: dict[str, Any] = {"solver": "highs", "columns": len(md.cost), "rows": len(md.rows)}
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


def least_memory(prob: ChainProblem) -> tuple[float, list[int]]:
    """(least memory of any choice, that choice): :meth:`ChainProblem.memory` minimised exactly, both
    moments (``M >= Σ mem + G + R``, ``M >= Σ end + G + tail``) in one program; inf when the
    program has no solution."""
    md = _Model()
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
            md.row({v: 1.0, y: -float(len(units))}, hi=0.0)
            md.row({y: o.g * scale, G: -1.0}, hi=0.0)
            md.row({y: o.r * scale, R: -1.0}, hi=0.0)
            run_row[v] = o.mem * scale
            end_row[v] = o.end * scale
            row_cols.append(v)
        md.row(dict.fromkeys(row_cols, 1.0), lo=len(units), hi=len(units))
        cols.append((units, row_cols))
    md.row(run_row, hi=0.0)
    if prob.tail is not None:
        md.row(end_row, hi=-prob.tail * scale)
    x = md.solve(0.0, None)[1]
    if x is None:
        return np.inf, []
    choice = [0] * prob.units
    for units, row_cols in cols:
        slots = [c for c, v in enumerate(row_cols) for _ in range(int(round(x[v])))]
        for i, c in zip(units, slots, strict=True):
            choice[i] = c
    return prob.memory(choice), choice
