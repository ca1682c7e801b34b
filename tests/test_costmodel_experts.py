"""Mixture-of-experts mechanics priced from first principles: grouped GEMMs by the rows each expert
receives (tile padding, the weight-bound roofline), the permutations around them, and the load
imbalance that only expert parallelism exposes."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb
from pathlib import Path

import numpy as np
import pytest

from costmodel.configs import AxisGroup, ConfigArrays
from costmodel.device import DeviceModel, gemm_bytes
from costmodel.estimate import estimate
from costmodel.experts import (
    EAGER_PERMUTE_RATE,
    GROUPED_GEMM_TILE,
    PERMUTE_ELEMENTS,
    dispatch_time,
    expert_times,
    grouped_gemm_time,
    load_imbalance,
    permute_bytes,
    remote_copies,
    remote_domains,
    tokens_per_sample,
)
from costmodel.node_costs import node_times
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import load_model
from profiler.transformer import build_graph
from tests.benchmark_scripts import benchmark_script
from vocab.strategy import LayerStrategy, Mesh, MeshConfig, Strategy, Workload

H, F_, E, K = 7168, 2048, 256, 8  # DeepSeek-V3's routed experts


def _experts(seq: int = 4096):
    cfg = TransformerConfig(name="moe", layers=1, hidden=H, heads=56, vocab=1000, activation="swiglu",
                            norm="rmsnorm", experts=E, top_k=K, moe_ffn_hidden=F_)
    return next(n for n in build_graph(cfg, seq).nodes if n.kind == "experts")


def _dev() -> DeviceModel:
    return DeviceModel(parse_cluster("64xh100"))


def test_a_node_routes_its_tokens() -> None:
    assert tokens_per_sample(_experts(4096)) == pytest.approx(4096)


def test_grouped_gemm_pads_each_experts_rows_by_half_a_tile_and_pays_one_launch() -> None:
    """ep = 8: 32 local experts, 4,096 tokens · 8 copies = 32,768 rows, 1,024 per expert, and the
    slowest rank holds moe_imbalance times that; compute-bound, so each of the two grouped GEMMs is
    its padded FLOPs at the GEMM rate plus one call's fixed cost."""
    dev, n = _dev(), _experts()
    rows = 4096 * K * dev.c.moe_imbalance / 32 + GROUPED_GEMM_TILE / 2
    flops = 2 * rows * 32 * (2 * F_ * H + H * F_)
    fwd, bwd = expert_times(n, dev, 4096, ep=8, tdiv=1, gemm_precision="bf16", fp8_casts=False, kernels="fused")
    pf, pb = permute_bytes(H, K, 4096, "fused")
    perm = dev.memory_time(pf), dev.memory_time(pb)
    assert fwd - perm[0] == pytest.approx(flops / dev.gemm_rate("bf16") + 2 * dev.c.grouped_gemm_overhead_s,
                                          rel=1e-12)
    assert bwd - perm[1] == pytest.approx(2 * (fwd - perm[0]), rel=1e-12)


def test_few_rows_per_expert_are_bound_by_reading_the_weights() -> None:
    """256 local experts (ep = 1) and 64 tokens: 2 rows per expert (66 padded), each expert reads
    its whole 3·h·f weight for them: the GEMMs take the bytes' time, not the FLOPs'."""
    dev, n = _dev(), _experts()
    fwd, _ = expert_times(n, dev, 64, ep=1, tdiv=1, gemm_precision="bf16", fp8_casts=False, kernels="fused")
    rows = 64 * K / E + GROUPED_GEMM_TILE / 2
    weights = E * sum(gemm_bytes((rows, c, d), "bf16", False) for c, d in ((2 * F_, H), (H, F_)))
    pf, _ = permute_bytes(H, K, 64, "fused")
    read = weights / (dev.acc.hbm_tbps * 1e12 * dev.c.gemm_stream_efficiency)
    expect = read + 2 * dev.c.grouped_gemm_overhead_s + dev.memory_time(pf)
    assert fwd == pytest.approx(expect, rel=1e-12)
    assert weights > 3 * E * H * F_ * 2  # the weights dominate the bytes
    compute = 2 * rows * E * 3 * H * F_ / dev.gemm_rate("bf16")
    assert read > 3 * compute


