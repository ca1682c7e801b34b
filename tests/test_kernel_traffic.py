"""Kernels by class: the bytes memory-bound kernels move (counted from ATen ops) and what the cost
model charges for them; the attention kernel priced by its shape."""

from __future__ import annotations

import pytest

from costmodel.configs import ConfigArrays
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.kernels import EAGER_BYTES, FUSED_BYTES, MINIMAL_BYTES, RESIDUAL_BYTES, kernel_class, traffic
from costmodel.node_costs import node_times
from profiler.graph import LayerGraph
from profiler.hardware import parse_cluster
from profiler.kernel_traffic import count, eager_counts, gelu, norm_fused
from profiler.models import load_model
from vocab.strategy import Mesh, Strategy, Workload


def test_eager_bytes_are_the_counted_aten_traffic() -> None:
    """The table holds what the eager modules' ATen ops move, per element of their input, to the byte
    (per-row statistics and the weight are below a byte at a width of 4096)."""
    counted = eager_counts()
    for cls, t in counted.items():
        assert (round(t.forward), round(t.backward)) == EAGER_BYTES[cls], cls
    assert (counted["rmsnorm"].forward_ops, counted["rmsnorm"].backward_ops) == (8, 16)
    assert (counted["swiglu"].forward_ops, counted["swiglu"].backward_ops) == (2, 3)


def test_single_native_kernels_move_the_minimal_bytes() -> None:
    """A native layer norm or GELU is one kernel each way: its input in and its output out forward
    (the graph's minimal traffic), input and gradient in and gradient out backward."""
    ln = count(lambda x, g: norm_fused(x, g), (256, 4096), (4096,))
    assert (round(ln.forward), round(ln.backward)) == FUSED_BYTES["layernorm"] == FUSED_BYTES["rmsnorm"]
    assert round(ln.forward) == MINIMAL_BYTES["layernorm"]
    g = count(gelu, (256, 4096))
    assert (g.forward, g.backward) == FUSED_BYTES["gelu"] == EAGER_BYTES["gelu"]


def _graph(model: str) -> LayerGraph:
    return load_model(model, 1024)


def test_kernel_classes_of_the_graph_nodes() -> None:
    llama = {n.name: n for n in _graph("llama3-8b").nodes}
    gpt = {n.name: n for n in _graph("gpt2").nodes}
    assert kernel_class(llama["layers.0.attn_norm"]) == "rmsnorm"
    assert kernel_class(next(n for n in gpt.values() if n.kind == "norm")) == "layernorm"
    assert kernel_class(next(n for n in llama.values() if n.kind == "activation")) == "swiglu"
    assert kernel_class(next(n for n in gpt.values() if n.kind == "activation")) == "gelu"
    assert kernel_class(next(n for n in gpt.values() if n.kind == "loss")) == "cross_entropy"
    assert kernel_class(next(n for n in gpt.values() if n.kind == "linear")) is None


def test_traffic_per_stack() -> None:
    """An eager RMSNorm moves 9x its minimal bytes forward and 24x backward, plus the residual add it
    follows; fused, once each way; the loss follows the cross-entropy kernel, not the stack."""
    nodes = _graph("llama3-8b").nodes
    norm = next(n for n in nodes if n.kind == "norm")
    loss = next(n for n in nodes if n.kind == "loss")
    r = RESIDUAL_BYTES
    assert traffic(norm, "eager", "eager") == ((36 + r[0]) / 4, (96 + r[1]) / 4)
    assert traffic(norm, "fused", "eager") == ((4 + r[0]) / 4, (6 + r[1]) / 4)
    assert traffic(loss, "fused", "eager") == (14 / 8, 22 / 8)
    assert traffic(loss, "eager", "fused") == (2 / 8, 4 / 8)


