"""TSP (``tp_mode = tsp``, :mod:`runtime.tsp`): a block on the weight rings computes what the
unsharded block computes, outputs and gradients, on gloo ranks; and what its rings send and hold is
what the cost model's TSP formulas price (``costmodel.units._Traffic.tsp_volumes``, ``_tsp_buffers``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer
from costmodel.units import tsp_volumes
from profiler.hardware import parse_cluster
from profiler.transformer import build_graph
from runtime.context_parallel import ContextShard, zigzag_index
from runtime.model import TINY_MODELS, AttentionCore, Transformer
from runtime.tsp import TspGroup, apply_tsp, shard_sizes
from vocab.strategy import Mesh, Strategy, Workload

MODEL = "tiny-llama"
B, S = 2, 32  # micro-batch, sequence
BLOCK = "1"


def _inputs(h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, h, generator=g), torch.randn(B, S, h, generator=g)


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Transformer(TINY_MODELS[MODEL])
        tg = TspGroup(dist.group.WORLD, rank, world)
        apply_tsp(model, tg)
        cs = ContextShard(dist.group.WORLD, rank, world)
        for m in model.modules():
            if isinstance(m, AttentionCore):
                m.context = cs
        block = model.layers[BLOCK]
        x, g = _inputs(model.cfg.hidden)
        idx = zigzag_index(S, rank, world)
        xl = x[:, idx].clone().requires_grad_(True)
        y = block(xl)
        fwd = (tg.stats.sent_w, tg.stats.peak_w, cs.gathered)
        tg.stats.reset()
        (y * g[:, idx]).sum().backward()
        st = tg.stats
        bwd = (st.sent_w, st.sent_g, st.peak, st.peak_w, st.peak_g)
        grads = {n: p.grad for n, p in block.named_parameters()}
        torch.save({"idx": idx, "y": y.detach(), "dx": xl.grad, "grads": grads, "fwd": fwd, "bwd": bwd},
                   f"{out}/{rank}.pt")
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


def test_the_rings_move_and_hold_what_the_cost_model_prices(ranks: tuple[int, list[dict]]) -> None:
    """Per rank and micro-batch, in elements (the runtime ran fp32, the model prices bf16 weights
    and fp32 gradients): forward sends tp-1 of the tp weight shards (an all-gather's share), backward
    as many again and as many fp32 accumulators (a reduce-scatter's); attention gathers the whole
    sequence's K/V; in flight, two weight shards (one with two ranks) and two accumulators of the
    largest operator."""
    world, got = ranks
    cfg = TINY_MODELS[MODEL]
    nodes = dict(build_graph(cfg, S).blocks())[f"layers.{BLOCK}"]
    s = Strategy(mesh=Mesh(tp=world), tp_mode="tsp", micro_batch=B)
    w = Workload(seq_len=S, global_batch=B, precision="bf16")
    wbytes, gbytes, kv = (float(a[0]) for a in tsp_volumes(nodes, ConfigArrays.of_strategy(s), w))
    buffers = UnitPricer(DeviceModel(parse_cluster(f"{world}xh100")), s, w)(f"layers.{BLOCK}", nodes).gathered
    share = (world - 1) / world  # what one rank sends of an all-gather or reduce-scatter
    fp32 = 4
    largest = max(shard_sizes(2 * cfg.ffn_hidden, world)) * cfg.hidden  # the MLP up projection's shard
    for r in got:
        sent_fwd, peak_fwd, kv_elems = r["fwd"]
        sent_w, sent_g, peak, peak_w, peak_g = r["bwd"]
        assert sent_fwd / fp32 == share * wbytes / 2
        assert sent_w / fp32 == share * wbytes / 2 and sent_g / fp32 == share * gbytes / 4
        assert kv_elems == kv / 2
        assert peak_fwd == 2 * largest * fp32
        assert (peak_w, peak_g) == ((2 if world > 2 else 1) * largest * fp32, 2 * largest * fp32)
        assert peak == peak_w + peak_g
        assert buffers == kv + 2 * (peak_w / fp32) + 4 * (peak_g / fp32)
