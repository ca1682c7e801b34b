"""Zero-bubble memory: the cost model counts what torch's schedule and autograd keep alive.

Torch's ``ScheduleInterleavedZeroBubble`` computes a micro-batch's input gradients
(``stage_backward_input``, graph retained) and its weight gradients later. Until then the
micro-batch keeps its saved activations and, for the weight pass, the gradients at the outputs of
its weight-carrying ops; the loss's own saved activations go with the detached loss. These tests
replay the schedule's op lists and measure those bytes op by op, no process group needed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, _ComputationType

from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer, estimate, stage_units
from costmodel.pipeline import in_flight, weights_pending
from costmodel.vectorized import price_grid, strategies_grid
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import load_model
from profiler.transformer import build_graph
from runtime.memory import TensorPeak
from runtime.model import Transformer, lm_loss
from runtime.pipeline import stage_module
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

CFG = TransformerConfig(name="zb-gpt", layers=4, hidden=64, heads=4, vocab=512, max_seq=32, bias=True,
                        position="learned", tied_embeddings=True, activation="gelu", norm="layernorm",
                        attention_impl="flash")
SEQ = 32


def _rank_ops(p: int, m: int, v: int, rank: int) -> list:
    """Rank ``rank``'s op list as ``ScheduleInterleavedZeroBubble`` computes it (its own method,
    on an instance given only what the method reads)."""
    sched = object.__new__(ScheduleInterleavedZeroBubble)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return sched._calculate_single_rank_operations(rank)


def _peak_held(ops: list) -> tuple[int, int]:
    """(micro-batch stages with their graph alive, of them with input gradients made) at the peak."""
    graphs = pending = 0
    peak = (0, 0)
    for a in ops:
        if a is None:
            continue
        t = a.computation_type
        graphs += t == _ComputationType.FORWARD
        pending += t == _ComputationType.BACKWARD_INPUT
        if t == _ComputationType.BACKWARD_WEIGHT:
            graphs, pending = graphs - 1, pending - 1
        peak = max(peak, (graphs, pending))
    return peak


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)])
def test_in_flight_and_pending_count_torch_zero_bubble_schedule(p: int, v: int) -> None:
    for m in (1, 2, 4, 8, 16):
        if v > 1 and m < p:
            continue  # interleaving needs a micro-batch per rank
        for r in range(p):
            graphs, pending = _peak_held(_rank_ops(p, m, v, r))
            assert graphs / v == in_flight("zb", r, p, m, v), (p, m, v, r)
            assert pending / v == weights_pending("zb", r, p, m, v), (p, m, v, r)
    assert weights_pending("1f1b", 1, 4, 8) == 0.0 and in_flight("1f1b", 1, 4, 8) == 3.0


def _unit_pending(stage: str, recompute: str) -> float:
    """The cost model's pending bytes of the last stage (block, final norm, head, loss) or of a block."""
    s = Strategy(mesh=Mesh(pp=4), micro_batch=1, schedule="zb", default=LayerStrategy(recompute=recompute))
    w = Workload(seq_len=SEQ, global_batch=4, precision="fp32")
    price = UnitPricer(DeviceModel(parse_cluster("4xcpu")), s, w)
    units = stage_units(build_graph(CFG, SEQ), s)[3 if stage == "last" else 1]
    return sum(price(name, nodes).pending for name, nodes in units)


@pytest.mark.parametrize("stage,recompute", [("block", "none"), ("block", "full"), ("last", "none")])
def test_pending_bytes_equal_what_autograd_keeps_for_the_weight_pass(stage: str, recompute: str) -> None:
    """Per micro-batch awaiting its weight gradients, live tensor bytes after its input gradients
    less those after its forward (its activations): exactly the cost model's ``pending``."""
    torch.manual_seed(0)
    model = Transformer(CFG)
    mod = stage_module(model, 3 if stage == "last" else 1, [1, 1, 1, 1])
    if recompute == "full":
        from runtime.checkpointing import wrap

        wrap(mod.layers["1"], "full", "cpu")
    params = list(mod.parameters())
    held = []
    with TensorPeak(params) as tp:
        for _ in range(3):
            x = torch.randn(1, SEQ, CFG.hidden, requires_grad=True)
            targets = torch.randint(0, CFG.vocab, (1, SEQ))  # the runtime keeps its micro-batches' targets
            out = mod(x)
            if stage == "last":
                out = lm_loss(out, targets)
            after_forward = tp.live
            # the gradient received from the next stage is the last op's output gradient: the
            # weight pass keeps it, as it would keep one computed here
            grads = None if stage == "last" else [torch.randn_like(out)]
            dx, groups = stage_backward_input([out], grads, [x], iter(params))
            del grads
            added = tp.live - after_forward - dx[0].nbytes
            # exact but for the loss's 4-byte total weight, which goes with the loss
            assert added == pytest.approx(_unit_pending(stage, recompute), abs=4)
            held.append((x, targets, groups))
        for _, _, groups in held:  # the weight pass still finds what it needs
            stage_backward_weight(iter(params), groups)
    assert all(p.grad is not None for p in params)


