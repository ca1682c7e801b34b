"""Where each local parameter's elements sit in the model as built: the thread that lets a rank
initialise, save and load its own shards without the whole model (:mod:`runtime.init`,
:mod:`runtime.dcp`).

Every parameter of the reference model is marked at build with its :class:`Origin`: its path in the
unsplit model, its shape there, and per dimension the indices it holds (all of them). Each step of
``apply_plan`` that makes a parameter out of part of another one composes the part's origin:
OSDP slices (rows, or a table's columns), TSP's ring shards (``tensor_split``), an EP rank's experts,
a pipeline stage's copy of a tied table; tensor parallelism and FSDP2 (DTensors: ``torch.chunk`` of
the tensor they were given, along the sharded dimension, by the rank's coordinate) are read off
after the fact (:func:`after_sharding`). Every transformation keeps a parameter's number of
dimensions, so the indices stay one tensor per dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

ATTR = "_shardplan_origin"


@dataclass(frozen=True)
class Origin:
    """The global parameter ``name`` (shape ``shape``) and, per dimension, the indices a local tensor holds."""

    name: str
    shape: tuple[int, ...]
    index: tuple[torch.Tensor, ...]

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> Origin:
        return cls(name, tuple(shape), tuple(torch.arange(n) for n in shape))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(len(i) for i in self.index)

    def select(self, dim: int, idx: torch.Tensor | slice) -> Origin:
        """The part at local indices ``idx`` along ``dim``."""
        index = list(self.index)
        index[dim] = index[dim][idx]
        return Origin(self.name, self.shape, tuple(index))

    def chunk(self, dim: int, n: int, r: int) -> Origin:
        """Part ``r`` of ``torch.chunk(..., n, dim)`` (empty when there are fewer chunks)."""
        size = len(self.index[dim])
        step = -(-size // n) if size else 0
        lo = min(r * step, size)
        return self.select(dim, slice(lo, min(lo + step, size)))

    def split(self, dim: int, n: int, r: int) -> Origin:
        """Part ``r`` of ``torch.tensor_split(..., n, dim)``."""
        size = len(self.index[dim])
        lo = r * (size // n) + min(r, size % n)
        return self.select(dim, slice(lo, lo + size // n + (1 if r < size % n else 0)))

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """The local tensor as boxes contiguous both here and in the global parameter:
        ``(local offsets, global offsets, sizes)``."""
        per_dim = [_runs(i) for i in self.index]
        out: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = [((), (), ())]
        for runs in per_dim:
            out = [(lo + (a,), go + (b,), sz + (n,)) for lo, go, sz in out for a, b, n in runs]
        return [b for b in out if all(b[2])]


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the runs of consecutive global indices in ``idx``."""
    if len(idx) == 0:
        return []
    breaks = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(idx)]
    return [(a, int(idx[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def of(p: torch.Tensor) -> Origin | None:
    return getattr(p, ATTR, None)


def mark(model: nn.Module) -> None:
    """Give each parameter of ``model`` (as built, unsplit) its whole origin."""
    for name, p in model.named_parameters():
        setattr(p, ATTR, Origin.whole(name, tuple(p.shape)))


def inherit(new: torch.Tensor, old: torch.Tensor, dim: int, idx: torch.Tensor | slice) -> None:
    """``new`` holds ``old``'s part at ``idx`` along ``dim``."""
    o = of(old)
    if o is not None:
        setattr(new, ATTR, o.select(dim, idx))


def inherit_split(new: torch.Tensor, old: torch.Tensor, dim: int, n: int, r: int) -> None:
    """``new`` is ``torch.tensor_split(old, n, dim)[r]``."""
    o = of(old)
    if o is not None:
        setattr(new, ATTR, o.split(dim, n, r))


def snapshot(module: nn.Module) -> dict[str, tuple[Origin, int]]:
    """Origins (and identities) of ``module``'s parameters by path, before a step that replaces them."""
    return {n: (o, id(p)) for n, p in module.named_parameters() if (o := of(p)) is not None}


def after_sharding(module: nn.Module, before: dict[str, tuple[Origin, int]],
                   shard_dims: dict[int, int] | None = None) -> None:
    """Origins of the DTensor parameters a sharding step (TP's ``parallelize_module``, FSDP2's
    ``fully_shard``) put in place of the parameters ``before`` describes: each ``Shard(d)`` of the
    mesh dimensions in ``shard_dims`` (mesh dim → tensor dim; None: every sharded mesh dim) is a
    ``torch.chunk`` of the tensor it was given, by this rank's coordinate."""
    for n, p in module.named_parameters():
        if n not in before or id(p) == before[n][1] or not isinstance(p, DTensor):
            continue
        o = before[n][0]
        coord = p.device_mesh.get_coordinate()
        dims = shard_dims if shard_dims is not None else {
            i: pl.dim for i, pl in enumerate(p.placements) if isinstance(pl, Shard)}
        for mesh_dim, tensor_dim in dims.items():
            o = o.chunk(tensor_dim, p.device_mesh.size(mesh_dim), coord[mesh_dim])  # type: ignore[index]
        if o.local_shape != tuple(p.to_local().shape):
            raise RuntimeError(f"origin of '{n}': expected a local shard of {o.local_shape}, found "
                               f"{tuple(p.to_local().shape)}")
        setattr(p, ATTR, o)


def local(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of a (DTensor) parameter."""
    return p.to_local() if isinstance(p, DTensor) else p


def described(module: nn.Module) -> list[tuple[str, torch.Tensor, Origin]]:
    """(path, local tensor, origin) of every parameter of ``module`` that has an origin."""
    out: list[tuple[str, Any, Origin]] = []
    for n, p in module.named_parameters():
        o = of(p)
        if o is not None:
            out.append((n, p, o))
    return out
