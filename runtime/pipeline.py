"""Pipeline parallelism with ``torch.distributed.pipelining`` at the plan's stage boundaries.

Stages are cut from the reference model at :meth:`Strategy.stage_layout` (``stage_layers``, or
the even split with the extra blocks on the middle stages: the layout the cost model prices),
which gives the blocks of each of the ``pp * vpp`` (virtual) stages; stage 0 also holds ``embed``,
the last stage ``final_norm`` and ``head``. Virtual stage ``s`` lives on pipeline rank ``s % pp``
(:meth:`Strategy.rank_stages`, the looping layout the interleaved schedules expect). Each stage is
a hand-built ``PipelineStage``.

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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

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
    """This rank's stages and the schedule that runs them."""

    stages: list[PipelineStage]
    modules: list[Transformer]
    schedule: object
    has_first: bool
    has_last: bool
    n_microbatches: int
    tp: int = 1

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch; the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        with loss_context(self.tp):  # vocabulary-parallel loss under TP
            self.schedule.step(*args, **kwargs, return_outputs=False)  # the loss is in ``losses``
        if self.has_last:
            return torch.stack([plain(x.detach()).float() for x in losses]).mean()
        return None


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
                n_microbatches: int, device: torch.device) -> PipelineRunner:
    """This rank's ``PipelineStage``s over ``mods`` (virtual stages ``ids``) and the plan's schedule."""
    n_stages = strategy.num_stages
    group = rt.group("pp")
    stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(mods, ids, strict=True)]
    cls = SCHEDULES[strategy.schedule]
    if strategy.schedule in MULTI_STAGE:
        schedule = cls(stages, n_microbatches=n_microbatches, loss_fn=lm_loss)
    else:
        schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=lm_loss)
    return PipelineRunner(stages=stages, modules=mods, schedule=schedule, has_first=0 in ids,
                          has_last=(n_stages - 1) in ids, n_microbatches=n_microbatches,
                          tp=1 if rt.tsp else strategy.mesh.tp)
