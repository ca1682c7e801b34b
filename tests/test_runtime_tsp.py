"""TSP (``tp_mode = tsp``, :mod:`runtime.tsp`): a block on the weight rings computes what the
unsharded block computes, outputs and gradients, on gloo ranks; what its rings send (pass by pass,
in bf16 under mixed precision, recomputation included) and hold is what the cost model's TSP
formulas price (``costmodel.units._Traffic.tsp_volumes``, ``_tsp_buffers``, ``tsp_weight_passes``);
and each step's next shard is in flight while the step computes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer
from costmodel.units import tsp_volumes, tsp_weight_passes
from profiler.hardware import parse_cluster
from profiler.transformer import build_graph
from runtime import checkpointing
from runtime.context_parallel import ContextShard, zigzag_index
from runtime.model import TINY_MODELS, AttentionCore, Transformer
from runtime.precision import to_dtype
from runtime.tsp import TspGroup, apply_tsp, shard_sizes
from vocab.strategy import Mesh, Strategy, Workload

MODEL = "tiny-llama"
B, S = 2, 32  # micro-batch, sequence
BLOCK = "1"


def _inputs(h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, h, generator=g), torch.randn(B, S, h, generator=g)


def _tsp_block(rank: int, world: int) -> tuple[torch.nn.Module, TspGroup, ContextShard]:
    torch.manual_seed(0)
    model = Transformer(TINY_MODELS[MODEL])
    tg = TspGroup(dist.group.WORLD, rank, world)
    apply_tsp(model, tg)
    cs = ContextShard(dist.group.WORLD, rank, world)
    for m in model.modules():
        if isinstance(m, AttentionCore):
            m.context = cs
    return model.layers[BLOCK], tg, cs


RECOMPUTE = ("none", "full", "selective")


class _Gathers(TorchDispatchMode):
    """Counts the all-gathers that run while active (outside selective checkpointing's cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += "all_gather_into_tensor" in str(func)
        return func(*args, **(kwargs or {}))


def _bf16_passes(rank: int, world: int) -> dict[str, dict]:
    """Per recomputation mode, a bf16 block's forward and backward: the weight bytes each pass sent,
    the accumulators' bytes, the K/V gathered, and the order of posts, computes and waits."""
    out = {}
    x, g = _inputs(TINY_MODELS[MODEL].hidden)
    idx = zigzag_index(S, rank, world)
    for mode in RECOMPUTE:
        block, tg, cs = _tsp_block(rank, world)
        to_dtype(list(block.parameters()), torch.bfloat16)
        checkpointing.wrap(block, mode, "cpu")
        tg.stats.trace = True
        xl = x[:, idx].to(torch.bfloat16).requires_grad_(True)
        y = block(xl)
        fwd_kv, fwd_events = cs.gathered, list(tg.stats.events)
        tg.stats.events = []
        with _Gathers() as gathers:  # the all-gathers backward runs (a recomputation's, not a cached one's)
            (y.float() * g[:, idx]).sum().backward()
        out[mode] = {"by_pass": dict(tg.stats.by_pass), "sent_g": tg.stats.sent_g, "kv": (fwd_kv, gathers.n),
                     "events": (fwd_events, list(tg.stats.events))}
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        block, tg, cs = _tsp_block(rank, world)
        x, g = _inputs(TINY_MODELS[MODEL].hidden)
        idx = zigzag_index(S, rank, world)
        xl = x[:, idx].clone().requires_grad_(True)
        y = block(xl)
        fwd = (tg.stats.sent_w, tg.stats.peak_w, cs.gathered)
        tg.stats.reset()
        (y * g[:, idx]).sum().backward()
        st = tg.stats
        bwd = (st.sent_w, st.sent_g, st.peak, st.peak_w, st.peak_g)
        grads = {n: p.grad for n, p in block.named_parameters()}
        torch.save({"idx": idx, "y": y.detach(), "dx": xl.grad, "grads": grads, "fwd": fwd, "bwd": bwd,
                    "bf16": _bf16_passes(rank, world)}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


#: how each weight of a block is cut over the ranks (dimension of the full tensor)
CUT_DIM = {"attn.out.weight": 1, "mlp.down.weight": 1}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world, start_method="spawn")
        return world, [torch.load(Path(tmp) / f"{r}.pt") for r in range(world)]


def test_a_block_on_the_rings_computes_the_unsharded_block(ranks: tuple[int, list[dict]]) -> None:
    world, got = ranks
    torch.manual_seed(0)
    ref = Transformer(TINY_MODELS[MODEL]).layers[BLOCK]
    x, g = _inputs(ref.attn.qkv.in_features)
    x.requires_grad_(True)
    y = ref(x)
    (y * g).sum().backward()
    for rank, r in enumerate(got):
        idx = r["idx"]
        torch.testing.assert_close(r["y"], y.detach()[:, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["dx"], x.grad[:, idx], rtol=1e-5, atol=1e-6)
        for name, p in ref.named_parameters():
            want = torch.tensor_split(p.grad, world, dim=CUT_DIM.get(name, 0))[rank]
            # each shard's gradient arrives home averaged over the ranks (their losses are means)
            torch.testing.assert_close(r["grads"][name] * world, want, rtol=1e-5, atol=1e-6, msg=name)


def _priced(world: int, precision: str) -> tuple[float, float, float, float]:
    """(weight bytes of a pass, accumulator bytes, K/V bytes of a pass, ring buffers) the cost model
    prices for the block on ``world`` TSP ranks at ``precision``."""
    nodes = dict(build_graph(TINY_MODELS[MODEL], S).blocks())[f"layers.{BLOCK}"]
    s = Strategy(mesh=Mesh(tp=world), tp_mode="tsp", micro_batch=B)
    w = Workload(seq_len=S, global_batch=B, precision=precision)
    wbytes, gbytes, kv = (float(a[0]) for a in tsp_volumes(nodes, ConfigArrays.of_strategy(s), w))
    buffers = UnitPricer(DeviceModel(parse_cluster(f"{world}xh100")), s, w)(f"layers.{BLOCK}", nodes).gathered
    return wbytes, gbytes, kv, float(buffers)


def test_the_rings_move_and_hold_what_the_cost_model_prices(ranks: tuple[int, list[dict]]) -> None:
    """Per rank and micro-batch of the fp32 run, in bytes as the cost model prices an fp32 workload:
    forward sends tp-1 of the tp weight shards (an all-gather's share), backward as many again and
    as many fp32 accumulators (a reduce-scatter's); attention gathers the whole sequence's K/V; in
    flight, two weight shards (one with two ranks) and two accumulators of the largest operator."""
    world, got = ranks
    cfg = TINY_MODELS[MODEL]
    wbytes, gbytes, kv, buffers = _priced(world, "fp32")
    share = (world - 1) / world  # what one rank sends of an all-gather or reduce-scatter
    fp32 = 4
    largest = max(shard_sizes(2 * cfg.ffn_hidden, world)) * cfg.hidden  # the MLP up projection's shard
    for r in got:
        sent_fwd, peak_fwd, kv_elems = r["fwd"]
        sent_w, sent_g, peak, peak_w, peak_g = r["bwd"]
        assert sent_fwd == share * wbytes
        assert sent_w == share * wbytes and sent_g == share * gbytes
        assert kv_elems * fp32 == kv
        assert peak_fwd == 2 * largest * fp32
        assert (peak_w, peak_g) == ((2 if world > 2 else 1) * largest * fp32, 2 * largest * fp32)
        assert peak == peak_w + peak_g
        assert buffers == kv + peak_w + peak_g


def test_bf16_rings_send_bf16_shards_and_fp32_accumulators_pass_by_pass(ranks: tuple[int, list[dict]]) -> None:
    """Under mixed precision each pass sends the bf16 weight bytes a bf16 workload prices; a unit
    that recomputes (full, or selective: its saved GEMM outputs do not spare the rings) runs a third
    pass inside backward, as ``tsp_weight_passes`` prices it; selective keeps the gathered K/V (the
    collective's output is saved), full gathers it again."""
    world, got = ranks
    wbytes, gbytes, kv, _ = _priced(world, "bf16")
    share = (world - 1) / world
    for r in got:
        for mode, m in r["bf16"].items():
            passes = {"forward": share * wbytes, "backward": share * wbytes}
            if tsp_weight_passes(mode, "gemms") == 3:
                passes["recompute"] = share * wbytes
            assert m["by_pass"] == passes, mode
            assert m["sent_g"] == share * gbytes, mode
            assert m["kv"] == (kv / 2, 2 if mode == "full" else 0), mode  # K and V gathered again, or kept
    assert [tsp_weight_passes(m, "gemms") for m in RECOMPUTE] == [2, 3, 3]
    assert tsp_weight_passes("selective", "attention") == 2  # the rings are outside the attention core


def test_the_next_shard_is_in_flight_while_the_current_one_computes(ranks: tuple[int, list[dict]]) -> None:
    """Each ring step posts the exchange that brings the next shard, then launches its compute, then
    waits — after the compute is launched, before the next step's. Backward posts the accumulator
    once the step has added to it, before the input gradient's compute; the first shard arrives
    while the input gradient of the rank's own shard is computed. Six rings: two norms, four
    projections."""
    world, got = ranks
    d = world
    forward = [e for t in range(d - 1) for e in (("post_w", t), ("compute", t), ("wait", t))] + [("compute", d - 1)]
    backward = [("post_w", -1), ("compute", -1), ("wait", -1)]
    for t in range(d):
        backward += [("post_w", t)] * (t <= d - 3) + [("compute", t)] + [("post_g", t)] * (t <= d - 2)
        backward += [("wait", t)] * (t <= d - 2)
    for r in got:
        fwd, bwd = r["bf16"]["none"]["events"]
        assert fwd == forward * 6
        assert bwd == backward * 6
