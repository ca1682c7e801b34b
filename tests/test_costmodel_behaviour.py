"""Directions the cost model must get right: what each strategy buys and what it costs."""

from __future__ import annotations

import pytest

from costmodel.device import AxisGroup, DeviceModel
from costmodel.estimate import UnitPricer, estimate, stage_units
from profiler.hardware import parse_cluster
from profiler.models import load_model
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload, even_split

G = load_model("llama3-8b", 4096)
C = parse_cluster("16xh100")
W = Workload(seq_len=4096, global_batch=32)


def _est(**kw):
    default = kw.pop("default", LayerStrategy())
    return estimate(G, C, Strategy(default=default, **kw), W)


def test_sharding_trades_memory_for_communication() -> None:
    mesh = Mesh(dp_shard=16)
    by = {z: _est(mesh=mesh, default=LayerStrategy(sharding=z)) for z in ("replicate", "zero1", "zero2", "zero3")}
    mem = [by[z].stages[0].params + by[z].stages[0].grads + by[z].stages[0].optimizer for z in by]
    assert mem == sorted(mem, reverse=True) and mem[0] > 10 * mem[-1]
    assert by["zero3"].time.comm["dp"] >= by["zero2"].time.comm.get("dp", 0.0)


def test_recomputation_trades_time_for_activation_memory() -> None:
    mesh = Mesh(dp_shard=16)
    none, sel, full = (_est(mesh=mesh, default=LayerStrategy(sharding="zero3", recompute=r))
                       for r in ("none", "selective", "full"))
    assert full.stages[0].activations < none.stages[0].activations
    assert full.step_time_s > none.step_time_s and full.hfu > full.mfu
    assert sel.stages[0].activations <= none.stages[0].activations


def test_tensor_and_context_parallel_split_activations() -> None:
    base = _est(mesh=Mesh(dp_shard=16), micro_batch=2)
    tp = _est(mesh=Mesh(dp_shard=8, tp=2), micro_batch=2, sequence_parallel=True)
    cp = _est(mesh=Mesh(dp_shard=8, cp=2), micro_batch=2)
    assert tp.stages[0].activations == pytest.approx(base.stages[0].activations / 2, rel=0.02)
    assert cp.stages[0].activations == pytest.approx(base.stages[0].activations / 2, rel=1e-9)
    assert tp.time.comm["tp"] > 0 and cp.time.comm.get("cp", 0) >= 0


def test_optimizer_offload_moves_states_to_the_host() -> None:
    on = _est(mesh=Mesh(dp_shard=16), default=LayerStrategy(sharding="zero1"))
    off = _est(mesh=Mesh(dp_shard=16), default=LayerStrategy(sharding="zero1", offload="optimizer"))
    assert off.stages[0].optimizer == 0 and on.stages[0].optimizer > 0
    assert off.time.offload > 0


def test_operator_splitting_shrinks_the_gathered_buffer() -> None:
    g = load_model("gpt2-xl", 1024)
    c = parse_cluster("8xa100-80gb")
    w = Workload(seq_len=1024, global_batch=8)
    whole = estimate(g, c, Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding="zero3")), w)
    split = estimate(g, c, Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding="zero3", split=4)), w)
    assert split.stages[0].buffers < whole.stages[0].buffers
    assert split.step_time_s >= whole.step_time_s  # more, smaller collectives and GEMMs


def test_collectives_pay_the_scale_out_tier_when_they_span_nodes() -> None:
    dev = DeviceModel(parse_cluster("64xh100"))
    inside = dev.collective_time("all_reduce", 1e9, AxisGroup(8, 1))
    across = dev.collective_time("all_reduce", 1e9, AxisGroup(8, 8))  # one rank per node
    hier = dev.collective_time("all_reduce", 1e9, AxisGroup(64, 1))
    assert inside < hier < across
    ring = 2 * 7 / 8 * 1e9 / (450e9 * dev.acc.busbw_efficiency)
    assert inside == pytest.approx(ring + 2 * 3 * 3e-6)


def test_stage_assignment_puts_embedding_first_and_head_last() -> None:
    s = Strategy(mesh=Mesh(pp=4, dp_shard=4))
    stages = stage_units(G, s)
    assert [len([u for u, _ in st if u.startswith("layers.")]) for st in stages] == even_split(32, 4) == [8] * 4
    assert stages[0][0][0] == "embedding" and stages[-1][-1][0] == "head"
    assert even_split(10, 4) == [2, 3, 3, 2]


def test_same_inputs_same_report() -> None:
    a = _est(mesh=Mesh(pp=2, dp_shard=4, tp=2), schedule="1f1b").to_dict()
    b = _est(mesh=Mesh(pp=2, dp_shard=4, tp=2), schedule="1f1b").to_dict()
    assert a == b


