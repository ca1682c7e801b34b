"""Input-handling defects of a fuzz run: a solver stopped before proving a bound, batch estimates,
interrupts, arguments checked before work, typed errors of the public API, ASCII numbers, output
files (modes, temporary names, reproducible SVG)."""

from __future__ import annotations

import numpy as np
import pytest

from planner import api
from solvers import hybrid
from solvers.chain import ChainSolution
from solvers.result import proven_bound


@pytest.mark.parametrize("stopped", [-np.inf, np.nan])
def test_a_mip_stopped_without_a_bound_gives_a_plan_without_one(monkeypatch: pytest.MonkeyPatch,
                                                                 stopped: float) -> None:
    """A per-layer MIP stopped by the time limit before its first bound (HiGHS and MathOpt report
    -inf or NaN): the plan records no bound and no gap, and the status time_limit."""
    monkeypatch.setattr(hybrid, "solve_ilp", lambda *a, **k: ChainSolution(None, np.inf, stopped, "time_limit"))
    p = api.plan("gpt2", "4xcpu", 128, 8, space="osdp", time_limit=5, tie_break=False)
    assert (p.solver.status, p.solver.bound, p.solver.gap) == ("time_limit", None, None)
    assert p.solver.objective == p.predicted.step_time_s


def test_proven_bound_is_the_least_finite_bound_or_none() -> None:
    assert proven_bound(2.0, [1.5, np.inf]) == 1.5
    assert proven_bound(2.0, []) == 2.0
    assert proven_bound(2.0, [1.5, -np.inf]) is None
    assert proven_bound(2.0, [np.nan]) is None
