"""Properties of the cost model against facts that do not come from its own code: the ZeRO paper's
state bytes, the ring collectives' α–β cost, a lower bound that must stay below every price, and
the array pricer's independence of what else is priced beside a configuration."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from costmodel.configs import AxisGroup
from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.vectorized import compute_bound, price_grid, strategies_grid
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.space import SPACES, mesh_configs
from vocab.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Mesh, Strategy, Workload

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CASES = {
    "llama3-70b": ("64xh100", 4096, 256, Workload(seq_len=4096, global_batch=256)),
    "mixtral-8x7b": ("64xh100", 4096, 256, Workload(seq_len=4096, global_batch=256, attention_kernel="flash2")),
    "gpt2-xl": ("8xh100", 1024, 64, Workload(seq_len=1024, global_batch=64, attention_kernel="flash3")),
    "gpt2-medium": ("4xcpu", 128, 8, Workload(seq_len=128, global_batch=8, precision="fp32")),
}
_CONFIGS: dict[str, list] = {}


def _case(model: str) -> tuple:
    cluster, seq, _, w = CASES[model]
    g, cl = load_model(model, seq), parse_cluster(cluster)
    if model not in _CONFIGS:
        _CONFIGS[model] = list(mesh_configs(g, cl, w, SPACES["hybrid"]))
    return g, cl, w, _CONFIGS[model]


layer_strategies = st.builds(LayerStrategy, sharding=st.sampled_from(SHARDINGS),
                             recompute=st.sampled_from(RECOMPUTES), offload=st.sampled_from(OFFLOADS))


@SETTINGS
@given(model=st.sampled_from(sorted(CASES)), data=st.data())
def test_a_configuration_prices_the_same_alone_and_in_any_batch(model: str, data: st.DataObject) -> None:
    """The grid prices a configuration under an option from that pair alone: the same numbers in a
    batch of others (rows grouped by pipeline degree, ranks deduplicated, work shared across
    options) as alone, and as :func:`estimate` reports for the plan."""
    g, cl, w, cfgs = _case(model)
    idx = data.draw(st.lists(st.integers(0, len(cfgs) - 1), min_size=2, max_size=8, unique=True))
    layers = data.draw(st.lists(layer_strategies, min_size=1, max_size=4, unique=True))
    strategies = [cfgs[i].strategy(default=ls) for i in idx for ls in layers]
    # activation offload is priced without a pipeline only (vocab.rules), which estimate checks
    strategies = [s for s in strategies if s.mesh.pp == 1 or s.default.offload != "activations"]
    assume(strategies)
    configs, options, cells = strategies_grid(strategies)
    gr = price_grid(g, cl, w, configs, options, memory_limit_gib=40.0)
    for s, (i, j) in zip(strategies, cells, strict=True):
        alone = price_grid(g, cl, w, [configs[i]], [options[j]], memory_limit_gib=40.0)
        assert gr.step_time_s[i, j] == pytest.approx(alone.step_time_s[0, 0], rel=1e-12)
        assert gr.memory_peak_gib[i, j] == pytest.approx(alone.memory_peak_gib[0, 0], rel=1e-12)
        assert gr.hfu[i, j] == pytest.approx(alone.hfu[0, 0], rel=1e-12)
        r = estimate(g, cl, s, w, memory_limit_gib=40.0)
        assert r.step_time_s == pytest.approx(gr.step_time_s[i, j], rel=1e-9)
        assert r.memory_peak_gib == pytest.approx(gr.memory_peak_gib[i, j], rel=1e-9)
        assert gr.strategy(i, j) == s


@SETTINGS
@given(model=st.sampled_from(sorted(CASES)), data=st.data())
def test_the_compute_bound_stays_below_every_price(model: str, data: st.DataObject) -> None:
    """Compute alone at perfectly balanced stages is a lower bound of any plan on the mesh."""
    g, cl, w, cfgs = _case(model)
    idx = data.draw(st.lists(st.integers(0, len(cfgs) - 1), min_size=1, max_size=10, unique=True))
    layers = data.draw(st.lists(layer_strategies, min_size=1, max_size=6, unique=True))
    configs = [cfgs[i] for i in idx]
    gr = price_grid(g, cl, w, configs, layers)
    lb = compute_bound(g, cl, w, configs)
    assert (lb[:, None] <= gr.step_time_s * (1 + 1e-12)).all()


def test_the_bound_counts_the_communication_no_option_hides() -> None:
    """The search's bound is compute plus the exposed TP/CP traffic of the unit at its fastest: on a
    TP-8 mesh it is above compute alone, and still below the cheapest plan."""
    from costmodel.configs import ConfigArrays
    from costmodel.node_costs import node_times
    from costmodel.unit_classes import unit_classes

    g, cl = load_model("llama3-8b", 4096), parse_cluster("32xh100")
    w = Workload(seq_len=4096, global_batch=32)
    every = [c for c in mesh_configs(g, cl, w, SPACES["full"]) if c.pp == 1 and c.micro_batch == 1 and c.cp == 1
             and c.tp_mode == "megatron"]
    cfgs = [next(c for c in every if c.tp == t) for t in (1, 8)]
    reps, index = unit_classes(g)
    counts = np.bincount(np.array(index))
    compute = sum(counts[k] * sum(sum(node_times(n, DeviceModel(cl), ConfigArrays.of(cfgs), w)) for n in nodes)
                  for k, (_, nodes) in enumerate(reps))
    lb = compute_bound(g, cl, w, cfgs)
    m = np.array([w.global_batch / (c.dp * c.micro_batch) for c in cfgs])
    ratio = (lb - DeviceModel(cl).c.step_overhead_s) / (m * compute)
    assert ratio[0] == pytest.approx(1.0, rel=1e-9) and ratio[1] > 1.1, ratio  # TP 8 with SP: 1.18
    gr = price_grid(g, cl, w, cfgs, [LayerStrategy(sharding=sh) for sh in SHARDINGS])
    assert (lb <= gr.step_time_s.min(axis=1) * (1 + 1e-12)).all()


@SETTINGS
@given(dp=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), sharding=st.sampled_from(SHARDINGS),
       grad_dtype=st.sampled_from(["fp32", "bf16"]), model=st.sampled_from(["gpt2", "llama3-8b", "mixtral-8x7b"]))
def test_data_parallel_states_are_the_zero_papers(dp: int, sharding: str, grad_dtype: str, model: str) -> None:
    """Rajbhandari et al. 2020, section 5: with Ψ parameters on N_d ranks, mixed-precision Adam
    keeps 2Ψ of parameters, gΨ of gradients (g = 2, or 4 for fp32 buffers) and KΨ = 12Ψ of optimizer
    state, each divided by N_d from the ZeRO stage that shards it on (optimizer: 1, gradients: 2,
    parameters: 3). Ψ counted from the graph, the tied head's weight once."""
    g = load_model(model, 512)
    psi = sum(n.params for n in g.nodes)
    w = Workload(seq_len=512, global_batch=dp * 2, grad_dtype=grad_dtype)
    r = estimate(g, parse_cluster(f"{dp}xh100"), Strategy(mesh=Mesh(dp_shard=dp), default=LayerStrategy(sharding=sharding)), w)
    level = {"replicate": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3_keep": 3}[sharding] if dp > 1 else 0
    gbytes = 4 if grad_dtype == "fp32" else 2
    st0 = r.stages[0]
    assert st0.param_bytes == pytest.approx(2 * psi / (dp if level >= 3 else 1), rel=1e-6)
    assert st0.grad_bytes == pytest.approx(gbytes * psi / (dp if level >= 2 else 1), rel=1e-6)
    assert st0.optim_bytes == pytest.approx(12 * psi / (dp if level >= 1 else 1), rel=1e-6)


@SETTINGS
@given(n=st.integers(2, 8), nbytes=st.floats(1e3, 1e10),
       kind=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]))
