"""The solvers' one mixed-integer model: every formulation (OSDP per layer, the stage MIP, the
least-memory program) is written once against :class:`Model`, built as an OR-Tools MathOpt model
and solved by its HiGHS (default) or SCIP.

A formulation adds named columns (:meth:`Model.var`: cost, bounds, integrality and the name of
the variable family, e.g. ``count`` or ``stage_time``) and rows (:meth:`Model.row`: coefficients,
bounds and the *family* the row belongs to, the names docs/solvers.md uses), one function per
family; :meth:`Model.build` makes the MathOpt model of them (columns named ``name[n]``, rows
``family[n]``). Every back-end answers in one vocabulary: ``optimal``, ``time_limit``,
``feasible``, ``infeasible`` or ``cutoff`` (no plan strictly better than the incumbent), with the
primal values, the objective and a proven lower bound.

Back-ends (``--solver``):

* ``highs`` (default): the HiGHS that OR-Tools 9.15's MathOpt bundles (``SolverType.HIGHS``);
* ``highspy``: HiGHS 1.16 through ``highspy``, from the same columns and rows, around OR-Tools:
  measured faster on the stage MIPs (``benchmarks/mip_backends.py``, docs/solvers.md), an option;
* ``scip``: SCIP through MathOpt (``SolverType.GSCIP``), with a warm start (:meth:`Model.hint`).

CP-SAT (MathOpt's ``CP_SAT``) is measured but not offered: it reads the stage MIP's continuous
columns (its transient caps, the clipped sync, stage times) as integers and answers "optimal"
with wrong plans.

A cutoff is what each back-end does best with it: ``highspy`` prunes with it (``objective_bound``);
MathOpt's HiGHS refuses ``cutoff_limit``, so the objective gets a row ``cost·x + offset <= cutoff``
(family ``cutoff``: nothing at or above it is a plan); SCIP solves without it (MathOpt's Python
layer in OR-Tools 9.15 cannot read SCIP's cutoff answer). A plan that does not beat it reads as
``cutoff`` afterwards, the same answer on every back-end.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from typing import Any

import numpy as np

from vocab.interrupts import held_interrupts

#: the back-ends ``--solver`` selects, by their names in the CLI
SOLVERS = ("highs", "highspy", "scip")
DEFAULT_SOLVER = "highs"
#: the back-ends that start from a hint (:meth:`Model.hint`); HiGHS prunes with the cutoff instead
HINTED = ("scip",)
#: relative and absolute MIP gaps: proven optimal means to rounding
GAPS = (1e-10, 1e-12)


def _mathopt() -> Any:
    """OR-Tools' MathOpt, imported with Ctrl-C held back: protobuf's descriptor pool, which it loads,
    would print a ``KeyboardInterrupt`` raised in its callbacks and go on (:mod:`vocab.interrupts`)."""
    with held_interrupts():
        from ortools.math_opt.python import mathopt
    return mathopt


def solver_type(name: str) -> Any:
    """MathOpt's ``SolverType`` of a back-end name (``ValueError`` for an unknown one)."""
    mathopt = _mathopt()

    table = {"highs": mathopt.SolverType.HIGHS, "cp-sat": mathopt.SolverType.CP_SAT,
             "scip": mathopt.SolverType.GSCIP}  # CP-SAT: measured only
    if name not in table:
        raise ValueError(f"unknown MIP solver '{name}': choose one of {', '.join(SOLVERS)}")
    return table[name]


