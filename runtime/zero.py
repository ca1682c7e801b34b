"""Data parallelism for parameters that stay whole on every rank: ``replicate``, ``zero1``, ``zero2``.

FSDP2 (``fully_shard``) always shards parameters at rest, so it implements ZeRO-3 only. The
plan values that keep parameters whole are implemented here, on plain collectives, with the
semantics of DeepSpeed's stages:

=========  ==================  ==========================================================
stage      plan value          what happens
=========  ==================  ==========================================================
0          ``replicate``       DDP: gradients all-reduced (averaged) over the data-parallel
                               ranks before the step; full optimizer state on every rank.
1          ``zero1``           gradients all-reduced as in DDP; the optimizer steps a flat
                               1/N slice of every parameter (its Adam moments exist for that
                               slice only), then the slices are all-gathered.
2          ``zero2``           as ``zero1``, but each gradient is reduce-scattered as soon as
                               it is accumulated (a post-accumulate-grad hook), so only the
                               rank's 1/N gradient slice is kept.
=========  ==================  ==========================================================

N is the ``dp_shard`` degree; with ``dp_replicate > 1`` the slices are additionally all-reduced
over ``dp_replicate`` (HSDP-style). Tensor-parallel parameters (DTensors) are handled through
their local shards. Slices are views into the parameter, so no second copy of the weights exists
in fp32 training. Collectives are blocking, after backward; gradients under ``COALESCE_BYTES`` are
reduced together in small flat buffers, larger ones in place.

Mixed precision (``compute_dtype`` bf16, :mod:`runtime.precision`): the parameters become bf16 and
each slot keeps an fp32 master — the whole parameter (stage 0) or this rank's slice (stages 1, 2) —
which the optimizer steps. Each bf16 gradient moves, as soon as it is accumulated, into an fp32
buffer (``reduce_dtype`` fp32; stage 2 reduce-scatters it there), which is what is reduced; after
the step the masters are copied back (all-gathered in bf16 under stages 1 and 2). With
``reduce_dtype`` bf16 the gradients stay and are reduced in bf16, and the masters step their fp32 cast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.precision import to_dtype

STAGES = {"replicate": 0, "zero1": 1, "zero2": 2}
COALESCE_BYTES = 1024**2  # gradients below this size are all-reduced together, in flat buffers up to it


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (sharing storage), else ``t`` itself (detached)."""
    return t._local_tensor if isinstance(t, DTensor) else t.detach()