def test_the_roofline_leaves_a_large_dense_gemm_compute_bound() -> None:
    dev = _dev()
    m, n, k = 8192, 8192, 8192
    assert dev.gemm_time(2 * m * n * k, shape=(m, n, k)) == dev.gemm_time(2 * m * n * k)
    # one row: the weight's 128 MiB read takes longer than its 134 MFLOP
    read = gemm_bytes((1, n, k), "bf16", False) / (dev.acc.hbm_tbps * 1e12 * dev.c.gemm_stream_efficiency)
    assert dev.gemm_time(2 * n * k, shape=(1, n, k)) == pytest.approx(read + dev.c.gemm_overhead_s, rel=1e-12)


@pytest.mark.parametrize("kernels", ["fused", "eager"])
def test_permutations_move_the_counted_bytes(kernels: str) -> None:
    """The counted bytes; eager gathers and atomic scatter-adds at the rate measured against a
    streaming kernel's, fused ones at the streaming rate."""
    n, dev = _experts(), _dev()
    (a, b), (c, d) = PERMUTE_ELEMENTS[kernels]
    pf, pb = permute_bytes(H, K, 1000, kernels)
    assert (pf, pb) == (2 * H * 1000 * (a * K + b), 2 * H * 1000 * (c * K + d))
    assert PERMUTE_ELEMENTS["fused"] == ((3.0, 1.0), (4.0, 1.0))  # 2k + (k + 1) forward, +k backward
    fwd, bwd = expert_times(n, dev, 1000, 8, 1, "bf16", False, kernels)
    rows = 1000 * K * dev.c.moe_imbalance / (E / 8)
    shapes = ((2 * F_, H), (H, F_))
    gf = sum(grouped_gemm_time(dev, rows, E / 8, c_, d_, "bf16") for c_, d_ in shapes)
    gb = sum(grouped_gemm_time(dev, rows, E / 8, c_, d_, "bf16", backward=True) for c_, d_ in shapes)
    rate = EAGER_PERMUTE_RATE if kernels == "eager" else 1.0
    assert fwd == pytest.approx(gf + dev.memory_time(pf) / rate, rel=1e-12)
    assert bwd == pytest.approx(gb + dev.memory_time(pb) / rate, rel=1e-12)


def test_imbalance_is_paid_across_expert_ranks_only() -> None:
    """One rank holds every expert: its load is the mean. Across ranks the slowest one paces the
    GEMMs and the all-to-all."""
    dev, n = _dev(), _experts()
    one, _ = expert_times(n, dev, 4096, ep=1, tdiv=1, gemm_precision="bf16", fp8_casts=False, kernels="fused")
    dev_flat = DeviceModel(parse_cluster("64xh100"), constants=dev.c.with_overrides({"moe_imbalance": 1.0}))
    flat, _ = expert_times(n, dev_flat, 4096, ep=1, tdiv=1, gemm_precision="bf16", fp8_casts=False, kernels="fused")
    assert one == flat
    spread, _ = expert_times(n, dev, 4096, ep=8, tdiv=1, gemm_precision="bf16", fp8_casts=False, kernels="fused")
    spread_flat, _ = expert_times(n, dev_flat, 4096, ep=8, tdiv=1, gemm_precision="bf16", fp8_casts=False,
                                  kernels="fused")
    assert spread > spread_flat


def test_node_prices_experts_per_ep_in_a_batch_as_alone() -> None:
    """Configurations that differ only in ep price their experts differently, in a batch as alone."""
    dev, n = _dev(), _experts()
    w = Workload(seq_len=4096, global_batch=64, kernels="fused")
    cfgs = [MeshConfig.of(Strategy(mesh=Mesh(dp_shard=64, ep=ep))) for ep in (1, 8, 64)]
    f, b = node_times(n, dev, ConfigArrays.of(cfgs), w)
    for i, c in enumerate(cfgs):
        fa, ba = node_times(n, dev, ConfigArrays.of([c]), w)
        assert (f[i], b[i]) == (fa[0], ba[0])
    assert len(set(np.round(f, 12))) == 3