class Model:
    """Columns and named rows, buffered; one MathOpt model built and solved by :meth:`solve`.

    ``cost`` stays a list a formulation may add to (``md.cost[col] += a``) until it solves."""

    def __init__(self, name: str = "shardplan", solver: str = DEFAULT_SOLVER) -> None:
        if solver not in SOLVERS:  # an unknown name fails here, not at solve
            raise ValueError(f"unknown MIP solver '{solver}': choose one of {', '.join(SOLVERS)}")
        self.name, self.solver = name, solver
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[bool] = []
        self.names: list[str] = []
        self.rows: list[tuple[dict[int, float], float, float, str]] = []
        self.families: Counter[str] = Counter()
        self.columns: Counter[str] = Counter()
        self._hint: dict[int, float] | None = None

    def var(self, cost: float = 0.0, lo: float = 0.0, hi: float = np.inf, integer: bool = False,
            name: str = "x") -> int:
        """A new column (its index): ``cost`` in the objective, ``lo <= x <= hi``, the ``name``
        column number n named ``name[n]``."""
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        self.names.append(f"{name}[{self.columns[name]}]")
        self.columns[name] += 1
        return len(self.cost) - 1

    def row(self, coefs: dict[int, float], lo: float = -np.inf, hi: float = np.inf, family: str = "row") -> None:
        """``lo <= Σ coefs[j]·x_j <= hi``, the ``family`` row number n named ``family[n]``."""
        self.rows.append((coefs, lo, hi, f"{family}[{self.families[family]}]"))
        self.families[family] += 1

    def hint(self, values: dict[int, float]) -> None:
        """A feasible point to start from (columns not given are left to the solver)."""
        self._hint = dict(values)

    def build(self, offset: float, cutoff: float | None = None) -> tuple[Any, list[Any]]:
        """The MathOpt model (minimisation) and its variables, column by column; with ``cutoff``, the
        row ``cost·x + offset <= cutoff`` (family ``cutoff``)."""
        mathopt = _mathopt()

        m = mathopt.Model(name=self.name)
        xs = [m.add_variable(lb=lo, ub=hi, is_integer=i, name=name)
              for lo, hi, i, name in zip(self.lo, self.hi, self.integer, self.names, strict=True)]
        obj = m.objective
        obj.is_maximize = False
        obj.offset = offset
        for j, c in enumerate(self.cost):
            if c:
                obj.set_linear_coefficient(xs[j], c)
        for coefs, lo, hi, name in self.rows:
            con = m.add_linear_constraint(lb=lo, ub=hi, name=name)
            for j, a in coefs.items():
                if a:
                    con.set_coefficient(xs[j], a)
        if cutoff is not None:
            con = m.add_linear_constraint(ub=cutoff - offset, name="cutoff[0]")
            for j, c in enumerate(self.cost):
                if c:
                    con.set_coefficient(xs[j], c)
        return m, xs

    def solve(
        self, offset: float, time_limit: float | None, cutoff: float | None = None, presolve: bool = True
    ) -> tuple[str, np.ndarray | None, float, float]:
        """(status, column values or None, objective, lower bound), minimising cost·x + offset."""
        cut = float(cutoff) if cutoff is not None and np.isfinite(cutoff) else None
        if self.solver == "highspy":
            return _solve_highs(self, offset, time_limit, cut, presolve)
        return self.solve_mathopt(offset, time_limit, cut, presolve)

    def solve_mathopt(self, offset: float, time_limit: float | None, cutoff: float | None = None,
                      presolve: bool = True, solver: str | None = None) -> tuple[str, np.ndarray | None, float, float]:
        """:meth:`solve` through MathOpt with ``solver`` (this model's by default; ``highs`` and
        ``cp-sat`` here are MathOpt's own, which the benchmark measures)."""
        mathopt = _mathopt()

        name = solver or self.solver
        m, xs = self.build(offset, cutoff if name == "highs" else None)  # the others take none as a row
        params: dict[str, Any] = {"random_seed": 0}
        params["relative_gap_tolerance"], params["absolute_gap_tolerance"] = GAPS
        if time_limit is not None:
            params["time_limit"] = datetime.timedelta(seconds=max(float(time_limit), 1e-3))
        if not presolve:
            params["presolve"] = mathopt.Emphasis.OFF
        if name != "highs":  # MathOpt refuses a thread count for HiGHS, which runs on one anyway
            params["threads"] = 1
        model_params = None
        if self._hint is not None and name != "highs":  # MathOpt's HiGHS takes no hints
            model_params = mathopt.ModelSolveParameters(
                solution_hints=[mathopt.SolutionHint(variable_values={xs[j]: v for j, v in self._hint.items()})])
        res = mathopt.solve(m, solver_type(name), params=mathopt.SolveParameters(**params), model_params=model_params)
        return _answer(res, xs, bool(any(self.integer)), cutoff)


