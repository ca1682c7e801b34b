"""Pipeline parallelism with ``torch.distributed.pipelining`` at the plan's stage boundaries.

Stages are cut from the reference model at :meth:`Strategy.stage_layout` (``stage_layers``, or
the even split with the extra blocks on the middle stages: the layout the cost model prices),
which gives the blocks of each of the ``pp * vpp`` (virtual) stages; stage 0 also holds ``embed``,
the last stage ``final_norm`` and ``head``. Virtual stage ``s`` lives on pipeline rank ``s % pp``
(:meth:`Strategy.rank_stages`, the looping layout the interleaved schedules expect). Each stage is
a hand-built ``PipelineStage`` told the shapes it receives and sends (:func:`stage_examples`, from
the first batch's shape): torch's own inference would run each stage's forward on uninitialised
inputs, where a MoE router routes garbage.

Plan schedule → PyTorch schedule:

=================  =====================================  ==================================
plan ``schedule``  class                                  note
=================  =====================================  ==================================
``gpipe``          ``ScheduleGPipe``                      one stage per rank
``1f1b``           ``Schedule1F1B``                       one stage per rank
``interleaved``    ``ScheduleInterleaved1F1B``            ``vpp`` stages per rank
``zb``             ``ScheduleInterleavedZeroBubble``      ``vpp`` stages per rank (1 allowed);
                                                          the zero-bubble schedule that works
                                                          with the looping layout (ZBV needs a
                                                          V layout and is not used)
=================  =====================================  ==================================

Tied embeddings across stages are untied Megatron-style: the last stage holds a copy of the
embedding table as its head weight, and the two copies' gradients are summed (all-reduce over
the first and last pipeline ranks) before each optimizer step, so they stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard

from runtime import origins
from runtime.mesh import RuntimeMesh
from runtime.model import Transformer, lm_loss
from runtime.tensor_parallel import loss_context, plain
from vocab.strategy import Strategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zb": ScheduleInterleavedZeroBubble}
MULTI_STAGE = ("interleaved", "zb")


def stage_module(model: Transformer, stage: int, counts: list[int]) -> Transformer:
    """A ``Transformer`` sharing ``model``'s submodules that holds only stage ``stage``'s parts, of
    the layout ``counts`` (blocks per virtual stage, :meth:`Strategy.stage_layout`)."""
    first, last = stage == 0, stage == len(counts) - 1
    lo = sum(counts[:stage])
    keys = [str(i) for i in range(lo, lo + counts[stage])]
    m = Transformer.__new__(Transformer)
    nn.Module.__init__(m)
    m.cfg = model.cfg
    m.embed = model.embed if first else None
    m.layers = nn.ModuleDict({k: model.layers[k] for k in keys})
    m.final_norm = model.final_norm if last else None
    m.head = model.head if last else None
    if last and not first and model.cfg.tied_embeddings:
        head = nn.Linear(model.cfg.hidden, model.cfg.vocab, bias=False, device=model.head.weight.device,
                         dtype=model.head.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(model.head.weight)
        if (o := origins.of(model.head.weight)) is not None:  # a copy of the table
            setattr(head.weight, origins.ATTR, o)
        m.head = head
    return m


@dataclass
class TiedPair:
    """The first and last stage's copies of a tied embedding, and the group that sums their grads."""

    group: dist.ProcessGroup | None
    params: list[nn.Parameter]  # this rank's copy, slice by slice when split (none: it holds neither end)


def tied_params(first: Transformer | None, last: Transformer | None) -> list[nn.Parameter]:
    """This rank's copy of a tied table: the first stage's token table, else the last stage's head
    (each as its OSDP slices when split, in slice order)."""
    if first is not None:
        tok = first.embed.tok
        return [s.weight for s in tok.slices] if hasattr(tok, "slices") else [tok.weight]
    if last is not None:
        head = last.head
        return [p.weight for p in head.parts] if hasattr(head, "parts") else [head.weight]
    return []


def tied_pair_group(rt: RuntimeMesh) -> dist.ProcessGroup | None:
    """Process group {first, last} pipeline rank for this rank's (dp, cp, tp) coordinate."""
    grid = rt.mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) rank ids
    mine = None
    firsts, lasts = grid[0].reshape(-1).tolist(), grid[-1].reshape(-1).tolist()
    for a, b in zip(firsts, lasts, strict=True):
        g = dist.new_group([a, b])
        if dist.get_rank() in (a, b):
            mine = g
    return mine


