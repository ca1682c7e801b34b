"""Training checkpoints with ``torch.distributed.checkpoint`` in the model's own coordinates: a plan
saves, and the same plan or another plan of the same model resumes.

Each rank writes the parts of the model it holds, wherever the plan put them (FSDP2 and TP shards,
TSP ring shards, OSDP slices, its experts, its pipeline stages, its ZeRO-1/2 slices): every part is
a set of boxes of a parameter of the unsplit model (:mod:`runtime.origins`), written as chunks of
that parameter (``WriteItemType.SHARD``). Replicas write the same chunk once (DCP's deduplication),
and DCP's global-plan validation checks that the chunks of each parameter tile it. Loading is DCP's
resharding: each rank reads the chunks that overlap what it holds, whatever plan wrote them.

What is saved, under ``<what>/<parameter>``: ``weight`` — the fp32 values the optimizer steps (the
fp32 masters under mixed precision: the bf16 compute copies are derived), ``exp_avg`` and
``exp_avg_sq`` — Adam's moments; ``buffer/<path>`` — the MoE blocks' balancing biases; ``meta/step``
— the steps trained (the data position). Only the model's own parameters can be saved this way:
the reference model (Hugging Face models carry no origins).
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from runtime import origins
from runtime.apply import applied, optimizer_params
from vocab.errors import ShardplanError, shown

STATE = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    """A box of global tensor ``key`` (shape ``size``) at ``offsets``, held here as ``view``."""

    key: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    view: torch.Tensor


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[lo, hi)`` (row-major) of a tensor of ``shape`` as boxes, each contiguous in
    row-major order: ``(offsets, sizes)``."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if lo % inner:  # the end of a row
        r, end = lo // inner, min(hi, (lo // inner + 1) * inner)
        out += [((r, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - r * inner, end - r * inner)]
        lo = end
    if (full := (hi - lo) // inner) > 0:
        out.append(((lo // inner, *([0] * (len(shape) - 1))), (full, *shape[1:])))
        lo += full * inner
    if lo < hi:  # the start of a row
        out += [((lo // inner, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, hi - lo)]
    return out


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(d, o, n)
    return t


def _pieces(key: str, o: origins.Origin, local: torch.Tensor, flat: tuple[int, int] | None) -> list[Piece]:
    """``local`` (the tensor the optimizer steps: a parameter's local tensor, its master, or the flat
    slice ``flat`` of it) as boxes of global parameter ``o.name``."""
    shape = o.local_shape
    if flat is None:
        boxes = [((0,) * len(shape), shape)]
    else:
        boxes = flat_boxes(shape, *flat)
    out = []
    for off, size in boxes:
        if flat is None:
            view = local
        else:
            at = sum(a * math.prod(shape[d + 1:]) for d, a in enumerate(off)) - flat[0]
            view = local.view(-1)[at : at + math.prod(size)].view(size)
        sub = o
        for d, (a, n) in enumerate(zip(off, size, strict=True)):
            sub = sub.select(d, slice(a, a + n))
        out += [Piece(f"{key}/{o.name}", o.shape, goff, _narrow(view, loff, sz)) for loff, goff, sz in sub.boxes()]
    return out


def _stepped(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]]:
    """(tensor the optimizer steps, the parameter it stands for, its flat range of it or None)."""
    info = applied(model)
    slots = {id(s.stepped()): s for r in info.replicated for s in r.slots}
    out = []
    for t in optimizer_params(model):
        s = slots.get(id(t))
        if s is None or t is s.param:
            out.append((t, t, None))
        else:
            out.append((t, s.param, (s.lo, s.hi) if s.shard is t else None))
    return out


def _buffers(model: nn.Module) -> list[Piece]:
    out = []
    for st in applied(model).stages:
        for name, b in st.named_buffers():
            if name.endswith("balance_bias"):
                out.append(Piece(f"buffer/{name}", tuple(b.shape), (0,) * b.dim(), b))
    return out


def pieces(model: nn.Module, opt: torch.optim.Optimizer) -> list[Piece]:
    """Everything this rank saves or loads: weights and Adam moments, box by box, and the buffers."""
    out = _buffers(model)
    for t, p, flat in _stepped(model):
        o = origins.of(p)
        if o is None:
            raise ShardplanError("checkpoints need the runtime's reference model (its parameters know where "
                                 "they sit in the model); this model has none")
        state = opt.state[t]
        for key, tensor in (("weight", t), *((k, state[k]) for k in STATE)):
            out += _pieces(key, o, origins.local(tensor).detach(), flat)
    return out


def ensure_state(opt: torch.optim.Optimizer) -> None:
    """Adam's state for every parameter (zeros), as its first step makes it, so that it can be loaded."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=origins.local(p).device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class _Save(DefaultSavePlanner):
    def __init__(self, items: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items = {(p.key, p.offsets): p for p in items}

    def create_local_plan(self) -> SavePlan:
        plan = [WriteItem(index=MetadataIndex(p.key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.view.shape)),
                              properties=TensorProperties.create_from_tensor(p.view), size=torch.Size(p.size)))
                for p in self.items.values()]
        self.plan = SavePlan(plan)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        p = self.items[(write_item.index.fqn, tuple(write_item.index.offset))]  # type: ignore[arg-type]
        return p.view.detach().to("cpu", copy=True).contiguous()