def test_expected_domains_a_token_reaches() -> None:
    """Uniform routing: each copy lies in another of m domains with probability (m-1)/m; distinct
    domains by inclusion-exclusion over the experts; DeepSeek-V3's 4-of-8 groups, one per node, 3.5."""
    assert remote_copies(256, 8, 8) == 7.0
    assert remote_domains(256, 8, 8) == pytest.approx(7 * (1 - comb(224, 8) / comb(256, 8)), rel=1e-12)
    assert remote_domains(256, 8, 8, groups=8, group_top_k=4) == 3.5
    assert remote_domains(256, 8, 1) == 0.0
    assert remote_domains(8, 2, 2) == pytest.approx(1 - comb(4, 2) / comb(8, 2))  # Mixtral over 2 nodes


def test_dedup_dispatch_sends_one_copy_per_domain_reached() -> None:
    """Inside one domain a de-duplicating dispatch is the all-to-all; across eight, its scale-out
    bytes shrink to the domains reached (3.5 of 7 remote copies for DeepSeek-V3) and the forwarding
    inside the domain still moves every copy."""
    dev = DeviceModel(parse_cluster("128xh100"))
    routing = (256, 8, 8, 4)
    nbytes = 4096 * 8 * 7168 * 2.0
    inside = AxisGroup(np.array([8.0]), np.array([1.0]))
    assert dispatch_time(dev, nbytes, inside, routing, np.array([True])) == dev.collective_time(
        "all_to_all", nbytes, inside)
    across = AxisGroup(np.array([64.0]), np.array([1.0]))
    a2a = dev.collective_time("all_to_all", nbytes, across)
    dedup = dispatch_time(dev, nbytes, across, routing, np.array([True]))
    expect = max(dev.collective_time("all_to_all", nbytes * 0.5, across), dev.collective_time("all_to_all", nbytes, inside))
    assert dedup == pytest.approx(expect, rel=1e-12) and dedup < 0.6 * a2a
    assert dispatch_time(dev, nbytes, across, routing, np.array([False])) == a2a


