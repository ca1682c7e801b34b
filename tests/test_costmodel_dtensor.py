"""DTensor's host overhead under Megatron TP: measured by the profiler, priced where the runtime
makes DTensor modules (TP linears and embeddings, sequence-parallel norms, the parallel loss),
added to the device time on a CPU and overlapped with it on a GPU."""

from __future__ import annotations

import pytest
import torch

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer, estimate
from costmodel.node_costs import node_times
from profiler.hardware import parse_cluster
from profiler.measure_dtensor import measure_dtensor_overhead
from profiler.models import load_model
from profiler.profile_schema import BwPoint, ComputeProfile, DeviceInfo, DTensorOverhead, GemmPoint, Profile
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

OVERHEAD = DTensorOverhead(linear_fwd_s=1e-3, linear_bwd_s=2e-3, norm_fwd_s=3e-4, norm_bwd_s=4e-4,
                           loss_fwd_s=5e-3, loss_bwd_s=6e-3, loss_traffic_ratio=2.0)


def profile(kind: str = "cpu", dtensor: DTensorOverhead | None = OVERHEAD) -> Profile:
    gemm = GemmPoint(m=128, n=768, k=768, fwd_s=1e-3, bwd_s=2e-3, flops=2.0 * 128 * 768 * 768,
                     flops_per_s=3 * 2.0 * 128 * 768 * 768 / 3e-3)
    bw = {op: [BwPoint(bytes=1e6, seconds=1e-3, bytes_per_s=1e9, bwd_s=2e-3)] for op in ("norm", "cross_entropy")}
    return Profile(device=DeviceInfo(kind=kind, name="test", torch_version="2.13.0", threads=1, hostname="h",
                                     created="2026-01-01T00:00:00+00:00"),
                   compute=ComputeProfile(dtype="fp32", gemm=[gemm], bandwidth=bw, dtensor=dtensor))


GRAPH = load_model("gpt2", 128)
W = Workload(seq_len=128, global_batch=8, precision="fp32")


def times(node: str, s: Strategy, dtensor: DTensorOverhead | None = OVERHEAD, cluster: str = "4xcpu",
          kind: str = "cpu") -> tuple[float, float]:
    n = next(x for x in GRAPH.nodes if x.name == node)
    f, b = node_times(n, DeviceModel(parse_cluster(cluster), profile(kind, dtensor)), ConfigArrays.of_strategy(s), W)
    return float(f[0]), float(b[0])


def tp(sp: bool = False) -> Strategy:
    return Strategy(mesh=Mesh(tp=2, dp_shard=2), micro_batch=4, sequence_parallel=sp)


def test_each_dtensor_module_adds_its_measured_host_time_on_a_cpu() -> None:
    share = DeviceModel(parse_cluster("4xcpu"), profile()).share  # 4 ranks time-share 2 cores
    assert share == pytest.approx(0.5)
    for node in ("layers.0.attn.qkv", "layers.0.attn.out", "layers.0.mlp.up", "embed", "head"):
        (f, b), (f0, b0) = times(node, tp()), times(node, tp(), dtensor=None)
        assert (f - f0, b - b0) == pytest.approx((1e-3 / share, 2e-3 / share), rel=1e-12)
    for node in ("layers.0.attn.core", "layers.0.mlp.act"):  # local tensors under the runtime's TP
        assert times(node, tp()) == times(node, tp(), dtensor=None)
    norm = "layers.0.attn_norm"
    assert times(norm, tp()) == times(norm, tp(), dtensor=None)  # without SP a norm stays a plain module
    (f, b), (f0, b0) = times(norm, tp(sp=True)), times(norm, tp(sp=True), dtensor=None)
    assert (f - f0, b - b0) == pytest.approx((3e-4 / share, 4e-4 / share), rel=1e-12)
    (f, b), (f0, b0) = times("loss", tp()), times("loss", tp(), dtensor=None)  # twice the traffic, plus its host time
    assert (f, b) == pytest.approx((2 * f0 + 5e-3 / share, 2 * b0 + 6e-3 / share), rel=1e-12)


def test_without_tp_or_under_tsp_nothing_changes() -> None:
    for s in (Strategy(mesh=Mesh(dp_shard=4), micro_batch=2),
              Strategy(mesh=Mesh(tp=2, dp_shard=2), micro_batch=4, tp_mode="tsp")):
        for node in ("layers.0.attn.qkv", "layers.0.attn_norm", "loss"):
            assert times(node, s) == times(node, s, dtensor=None)


def test_on_a_gpu_the_host_overlaps_the_kernels() -> None:
    """A GPU's host issues kernels ahead of them: the slower of the two counts."""
    slow_host = DTensorOverhead(linear_fwd_s=10.0, linear_bwd_s=20.0, norm_fwd_s=0, norm_bwd_s=0, loss_fwd_s=0,
                                loss_bwd_s=0)
    fast_host = slow_host.model_copy(update={"linear_fwd_s": 1e-9, "linear_bwd_s": 1e-9})
    s = tp()
    plain = times("layers.0.mlp.up", s, None, "8xh100", "gpu")
    assert times("layers.0.mlp.up", s, slow_host, "8xh100", "gpu") == (10.0, 20.0)
    assert times("layers.0.mlp.up", s, fast_host, "8xh100", "gpu") == plain


def test_a_blocks_step_pays_four_tp_linears_and_under_sp_two_norms() -> None:
    dev, bare = (DeviceModel(parse_cluster("4xcpu"), profile(dtensor=d)) for d in (OVERHEAD, None))
    block = next(nodes for name, nodes in GRAPH.blocks() if name == "layers.0")
    for sp, extra in ((False, 4 * 3e-3), (True, 4 * 3e-3 + 2 * 7e-4)):
        s = tp(sp)
        u, u0 = UnitPricer(dev, s, W)("layers.0", block), UnitPricer(bare, s, W)("layers.0", block)
        assert (u.fwd + u.bwd) - (u0.fwd + u0.bwd) == pytest.approx(extra / dev.share, rel=1e-9)
    s = tp().model_copy(update={"default": LayerStrategy(recompute="full")})  # recompute re-dispatches the forward
    u, u0 = UnitPricer(dev, s, W)("layers.0", block), UnitPricer(bare, s, W)("layers.0", block)
    assert u.recompute - u0.recompute == pytest.approx(4 * 1e-3 / dev.share, rel=1e-9)
    assert estimate(GRAPH, parse_cluster("4xcpu"), tp(), W, device=dev).step_time_s > \
        estimate(GRAPH, parse_cluster("4xcpu"), tp(), W, device=bare).step_time_s


def test_the_measurement_declines_inside_a_process_group(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        d, why = measure_dtensor_overhead(torch.device("cpu"), reps=3)
    finally:
        dist.destroy_process_group()
    assert d is None and "process group" in why
    d, why = measure_dtensor_overhead(torch.device("cpu"), reps=3)  # and runs outside one
    assert d is not None and why == "" and d.linear_fwd_s + d.linear_bwd_s > 0
