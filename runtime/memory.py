"""Measured per-rank memory: training-state bytes from local tensor shards, peak memory (process
RSS on CPU), and the peak of live tensor bytes (``max_memory_allocated`` on GPU, :class:`TensorPeak`
on CPU)."""

from __future__ import annotations

import gc
import resource
import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the local parts of ``tensors``, each storage region counted once.

    Views that overlap (a ZeRO slice of a gradient, a parameter shared by two modules) are
    counted once: per storage, the union of the element ranges the tensors cover. Padding of a
    storage that no tensor covers is not counted.
    """
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for t in tensors:
        if t is None:
            continue
        lt = _local(t)
        if lt.numel() == 0:
            continue
        es = lt.element_size()
        start = lt.storage_offset() * es
        key = lt.untyped_storage().data_ptr() if lt.device.type != "meta" else id(lt)
        spans.setdefault(key, []).append((start, start + lt.numel() * es, es))
    total = 0
    for ivs in spans.values():
        ivs.sort()
        cur_lo, cur_hi = ivs[0][0], ivs[0][1]
        for lo, hi, _ in ivs[1:]:
            if lo > cur_hi:
                total += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        total += cur_hi - cur_lo
    return total


def _optimizer_params(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [p for g in optimizer.param_groups for p in g["params"]]


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's training state in bytes: ``{param_bytes, grad_bytes, optim_bytes}``.

    * ``param_bytes``: local shards of the model's parameters (FSDP/TP shards, ZeRO-1/2 and
      replicated parameters whole);
    * ``grad_bytes``: gradients currently held, of the model's parameters, of the slices and
      masters the optimizer steps (ZeRO-1/2, mixed precision) and the fp32 gradient buffers of
      mixed precision; measure after backward and before ``optimizer.zero_grad``;
    * ``optim_bytes``: optimizer state tensors with at least one dimension (Adam's two moments;
      the 0-dim ``step`` counters are not counted), present after the first step, and the fp32
      master weights the optimizer steps in place of bf16 parameters (mixed precision).
    """
    params = list(model.parameters())
    param_bytes = tensor_bytes(params)
    stepped = _optimizer_params(optimizer)
    info = getattr(model, "_shardplan", None)
    held = [g for r in getattr(info, "replicated", []) for g in r.held_grads()]
    grads = [p.grad for p in params] + [p.grad for p in stepped] + held
    grad_bytes = tensor_bytes(grads)
    mine = {_local(p).untyped_storage().data_ptr() for p in params if _local(p).device.type != "meta"}
    optim: list[torch.Tensor] = [p for p in stepped if _local(p).untyped_storage().data_ptr() not in mine]
    if optimizer is not None:
        for st in optimizer.state.values():
            optim += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": tensor_bytes(optim)}


def peak_bytes(device: str) -> int:
    """Peak memory of this process: ``torch.cuda.max_memory_allocated`` on GPU, max RSS on CPU."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class TensorPeak(TorchDispatchMode):
    """The CPU counterpart of ``torch.cuda.max_memory_allocated``: the peak bytes of live tensor
    storage while the mode is active.

    On entry every storage alive in the process (of ``tensors`` when given, else of every tensor
    the garbage collector knows: parameters, gradients, optimizer state, FSDP2's buffers) is
    counted once. Then each op's outputs are counted by storage (a DTensor by its local shard):
    a storage seen before — a view of a parameter, say — adds nothing, a new one adds its bytes
    until it is freed; ``UntypedStorage.resize_`` — how FSDP2 allocates and frees its unsharded
    parameters — adds its change in size. What is not a tensor (gloo's buffers, the allocator's
    slack, the interpreter) is not counted: RSS measures that. The bookkeeping costs a Python call
    per op, so a step measured under it is slower than the others.
    """

    def __init__(self, tensors: Iterable[torch.Tensor | None] | None = None):
        super().__init__()
        self.live = self.peak = 0
        self.peak_op = ""  # the op whose outputs set the peak ("" before any op)
        self._op = ""
        self._sizes: dict[int, int] = {}
        self._tensors = tensors
        self._resize: Any = None

    def _add(self, n: int) -> None:
        self.live += n
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, self._op

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        lt = _local(t)
        if lt.device.type == "meta":
            return
        st = lt.untyped_storage()
        key = id(st)
        if key in self._sizes:
            return
        n = st.nbytes()
        self._sizes[key] = n
        weakref.finalize(st, self._free, key)
        self._add(n)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self) -> TensorPeak:
        with warnings.catch_warnings():  # isinstance on some collected objects warns of deprecations
            warnings.simplefilter("ignore")
            alive = list(self._tensors) if self._tensors is not None else [
                o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        self._op = "(alive on entry)"
        for t in alive:
            if t is not None:
                self._track(t)
        original = self._resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            key, before = id(st), st.nbytes()
            out = original(st, size)
            mode._op = "UntypedStorage.resize_"
            if key not in mode._sizes:  # not seen yet: alive before the mode, not found on entry
                mode._sizes[key] = before
                weakref.finalize(st, mode._free, key)
                mode._add(before)
            mode._sizes[key] += st.nbytes() - before
            mode._add(st.nbytes() - before)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