def _span(numel: int, n: int, r: int) -> tuple[int, int, int]:
    chunk = -(-numel // n)
    lo = min(r * chunk, numel)
    return lo, min(lo + chunk, numel), chunk


@dataclass
class _Slot:
    param: nn.Parameter
    shard: nn.Parameter | None  # stage >= 1: this rank's slice (a flat view of it; its fp32 master in bf16)
    lo: int = 0
    hi: int = 0
    chunk: int = 0
    master: nn.Parameter | None = None  # stage 0 in bf16: the fp32 master
    main_grad: torch.Tensor | None = None  # bf16, stages 0 and 1: the fp32 gradient accumulated

    def stepped(self) -> nn.Parameter:
        """What the optimizer steps for this parameter."""
        return self.shard if self.shard is not None else (self.master if self.master is not None else self.param)


@dataclass
class ReplicatedParams:
    """Parameters of one ZeRO stage (0, 1 or 2) that are whole on every data-parallel rank.

    Attributes:
        stage: 0 (``replicate``), 1 (``zero1``) or 2 (``zero2``).
        shard_group: the ``dp_shard`` group, ``dp_shard × cp`` with context parallelism (slices
            are 1/its size); None when of size 1.
        replicate_group: the ``dp_replicate`` group; None when of size 1.
        dp_size: every rank the gradients average over (``dp_replicate × dp_shard × cp``).
        compute_dtype: bf16 for mixed precision (fp32 masters kept here), None or fp32 for none.
        reduce_dtype: the dtype gradients are accumulated and reduced in under mixed precision.
    """

    stage: int
    params: list[nn.Parameter]
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None
    dp_size: int
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    slots: list[_Slot] = field(default_factory=list)
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def low(self) -> bool:
        """Mixed precision: bf16 parameters, fp32 masters."""
        return self.compute_dtype not in (None, torch.float32)

    def __post_init__(self) -> None:
        if self.shard_group is None and self.stage > 0:
            self.stage = 0  # nothing to shard over
        n = dist.get_world_size(self.shard_group) if self.shard_group is not None else 1
        r = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        for p in self.params:
            if self.stage == 0:
                self.slots.append(_Slot(p, None, master=nn.Parameter(local(p).clone()) if self.low else None))
            else:
                data = local(p)
                if not data.is_contiguous():
                    raise RuntimeError(f"zero{self.stage}: parameter of shape {tuple(data.shape)} is not contiguous")
                lo, hi, chunk = _span(data.numel(), n, r)
                piece = data.view(-1)[lo:hi]
                self.slots.append(_Slot(p, nn.Parameter(piece.clone() if self.low else piece), lo, hi, chunk))
        if self.low:  # before the hooks: swapping a tensor does not carry its hooks over
            to_dtype(self.params, self.compute_dtype)  # type: ignore[arg-type]
        hook = self._scatter_hook if self.stage == 2 else (self._main_grad_hook if self._main_grads else None)
        if hook is not None:
            self._hooks += [s.param.register_post_accumulate_grad_hook(hook(s)) for s in self.slots]

    @property
    def _main_grads(self) -> bool:
        """Stages 0 and 1 under mixed precision with fp32 reduction: bf16 gradients move to fp32 buffers."""
        return self.low and self.reduce_dtype != self.compute_dtype

    def held_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient buffers of mixed precision (beside the parameters' and masters' ``grad``)."""
        return [s.main_grad for s in self.slots if s.main_grad is not None]

    # ---- gradients -------------------------------------------------------------------------
    def _main_grad_hook(self, slot: _Slot):
        def hook(p: torch.Tensor) -> None:
            g = local(p.grad)
            if slot.main_grad is None:
                slot.main_grad = g.to(self.reduce_dtype, copy=True)
            else:
                slot.main_grad.add_(g)
            p.grad = None

        return hook

    def _scatter_hook(self, slot: _Slot):
        def hook(p: torch.Tensor) -> None:
            g = local(p.grad).reshape(-1)
            piece = self._reduce_scatter(g.to(self.reduce_dtype) if self.low else g, slot)
            piece = piece.to(slot.shard.dtype)
            if slot.shard.grad is None:
                slot.shard.grad = piece
            else:
                slot.shard.grad.add_(piece)
            p.grad = None

        return hook

    def _fold_assigned(self) -> None:
        """Gradients a schedule assigned to ``.grad`` without accumulating them (the zero-bubble
        schedule's weight pass), which no post-accumulate hook saw: moved where the hooks move them."""
        hook = self._scatter_hook if self.stage == 2 else (self._main_grad_hook if self._main_grads else None)
        if hook is None:
            return
        for s in self.slots:
            if s.param.grad is not None:
                hook(s)(s.param)

    def _reduce_scatter(self, flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
        n = dist.get_world_size(self.shard_group)
        padded = torch.zeros(n * slot.chunk, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        out = torch.empty(slot.chunk, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(out, padded, group=self.shard_group)
        return out[: slot.hi - slot.lo].clone()

    def _all_reduce(self, t: torch.Tensor, groups: list[dist.ProcessGroup | None]) -> None:
        for g in groups:
            if g is not None:
                dist.all_reduce(t, group=g)

    def reduce_grads(self) -> None:
        """Average gradients over data parallelism (call after backward, before the step).

        Gradients of at least :data:`COALESCE_BYTES` are all-reduced in place, one collective each;
        smaller ones (biases, norms) are coalesced into flat buffers of at most that size, so a
        model's many small tensors cost a few collectives' latency, not one each."""
        self._fold_assigned()
        if self.stage == 2:
            for s in self.slots:
                if s.shard.grad is None:  # unused parameter: no hook fired
                    s.shard.grad = torch.zeros_like(s.shard)
            self._average([s.shard.grad for s in self.slots], [self.replicate_group])
            return
        grads = []
        for s in self.slots:
            if self._main_grads:
                if s.main_grad is None:
                    s.main_grad = torch.zeros_like(local(s.param), dtype=self.reduce_dtype)
                grads.append(s.main_grad)
                continue
            if s.param.grad is None:
                s.param.grad = torch.zeros_like(s.param)
            grads.append(local(s.param.grad))
        self._average(grads, [self.shard_group, self.replicate_group])
        for s, g in zip(self.slots, grads, strict=True):
            target = s.stepped()
            if target is not s.param:  # a master or a slice: its gradient, fp32 where it is
                piece = g.view(-1)[s.lo : s.hi] if self.stage == 1 else g
                target.grad = piece.to(target.dtype)

    def _average(self, grads: list[torch.Tensor], groups: list[dist.ProcessGroup | None]) -> None:
        """All-reduce ``grads`` in place over ``groups`` and divide by the data-parallel size."""
        if any(x is not None for x in groups):
            small: list[torch.Tensor] = []  # waiting to be reduced together
            size = 0  # their bytes
            for g in grads:
                nbytes = g.numel() * g.element_size()
                if nbytes >= COALESCE_BYTES or not g.is_contiguous():
                    self._all_reduce(g, groups)
                    continue
                if small and (size + nbytes > COALESCE_BYTES or (small[0].dtype, small[0].device) != (g.dtype, g.device)):
                    self._all_reduce_flat(small, groups)
                    small, size = [], 0
                small.append(g)
                size += nbytes
            if small:
                self._all_reduce_flat(small, groups)
        for g in grads:
            g.div_(self.dp_size)

    def _all_reduce_flat(self, ts: list[torch.Tensor], groups: list[dist.ProcessGroup | None]) -> None:
        if len(ts) == 1:
            self._all_reduce(ts[0], groups)
            return
        flat = torch.cat([t.reshape(-1) for t in ts])
        self._all_reduce(flat, groups)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    # ---- parameters --------------------------------------------------------------------------
    def optimizer_params(self) -> list[nn.Parameter]:
        """What the optimizer steps: the parameters or their masters (stage 0), or this rank's slices."""
        return [s.stepped() for s in self.slots]

    def gather_params(self) -> None:
        """After the step: all-gather the updated slices into the whole parameters (copy the masters
        back under mixed precision)."""
        for s in self.slots:
            s.main_grad = None
            if s.master is not None:
                with torch.no_grad():
                    local(s.param).copy_(s.master)
        if self.stage == 0:
            return
        n = dist.get_world_size(self.shard_group)
        for s in self.slots:
            flat = local(s.param).view(-1)
            inp = torch.zeros(s.chunk, dtype=flat.dtype, device=flat.device)
            inp[: s.hi - s.lo] = s.shard.detach() if self.low else flat[s.lo : s.hi]
            out = torch.empty(n * s.chunk, dtype=flat.dtype, device=flat.device)
            dist.all_gather_single(out, inp, group=self.shard_group)
            flat.copy_(out[: flat.numel()])
            if self.stage == 1:
                s.param.grad = None
                s.shard.grad = None
