"""costmodel.vectorized prices uniform plans exactly as estimate() does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from costmodel.estimate import estimate
from costmodel.vectorized import compute_bound, price_grid, strategies_grid
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.space import SPACES, mesh_configs
from vocab.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Mesh, Strategy, Workload

CASES = [
    ("llama3-70b", "64xh100", 4096, 256, "auto"),
    ("mixtral-8x7b", "64xh100", 4096, 256, "flash2"),
    ("gpt2-xl", "8xh100", 1024, 64, "flash3"),
    ("gpt2", "4xcpu", 128, 8, "auto"),
    ("gpt2-medium", "4xcpu", 128, 8, "fp32"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_grid_equals_estimate(case: tuple) -> None:
    model, cluster, seq, gb, kernel = case
    g, cl = load_model(model, seq), parse_cluster(cluster)
    w = (Workload(seq_len=seq, global_batch=gb, precision="fp32") if kernel == "fp32"
         else Workload(seq_len=seq, global_batch=gb, attention_kernel=kernel))
    rng = random.Random(hash(model) % 1000)
    cfgs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))
    strategies = [
        rng.choice(cfgs).strategy(
            default=LayerStrategy(
                sharding=rng.choice(SHARDINGS), recompute=rng.choice(RECOMPUTES), offload=rng.choice(OFFLOADS)
            )
        )
        for _ in range(9)
    ]
    configs, options, cells = strategies_grid(strategies)
    gr = price_grid(g, cl, w, configs, options, memory_limit_gib=40.0)
    lb = compute_bound(g, cl, w, configs)
    for s, (i, j) in zip(strategies, cells, strict=True):
        r = estimate(g, cl, s, w, memory_limit_gib=40.0)
        assert gr.step_time_s[i, j] == pytest.approx(r.step_time_s, rel=1e-9)
        assert gr.memory_peak_gib[i, j] == pytest.approx(r.memory_peak_gib, rel=1e-9)
        assert gr.mfu[i, j] == pytest.approx(r.mfu, rel=1e-9)
        assert gr.hfu[i, j] == pytest.approx(r.hfu, rel=1e-9)
        assert gr.tokens_per_s_per_gpu[i, j] == pytest.approx(r.tokens_per_s_per_gpu, rel=1e-9)
        assert bool(gr.fits[i, j]) == r.fits
        assert lb[i] <= r.step_time_s * (1 + 1e-12)
        assert gr.strategy(i, j) == s


def test_empty_grid() -> None:
    g, cl = load_model("gpt2", 128), parse_cluster("4xcpu")
    gr = price_grid(g, cl, Workload(seq_len=128, global_batch=8), [], [LayerStrategy()])
    assert gr.size == 0 and np.asarray(gr.step_time_s).shape == (0, 1)


def test_grid_equals_estimate_with_a_profile() -> None:
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
        r = estimate(g, cl, s, w, profile=prof)
        assert gr.step_time_s[i, j] == pytest.approx(r.step_time_s, rel=1e-9)
        assert gr.memory_peak_gib[i, j] == pytest.approx(r.memory_peak_gib, rel=1e-9)
        assert lb[i] <= r.step_time_s * (1 + 1e-12)


def test_grid_equals_estimate_with_communication_interference() -> None:
    from costmodel.constants import CostConstants
    from costmodel.device import DeviceModel

    g, cl = load_model("llama3-70b", 4096), parse_cluster("64xh100")
    w = Workload(seq_len=4096, global_batch=256)
    dev = DeviceModel(cl, constants=CostConstants(comm_interference=0.4, tp_overlap=0.5, ep_overlap=0.3))
    rng = random.Random(7)
    cfgs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))
    strategies = [rng.choice(cfgs).strategy(default=LayerStrategy(sharding=rng.choice(SHARDINGS),
                                                                  recompute=rng.choice(RECOMPUTES)))
                  for _ in range(12)]
    configs, options, cells = strategies_grid(strategies)
    gr = price_grid(g, cl, w, configs, options, memory_limit_gib=70.0, device=dev)
    for s, (i, j) in zip(strategies, cells, strict=True):
        r = estimate(g, cl, s, w, memory_limit_gib=70.0, device=dev)
        assert gr.step_time_s[i, j] == pytest.approx(r.step_time_s, rel=1e-9)
