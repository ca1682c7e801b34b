"""The MIP model every formulation shares (solvers.mip): named rows, three back-ends that agree with
brute force, one cutoff vocabulary, warm starts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from solvers.chain import ChainProblem, Option
from solvers.exhaustive import solve_chain
from solvers.mip import SOLVERS, Model
from solvers.osdp_ilp import least_memory, solve_ilp
from solvers.stage_ilp import solve_layers
from tests.test_solvers_chain import chains
from tests.test_solvers_stage_ilp import _instance, _problems
from vocab.errors import ShardplanError

#: the row families of the OSDP and stage programs, as docs/solvers.md names them
CHAIN_FAMILIES = {"assign", "gathered", "gathered_order", "remat", "remat_order", "memory", "memory_end", "host", "sync", "flow_out", "flow_in"}
STAGE_FAMILIES = {"assign", "used", "gathered", "remat", "memory", "host", "stage_sizes", "block_stage", "stage_index",
                  "contiguous", "ends", "tied", "stage_time", "sync", "optimizer", "offload", "fill", "time_shared"}


def _captured(monkeypatch: pytest.MonkeyPatch) -> list[Model]:
    """Every model solved from now on."""
    seen: list[Model] = []
    solve = Model.solve

    def spy(self: Model, *a, **k):  # type: ignore[no-untyped-def]
        seen.append(self)
        return solve(self, *a, **k)

    monkeypatch.setattr(Model, "solve", spy)
    return seen


def test_rows_are_named_after_their_families(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _captured(monkeypatch)
    opts = [[Option(a=1.0, mem=6.0, g=2.0, d=1.0, end=9.0), Option(a=2.0, mem=8.0, r=1.0, d=-2.0, end=6.0)]]
    solve_ilp(ChainProblem(opts, [0, 0, 0], 40.0, tail=2.0))
    g, cl, w, o, cfg, dev, plans, reps = _instance("zb")
    solve_layers(_problems(g, dev, cfg, w, o, max(r.memory_peak_gib for r in reps)))
    chain, stage = seen
    for md, known in ((chain, CHAIN_FAMILIES), (stage, STAGE_FAMILIES)):
        assert set(md.families) <= known and "row" not in md.families
        m, _ = md.build(0.0)
        names = [c.name for c in m.linear_constraints()]
        assert len(names) == len(md.rows) == len(set(names))
        assert all(n.split("[")[0] in known for n in names)
    assert {"assign", "memory", "memory_end", "sync"} <= set(chain.families)
    assert {"assign", "memory", "stage_time", "fill", "stage_sizes"} <= set(stage.families)


@settings(max_examples=12, deadline=None)
@given(chains(transitions=False))
def test_scip_finds_brute_forces_optimum(p: ChainProblem) -> None:
    brute = solve_chain(p)
    sol = solve_ilp(p, solver="scip")
    if brute.choice is None:
        assert sol.choice is None
        return
    assert sol.status == "optimal" and sol.objective == pytest.approx(brute.objective, rel=1e-9)
    assert p.fits(sol.choice)  # type: ignore[arg-type]


@pytest.mark.parametrize("solver", SOLVERS)
def test_cutoff_means_the_same_on_every_back_end(solver: str) -> None:
    opts = [[Option(a=1.0, mem=10.0, key="a"), Option(a=2.0, mem=4.0, key="b")]]
    p = ChainProblem(opts, [0, 0], 15.0)  # optimum 3: one unit each way
    assert solve_ilp(p, solver=solver).objective == pytest.approx(3.0)
    at = solve_ilp(p, solver=solver, cutoff=3.0)  # nothing strictly better than 3
    assert at.status == "cutoff" and at.choice is None and at.bound == 3.0
    above = solve_ilp(p, solver=solver, cutoff=3.5)
    assert above.status == "optimal" and above.objective == pytest.approx(3.0)
    assert solve_ilp(ChainProblem(opts, [0, 0], 7.0), solver=solver).status == "infeasible"
    assert least_memory(p, solver=solver)[0] == pytest.approx(8.0)


def test_warm_start_from_a_plan_keeps_the_optimum() -> None:
    """SCIP starts from the hinted plan (every unit option "a", which fits); HiGHS ignores hints.
    Both still prove the same optimum, and a hint naming no option of a class is left out."""
    opts = [[Option(a=1.0, mem=10.0, key="a"), Option(a=2.0, mem=4.0, key="b")], [Option(a=1.0, mem=1.0, key="c")]]
    p = ChainProblem(opts, [0, 0, 1], 30.0)
    for solver in SOLVERS:
        for hint in (["a"], ["b", "a"], ["z"]):
            assert solve_ilp(p, solver=solver, hint=hint).objective == pytest.approx(3.0)


def test_stage_mix_agrees_across_back_ends() -> None:
    g, cl, w, o, cfg, dev, plans, reps = _instance("1f1b")
    for limit in sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})[::12]:
        qs = _problems(g, dev, cfg, w, o, limit)
        a, b = solve_layers(qs), solve_layers(qs, solver="scip")
        best = min((r.step_time_s for r in reps if r.memory_peak_gib <= limit), default=np.inf)
        for mix in (a, b):
            got = mix.solution.objective if mix.solution is not None else np.inf
            assert got == pytest.approx(best, rel=1e-9) if np.isfinite(best) else got == np.inf


def test_unknown_solver_is_one_clear_error() -> None:
    from planner.api import plan

    with pytest.raises(ValueError, match="unknown MIP solver 'cp-sat'"):
        Model("x", "cp-sat")
    with pytest.raises(ShardplanError, match="unknown MIP solver 'glpk'; known: highs, highspy, scip"):
        plan("llama3-8b", "8xh100", 1024, 8, solver="glpk")


def test_the_default_plan_solves_through_or_tools() -> None:
    """The default back-end is OR-Tools MathOpt's HiGHS: a default plan of the 70B job imports
    ortools and solves its OSDP programs with it (highspy is an option, never imported here)."""
    import subprocess
    import sys

    code = ("import sys; from solvers.mip import Model; solved = []; solve = Model.solve_mathopt\n"
            "def spy(self, *a, **k):\n    solved.append(self.solver); return solve(self, *a, **k)\n"
            "Model.solve_mathopt = spy\n"
            "import planner.api as a; a.plan('llama3-70b', '1024xh100', seq_len=8192, global_batch=512)\n"
            "print(sorted(set(solved)), 'ortools' in sys.modules, 'highspy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "['highs'] True False"