class _Load(DefaultLoadPlanner):
    def __init__(self, items: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items: dict[tuple[str, tuple[int, ...]], list[Piece]] = {}
        for p in items:
            self.items.setdefault((p.key, p.offsets), []).append(p)

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata  # type: ignore[union-attr]
        reads: list[ReadItem] = []
        for (key, off), ps in self.items.items():
            have = md.get(key)
            if not isinstance(have, TensorStorageMetadata) or tuple(have.size) != ps[0].size:
                found = "nothing" if have is None else f"shape {tuple(getattr(have, 'size', ()))}"
                raise ShardplanError(f"the checkpoint does not fit this model: {shown(key)} of shape {ps[0].size} "
                                     f"holds {found} there")
            chunk = ChunkStorageMetadata(torch.Size(off), torch.Size(ps[0].view.shape))
            reads += create_read_items_for_chunk_list(key, have, [chunk])
        return LoadPlan(reads)

    def _target(self, item: ReadItem) -> list[Piece]:
        return self.items[(item.dest_index.fqn, tuple(item.dest_index.offset))]  # type: ignore[arg-type]

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        p = self._target(read_item)[0]
        return _narrow(p.view, tuple(read_item.dest_offsets), tuple(read_item.lengths))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        ps = self._target(read_item)
        for p in ps[1:]:  # the same box held twice here (a pipeline rank's two copies of a tied table)
            _narrow(p.view, tuple(read_item.dest_offsets), tuple(read_item.lengths)).copy_(tensor)


def check_source(path: str | Path) -> Path:
    """``path`` as a checkpoint to resume from, checked before any rank starts."""
    p = Path(path)
    if not (p / ".metadata").is_file():
        raise ShardplanError(f"{shown(str(p))} is not a checkpoint (no .metadata file in it)")
    return p


def check_target(path: str | Path) -> Path:
    """``path`` as a checkpoint directory to write (or replace), checked before any rank starts."""
    p = Path(path)
    if p.exists() and not (p.is_dir() and ((p / ".metadata").is_file() or not any(p.iterdir()))):
        raise ShardplanError(f"{shown(str(p))} exists and is not a checkpoint: not replaced")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ShardplanError(f"cannot write a checkpoint at {shown(str(p))}: permission denied")
    return p


def _step_piece(step: int) -> Piece:
    return Piece("meta/step", (1,), (0,), torch.tensor([float(step)], dtype=torch.float64))


def save(model: nn.Module, opt: torch.optim.Optimizer, path: str | Path, step: int) -> None:
    """Write a checkpoint of ``model`` and ``opt`` after ``step`` steps to the directory ``path``
    (every rank calls it); written beside it first and renamed once complete."""
    path = Path(path)
    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=0)
    tmp = path.with_name(f".{path.name}.shardplan-tmp-{token[0]}")
    ensure_state(opt)
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=_Save([*pieces(model, opt), _step_piece(step)]))
    dist.barrier()
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    dist.barrier()


def load(model: nn.Module, opt: torch.optim.Optimizer, path: str | Path) -> int:
    """Read the checkpoint at ``path`` into ``model`` and ``opt`` (every rank calls it; any plan of
    the same model may have written it); returns the steps it had trained."""
    ensure_state(opt)
    step = _step_piece(0)
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=_Load([*pieces(model, opt), step]))
    except CheckpointException as e:
        raise ShardplanError(f"cannot load the checkpoint {shown(str(path))}: {_first_failure(e)}") from None
    k = int(step.view.item())
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p]["step"].fill_(k)
    for r in applied(model).replicated:  # the compute copies from the masters / the ZeRO slices
        r.gather_params()
    return k


def _first_failure(e: Any) -> str:
    failures = getattr(e, "failures", {}) or {}
    for err in failures.values():
        return str(getattr(err, "args", [err])[0]).split("\n")[0]
    return str(e).split("\n")[0]