def _ep_comm(overlap: str, pp: int = 1, vpp: int = 1, recompute: str = "none") -> float:
    graph = load_model("mixtral-8x7b", 2048)
    s = Strategy(mesh=Mesh(pp=pp, dp_shard=16 // pp, ep=8), micro_batch=1,
                 schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp,
                 default=LayerStrategy(sharding="zero1", recompute=recompute))
    w = Workload(seq_len=2048, global_batch=32, kernels="fused", moe_overlap=overlap)
    return estimate(graph, parse_cluster("16xh100"), s, w).time.comm["ep"]


def test_megatron_overlap_hides_the_all_to_alls_where_it_runs() -> None:
    """Under 1F1B pairing the all-to-alls (smaller than a block's compute here) hide but for
    comm_interference of them; not with full recomputation, nor with a pipeline of one virtual
    stage per rank, as Megatron refuses both."""
    c = DeviceModel(parse_cluster("16xh100")).c
    assert _ep_comm("1f1b") == pytest.approx(c.comm_interference * _ep_comm("none"), rel=1e-9)
    assert _ep_comm("1f1b", recompute="full") == _ep_comm("none", recompute="full")
    assert _ep_comm("1f1b", pp=2) == _ep_comm("none", pp=2)
    assert _ep_comm("1f1b", pp=2, vpp=2) == pytest.approx(c.comm_interference * _ep_comm("none", pp=2, vpp=2),
                                                          rel=1e-9)


def test_deepseek_v3s_published_job_is_priced_with_its_dispatch_and_overlap() -> None:
    """benchmarks/moe_jobs.py's four pricings of DeepSeek-V3's pre-training: the de-duplicated
    dispatch cuts the exposed all-to-alls, the overlap hides them, and with both they are a small
    part of the step."""
    jobs = benchmark_script("moe_jobs")
    graph, cl = load_model(jobs.MODEL, jobs.SEQ), parse_cluster(jobs.CLUSTER)
    steps, comm = {}, {}
    for dispatch in ("alltoall", "dedup"):
        for overlap in ("none", "1f1b"):
            w = Workload(seq_len=jobs.SEQ, global_batch=jobs.BATCH, precision="fp8", kernels="fused",
                         moe_dispatch=dispatch, moe_overlap=overlap)
            r = estimate(graph, cl, jobs.strategy(), w)
            steps[dispatch, overlap], comm[dispatch, overlap] = r.step_time_s, r.time.comm["ep"]
    assert comm["dedup", "none"] < 0.6 * comm["alltoall", "none"]
    assert comm["alltoall", "1f1b"] < comm["alltoall", "none"]
    assert min(steps.values()) == steps["dedup", "1f1b"] and max(steps.values()) == steps["alltoall", "none"]
    assert comm["dedup", "1f1b"] < 0.05 * steps["dedup", "1f1b"]


def test_the_kernel_benchmark_dry_runs_its_moe_and_rows_sections(tmp_path: Path) -> None:
    """benchmarks/gpu_kernels.py on CPU with small shapes: every MoE and few-row case is recorded
    with the model's price, and --summarize reads the file back."""
    out = tmp_path / "k.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--small", "--sections", "moe,rows",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    sections = {r["section"] for r in rows}
    assert {"moe grouped_mm", "moe loop", "moe permute fwd", "moe permute bwd", "gemm rows"} <= sections
    assert all(r["model_s"] > 0 and r["measured_s"] > 0 for r in rows)
    again = subprocess.run([sys.executable, str(script), "--summarize", str(out)], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and "rows per expert" in again.stdout and "| GEMM (n x k) |" in again.stdout


def test_a_capacity_factor_caps_the_slowest_expert_rank() -> None:
    """Tokens beyond capacity are dropped before the dispatch: the slowest rank holds at most the
    capacity factor times the mean, in its GEMMs and its all-to-alls; on one rank a factor below 1
    drops part of every expert's tokens."""
    dev, n = _dev(), _experts()
    assert float(load_imbalance(dev, 8, 1.0)) == 1.0 and float(load_imbalance(dev, 8, 2.0)) == dev.c.moe_imbalance
    assert float(load_imbalance(dev, 1, 0.5)) == 0.5 and float(load_imbalance(dev, 1)) == 1.0
    capped = expert_times(n, dev, 4096, 8, 1, "bf16", False, "fused", capacity=1.0)
    flat = DeviceModel(parse_cluster("64xh100"), constants=dev.c.with_overrides({"moe_imbalance": 1.0}))
    assert capped == expert_times(n, flat, 4096, 8, 1, "bf16", False, "fused")
    graph = load_model("mixtral-8x7b", 2048)
    s = Strategy(mesh=Mesh(dp_shard=16, ep=8), default=LayerStrategy(sharding="zero1"))
    w = Workload(seq_len=2048, global_batch=32, kernels="fused")
    free = estimate(graph, parse_cluster("16xh100"), s, w)
    cut = estimate(graph, parse_cluster("16xh100"), s, w.model_copy(update={"moe_capacity_factor": 1.0}))
    assert cut.time.comm["ep"] == pytest.approx(free.time.comm["ep"] / dev.c.moe_imbalance, rel=0.02)
    assert cut.step_time_s < free.step_time_s


def test_torchtitan_routes_every_gathered_token_on_every_tp_rank() -> None:
    """Under torchtitan's gathered MoE layer the router runs on the tokens all-gathered over tp: its GEMM
    (2·s·h·E forward, twice that backward) and its saved input (s·h bf16 and s·E fp32 scores) are not
    split over tp=2; Megatron's dispatcher routes each rank's sequence share. Folded experts (etp 1) so
    that the experts' part is the same either way: the difference is the router's other half."""
    from costmodel.units import unit_cost

    cfg = TransformerConfig(name="m", layers=2, hidden=256, heads=4, kv_heads=4, ffn_hidden=512, vocab=1000,
                            activation="swiglu", norm="rmsnorm", position="rope", experts=8, top_k=2,
                            moe_ffn_hidden=128)
    s_len, b, h, e = 512, 2, 256, 8
    nodes = dict(build_graph(cfg, s_len).blocks())["layers.1"]
    s = Strategy(mesh=Mesh(dp_shard=2, tp=2, ep=4, etp=1), micro_batch=b, sequence_parallel=True)
    dev = DeviceModel(parse_cluster("4xh100"))
    cost = {m: unit_cost("layers.1", nodes, dev, s, Workload(seq_len=s_len, global_batch=8, moe_tp=m))
            for m in ("dispatcher", "gathered")}
    tokens = b * s_len
    assert cost["gathered"].activations - cost["dispatcher"].activations == (2 * tokens * h + 4 * tokens * e) / 2
    assert cost["gathered"].hw_flops - cost["dispatcher"].hw_flops == 6 * tokens * h * e / 2