def test_attention_kernel_prices_flash_attention_by_generation() -> None:
    """FlashAttention-2 on a Hopper GPU runs at the file's fraction of the peak, the Hopper-native
    kernel faster; an A100 has no Hopper-native kernel: auto means flash2 there, flash3 is an error."""
    dev = DeviceModel(C)
    h100 = dev.acc.attention_efficiency
    assert dev.acc.attention_kernel("auto") == "flash3"
    t2 = dev.attention_time(1e18, causal=True, kernel="flash2")
    t3 = dev.attention_time(1e18, causal=True, kernel="flash3")
    assert t2 / t3 == pytest.approx(h100["flash3"] / h100["flash2"], rel=1e-6)
    assert dev.attention_time(1e18, causal=True) == t3
    assert dev.attention_time(1e18, causal=False, kernel="flash2") == pytest.approx(2 * t2, rel=1e-6)
    w2 = Workload(seq_len=4096, global_batch=32, attention_kernel="flash2")
    s = Strategy(mesh=Mesh(dp_shard=16))
    r2, r3 = estimate(G, C, s, w2), estimate(G, C, s, W)
    assert r2.step_time_s > r3.step_time_s and r2.memory_peak_gib == r3.memory_peak_gib
    a100 = parse_cluster("8xa100-80gb")
    assert a100.accelerator.attention_kernel("auto") == "flash2"
    with pytest.raises(ShardplanError, match="'flash3' is not available on 'a100-80gb'"):
        estimate(G, a100, Strategy(mesh=Mesh(dp_shard=8)), Workload(seq_len=4096, global_batch=8,
                                                                      attention_kernel="flash3"))


def test_eager_attention_is_two_gemms_and_passes_over_the_scores() -> None:
    """gpt2's eager attention computes the whole s x s (causal or not) and reads and writes the scores
    four times (scale, mask, softmax, dropout); flash attention skips the masked half at its own rate."""
    from dataclasses import replace

    from costmodel.configs import ConfigArrays
    from costmodel.node_costs import node_times
    from profiler.models import resolve_config
    from profiler.transformer import build_graph

    cfg = resolve_config("gpt2")
    assert cfg.attention_impl == "eager" and cfg.dropout
    eager = next(n for n in build_graph(cfg, 1024).nodes if n.kind == "attention")
    flash = next(n for n in build_graph(replace(cfg, attention_impl="flash", dropout=0.0), 1024).nodes
                 if n.kind == "attention")
    dev, s, w = DeviceModel(parse_cluster("8xh100")), Strategy(), Workload(seq_len=1024, global_batch=8)
    scores = 2 * 12 * 1024 * 1024
    assert eager.mem_bytes == 8 * scores and eager.fwd_flops == flash.fwd_flops
    fwd, bwd = (float(x[0]) for x in node_times(eager, dev, ConfigArrays.of_strategy(s), w))
    assert fwd == pytest.approx(dev.gemm_time(eager.fwd_flops) + dev.memory_time(8 * scores, "softmax"))
    assert bwd == pytest.approx(dev.gemm_time(eager.fwd_flops, backward=True)
                                + dev.memory_time(8 * scores, "softmax", backward=True))
    assert fwd > float(node_times(flash, dev, ConfigArrays.of_strategy(s), w)[0][0])


def test_fp32_training_doubles_activation_bytes_but_not_the_loss() -> None:
    from costmodel.units import unit_cost

    g = load_model("llama3-8b", 1024)
    units = dict(g.blocks())
    dev, s = DeviceModel(parse_cluster("8xcpu")), Strategy()
    half, full = (Workload(seq_len=1024, global_batch=8, precision=p) for p in ("bf16", "fp32"))
    for name in ("layers.0", "head"):
        a = unit_cost(name, units[name], dev, s, half)
        b = unit_cost(name, units[name], dev, s, full)
        loss = sum(n.act_saved_bytes for n in units[name] if n.kind == "loss")
        assert b.activations - 2 * a.activations == pytest.approx(-loss)


def test_loss_and_gradient_buffers_follow_the_framework() -> None:
    """Eager cross-entropy holds two fp32 logit-sized gradients beside the kept softmax (2x its
    activations) where a fused kernel holds the bf16 logits (1/2x); fp32 gradient buffers hold
    4 bytes per parameter where 16-bit ones hold 2. (Two micro-batches: the peak is where the loss
    runs, gradients of the first beside the second's activations.)"""
    g, cl = load_model("llama3-8b", 4096), parse_cluster("8xh100")
    s = Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding="zero1"))

    def stage(**kw: str):  # type: ignore[no-untyped-def]
        return estimate(g, cl, s, Workload(seq_len=4096, global_batch=16, **kw)).stages[0]  # type: ignore[arg-type]

    eager, fused = stage(), stage(cross_entropy="fused")
    assert eager.phase == fused.phase == "backward"
    price = UnitPricer(DeviceModel(cl), s, Workload(seq_len=4096, global_batch=16))
    head = price("head", dict(g.blocks())["head"]).activations
    assert eager.buffers - fused.buffers == pytest.approx(1.5 * head, rel=1e-12)
    assert head == pytest.approx(4 * 4096 * g.config["vocab"], rel=0.05)  # mostly the fp32 softmax
    half = stage(grad_dtype="bf16")
    assert eager.grad_bytes == 2 * half.grad_bytes and eager.param_bytes == half.param_bytes