def test_a_collective_inside_one_node_is_the_ring_formula(n: int, nbytes: float, kind: str) -> None:
    """NCCL's ring within a scale-up domain: each rank moves 2(n-1)/n of the buffer for an all-reduce
    and (n-1)/n for the others at the bus bandwidth, in ⌈log2 n⌉ latency steps (twice for an
    all-reduce); an array of groups prices as each group alone."""
    cl = parse_cluster("8xh100")
    acc = cl.accelerator
    bw = acc.scale_up.gbps * 1e9 * acc.busbw_efficiency
    factor = (2 if kind == "all_reduce" else 1) * (n - 1) / n
    steps = math.ceil(math.log2(n)) * (2 if kind == "all_reduce" else 1)
    dev = DeviceModel(cl)
    t = dev.collective_time(kind, nbytes, AxisGroup(n, 1))
    assert t == pytest.approx(steps * acc.scale_up.latency_us * 1e-6 + factor * nbytes / bw, rel=1e-12)
    sizes = np.array([1.0, n, 2.0])
    arr = dev.collective_time(kind, np.array([nbytes, nbytes, nbytes / 3]), AxisGroup(sizes, np.ones(3)))
    assert arr[0] == 0.0 and arr[1] == pytest.approx(t, rel=1e-12)
    assert arr[2] == pytest.approx(dev.collective_time(kind, nbytes / 3, AxisGroup(2, 1)), rel=1e-12)


def test_a_group_across_nodes_is_no_faster_than_one_inside_a_node() -> None:
    dev = DeviceModel(parse_cluster("64xh100"))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        inside = dev.collective_time(kind, 1e9, AxisGroup(8, 1))
        across = dev.collective_time(kind, 1e9, AxisGroup(8, 8))
        assert across > inside


