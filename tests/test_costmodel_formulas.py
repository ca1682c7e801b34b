"""The cost model against closed-form results from the literature, exactly."""

from __future__ import annotations

import pytest

from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer, estimate, stage_units
from profiler.graph import LayerGraph, LayerNode
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import load_model
from profiler.transformer import build_graph
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload


def _one_layer_graph(params: int) -> LayerGraph:
    node = LayerNode(name="layers.0.fc", kind="linear", block=0, block_type="decoder", params=params,
                     fwd_flops=2.0 * params, bwd_flops=4.0 * params, tp="column", dims={"in": 1, "out": params})
    return LayerGraph(model_id="psi", seq_len=1, nodes=[node])


@pytest.mark.parametrize("sharding,gb", [("replicate", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)])
def test_zero_paper_model_state_grid(sharding: str, gb: float) -> None:
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam, 16-bit
    gradients); with fp32 gradient buffers (the default) each unsharded gradient byte pair doubles."""
    g = _one_layer_graph(7_500_000_000)
    s = Strategy(mesh=Mesh(dp_shard=64), default=LayerStrategy(sharding=sharding))
    cl = parse_cluster("64xa100-80gb")
    r = estimate(g, cl, s, Workload(seq_len=1, global_batch=64, grad_dtype="bf16"))
    st = r.stages[0]
    states = st.param_bytes + st.grad_bytes + st.optim_bytes
    assert round(states / 1e9, 2 if gb < 10 else 1) == gb
    fp32 = estimate(g, cl, s, Workload(seq_len=1, global_batch=64)).stages[0]
    assert fp32.grad_bytes == 2 * st.grad_bytes and fp32.param_bytes == st.param_bytes


@pytest.mark.parametrize("sharding", ["zero3", "zero3_keep"])
def test_fsdp_keeps_the_fp32_master_as_the_sharded_parameter(sharding: str) -> None:
    """FSDP's sharded parameter is the fp32 master: under bf16 its sharded states are fp32 training's
    (4 + 4 + 8 bytes per parameter over the shards, as the runtime measures in
    test_runtime_parity.test_bf16_mixed_precision_keeps_fp32_master_weights), 2 bytes a parameter
    less than DeepSpeed's 16-bit shard beside the optimizer's master; zero3_keep's gathered copy is
    the whole 16-bit model beside the fp32 shard."""
    g = _one_layer_graph(64_000_000)
    s = Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding=sharding))
    cl = parse_cluster("8xh100")
    w = Workload(seq_len=1, global_batch=8, zero3_master="parameter")
    fsdp = estimate(g, cl, s, w).stages[0]
    fp32 = estimate(g, cl, s, w.model_copy(update={"precision": "fp32"})).stages[0]
    ds = estimate(g, cl, s, w.model_copy(update={"zero3_master": "optimizer"})).stages[0]
    n = 64_000_000 // 8
    assert (fsdp.param_bytes, fsdp.grad_bytes, fsdp.optim_bytes) == (4 * n, 4 * n, 8 * n)
    assert (fsdp.param_bytes, fsdp.optim_bytes) == (fp32.param_bytes, fp32.optim_bytes)
    assert (ds.param_bytes, ds.optim_bytes) == (2 * n, 12 * n)
    kept = fsdp.params - ds.params  # bytes
    assert kept == pytest.approx(2 * n if sharding == "zero3" else 2 * n + 2 * n, rel=1e-9)


@pytest.mark.parametrize("sharding,batch,gathered", [
    ("zero3", 8, 2 * 2 + 4), ("zero3_keep", 8, 4), ("zero2", 8, 0),
    ("replicate", 8, 0),  # one micro-batch: each gradient is made once, no transient
    ("replicate", 16, 4), ("zero1", 16, 4),  # two: the second's new gradient beside the held one
])
def test_parameter_side_transient_of_a_unit(sharding: str, batch: int, gathered: int) -> None:
    """Per parameter of the (one-operator) unit: under ZeRO-3 the running and the prefetched bf16
    copy (not under zero3_keep, whose copy is a state) and, in backward, its fp32 unsharded gradient
    before the reduce-scatter; with whole gradients accumulating over micro-batches, the operator's
    new fp32 gradient beside the one held."""
    g = _one_layer_graph(1_000_000)
    s = Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding=sharding))
    price = UnitPricer(DeviceModel(parse_cluster("8xh100")), s, Workload(seq_len=1, global_batch=batch))
    assert price("layers.0", g.nodes).gathered == gathered * 1_000_000


@pytest.mark.parametrize("master,shard", [("parameter", 4), ("optimizer", 2)])
@pytest.mark.parametrize("keep,gathers", [("zero3", 2), ("zero3_keep", 1)])
def test_parameter_offload_moves_the_shards_every_micro_batch(keep: str, gathers: int, master: str,
                                                               shard: int) -> None:
    """FSDP2's CPU offload: each micro-batch copies the parameter shard it keeps up for every gather
    (FSDP's fp32 master, 4 bytes; a 16-bit shard where the optimizer keeps the master) and the fp32
    gradient shard down; optimizer offload moves gradients and parameters once a step."""
    psi, d, n_mb = 1_000_000, 8, 4
    g = _one_layer_graph(psi)
    dev = DeviceModel(parse_cluster("8xh100"))
    w = Workload(seq_len=1, global_batch=d * n_mb, zero3_master=master)

    def offload(sharding: str, mode: str) -> float:
        s = Strategy(mesh=Mesh(dp_shard=d), default=LayerStrategy(sharding=sharding, offload=mode))
        return UnitPricer(dev, s, w)("layers.0", g.nodes).offload

    hidden = 1 - dev.c.dp_overlap
    assert offload(keep, "params") == pytest.approx(n_mb * dev.host_time(psi / d * (shard * gathers + 4)) * hidden)
    assert offload("zero3", "optimizer") == pytest.approx(dev.host_time(psi / d * (4 + 2)) * hidden)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tsp_holds_the_whole_sequences_kv_and_weight_shards_in_flight(tp: int) -> None:
    """TSP (each of tp ranks holds 1/tp of the tokens and of the weights): attention needs the K/V of
    the whole sequence in every KV head, whatever tp (2 tensors x b x s x kv_heads x head_dim, bf16);
    the projections stream weight shards round the ring, so the largest operator's shard is in
    flight twice (computed with and sent on, arriving, bf16; with two ranks once: nothing goes on)
    and in backward its gradient accumulator twice (sent on, arriving, fp32). Megatron TP on the
    same mesh holds none of it."""
    cfg = TransformerConfig(name="llama-k", layers=2, hidden=2048, heads=16, kv_heads=4, vocab=32000,
                            max_seq=4096, ffn_hidden=5632, activation="swiglu", norm="rmsnorm", position="rope")
    seq, b = 4096, 2
    g = build_graph(cfg, seq)
    nodes = dict(g.blocks())["layers.0"]
    w = Workload(seq_len=seq, global_batch=8 // tp * b)  # one micro-batch: no gradient held beside a new one
    dev = DeviceModel(parse_cluster("8xh100"))

    def gathered(mode: str) -> float:
        s = Strategy(mesh=Mesh(tp=tp, dp_shard=8 // tp), micro_batch=b, tp_mode=mode)  # type: ignore[arg-type]
        return UnitPricer(dev, s, w)("layers.0", nodes).gathered

    kv = 2 * b * seq * cfg.kv_heads * cfg.head_dim * 2
    largest = cfg.hidden * 2 * cfg.ffn_hidden // tp  # the fused gate+up projection's shard
    assert gathered("megatron") == 0
    assert gathered("tsp") == kv + largest * ((2 if tp > 2 else 1) * 2 + 2 * 4)


def _gpt_block_acts(tp: int, sp: bool, recompute: str, seq: int = 2048, b: int = 4) -> tuple[float, dict]:
    cfg = TransformerConfig(name="gpt-k", layers=4, hidden=1024, heads=16, vocab=51200, max_seq=seq,
                            bias=True, dropout=0.1, attention_impl="eager")
    g = build_graph(cfg, seq)
    s = Strategy(mesh=Mesh(tp=tp, dp_shard=8 // tp), micro_batch=b, sequence_parallel=sp,
                 default=LayerStrategy(recompute=recompute))
    price = UnitPricer(DeviceModel(parse_cluster("8xa100-80gb")), s, Workload(seq_len=seq, global_batch=64))
    nodes = dict(g.blocks())["layers.1"]
    return price("layers.1", nodes).activations, {"s": seq, "b": b, "h": 1024, "a": 16}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_korthikanti_activation_formulas(tp: int) -> None:
    """Korthikanti et al. 2022, eqs. (1)-(5): bytes per layer in 16-bit training."""
    acts, d = _gpt_block_acts(tp, sp=False, recompute="none")
    s, b, h, a = d["s"], d["b"], d["h"], d["a"]
    if tp == 1:
        assert acts == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    assert acts == pytest.approx(s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)), rel=1e-12)
    if tp > 1:
        sp, _ = _gpt_block_acts(tp, sp=True, recompute="none")
        assert sp == pytest.approx(s * b * h / tp * (34 + 5 * a * s / h), rel=1e-12)
        sel, _ = _gpt_block_acts(tp, sp=True, recompute="selective")
        assert sel == pytest.approx(34 * s * b * h / tp, rel=1e-12)
        full_sp, _ = _gpt_block_acts(tp, sp=True, recompute="full")
        assert full_sp == pytest.approx(2 * s * b * h / tp, rel=1e-12)
    sel_nosp, _ = _gpt_block_acts(tp, sp=False, recompute="selective")
    assert sel_nosp == pytest.approx(s * b * h * (10 + 24 / tp), rel=1e-12)
    full, _ = _gpt_block_acts(tp, sp=False, recompute="full")
    assert full == pytest.approx(2 * s * b * h, rel=1e-12)


def test_model_flops_and_mfu_follow_the_megatron_formula() -> None:
    g = load_model("gpt3-175b", 2048)
    s = Strategy(mesh=Mesh(pp=8, tp=8, dp_replicate=16), schedule="1f1b", sequence_parallel=True,
                 default=LayerStrategy(sharding="zero1", recompute="full"))
    w = Workload(seq_len=2048, global_batch=1024)
    r = estimate(g, parse_cluster("1024xa100-80gb"), s, w)
    n_layers, h, v, seq, bsz = 96, 12288, 50257, 2048, 1024
    assert r.model_flops_per_step == pytest.approx(72 * bsz * seq * n_layers * h**2 * (1 + seq / (6 * h) + v / (12 * n_layers * h)))
    assert r.mfu == pytest.approx(r.model_flops_per_step / r.step_time_s / (1024 * 312e12))
    assert r.hfu > r.mfu  # full recomputation adds a forward pass
    assert r.tokens_per_s_per_gpu == pytest.approx(bsz * seq / r.step_time_s / 1024)


def test_pipeline_bubble_shrinks_with_interleaving_and_zero_bubble() -> None:
    g = load_model("llama3-70b", 4096)
    c = parse_cluster("64xh100")
    w = Workload(seq_len=4096, global_batch=64)
    times = {}
    for sched, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        s = Strategy(mesh=Mesh(pp=8, tp=8), schedule=sched, vpp=vpp, default=LayerStrategy(recompute="full"))
        times[sched] = estimate(g, c, s, w).time.bubble
    assert times["gpipe"] == pytest.approx(times["1f1b"])
    assert times["interleaved"] < times["1f1b"] and times["zb"] < times["1f1b"]


def test_memory_peak_is_the_worst_stage_and_1f1b_holds_fewer_microbatches_than_gpipe() -> None:
    g = load_model("llama3-8b", 4096)
    c = parse_cluster("8xh100")
    w = Workload(seq_len=4096, global_batch=32)
    gp = estimate(g, c, Strategy(mesh=Mesh(pp=4, tp=2), schedule="gpipe"), w)
    ofob = estimate(g, c, Strategy(mesh=Mesh(pp=4, tp=2), schedule="1f1b"), w)
    assert ofob.memory_peak_gib < gp.memory_peak_gib
    assert ofob.memory_peak_gib == pytest.approx(max(st.total for st in ofob.stages) / 1024**3)
    acts = [st.activations for st in ofob.stages]
    assert acts[0] > acts[-1]  # the first stage keeps p micro-batches in flight, the last one


@pytest.mark.parametrize("seq,batch,phase", [
    (1024, 4, "backward"),  # one micro-batch per rank: gradients replace activations
    (1024, 8, "backward"),  # two: the first one's gradients beside the second's activations
    (128, 4, "end of backward"),  # few activations: every gradient plus the tied sum is the peak
])
def test_memory_peak_is_the_larger_of_two_moments(seq: int, batch: int, phase: str) -> None:
    """Backward's start (activations saved; gradients too only when micro-batches accumulate) or
    its end (every gradient, the tied head's gradient summed into the embedding's): exactly."""
    g = load_model("gpt2", seq)  # a head tied to the embedding
    cl = parse_cluster("4xh100")
    w = Workload(seq_len=seq, global_batch=batch)
    s = Strategy(mesh=Mesh(dp_shard=4), micro_batch=1, default=LayerStrategy(sharding="replicate"))
    dev = DeviceModel(cl)
    price = UnitPricer(dev, s, w)
    units = [price(n, nodes) for n, nodes in g.blocks()]
    params, grads, optim = (sum(getattr(u, f) for u in units) for f in ("state_params", "state_grads", "state_optim"))
    acts = sum(u.activations for u in units)
    bucket = dev.c.dp_bucket_bytes
    gathered = max(u.gathered for u in units)  # two micro-batches: the largest new gradient beside the held one
    assert (gathered > 0) == (batch // 4 > 1)
    run = params + optim + (grads if batch // 4 > 1 else 0.0) + acts + gathered + bucket
    run += units[-1].activations * w.loss_buffer
    tied = g.config["vocab"] * g.config["hidden"]
    end = params + optim + grads + gathered + bucket + 2 * tied * 4  # fp32 gradients
    st = estimate(g, cl, s, w).stages[0]
    assert st.total - st.overhead == pytest.approx(max(run, end), rel=1e-12)
    assert st.phase == phase == ("backward" if run >= end else "end of backward")
    assert st.grad_bytes == pytest.approx(grads, rel=1e-6)  # the state is reported whole either way


@pytest.mark.parametrize("model,kwargs,message", [
    ("llama2-13b", {"mesh": Mesh(tp=3, dp_shard=1)}, "does not match the cluster's 8 GPUs"),
    ("gpt2", {"mesh": Mesh(tp=8)}, "tp=8 does not divide the 12 attention heads"),
    ("llama3-8b", {"mesh": Mesh(tp=8, ep=1)}, None),  # 8 KV heads
    ("mixtral-8x7b", {"mesh": Mesh(ep=8, dp_shard=8)}, None),
    ("qwen3-235b-a22b", {"mesh": Mesh(ep=8, dp_shard=8)}, None),
    ("llama2-13b", {"mesh": Mesh(ep=2, dp_shard=4, tp=2)}, r"ep=2\) needs a mixture-of-experts model"),
    ("llama2-13b", {"mesh": Mesh(pp=8), "micro_batch": 1}, None),
])
def test_constraint_violations_name_the_constraint_and_values(model: str, kwargs: dict, message: str | None) -> None:
    g = load_model(model, 4096)
    c = parse_cluster("8xh100")
    s = Strategy(**kwargs)
    if message is None:
        estimate(g, c, s, Workload(seq_len=4096, global_batch=8))
        return
    with pytest.raises(ShardplanError, match=message):
        estimate(g, c, s, Workload(seq_len=4096, global_batch=8))


def test_batch_not_divisible_and_too_many_stages() -> None:
    g = load_model("gpt2", 1024)
    c = parse_cluster("16xa100-80gb")
    with pytest.raises(ShardplanError, match="global batch 12 is not divisible by dp\\*micro_batch = 16\\*1"):
        estimate(g, c, Strategy(mesh=Mesh(dp_shard=16)), Workload(seq_len=1024, global_batch=12))
    with pytest.raises(ShardplanError, match="16 stages for only 12 layers"):
        estimate(g, c, Strategy(mesh=Mesh(pp=16)), Workload(seq_len=1024, global_batch=16))


def test_sequence_parallel_prices_every_blocking_collective_the_runtime_issues() -> None:
    """A GPT layer under TP 2 with sequence parallel: each of the 2 row-parallel all-reduces per pass
    is an all-gather + a reduce-scatter (one more wait each), and the 6 whole-parameter gradients
    (2 LayerNorms' weight and bias, 2 row biases) are all-reduced over TP every micro-batch."""
    from costmodel.gradients import sp_partial_grads
    from costmodel.units import unit_cost
    from profiler.profile_schema import CommFit, DeviceInfo, Profile

    alpha, beta, wait = 1e-4, 1e-9, 2e-3
    prof = Profile(device=DeviceInfo(kind="cpu", name="test cpu", torch_version="x", threads=1, hostname="h",
                                     created="now"),
                   comm=[CommFit(collective=c, world=2, backend="gloo", alpha_s=alpha, beta_s_per_byte=beta,
                                 median_rel_error=0.0, points=[(1.0, alpha)], wait_s=wait)
                         for c in ("all_reduce", "reduce_scatter")])
    g = load_model("gpt2", 128)
    layer = [n for n in g.nodes if n.block == 0]
    assert [sp_partial_grads(n) for n in layer if sp_partial_grads(n)[0]] == [(2, 1536), (1, 768), (2, 1536), (1, 768)]
    dev = DeviceModel(parse_cluster("2xcpu"), prof)
    w = Workload(seq_len=128, global_batch=2, precision="fp32")

    def tp_comm(sp: bool) -> float:
        s = Strategy(mesh=Mesh(tp=2), sequence_parallel=sp, micro_batch=2)
        return unit_cost("layers.0", layer, dev, s, w).comm["tp"]

    act_msg = 4.0 * 2 * 128 * 768  # fp32 activations of a micro-batch of 2
    plain = 2 * 2 * (alpha + beta * act_msg + wait)  # 2 row-parallel all-reduces, forward and backward
    assert tp_comm(False) == pytest.approx(plain, rel=1e-12)
    assert tp_comm(True) == pytest.approx(plain + 2 * 2 * wait + 6 * (alpha + beta * 4608 / 6 * 4 + wait), rel=1e-12)


def test_a_replicated_gradient_all_reduce_costs_what_the_runtime_issues() -> None:
    """On CPU the runtime all-reduces every gradient of at least 1 MiB alone and the smaller ones
    together in 1 MiB buffers (``runtime.zero``). The cost model counts the big tensors from the
    graph: as many as the runtime's own GPT-2 holds, each one α more (back to back, the sync waits
    for its partners once); the small ones are priced as their share of a buffer, within one
    collective of the runtime's whole buffers."""
    import math

    import torch

    from costmodel.device import DeviceModel
    from profiler.profile_schema import CommFit, DeviceInfo, Profile
    from runtime.model import build, spec_for
    from runtime.zero import COALESCE_BYTES

    with torch.device("meta"):
        model, _ = build(spec_for("gpt2"))
    sizes = [p.numel() * 4 for p in model.parameters()]  # fp32 gradients
    big = sum(b >= COALESCE_BYTES for b in sizes)
    small = sum(b for b in sizes if b < COALESCE_BYTES)
    assert big == 2 + 4 * 12  # token and position tables, four weights a layer
    alpha, beta = 1e-3, 1e-9
    info = DeviceInfo(kind="cpu", name="test cpu", torch_version="x", threads=1, hostname="h", created="now")

    def sync(wait: float) -> float:
        prof = Profile(device=info, comm=[CommFit(collective="all_reduce", world=4, backend="gloo", alpha_s=alpha,
                                                  beta_s_per_byte=beta, median_rel_error=0.0, points=[(1.0, alpha)],
                                                  wait_s=wait)])
        assert DeviceModel(cl, prof).c.grad_coalesce_bytes == COALESCE_BYTES
        return estimate(graph, cl, s, w, profile=prof).time.comm["dp"]

    cl, graph = parse_cluster("4xcpu"), load_model("gpt2", 128)
    s = Strategy(mesh=Mesh(dp_shard=4), micro_batch=2, default=LayerStrategy(sharding="replicate"))
    w = Workload(seq_len=128, global_batch=8, precision="fp32")
    collectives = (sync(0.0) - beta * sum(sizes)) / alpha
    assert collectives == pytest.approx(big + small / COALESCE_BYTES, rel=1e-9)
    assert 0 <= big + math.ceil(small / COALESCE_BYTES) - collectives < 1
    # the wait is paid by each unit's own sync, not again by the collectives it is cut into
    units = sum(any(n.params for n in nodes) for st in stage_units(graph, s) for _, nodes in st)
    assert units == 14  # embedding, 12 blocks, the final norm with the (tied) head
    assert sync(2e-3) - sync(0.0) == pytest.approx(units * 2e-3, rel=1e-9)


@pytest.mark.parametrize("sharding,gathers", [("zero3", 2), ("zero3_keep", 1)])
def test_fsdp_prices_its_copies_around_each_collective(sharding: str, gathers: int) -> None:
    """FSDP2 copies each all-gather's flat output into the parameters and the gradients into each
    reduce-scatter's flat input (a read and a write of the unsharded bytes), every micro-batch, at
    the profile's memory bandwidth and unhidden."""
    from profiler.profile_schema import BwPoint, CommFit, ComputeProfile, DeviceInfo, Profile

    info = DeviceInfo(kind="cpu", name="test cpu", torch_version="x", threads=1, hostname="h", created="now")
    bw = 2e9
    compute = ComputeProfile(dtype="fp32", bandwidth={"elementwise": [BwPoint(bytes=1e6, seconds=1e6 / bw,
                                                                              bytes_per_s=bw, bwd_s=2e6 / bw)]})
    fits = [CommFit(collective=k, world=2, backend="gloo", alpha_s=1e-3, beta_s_per_byte=1e-9, median_rel_error=0.0,
                    points=[(1.0, 1e-3)]) for k in ("all_gather", "reduce_scatter")]
    prof = Profile(device=info, compute=compute, comm=fits)
    g = _one_layer_graph(1_000_000)
    cl = parse_cluster("2xcpu")
    dev = DeviceModel(cl, prof)
    w = Workload(seq_len=1, global_batch=4, precision="fp32")
    s = Strategy(mesh=Mesh(dp_shard=2), micro_batch=1, default=LayerStrategy(sharding=sharding))
    dp = estimate(g, cl, s, w, device=dev).time.comm["dp"]
    full = grads = 4 * 1_000_000  # fp32 parameters gathered, fp32 gradients reduced
    collectives = gathers * (1e-3 + 1e-9 * full) + (1e-3 + 1e-9 * grads)
    copies = (gathers * 2 * full + 2 * grads) / (bw * dev.share)
    assert dp == pytest.approx(2 * (collectives + copies), rel=1e-9)  # two micro-batches


@pytest.mark.parametrize("sharding,held", [("replicate", 1), ("zero1", 1), ("zero2", 4), ("zero3", 4)])
def test_gradient_accumulation_adds_three_passes_over_the_held_gradients(sharding: str, held: int) -> None:
    """Where autograd accumulates (``grad_accumulate_passes`` 3, the CPU file: the runtime's
    AccumulateGrad reads both gradients and writes one), every micro-batch after a step's first
    adds 3 passes over the gradients the rank holds — whole, or the ZeRO-2/3 shards — at an add's
    bandwidth; none with one micro-batch, none where GEMMs accumulate in place (GPU default)."""
    from costmodel.constants import CostConstants

    g = _one_layer_graph(1_000_000)
    cl = parse_cluster("4xcpu")
    dev = DeviceModel(cl)
    assert dev.c.grad_accumulate_passes == 3 and CostConstants().grad_accumulate_passes == 0
    node = g.nodes[0]
    for batch, n_mb in ((4, 1), (16, 4)):
        s = Strategy(mesh=Mesh(dp_shard=4), micro_batch=1, default=LayerStrategy(sharding=sharding))
        w = Workload(seq_len=1, global_batch=batch, precision="fp32")
        u = UnitPricer(dev, s, w)("layers.0", [node])
        expect = 3 * 1_000_000 * 4 / held * dev.memory_time(1.0, "add") * (n_mb - 1) / n_mb
        assert u.accumulate == pytest.approx(expect, rel=1e-12)
        assert u.time == pytest.approx(u.fwd + u.bwd + u.recompute + u.accumulate + sum(u.comm.values()), rel=1e-12)
    gpu = DeviceModel(parse_cluster("8xh100"))
    s = Strategy(mesh=Mesh(dp_shard=8), micro_batch=1)
    assert UnitPricer(gpu, s, Workload(seq_len=1, global_batch=64))("layers.0", [node]).accumulate == 0.0


def test_embedding_backward_zeroes_the_whole_table_each_micro_batch() -> None:
    """PyTorch's dense embedding backward zeroes a gradient of the whole (local) table before adding
    the looked-up rows: a profile's points give the two slopes (a fit, both ≥ 0), the cost model
    charges the table part per micro-batch on every rank that holds the table — a quarter of it per
    rank under vocabulary-parallel TP 4 — and spec sheets one write of the table."""
    from costmodel.configs import ConfigArrays
    from costmodel.node_costs import node_times, traffic_width
    from profiler.profile_schema import BwPoint, ComputeProfile, DeviceInfo, Profile

    def prof(points: list[tuple[float, float]]) -> Profile:  # (forward bytes, backward s), table 1000 x 512 fp32
        bw = [BwPoint(bytes=b, seconds=b / 1e9, bytes_per_s=1e9, bwd_s=t, shape=[int(b // 4096), 1000, 512])
              for b, t in points]
        return Profile(device=DeviceInfo(kind="cpu", name="t", torch_version="2.13.0", threads=1, hostname="h",
                                         created="2026-01-01T00:00:00+00:00"),
                       compute=ComputeProfile(dtype="fp32", bandwidth={"embedding": bw}))

    table = 1000 * 512 * 4
    fit = prof([(1e6, 2e-9 * 1e6 + 3e-9 * table), (4e6, 2e-9 * 4e6 + 3e-9 * table)]).embedding_backward()
    assert fit == pytest.approx((2e-9, 3e-9), rel=1e-9)
    assert prof([(1e6, 1e-3)]).embedding_backward() is None  # one size: no fit, the ratio stands in
    a, b = prof([(1e6, 2e-3), (4e6, 1e-3)]).embedding_backward()  # backward shrinking with the lookups
    assert a == 0.0 and b > 0
    g = load_model("gpt2", 128)
    embed = next(n for n in g.nodes if n.kind == "embedding")
    w = Workload(seq_len=128, global_batch=8, precision="fp32")
    tables = 50257 * 768 // 4 + 1024 * 768  # the token table split four ways, the position table whole
    for dev in (DeviceModel(parse_cluster("4xcpu"), prof([(1e6, 1e-3), (4e6, 2e-3)])), DeviceModel(parse_cluster("4xh100"))):
        s = Strategy(mesh=Mesh(tp=4), micro_batch=2)
        nbytes = embed.mem_bytes * 2 / 4 * traffic_width(embed, "fp32")
        f, bwd = (float(x[0]) for x in node_times(embed, dev, ConfigArrays.of_strategy(s), w))
        if dev.profile is not None:
            a, b = dev.profile.embedding_backward()
            assert bwd == pytest.approx((a * nbytes + b * tables * 4) / dev.share, rel=1e-12)
        else:
            assert bwd == pytest.approx(dev.memory_time(nbytes, "embedding", backward=True)
                                        + tables * 4 / (3.35e12), rel=1e-12)  # H100: 3.35 TB/s
