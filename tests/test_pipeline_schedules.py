"""The pipeline schedules' one owner (:mod:`costmodel.pipeline`): the textbook values, and the forms
the solvers read (coefficients, balanced stages) agree with the formula itself."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.pipeline import (
    SCHEDULES,
    balanced_coef,
    in_flight,
    pipeline_step,
    pipeline_time,
    ramp_step,
    ramp_terms,
    step_terms,
    weights_pending,
    with_ends,
)
from solvers.mip import Model
from vocab.strategy import SCHEDULES as SCHEDULE_NAMES


def test_every_schedule_has_one_entry() -> None:
    assert set(SCHEDULES) == set(SCHEDULE_NAMES)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
def test_textbook_bubbles(p: int, m: int) -> None:
    t = 3.0
    for sched in ("gpipe", "1f1b"):  # (p - 1)·T for equal stages
        total, bubble = pipeline_time(sched, [t] * p, m)
        assert bubble == pytest.approx((p - 1) * t)
        assert total == pytest.approx((m + p - 1) * t)
    for v in (2, 4):  # interleaved: (p - 1)·T / v
        assert pipeline_time("interleaved", [t] * p, m, v)[1] == pytest.approx((p - 1) * t / v)
    # zero bubble with F = B = W = T/3: (p - 1)·(F + B - W) = (p - 1)·T/3
    assert pipeline_time("zb", [t] * p, m)[1] == pytest.approx((p - 1) * t / 3)
    assert pipeline_time("1f1b", [t], m) == (m * t, 0.0)  # no pipeline, no bubble


def test_textbook_in_flight() -> None:
    p, m = 4, 16
    assert [in_flight("1f1b", r, p, m) for r in range(p)] == [4.0, 3.0, 2.0, 1.0]
    assert [in_flight("gpipe", r, p, m) for r in range(p)] == [m] * p
    assert [in_flight("zb", r, p, m) for r in range(p)] == [4.0] * p
    assert in_flight("interleaved", 0, p, m, 2) == pytest.approx(p + (p - 1) / 2)
    assert in_flight("1f1b", 0, p, 2) == 2.0  # at most m
    assert [weights_pending("zb", r, p, m) for r in range(p)] == [1.0, 2.0, 3.0, 4.0]
    assert weights_pending("1f1b", 3, p, m) == 0.0


@pytest.mark.parametrize("sched", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [1, 2, 5])
def test_coefficients_are_the_formula(sched: str, p: int) -> None:
    """What the MIP and the bounds read as coefficients gives the formula's value."""
    rng = np.random.default_rng(p)
    m, v = 12, 3 if sched == "interleaved" else 1
    on_max, on_sum, on_fill = step_terms(sched, m, p, v)
    r_max, r_sum, r_fill = ramp_terms(sched, p, v)
    for _ in range(20):
        worst, total, fill = rng.random(3) * [2.0, 2.0 * p, 1.0]
        step = pipeline_step(sched, m, p, v, worst, total, fill)
        assert on_max * worst + on_sum * total + on_fill * fill == pytest.approx(step, rel=1e-12)
        ramp = ramp_step(sched, total, worst, fill, p, v)
        assert r_max * worst + r_sum * total + r_fill * fill == pytest.approx(ramp, rel=1e-12)
        even = pipeline_step(sched, m, p, v, total / p, total, 0.0)  # balanced stages, no fill
        assert balanced_coef(sched, m, p, v) * total == pytest.approx(even, rel=1e-12)


def test_arrays_of_schedules() -> None:
    """Over configurations, each row takes its own schedule's formula (and ``m·T`` without a pipeline)."""
    sched = np.array(["gpipe", "1f1b", "interleaved", "zb", "1f1b"], dtype=object)
    p = np.array([4.0, 4.0, 4.0, 4.0, 1.0])
    v = np.array([1.0, 1.0, 2.0, 1.0, 1.0])
    out = pipeline_step(sched, 8.0, p, v, 2.0, 6.0, 0.5)
    one = [pipeline_step(str(s), 8.0, float(pi), float(vi), 2.0, 6.0, 0.5) for s, pi, vi in zip(sched, p, v, strict=True)]
    assert out.tolist() == one
    assert out[-1] == 16.0


def test_ends_ride_on_the_first_and_last_stage() -> None:
    assert with_ends([[1, 2], [3]], ["emb"], ["head"]) == [["emb", 1, 2], [3, "head"]]
    assert with_ends([[1]], ["emb"], []) == [["emb", 1]]


def test_model_columns_are_named() -> None:
    md = Model("names")
    cols = [md.var(name="count"), md.var(name="count"), md.var(cost=1.0, name="slowest_stage")]
    md.row({cols[0]: 1.0, cols[1]: 1.0}, lo=1.0, family="assign")
    _, xs = md.build(0.0)
    assert [x.name for x in xs] == ["count[0]", "count[1]", "slowest_stage[0]"]