def test_zero_bubble_memory_grid_equals_estimate_on_every_rank_shape() -> None:
    """Ranks holding the same units price alike in the grid, which must take the last of them
    (the one deferring the most weight gradients) under zero bubble."""
    cl, w = parse_cluster("8xcpu"), Workload(seq_len=SEQ, global_batch=16, precision="fp32")
    # 15 blocks on 4 stages: 4, 4, 4, 3; ranks 1 and 2 hold the same units and, the head being
    # small, rank 2 (3 micro-batches pending) is the peak
    small = build_graph(replace(CFG, layers=15, vocab=64), SEQ)
    strategies = [Strategy(mesh=Mesh(pp=p, dp_shard=8 // p), micro_batch=1, schedule=sched,
                           default=LayerStrategy(recompute=rc))
                  for p in (2, 4, 8) for sched in ("zb", "1f1b") for rc in ("none", "full")]
    configs, options, cells = strategies_grid(strategies)
    for g in (small, load_model("gpt2", SEQ)):
        gr = price_grid(g, cl, w, configs, options)
        for s, (i, j) in zip(strategies, cells, strict=True):
            r = estimate(g, cl, s, w)
            assert gr.memory_peak_gib[i, j] == pytest.approx(r.memory_peak_gib, rel=1e-9), s
    zb, one = estimate(small, cl, strategies[4], w), estimate(small, cl, strategies[6], w)  # pp 4, ZB and 1F1B
    assert [st.activations > o.activations for st, o in zip(zb.stages, one.stages, strict=True)] == [True] * 4
    assert max(zb.stages, key=lambda st: st.total).stage == 2


def test_receive_buffers_are_the_ones_torch_keeps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``PipelineStage`` keeps an input buffer and an output-gradient buffer per micro-batch after
    a step; the cost model counts them less those its activations (the in-flight inputs) and its
    pending weight gradients (their received output gradients) already hold, each a block's output."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from costmodel.pipeline import recv_buffers

    m = 4
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Transformer(CFG)
        mods = [stage_module(model, k, [2, 2]) for k in range(2)]
        stages = [PipelineStage(mod, k, 2, torch.device("cpu")) for k, mod in enumerate(mods)]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=lm_loss)
        sched.step(torch.randint(0, CFG.vocab, (m, SEQ)), target=torch.randint(0, CFG.vocab, (m, SEQ)))
        inputs = [i.buffer for mb in stages[1].args_recv_info.values() for i in mb if i.buffer is not None]
        grads = [i.buffer for mb in stages[0].grad_recv_info.values() for i in mb if i.buffer is not None]
    finally:
        dist.destroy_process_group()
    assert len({id(b.untyped_storage()) for b in inputs}) == len(inputs) == m
    assert len({id(b.untyped_storage()) for b in grads}) == len(grads) == m
    s = Strategy(mesh=Mesh(pp=2), micro_batch=1, schedule="1f1b")
    w = Workload(seq_len=SEQ, global_batch=m, precision="fp32")
    price = UnitPricer(DeviceModel(parse_cluster("2xcpu")), s, w)
    block = price(*stage_units(build_graph(CFG, SEQ), s)[0][1])
    assert all(b.nbytes == block.out_bytes for b in inputs + grads)
    for sched_name in ("1f1b", "gpipe", "zb"):
        fwd, _ = recv_buffers(sched_name, 1, 2, m)  # the last stage receives inputs
        _, grad = recv_buffers(sched_name, 0, 2, m)  # the first receives gradients
        assert fwd + in_flight(sched_name, 1, 2, m) == len(inputs)
        assert grad + weights_pending(sched_name, 0, 2, m) == len(grads)