@dataclass
class PipelineRunner:
    """This rank's stage modules and, once the batch's shape is known, their ``PipelineStage``s and
    the schedule that runs them (rebuilt when the shape changes)."""

    modules: list[Transformer]
    ids: list[int]
    strategy: Strategy
    rt: RuntimeMesh
    n_microbatches: int
    device: torch.device
    dtype: torch.dtype = torch.float32  # what the stages pass on: the compute dtype
    stages: list[PipelineStage] = field(default_factory=list)
    schedule: object = None
    shape: tuple[int, int] | None = None  # (rows, tokens) of the micro-batches the stages were built for

    @property
    def has_first(self) -> bool:
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        return (self.strategy.num_stages - 1) in self.ids

    @property
    def tp(self) -> int:
        """Megatron TP degree (the loss is vocabulary-parallel); 1 under TSP."""
        return 1 if self.rt.tsp else self.strategy.mesh.tp

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the mean loss on the last stage, else None."""
        shape = (tokens.shape[0] // self.n_microbatches, tokens.shape[1])
        if shape != self.shape:
            self._build(shape)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        with loss_context(self.tp):  # vocabulary-parallel loss under TP
            self.schedule.step(*args, **kwargs, return_outputs=False)  # the loss is in ``losses``
        if self.has_last:
            return torch.stack([plain(x.detach()).float() for x in losses]).mean()
        return None

    def _build(self, shape: tuple[int, int]) -> None:
        """``PipelineStage``s told the shapes they receive and send (torch's shape inference would
        run each stage on uninitialised tensors: a MoE router routes garbage, and the pass counts
        in the experts' loads), and the plan's schedule over them."""
        group = self.rt.group("pp")
        n = self.strategy.num_stages
        self.stages = []
        for m, sid in zip(self.modules, self.ids, strict=True):
            ins, outs, in_grads, out_grads = stage_examples(m.cfg, sid, n, shape, self._layout())
            self.stages.append(PipelineStage(m, sid, n, self.device, input_args=ins, output_args=outs,
                                             input_grads=in_grads, output_grads=out_grads, group=group))
        cls = SCHEDULES[self.strategy.schedule]
        held = self.stages if self.strategy.schedule in MULTI_STAGE else self.stages[0]
        self.schedule = cls(held, n_microbatches=self.n_microbatches, loss_fn=lm_loss)
        self.shape = shape

    def _layout(self) -> StageLayout:
        tp = self.strategy.mesh.tp
        megatron = tp > 1 and not self.rt.tsp
        return StageLayout(self.dtype, tp if megatron and self.strategy.sequence_parallel else 1,
                           self.rt.tp_mesh() if megatron else None)


@dataclass(frozen=True)
class StageLayout:
    """How activations cross stage boundaries: their dtype, the sequence-parallel ways the hidden
    states are cut (Megatron SP), and the TP mesh of vocabulary-sharded logits (Megatron TP)."""

    dtype: torch.dtype
    seq_ways: int = 1
    vocab_mesh: DeviceMesh | None = None


def stage_examples(cfg: Any, stage: int, n_stages: int, shape: tuple[int, int], lay: StageLayout) -> tuple[Any, ...]:
    """(inputs, outputs, input gradients, output gradients) of virtual stage ``stage``, as meta
    tensors, for micro-batches of ``shape`` (rows, this rank's tokens): stage 0 takes token ids,
    the others hidden states; the last stage returns logits (a vocabulary-sharded DTensor under
    Megatron TP), the others hidden states."""
    rows, seq = shape
    meta = torch.device("meta")

    def hidden() -> torch.Tensor:
        return torch.empty(rows, seq // lay.seq_ways, cfg.hidden, dtype=lay.dtype, device=meta, requires_grad=True)

    first, last = stage == 0, stage == n_stages - 1
    ins = torch.empty(rows, seq, dtype=torch.long, device=meta) if first else hidden()
    if not last:
        out = hidden()
    elif lay.vocab_mesh is not None:
        tp = lay.vocab_mesh.size()
        local = torch.empty(rows, seq, cfg.vocab // tp, dtype=lay.dtype, device=meta)
        out = DTensor.from_local(local, lay.vocab_mesh, [Shard(-1)], run_check=False).requires_grad_(True)
    else:
        out = torch.empty(rows, seq, cfg.vocab, dtype=lay.dtype, device=meta, requires_grad=True)
    in_grad = None if first else torch.empty_like(ins)
    out_grad = None if last else torch.empty_like(out)
    return (ins,), (out,), (in_grad,), (out_grad,)


def build_pipeline(model: Transformer, strategy: Strategy, rt: RuntimeMesh) -> tuple[list[Transformer], list[int], bool, bool]:
    """Cut this rank's stage modules; returns (modules, their stage ids, has_first, has_last)."""
    mods, ids = rank_stage_modules(model, strategy, rt.coord("pp"))
    release_unheld(model, mods)
    return mods, ids, 0 in ids, (strategy.num_stages - 1) in ids


def rank_stage_modules(model: Transformer, strategy: Strategy, rank: int) -> tuple[list[Transformer], list[int]]:
    """The stage modules pipeline rank ``rank`` runs and their virtual stage ids: the stages of
    :meth:`Strategy.rank_stages`, cut at :meth:`Strategy.stage_layout` (the layout the cost model prices)."""
    counts = strategy.stage_layout(model.cfg.layers)
    ids = strategy.rank_stages(rank)
    return [stage_module(model, s, counts) for s in ids], ids


def release_unheld(model: nn.Module, held: list[nn.Module]) -> None:
    """Free ``model``'s parameters and buffers that none of ``held`` holds: each becomes a tensor of
    the same shape on the meta device, so a pipeline rank keeps only its own stages' memory."""
    kept = {id(t) for m in held for t in (*m.parameters(), *m.buffers())}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and id(p) not in kept:
                mod._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and id(b) not in kept:
                mod._buffers[name] = torch.empty_like(b, device="meta")


def make_runner(mods: list[Transformer], ids: list[int], strategy: Strategy, rt: RuntimeMesh,
                n_microbatches: int, device: torch.device, dtype: torch.dtype = torch.float32) -> PipelineRunner:
    """This rank's runner over ``mods`` (virtual stages ``ids``) and the plan's schedule, its
    ``PipelineStage``s built at the first step from the batch's shape; ``dtype``: the activations'."""
    return PipelineRunner(modules=mods, ids=ids, strategy=strategy, rt=rt, n_microbatches=n_microbatches,
                          device=device, dtype=dtype)
