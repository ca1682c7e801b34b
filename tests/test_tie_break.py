"""Plans closer than the cost model can order: the plan is the fastest, a simpler runner-up within the
band is named; with ``tie_break`` the one with the fewest parallel axes is the plan, its status
``feasible`` with its gap to the bound, the fastest kept as the runner-up, and the summary and
explain say so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planner.api import search_plan
from planner.explain import explain_data
from planner.request import Request
from solvers.result import Found, break_tie, parallel_axes, simpler_runner_up
from vocab.strategy import Mesh, Strategy


def _found(step: float, **mesh: int) -> Found:
    report = SimpleNamespace(step_time_s=step, memory_peak_gib=1.0)
    return Found(strategy=Strategy(mesh=Mesh(**mesh)), report=report, family="hybrid")  # type: ignore[arg-type]


def _space(*found: Found) -> object:
    """A search over the plans ``found``: the fastest of at most ``a`` axes faster than ``cutoff``."""
    def search_axes(a: int, cutoff: float) -> Found | None:
        fit = [f for f in found if parallel_axes(f.strategy) <= a and f.step_time_s < cutoff]
        return min(fit, key=lambda f: f.step_time_s) if fit else None
    return search_axes


def test_parallel_axes_count_the_mesh_degrees_above_one() -> None:
    assert parallel_axes(Strategy(mesh=Mesh(dp_shard=8))) == 1
    assert parallel_axes(Strategy(mesh=Mesh(pp=4, dp_shard=4, cp=2, tp=4))) == 4


def test_the_fewest_axes_within_the_band_then_the_fastest() -> None:
    fastest = _found(10.0, pp=4, dp_shard=2, cp=2, tp=4)
    simpler = _found(10.5, pp=8, dp_shard=2, tp=4)
    simpler_slower = _found(10.8, pp=2, dp_shard=4, tp=4)
    simplest_too_slow = _found(12.0, dp_shard=32, tp=2)
    space = _space(fastest, simpler_slower, simpler, simplest_too_slow)
    assert break_tie(fastest, 0.10, space) is simpler  # 5% slower, one axis fewer (and the faster of two)
    assert break_tie(fastest, 0.01, space) is fastest  # nothing else is within 1%
    assert break_tie(fastest, 0.25, space) is simplest_too_slow
    same = _found(10.2, pp=4, dp_shard=2, cp=2, tp=4)
    assert break_tie(fastest, 0.10, _space(fastest, same)) is fastest  # equal axes: the fastest stays


@pytest.fixture(scope="module")
def tied() -> object:
    return search_plan(Request("gpt3-175b", "1024xa100-80gb", 4096, 512, target="megatron", tie_break=True))


def test_the_plan_records_the_tie_break_and_keeps_the_fastest_first(tied: object) -> None:
    """GPT-3 175B on 1,024 A100s for Megatron-LM: the fastest plan runs four axes (cp=2 among them);
    a plan 1% slower runs three (PP8 TP8), within the A100's pair band, so it is the plan."""
    p = tied.plan  # type: ignore[attr-defined]
    tie = p.solver.options["tie_break"]
    fastest = p.alternatives[0]
    assert tie["fastest_step_time_s"] == fastest.predicted.step_time_s == p.solver.bound  # the search was optimal
    assert p.solver.status == "feasible" and tie["fastest_status"] == "optimal"
    assert p.solver.objective == p.predicted.step_time_s
    assert p.solver.gap == pytest.approx((p.predicted.step_time_s - p.solver.bound) / p.predicted.step_time_s, rel=1e-12)
    assert parallel_axes(p.strategy) == tie["axes"] < tie["fastest_axes"] == parallel_axes(fastest.strategy)
    assert fastest.predicted.step_time_s < p.predicted.step_time_s <= fastest.predicted.step_time_s * (
        1 + tie["pair_band"])
    verdict = explain_data(p)["runner_up"]["verdict"]
    assert "indistinguishable" in verdict and f"runs {tie['axes']} parallel axes to its {tie['fastest_axes']}" in verdict
    default = search_plan(Request("gpt3-175b", "1024xa100-80gb", 4096, 512, target="megatron")).plan
    assert default.strategy == fastest.strategy and "tie_break" not in default.solver.options
    assert default.solver.status == "optimal" and default.solver.objective == default.predicted.step_time_s
    offer = default.solver.options["simpler_alternative"]
    named = default.alternatives[offer["alternative"]]
    assert named.predicted.step_time_s == offer["step_time_s"] <= default.predicted.step_time_s * (1 + offer["pair_band"])
    assert parallel_axes(named.strategy) == offer["axes"] < offer["fastest_axes"] == parallel_axes(default.strategy)


def test_the_tie_break_searches_the_fewer_axes_not_just_the_runners_up() -> None:
    """Llama 3 8B on 16 H100 under 14 GiB, staged space: the fastest plan runs three axes; the
    fastest two-axis plan within the band (per-unit sharding) was pruned by the fastest's search,
    which cannot beat it; the tie-break's own search finds it, the same as the hybrid space's."""
    kw = dict(seq_len=8192, global_batch=32, memory_limit_gib=14.0, top_k=1, tie_break=True)
    staged = search_plan(Request("llama3-8b", "16xh100", space="staged", **kw)).plan
    hybrid = search_plan(Request("llama3-8b", "16xh100", space="hybrid", **kw)).plan
    tie = staged.solver.options["tie_break"]
    assert tie["axes"] == 2 < tie["fastest_axes"] == 3
    assert staged.predicted.step_time_s == pytest.approx(hybrid.predicted.step_time_s, rel=1e-12)
    assert staged.alternatives[0].predicted.step_time_s == tie["fastest_step_time_s"] < staged.predicted.step_time_s


def test_the_simpler_runner_up_is_named_from_the_runners_up() -> None:
    fastest = _found(10.0, pp=4, dp_shard=2, cp=2, tp=4)
    same_axes = _found(10.1, pp=2, dp_shard=4, cp=2, tp=4)
    three = _found(10.6, pp=8, dp_shard=2, tp=4)
    two_far = _found(12.0, dp_shard=32, tp=2)
    two_near = _found(10.9, dp_shard=16, tp=4)
    runners_up = [same_axes, three, two_far, two_near]
    assert simpler_runner_up(fastest, runners_up, 0.10) == (3, two_near)  # fewest axes within 10%
    assert simpler_runner_up(fastest, runners_up, 0.07) == (1, three)
    assert simpler_runner_up(fastest, runners_up, 0.05) is None  # only equal axes that close