def test_empty_grid() -> None:
    g, cl = load_model("gpt2", 128), parse_cluster("4xcpu")
    gr = price_grid(g, cl, Workload(seq_len=128, global_batch=8), [], [LayerStrategy()])
    assert gr.size == 0 and np.asarray(gr.step_time_s).shape == (0, 1)


def test_a_configuration_prices_the_same_alone_and_in_a_batch_with_a_profile() -> None:
    """Under a measured profile (GEMMs by shape, collectives by group size, DTensor's host time) too."""
    from profiler.profile_schema import (
        AttnPoint,
        BwPoint,
        CommFit,
        ComputeProfile,
        DeviceInfo,
        DTensorOverhead,
        GemmPoint,
        Profile,
    )

    def gemm(m: int, n: int, k: int, rate: float) -> GemmPoint:  # distinct shapes: priced by shape
        flops = 2.0 * m * n * k
        t = 3 * flops / rate
        return GemmPoint(m=m, n=n, k=k, fwd_s=t / 3, bwd_s=2 * t / 3, flops=flops, flops_per_s=rate)

    def attn(flops: float, rate: float, causal: bool) -> AttnPoint:
        t = 3 * flops / rate
        return AttnPoint(batch=1, heads=1, seq=8, head_dim=8, causal=causal, fwd_s=t / 3, bwd_s=2 * t / 3,
                         flops=flops, flops_per_s=rate)

    def fit(coll: str, world: int) -> CommFit:
        return CommFit(collective=coll, world=world, backend="gloo", alpha_s=1e-4 * world, beta_s_per_byte=1e-9,
                       median_rel_error=0.0, points=[(1024.0, 1e-4)], wait_s=2e-3)

    compute = ComputeProfile(
        dtype="bf16", gemm=[gemm(128, 768, 768, 1e9), gemm(128, 2304, 768, 2e9), gemm(512, 3072, 768, 4e9)],
        attention=[attn(1e6, 1e9, False), attn(1e8, 2e9, True)],
        bandwidth={"norm": [BwPoint(bytes=1e6, seconds=1e-3, bytes_per_s=1e9, bwd_s=2e-3)],
                   "embedding": [BwPoint(bytes=b, seconds=b / 1e9, bytes_per_s=1e9, bwd_s=b * 1e-9 + 5e-3,
                                         shape=[int(b // 4096), 1000, 1024]) for b in (1e6, 4e6)]},
        dtensor=DTensorOverhead(linear_fwd_s=1e-3, linear_bwd_s=2e-3, norm_fwd_s=3e-4, norm_bwd_s=4e-4,
                                loss_fwd_s=5e-3, loss_bwd_s=6e-3, loss_traffic_ratio=2.0))  # TP's host time
    prof = Profile(device=DeviceInfo(kind="cpu", name="test cpu", torch_version="2.13.0", threads=2, hostname="h",
                                     created="2026-01-01T00:00:00+00:00"), compute=compute,
                   comm=[fit(c, n) for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
                         for n in (2, 4)])
    g, cl = load_model("gpt2", 128), parse_cluster("4xcpu")
    w = Workload(seq_len=128, global_batch=8)
    rng = random.Random(5)
    cfgs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))
    strategies = [rng.choice(cfgs).strategy(default=LayerStrategy(
        sharding=rng.choice(SHARDINGS), recompute=rng.choice(RECOMPUTES))) for _ in range(8)]
    strategies += [Strategy(mesh=Mesh(tp=2, dp_shard=2), sequence_parallel=sp, micro_batch=2,
                            default=LayerStrategy(sharding="zero2", recompute=rc))
                   for sp in (True, False) for rc in ("none", "full")]  # SP's extra waits and gradients
    strategies += [Strategy(mesh=m, micro_batch=1, default=LayerStrategy(sharding="replicate"))
                   for m in (Mesh(dp_shard=4), Mesh(dp_replicate=2, dp_shard=2), Mesh(tp=2, dp_replicate=2))]
    configs, options, cells = strategies_grid(strategies)
    gr = price_grid(g, cl, w, configs, options, profile=prof)
    lb = compute_bound(g, cl, w, configs, profile=prof)  # GEMMs priced by the same shapes
    for s, (i, j) in zip(strategies, cells, strict=True):
        alone = price_grid(g, cl, w, [configs[i]], [options[j]], profile=prof)
        assert gr.step_time_s[i, j] == pytest.approx(alone.step_time_s[0, 0], rel=1e-12)
        assert gr.memory_peak_gib[i, j] == pytest.approx(alone.memory_peak_gib[0, 0], rel=1e-12)
        r = estimate(g, cl, s, w, profile=prof)
        assert r.step_time_s == pytest.approx(gr.step_time_s[i, j], rel=1e-9)
        assert lb[i] <= r.step_time_s * (1 + 1e-12)
