"""Seeded initialisation of the reference model shard by shard: each rank draws only the values of
the parameter parts it holds, whatever the plan cut, so that no rank ever holds the whole model.

A parameter's value is a function of ``(seed, its path, row block)`` alone: dimension 0 is cut into
blocks of at most :data:`BLOCK_ELEMENTS` elements, and each block is drawn from its own generator.
A rank holding some rows of a parameter (FSDP2 shards, ring shards, OSDP slices, its experts)
draws only the blocks those rows fall in; one holding some columns (Megatron TP's row-parallel
layers) draws its rows' blocks and keeps its columns. Every plan, and one process building the
whole model, thus get the same numbers (:func:`materialize` after ``apply_plan`` on a model built on
the meta device; :func:`runtime.model.build` for a ``seeded`` spec).

What each parameter draws follows :func:`profiler.reference_model.init_weights`: weights normal with
``init_std`` (the residual outputs ``std / sqrt(2·layers)``, GPT-2 style), biases zeros, norm
weights ones. Buffers (the MoE blocks' balancing bias and load) start at zero.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from profiler.reference_model import RESIDUAL_OUTPUTS
from runtime import origins
from runtime.origins import Origin

#: the largest block of a parameter one generator draws (elements)
BLOCK_ELEMENTS = 1 << 22


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _rule(name: str, std: float, layers: int) -> tuple[str, float]:
    """(zeros | ones | normal, std) of parameter ``name``, as :func:`~profiler.reference_model.init_weights` draws it."""
    last = name.rsplit(".", 1)[-1]
    if last == "bias":
        return "zeros", 0.0
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        return "ones", 0.0
    if name.endswith(RESIDUAL_OUTPUTS):
        return "normal", std / math.sqrt(2 * layers)
    return "normal", std


def seeded(o: Origin, seed: int, std: float, layers: int) -> torch.Tensor:
    """The values of the part ``o`` of global parameter ``o.name`` (fp32, on the CPU)."""
    kind, scale = _rule(o.name, std, layers)
    shape = o.local_shape
    if kind != "normal":
        return torch.zeros(shape) if kind == "zeros" else torch.ones(shape)
    rest = math.prod(o.shape[1:])
    rows = max(1, BLOCK_ELEMENTS // max(rest, 1))
    out = torch.empty(shape)
    want = o.index[0]
    for b in torch.unique(want // rows).tolist():
        lo = b * rows
        n = min(rows, o.shape[0] - lo)
        g = torch.Generator().manual_seed(block_seed(seed, o.name, b))
        block = torch.randn((n, *o.shape[1:]), generator=g).mul_(scale)
        at = torch.nonzero((want >= lo) & (want < lo + n)).flatten()
        part = block[want[at] - lo]
        del block
        for d, idx in enumerate(o.index[1:], start=1):
            if len(idx) != o.shape[d] or not torch.equal(idx, torch.arange(o.shape[d])):  # not every column
                part = part.index_select(d, idx)
        out[at] = part
    return out


def materialize(module: nn.Module, device: torch.device, values: Callable[[Origin], torch.Tensor]) -> None:
    """Give ``module``'s meta parameters and buffers storage on ``device`` (local shards only: FSDP2's
    and TP's DTensors allocate their own part) and fill each parameter with ``values(origin)``,
    buffers with zeros.

    ``Module.to_empty`` allocates (FSDP2 takes its new shards from it), but it makes a new Parameter
    per module of a meta one — a tied weight comes back as two — and swaps DTensors, whose
    attributes and gradient hooks stay behind: the ties, origins and hooks are put back."""
    before = [(m, k, id(p), origins.of(p), p._post_accumulate_grad_hooks, p._backward_hooks)
              for m in module.modules() for k, p in m._parameters.items() if p is not None]
    module.to_empty(device=device)
    seen: dict[int, nn.Parameter] = {}
    for m, k, pid, o, post, pre in before:
        p = m._parameters[k]
        if pid in seen:
            if seen[pid] is not p:  # a tie to restore
                setattr(m, k, seen[pid])
            continue
        seen[pid] = p  # type: ignore[assignment]
        if o is not None:
            setattr(p, origins.ATTR, o)
        if post is not None:
            p._post_accumulate_grad_hooks = post  # type: ignore[union-attr]
        if pre is not None:
            p._backward_hooks = pre  # type: ignore[union-attr]
    with torch.no_grad():
        for name, p in module.named_parameters():
            o = origins.of(p)
            if o is None:
                raise RuntimeError(f"parameter '{name}' has no origin: cannot initialise it shard by shard")
            origins.local(p).copy_(values(o))
        for b in module.buffers():
            b.zero_()


def seeded_values(seed: int, std: float, layers: int) -> Callable[[Origin], torch.Tensor]:
    """:func:`seeded` for a model of ``layers`` blocks initialised with ``std``."""
    return lambda o: seeded(o, seed, std, layers)
