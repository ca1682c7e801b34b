"""Measured per-rank memory: training-state bytes from local tensor shards, and peak memory."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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
    * ``grad_bytes``: gradients currently held, of the model's parameters and of the slices the
      optimizer steps (ZeRO-1/2); measure after backward and before ``optimizer.zero_grad``;
    * ``optim_bytes``: optimizer state tensors with at least one dimension (Adam's two moments;
      the 0-dim ``step`` counters are not counted), present after the first step.
    """
    params = list(model.parameters())
    param_bytes = tensor_bytes(params)
    grads = [p.grad for p in params] + [p.grad for p in _optimizer_params(optimizer)]
    grad_bytes = tensor_bytes(grads)
    optim: list[torch.Tensor] = []
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