def test_the_device_prices_a_norm_by_its_kernels_bytes() -> None:
    """Spec sheet: a norm's seconds are its kernels' bytes over the streaming bandwidth, exactly."""
    cluster = parse_cluster("8xh100-sxm")
    c = CostConstants()
    dev = DeviceModel(cluster, constants=c)
    norm = next(n for n in _graph("llama3-8b").nodes if n.kind == "norm")
    cfg = ConfigArrays.of_strategy(Strategy())
    rate = cluster.accelerator.hbm_tbps * 1e12 * c.memory_efficiency
    for kernels in ("eager", "fused"):
        w = Workload(seq_len=1024, global_batch=8, kernels=kernels)
        f, b = node_times(norm, dev, cfg, w)
        tf, tb = traffic(norm, kernels, "eager")
        assert float(f[0]) == pytest.approx(norm.mem_bytes * tf / rate, rel=1e-12)
        assert float(b[0]) == pytest.approx(norm.mem_bytes * tb / rate, rel=1e-12)


def test_attention_kernel_shape() -> None:
    """A causal flash kernel computes its diagonal tiles whole: n tiles of 128 query rows do
    n(n+1)/2 tiles for n²/2 of work; its linear work costs c/tokens of the quadratic work (twice
    when causal), c by phase; head dim 64 runs at the kernel's published fraction of 128."""
    from costmodel.device import FLASH_LINEAR_TOKENS, attention_shape_factor

    fwd, bwd = FLASH_LINEAR_TOKENS["fwd"], FLASH_LINEAR_TOKENS["bwd"]
    assert attention_shape_factor("flash2", 1024, 128, causal=True) == pytest.approx(8 / 9 / (1 + 2 * fwd / 1024))
    assert attention_shape_factor("flash2", 1024, 128, causal=False) == pytest.approx(1 / (1 + fwd / 1024))
    assert attention_shape_factor("flash2", 512, 128, False, "bwd") == pytest.approx(1 / (1 + bwd / 512))
    # the backward loses more than the forward at short lengths, causal more than full
    assert attention_shape_factor("flash2", 512, 128, True, "bwd") < attention_shape_factor("flash2", 512, 128, True)
    assert attention_shape_factor("flash3", 1e9, 64, causal=True) == pytest.approx(0.72)
    assert attention_shape_factor("flash3", 1e9, 90.5, causal=False) == pytest.approx(0.86, abs=1e-3)
    # context parallelism shortens each rank's queries: cp=8 at 8192 tokens prices 1024 per rank
    cluster = parse_cluster("8xh100-sxm")
    dev = DeviceModel(cluster, constants=CostConstants())
    attn = next(n for n in load_model("llama3-8b", 8192).nodes if n.kind == "attention")
    w = Workload(seq_len=8192, global_batch=8)
    one = node_times(attn, dev, ConfigArrays.of_strategy(Strategy()), w)[0][0]
    cp8 = node_times(attn, dev, ConfigArrays.of_strategy(Strategy(mesh=Mesh(cp=8))), w)[0][0]
    kernel = cluster.accelerator.attention_kernel("auto")
    ratio = attention_shape_factor(kernel, 8192, 128, True) / attention_shape_factor(kernel, 1024, 128, True)
    launch = dev.c.gemm_overhead_s  # per call, not per FLOP
    assert cp8 * 8 == pytest.approx((one - launch) * ratio + launch * 8, rel=1e-9)


def test_ulysses_attends_the_whole_sequence() -> None:
    """Ulysses gives each rank the whole sequence for 1/cp of the heads: its attention kernel runs at
    the full sequence's shape, so cp=8 Ulysses costs 1/8 of the unsplit attention (a ring's
    1,024-token blocks cost more: their diagonal tiles)."""
    cluster = parse_cluster("8xh100-sxm")
    dev = DeviceModel(cluster, constants=CostConstants())
    attn = next(n for n in load_model("llama3-8b", 8192).nodes if n.kind == "attention")
    w = Workload(seq_len=8192, global_batch=8)
    launch = dev.c.gemm_overhead_s
    one = node_times(attn, dev, ConfigArrays.of_strategy(Strategy()), w)[0][0]
    uly = node_times(attn, dev, ConfigArrays.of_strategy(Strategy(mesh=Mesh(cp=8), cp_mode="ulysses")), w)[0][0]
    ring = node_times(attn, dev, ConfigArrays.of_strategy(Strategy(mesh=Mesh(cp=8))), w)[0][0]
    assert uly - launch == pytest.approx((one - launch) / 8, rel=1e-9)
    assert ring > uly


