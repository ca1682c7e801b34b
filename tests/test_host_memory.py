"""Host memory per node as a constraint of offloaded states: counted exactly, checked by the
estimate, and taken by every solver (chain ILP, stage DP, stage MIP) as brute force takes it."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.report import GIB
from profiler.hardware import HOST_RESERVE, accelerator, parse_cluster
from profiler.models import load_model
from solvers.chain import ChainProblem, Option, mesh_problem
from solvers.exhaustive import space_plans
from solvers.osdp_dp import solve_dp
from solvers.osdp_ilp import solve_ilp
from solvers.space import SPACES, mesh_configs
from solvers.stage_ilp import solve_layers
from solvers.stage_tables import Combo
from solvers.stages import PipelineProblem, pipeline_strategy, solve_pipeline
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

SMALL = {"name": "small", "hidden": 4096, "heads": 16, "vocab": 32000, "max_seq": 512, "layers": 3}


def _cluster(host_gb: float, gpus: int = 4):  # type: ignore[no-untyped-def]
    """One node of ``gpus`` H100s whose server has ``host_gb`` of host memory (0: not recorded)."""
    acc = {**accelerator("h100").to_dict(), "host_memory_gb": host_gb, "gpus_per_node": gpus}
    return parse_cluster({"accelerator": acc, "nodes": 1, "gpus_per_node": gpus})


def _zero3(dp: int, offload: str) -> Strategy:
    return Strategy(mesh=Mesh(dp_shard=dp), default=LayerStrategy(sharding="zero3", recompute="full", offload=offload))


@pytest.mark.parametrize(("offload", "master", "per_param"), [
    ("optimizer", "optimizer", 16),  # ZeRO-Offload: fp32 master, two moments, fp32 gradient
    ("params", "optimizer", 18),  # DeepSpeed's parameter offload: a 16-bit shard beside them
    ("params", "parameter", 16),  # FSDP2's CPU offload: the shard is the fp32 master
])
def test_host_bytes_are_the_offloaded_states(offload: str, master: str, per_param: int) -> None:
    g = load_model("llama3-8b", 1024)
    cl = parse_cluster("8xh100")
    w = Workload(seq_len=1024, global_batch=8, zero3_master=master)
    rep = estimate(g, cl, _zero3(8, offload), w)
    params = sum(n.params for n in g.nodes)
    # every GPU of the node holds its eighth: the node holds the whole model's states, to the byte
    # (each parameter group's shard rounds down)
    assert abs(rep.host_per_node_gib * GIB - per_param * params) <= per_param * 8 * len(g.nodes)
    assert rep.host_limit_per_node_gib * GIB == pytest.approx(2048e9 * (1 - HOST_RESERVE))
    assert rep.to_dict()["host_per_node_gib"] == rep.host_per_node_gib
    none = estimate(g, cl, _zero3(8, "none"), w)
    assert none.host_per_node_gib == 0 and "host_per_node_gib" not in none.to_dict()


def test_estimate_refuses_a_node_short_of_host_memory() -> None:
    g = load_model("llama3.1-405b", 4096)
    w = Workload(seq_len=4096, global_batch=16)
    two = estimate(g, parse_cluster("16xh100"), _zero3(16, "params"), w)
    assert not two.fits and two.memory_peak_gib < 80  # the GPUs would hold it; the hosts cannot
    assert any("host memory per node" in n for n in two.notes)
    four = estimate(g, parse_cluster("32xh100"), _zero3(32, "params"), Workload(seq_len=4096, global_batch=32))
    assert four.host_per_node_gib == pytest.approx(two.host_per_node_gib / 2, rel=1e-9) and four.fits
    # a server whose host memory is not recorded: not bounded, and said so
    pcie = estimate(g, parse_cluster("16xh100-pcie"), _zero3(16, "params"), w)
    assert pcie.host_limit_per_node_gib == 0 and any("not recorded" in n for n in pcie.notes)


def test_chain_ilp_takes_the_host_budget_and_the_dp_says_it_cannot() -> None:
    # two units; offloading a unit saves 6 of memory and costs 1 of time and 5 of host memory
    opts = [[Option(a=1.0, mem=10.0, key="keep"), Option(a=2.0, mem=4.0, host=5.0, key="offload")]]
    prob = ChainProblem(opts, [0, 0], budget=15.0, host_budget=None)
    assert solve_ilp(prob).objective == pytest.approx(3.0)  # one of the two offloaded
    tight = ChainProblem(opts, [0, 0], budget=9.0, host_budget=9.0)  # both must offload; the host holds one
    assert tight.host_binds and solve_ilp(tight).choice is None
    assert solve_dp(tight).status == "unsupported"
    roomy = ChainProblem(opts, [0, 0], budget=9.0, host_budget=10.0)
    sol = solve_ilp(roomy)
    assert sol.objective == pytest.approx(4.0) and roomy.host(sol.choice) == 10.0


@pytest.fixture(scope="module")
def instance():  # type: ignore[no-untyped-def]
    """A 3-block model on one node of 4 GPUs, every plan of a space with optimizer offload priced."""
    g = load_model(SMALL, 512)
    w = Workload(seq_len=512, global_batch=32)
    opts = SPACES["staged"].with_(tp=False, cp=False, ep=False, dp_replicate=False, shardings=("zero3",),
                                  recomputes=("none", "full"), offloads=("none", "optimizer"),
                                  max_micro_batch_sizes=1, schedules=("1f1b",), splits=(1,))
    out = {}
    for host_gb in (0.0, 8.0):
        cl = _cluster(host_gb)
        dev = DeviceModel(cl)
        plans = list(space_plans(g, cl, w, opts))
        out[host_gb] = (cl, dev, plans, [estimate(g, cl, s, w, device=dev) for s in plans])
    return g, w, opts, out


def _best(plans, reps, limit, pp, per_stage=None):  # type: ignore[no-untyped-def]
    return min((r.step_time_s for s, r in zip(plans, reps, strict=True)
                if s.mesh.pp == pp and r.memory_peak_gib <= limit and r.fits and (per_stage is None or per_stage(s))),
               default=np.inf)


def test_solvers_find_brute_forces_optimum_under_host_memory(instance) -> None:  # type: ignore[no-untyped-def]
    """At GPU limits where offloading pays, every solver finds brute force's best plan among those
    whose offloaded states fit the node's host memory; somewhere that plan is slower than the best
    without the host bound (the bound binds)."""
    g, w, opts, out = instance
    cl, dev, plans, reps = out[8.0]
    _, _, plans0, reps0 = out[0.0]
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})[::6]
    binds = 0
    for pp in (1, 2):
        cfg = next(c for c in mesh_configs(g, cl, w, opts) if c.pp == pp)
        for limit in limits:
            best, free = _best(plans, reps, limit, pp), _best(plans0, reps0, limit, pp)
            binds += best > free * (1 + 1e-9)
            if pp == 1:
                sol = solve_ilp(mesh_problem(g, dev, cfg, w, opts, limit))
                got = sol.objective if sol.choice is not None else np.inf
            else:
                qs = [PipelineProblem(g, dev, cfg, w, Combo("zero3", off), opts.recomputes, limit)
                      for off in ("none", "optimizer")]
                mix = solve_layers(qs)
                got = mix.solution.objective if mix.solution is not None else np.inf
                if mix.solution is not None:
                    rep = estimate(g, cl, pipeline_strategy(g, cfg, mix.solution), w, memory_limit_gib=limit, device=dev)
                    assert rep.fits
                # the per-stage DP: brute force's best among the plans whose stages each keep one offload
                dp = solve_pipeline(qs)
                want = _best(plans, reps, limit, pp, per_stage=lambda s: _stages_apart(s, g))
                assert (dp.objective if dp else np.inf) == pytest.approx(want, rel=1e-9)
            assert got == pytest.approx(best, rel=1e-9) if np.isfinite(best) else got == np.inf
    assert binds >= 2


def _stages_apart(s: Strategy, g) -> bool:  # type: ignore[no-untyped-def]
    """Every pipeline rank's units share one offload."""
    from costmodel.estimate import stage_units

    by_unit = {ls.unit: ls.offload for ls in s.layers}
    per_rank: dict[int, set] = {}
    for k, units in enumerate(stage_units(g, s)):
        per_rank.setdefault(k % s.mesh.pp, set()).update(by_unit.get(n, s.default.offload) for n, _ in units)
    return all(len(v) == 1 for v in per_rank.values())


def test_search_says_when_only_the_host_memory_is_short() -> None:
    """Llama 3 70B on one DGX A100 (40 GB): the GPUs hold it only with most states offloaded; the
    plan keeps the node's host memory, and without it the message says the host is short."""
    from planner.api import plan

    p = plan("llama3-70b", "8xa100-40gb", 1024, 8)
    pred = p.predicted.model_dump()
    assert 0 < pred["host_per_node_gib"] <= pred["host_limit_per_node_gib"]
    assert any(ls.offload == "none" for ls in p.strategy.layers)  # not every unit: the host holds less
    with pytest.raises(ShardplanError, match="host memory of a node"):
        plan("llama3-70b", "8xa100-40gb", 1024, 8, memory_limit_gib=20)
