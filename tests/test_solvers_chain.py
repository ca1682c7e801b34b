"""OSDP chain solvers: DP, ILP and brute force agree; the cost model's chain is estimate()."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.chain import ChainProblem, Option, chain_strategy, mesh_problem
from solvers.exhaustive import solve_chain
from solvers.osdp_dp import solve_dp
from solvers.osdp_ilp import lagrange_bound, solve_ilp
from solvers.space import SPACES
from vocab.strategy import MeshConfig, Workload


@st.composite
def chains(draw: st.DrawFn, transitions: bool) -> ChainProblem:
    n_units = draw(st.integers(1, 5))
    n_classes = draw(st.integers(1, 3))
    opt = st.builds(
        Option,
        a=st.integers(0, 20).map(float),
        d=st.integers(-5, 5).map(float),
        mem=st.integers(0, 10).map(float),
        g=st.sampled_from([0.0, 0.0, 3.0, 5.0]),
        r=st.sampled_from([0.0, 2.0, 4.0]),
        end=st.integers(0, 10).map(float),
    )
    options = [draw(st.lists(opt, min_size=1, max_size=4)) for _ in range(n_classes)]
    tail = draw(st.sampled_from([None, None, 0.0, 3.0]))
    classes = [draw(st.integers(0, n_classes - 1)) for _ in range(n_units)]
    trans = None
    if transitions:
        trans = [
            np.array(
                draw(
                    st.lists(
                        st.lists(
                            st.integers(0, 6).map(float),
                            min_size=len(options[classes[i + 1]]),
                            max_size=len(options[classes[i + 1]]),
                        ),
                        min_size=len(options[classes[i]]),
                        max_size=len(options[classes[i]]),
                    )
                )
            )
            for i in range(n_units - 1)
        ]
    return ChainProblem(options, classes, float(draw(st.integers(0, 40))), const=0.5, transitions=trans, tail=tail)


def _agree(p: ChainProblem) -> None:
    """The ILP is exact in both memory moments; the DP too unless the end of backward can bind,
    where its plan fits and its bound holds (the gap it reports)."""
    brute, dp, ilp = solve_chain(p), solve_dp(p), solve_ilp(p)
    if brute.choice is None:
        assert dp.choice is None and ilp.choice is None
        return
    assert ilp.status == "optimal"
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-9)
    assert p.fits(ilp.choice)  # type: ignore[arg-type]
    two = p.tail is not None and sum(max(o.end - o.mem for o in p.unit_options(i)) for i in range(p.units)) + p.tail > 0
    if not two:
        assert dp.status == "optimal"
        assert dp.objective == pytest.approx(brute.objective, rel=1e-12)
    assert dp.bound <= brute.objective + 1e-9
    if dp.choice is not None:
        assert p.fits(dp.choice) and dp.objective >= brute.objective - 1e-9
        if dp.status == "optimal":  # proven: equal to the optimum
            assert dp.objective == pytest.approx(brute.objective, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(chains(transitions=False))
def test_lagrange_bound_holds(p: ChainProblem) -> None:
    """The bound that spares the ILP never exceeds the optimum brute force finds, and a cutoff
    below the optimum is refused, one above it is not."""
    from solvers.chain import reduced

    brute = solve_chain(p)
    if brute.choice is None:
        return
    assert lagrange_bound(reduced(p)[0]) <= brute.objective * (1 + 1e-12)
    assert solve_ilp(p, cutoff=brute.objective * (1 - 1e-6) - 1e-9).status == "cutoff"
    assert solve_ilp(p, cutoff=brute.objective + 1.0).objective == pytest.approx(brute.objective, rel=1e-9)


def test_lagrange_bound_is_tight_where_memory_is_slack() -> None:
    """Memory to spare: the bound is the optimum (every unit at its fastest), so a cutoff there is
    settled without a program."""
    p = ChainProblem([[Option(a=1.0, mem=1.0), Option(a=2.0, mem=0.5)]], [0, 0, 0], 100.0, const=0.5)
    assert lagrange_bound(p) == 3.5
    sol = solve_ilp(p, cutoff=3.4)
    assert sol.status == "cutoff" and sol.info == {"solver": "bound"}
    assert solve_ilp(p, cutoff=3.6).objective == 3.5


def test_end_of_backward_binds() -> None:
    """One unit, two options: the cheaper one fits while activations are live but not once every
    gradient is made plus the tail; brute force, the ILP and the DP all take the other."""
    opts = [[Option(a=1.0, mem=6.0, end=9.0), Option(a=2.0, mem=8.0, end=6.0)]]
    p = ChainProblem(opts, [0], 10.0, tail=2.0)
    assert p.memory([0]) == 11.0 and p.memory([1]) == 8.0
    for sol in (solve_chain(p), solve_ilp(p), solve_dp(p)):
        assert sol.choice == [1] and sol.objective == 2.0
    assert ChainProblem(opts, [0], 10.0).memory([0]) == 6.0  # without a tail: one moment


@settings(max_examples=20, deadline=None)
@given(chains(transitions=False))
def test_dp_ilp_brute_agree(p: ChainProblem) -> None:
    _agree(p)


@settings(max_examples=15, deadline=None)
@given(chains(transitions=True))
def test_dp_ilp_brute_agree_with_transitions(p: ChainProblem) -> None:
    _agree(p)


def test_dp_discretisation_is_bounded_and_conservative() -> None:
    rng = random.Random(3)
    for _ in range(25):
        k = rng.randint(1, 3)
        opts = [
            [
                Option(
                    a=rng.random() * 3,
                    d=rng.uniform(-1, 1),
                    mem=rng.random() * 1e9,
                    g=rng.choice([0.0, rng.random() * 3e8]),
                    r=rng.choice([0.0, rng.random() * 2e8]),
                )
                for _ in range(rng.randint(1, 4))
            ]
            for _ in range(k)
        ]
        p = ChainProblem(opts, [rng.randrange(k) for _ in range(rng.randint(1, 5))], rng.random() * 4e9)
        brute, dp, ilp = solve_chain(p), solve_dp(p, mem_buckets=512), solve_ilp(p)
        if brute.choice is None:
            assert dp.choice is None and ilp.choice is None
            continue
        assert ilp.objective == pytest.approx(brute.objective, rel=1e-9)
        assert dp.bound <= brute.objective * (1 + 1e-12)  # the relaxed run bounds the optimum
        if dp.choice is not None:  # the conservative run only returns plans that fit
            assert p.fits(dp.choice) and dp.objective >= brute.objective * (1 - 1e-12)
        assert dp.info["mem_error_bound"] == pytest.approx(dp.info["mem_grid_bytes"] * p.units)


def test_time_limit_returns_bound() -> None:
    rng = random.Random(0)
    opts = [[Option(a=rng.random(), d=rng.uniform(-0.1, 0.1), mem=rng.random() * 10) for _ in range(6)]]
    p = ChainProblem(opts, [0] * 40, 220.0)
    sol = solve_ilp(p, time_limit=5.0)
    assert sol.status in ("optimal", "time_limit")
    assert sol.choice is not None and sol.bound <= sol.objective + 1e-12


@pytest.mark.parametrize("micro_batch", [2, 4])  # 2 micro-batches (gradients held) or 1
def test_mesh_chain_is_estimate(micro_batch: int) -> None:
    g = load_model("gpt2-medium", 512)  # a tied head: the end of backward has a tail
    cl = parse_cluster("8xh100")
    w = Workload(seq_len=512, global_batch=32)
    dev = DeviceModel(cl)
    cfg = MeshConfig(1, 2, 4, 1, 1, 1, micro_batch, "1f1b", 1, False)
    prob = mesh_problem(g, dev, cfg, w, SPACES["osdp"], 12.0)
    assert prob.tail is not None and prob.tail > 0
    rng = random.Random(1)
    for _ in range(6):
        choice = [rng.randrange(len(prob.unit_options(i))) for i in range(prob.units)]
        rep = estimate(g, cl, chain_strategy(g, cfg, prob, choice), w, memory_limit_gib=12.0)
        assert prob.objective(choice) == pytest.approx(rep.step_time_s, rel=1e-12)
        assert prob.fits(choice) == rep.fits
        tensors = max(st.total - st.overhead for st in rep.stages) - dev.c.dp_bucket_bytes
        assert prob.memory(choice) == pytest.approx(tensors, rel=1e-12)
    ilp, dp = solve_ilp(prob), solve_dp(prob)
    assert ilp.status == "optimal"
    assert dp.bound <= ilp.objective * (1 + 1e-9) <= dp.objective * (1 + 2e-9)
    assert ilp.choice is not None
    rep = estimate(g, cl, chain_strategy(g, cfg, prob, ilp.choice), w, memory_limit_gib=12.0)
    assert rep.fits and rep.step_time_s == pytest.approx(ilp.objective, rel=1e-12)


def test_mesh_chain_is_estimate_with_communication_interference() -> None:
    from costmodel.constants import CostConstants

    g, cl = load_model("gpt2-medium", 512), parse_cluster("8xh100")
    w = Workload(seq_len=512, global_batch=32)
    dev = DeviceModel(cl, constants=CostConstants(comm_interference=0.4))
    cfg = MeshConfig(1, 2, 4, 1, 1, 1, 2, "1f1b", 1, False)
    prob = mesh_problem(g, dev, cfg, w, SPACES["osdp"], 12.0)
    rng = random.Random(3)
    for _ in range(6):
        choice = [rng.randrange(len(prob.unit_options(i))) for i in range(prob.units)]
        rep = estimate(g, cl, chain_strategy(g, cfg, prob, choice), w, memory_limit_gib=12.0, device=dev)
        assert prob.objective(choice) == pytest.approx(rep.step_time_s, rel=1e-12)