def test_fp8_gemms_gain_by_size() -> None:
    """An fp8 GEMM runs at ``fp8_gemm_speedup`` times the bf16 rate with a larger fixed cost per call:
    large GEMMs approach the measured speed-up, small ones gain less, the smallest lose."""
    c = CostConstants()
    dev = DeviceModel(parse_cluster("8xh100-sxm"), constants=c)
    rate = dev.gemm_rate("bf16")
    for flops in (1e9, 1e11, 1e13):
        bf16, fp8 = dev.gemm_time(flops, "bf16"), dev.gemm_time(flops, "fp8")
        assert bf16 == pytest.approx(flops / rate + c.gemm_overhead_s, rel=1e-12)
        assert fp8 == pytest.approx(flops / (rate * c.fp8_gemm_speedup) + c.fp8_gemm_overhead_s, rel=1e-12)
    speedups = [dev.gemm_time(f, "bf16") / dev.gemm_time(f, "fp8") for f in (1e8, 1e10, 1e12, 1e14)]
    assert speedups == sorted(speedups) and speedups[0] < 1 < speedups[1] and speedups[-1] > 0.99 * c.fp8_gemm_speedup
    # an accelerator without fp8 runs the GEMM in bf16
    a100 = DeviceModel(parse_cluster("8xa100-80gb"), constants=c)
    assert a100.gemm_time(1e12, "fp8") == a100.gemm_time(1e12, "bf16")


def test_fp8_linear_pays_its_casts_and_the_head_stays_bf16() -> None:
    """An fp8 linear layer costs its fp8 GEMMs plus the casts (input and weight forward, output
    gradient backward, both orientations) at the stack's bytes per element; the output layer runs
    in bf16 and casts nothing."""
    from costmodel.kernels import FP8_CAST_BYTES, fp8_cast_elements
    from costmodel.node_costs import gemm_shape

    c = CostConstants()
    dev = DeviceModel(parse_cluster("8xh100-sxm"), constants=c)
    nodes = _graph("llama3-8b").nodes
    up = next(n for n in nodes if n.kind == "linear" and n.tp == "column")
    head = next(n for n in nodes if n.kind == "linear" and n.tp == "vocab")
    cfg = ConfigArrays.of_strategy(Strategy(micro_batch=2))
    bw = dev.acc.hbm_tbps * 1e12 * c.memory_efficiency
    ef, eb = fp8_cast_elements(gemm_shape(up, 2, 1, 1))
    assert ef == 2 * 1024 * up.dims["in"] + up.dims["out"] * up.dims["in"] and eb == 2 * 1024 * up.dims["out"]
    flops = up.fwd_flops * 2
    for kernels, per in FP8_CAST_BYTES.items():
        w = Workload(seq_len=1024, global_batch=8, precision="fp8", kernels=kernels)
        f, b = node_times(up, dev, cfg, w)
        assert float(f[0]) == pytest.approx(dev.gemm_time(flops, "fp8") + ef * per / bw, rel=1e-12)
        assert float(b[0]) == pytest.approx(dev.gemm_time(flops, "fp8", backward=True) + eb * per / bw, rel=1e-12)
    fp8 = node_times(head, dev, cfg, Workload(seq_len=1024, global_batch=8, precision="fp8"))
    bf16 = node_times(head, dev, cfg, Workload(seq_len=1024, global_batch=8, precision="bf16"))
    assert float(fp8[0][0]) == float(bf16[0][0]) and float(fp8[1][0]) == float(bf16[1][0])
    # an accelerator without fp8 runs the layer in bf16 and casts nothing
    a100 = DeviceModel(parse_cluster("8xa100-80gb"), constants=c)
    fp8 = node_times(up, a100, cfg, Workload(seq_len=1024, global_batch=8, precision="fp8"))
    bf16 = node_times(up, a100, cfg, Workload(seq_len=1024, global_batch=8, precision="bf16"))
    assert float(fp8[0][0]) == float(bf16[0][0]) and float(fp8[1][0]) == float(bf16[1][0])