def test_overlapped_communication_costs_its_interference_fraction() -> None:
    from costmodel.constants import CostConstants

    c = CostConstants(comm_interference=0.25)
    assert c.exposed(2.0, 1.0) == pytest.approx(1.25)  # 1 s sticks out, the hidden 1 s costs 0.25
    assert c.exposed(1.0, 3.0) == pytest.approx(0.25)  # all hidden: a quarter of it still costs
    assert CostConstants(comm_interference=0.0).exposed(1.0, 3.0) == 0.0
    import numpy as np

    assert np.allclose(c.exposed(np.array([2.0, 1.0]), np.array([1.0, 3.0])), [1.25, 0.25])
    with pytest.raises(ShardplanError, match="comm_interference"):
        CostConstants(comm_interference=1.5)
    # FSDP over 16 GPUs: the gathers hide under compute, so the step grows by κ of their time only
    mesh, z3 = Mesh(dp_shard=16), LayerStrategy(sharding="zero3")
    times = {}
    for k in (0.0, 0.5):
        dev = DeviceModel(C, constants=CostConstants(comm_interference=k))
        times[k] = estimate(G, C, Strategy(mesh=mesh, default=z3), W, device=dev)
    free, busy = times[0.0], times[0.5]
    assert busy.step_time_s > free.step_time_s
    assert busy.time.comm["dp"] > free.time.comm["dp"]
    assert busy.time.compute == free.time.compute


def test_receive_buffers_follow_the_trainer() -> None:
    """The same pipeline plan: torch's PipelineStage keeps a receive buffer per micro-batch beyond the
    in-flight activations, DeepSpeed one each way, Megatron-LM and nanotron none; time is unchanged."""
    from costmodel.pipeline import recv_buffers

    g, cl = load_model("llama3-8b", 4096), parse_cluster("16xh100")
    s = Strategy(mesh=Mesh(pp=4, dp_shard=4), micro_batch=1, schedule="1f1b")
    reports = {k: estimate(g, cl, s, Workload(seq_len=4096, global_batch=64, recv_buffers=k))
               for k in ("per_micro_batch", "one", "none")}
    mem = {k: r.memory_peak_gib for k, r in reports.items()}
    assert mem["per_micro_batch"] > mem["one"] > mem["none"]
    assert len({r.step_time_s for r in reports.values()}) == 1
    # rank 1 of 4 with 16 micro-batches, 3 of them in flight: 13 input and 16 gradient buffers beyond them
    assert recv_buffers("1f1b", 1, 4, 16.0) == (13.0, 16.0)
    assert recv_buffers("1f1b", 1, 4, 16.0, kind="one") == (1.0, 1.0)
    assert recv_buffers("1f1b", 1, 4, 16.0, kind="none") == (0.0, 0.0)


def _ring(seq: int, cp: int, rotate: str, cluster: str = "16xh100", tp: int = 1) -> tuple[float, DeviceModel]:
    """Exposed CP seconds of one Llama-3-8B block per micro-batch, spec sheet without interference."""
    from costmodel.constants import CostConstants
    from costmodel.units import unit_cost

    cl = parse_cluster(cluster)
    dev = DeviceModel(cl, constants=CostConstants(comm_interference=0.0))
    g = load_model("llama3-8b", seq)
    nodes = [n for n in g.nodes if n.block == 0]
    s = Strategy(mesh=Mesh(cp=cp, tp=tp, dp_shard=cl.world_size // (cp * tp)), cp_rotate=rotate,
                 sequence_parallel=tp > 1)
    return unit_cost("layers.0", nodes, dev, s, Workload(seq_len=seq, global_batch=cl.world_size)).comm_cp, dev


def test_ring_attention_hides_each_step_under_its_attention() -> None:
    """With long blocks every point-to-point step hides under the step's attention: what is left is
    the extra attention launches and the merges of the partial outputs (fp32, read twice, written
    once), exactly. Gathering instead leaves dK/dV's reduce-scatter exposed; and short blocks
    (1,024 tokens a rank over 16 ranks, the ring leaving the node) expose the transfers."""
    seq, cp = 32768, 2
    long_p2p, dev = _ring(seq, cp, "alltoall")
    out = 2 * seq // cp * 4096  # bf16 output of the rank's queries
    launch = dev.c.gemm_overhead_s
    assert long_p2p == pytest.approx((cp - 1) * (dev.memory_time(3 * 2 * out) + launch) + (cp - 1) * launch,
                                     rel=1e-9)
    long_ag, _ = _ring(seq, cp, "allgather")
    assert long_ag > long_p2p
    short, _ = _ring(16384, 16, "alltoall")
    per_token_short = short / (16384 / 16)
    per_token_long = long_p2p / (seq / cp)
    assert per_token_short > 5 * per_token_long