_BANNER_DONE = False


def _new_highs() -> Any:
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
    for k, v in (("output_flag", False), ("threads", 1), ("random_seed", 0), ("mip_rel_gap", GAPS[0]),
                 ("mip_abs_gap", GAPS[1])):
        h.setOptionValue(k, v)
    return h


def _solve_highs(md: Model, offset: float, time_limit: float | None, cutoff: float | None,
                 presolve: bool) -> tuple[str, np.ndarray | None, float, float]:
    """:meth:`Model.solve` by HiGHS through ``highspy``: the columns and rows passed row-wise."""
    import highspy

    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(md.cost), len(md.rows)
    lp.col_cost_ = np.array(md.cost)
    lp.col_lower_ = np.array(md.lo)
    lp.col_upper_ = np.where(np.isinf(md.hi), inf, md.hi)
    lp.offset_ = offset
    starts, idx, vals = [0], [], []
    for coefs, _, _, _ in md.rows:
        for j in sorted(coefs):
            idx.append(j)
            vals.append(coefs[j])
        starts.append(len(idx))
    lp.row_lower_ = np.array([-inf if np.isinf(lo) else lo for _, lo, _, _ in md.rows])
    lp.row_upper_ = np.array([inf if np.isinf(hi) else hi for _, _, hi, _ in md.rows])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts)
    lp.a_matrix_.index_ = np.array(idx, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(vals)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in md.integer]
    h = _new_highs()
    if not presolve:
        h.setOptionValue("presolve", "off")
    if time_limit is not None:
        h.setOptionValue("time_limit", max(float(time_limit), 1e-3))
    if cutoff is not None:
        h.setOptionValue("objective_bound", cutoff)
    h.passModel(lp)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    S = highspy.HighsModelStatus
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has else None
    obj = float(info.objective_function_value)
    bound = float(info.mip_dual_bound) if any(md.integer) else obj
    # with an objective bound HiGHS may report a model whose every plan it cuts off as infeasible
    # (seen when the optimum lies exactly at the bound), or its optimum at or above the bound:
    # either way no plan beats the cutoff, which stays a valid lower bound
    if cutoff is not None and (status in (S.kObjectiveBound, S.kInfeasible) or (status == S.kOptimal and obj >= cutoff)):
        return "cutoff", None, np.inf, cutoff
    if status == S.kOptimal:
        return "optimal", x, obj, bound
    if status == S.kInfeasible:
        return "infeasible", None, np.inf, np.inf
    if status == S.kTimeLimit:
        return "time_limit", x, obj if has else np.inf, bound
    return ("feasible" if has else "infeasible"), x, np.inf, bound


def _answer(res: Any, xs: list[Any], mip: bool, cutoff: float | None) -> tuple[str, np.ndarray | None, float, float]:
    """A MathOpt result in the solvers' vocabulary (see the module notes)."""
    mathopt = _mathopt()

    R = mathopt.TerminationReason
    reason = res.termination.reason
    has = res.has_primal_feasible_solution()
    x = np.array(res.variable_values(xs)) if has else None
    obj = float(res.objective_value()) if has else np.inf
    dual = float(res.termination.objective_bounds.dual_bound)
    bound = dual if mip and np.isfinite(dual) else (obj if reason == R.OPTIMAL else dual)
    if cutoff is not None and (reason == R.INFEASIBLE or (has and obj >= cutoff)):
        # a model whose every plan the cutoff removes may read as infeasible: either way no plan
        # beats the cutoff, which stays a valid lower bound
        return "cutoff", None, np.inf, float(cutoff)
    if reason == R.OPTIMAL:
        return "optimal", x, obj, bound
    if reason in (R.INFEASIBLE, R.INFEASIBLE_OR_UNBOUNDED):
        return "infeasible", None, np.inf, np.inf
    if res.termination.limit == mathopt.Limit.TIME:
        return "time_limit", x, obj, bound
    return ("feasible" if has else "infeasible"), x, obj if has else np.inf, bound
