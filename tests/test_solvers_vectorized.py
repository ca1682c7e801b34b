"""costmodel.vectorized prices uniform plans exactly as estimate() does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from costmodel.estimate import estimate
from costmodel.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Workload
from costmodel.vectorized import compute_bound, price_grid, strategies_grid
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.space import SPACES, mesh_configs

CASES = [("llama3-70b", "64xh100", 4096, 256), ("mixtral-8x7b", "64xh100", 4096, 256),
         ("gpt2-xl", "8xh100", 1024, 64), ("gpt2", "4xcpu", 128, 8)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_grid_equals_estimate(case: tuple) -> None:
    model, cluster, seq, gb = case
    g, cl = load_model(model, seq), parse_cluster(cluster)
    w = Workload(seq_len=seq, global_batch=gb)
    rng = random.Random(hash(model) % 1000)
    cfgs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))
    strategies = [rng.choice(cfgs).strategy(default=LayerStrategy(
        sharding=rng.choice(SHARDINGS), recompute=rng.choice(RECOMPUTES), offload=rng.choice(OFFLOADS)))
        for _ in range(9)]
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
