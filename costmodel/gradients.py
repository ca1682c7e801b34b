"""Parameter and gradient tensors of an operator, and what moving them costs: the collectives a
gradient sync is cut into, FSDP's copies, the partial gradients sequence parallelism all-reduces,
and gradient accumulation over micro-batches. Scalars or numpy arrays over configurations."""

from __future__ import annotations

from typing import Any

import numpy as np

from costmodel.device import DeviceModel
from profiler.graph import LayerNode

GRAD_REDUCE_BYTES = 4  # gradients are reduced in fp32 (FSDP2 reduce_dtype, Megatron main_grad)
GATHER_BYTES = 2  # parameters are gathered in bf16


def sp_partial_grads(n: LayerNode) -> tuple[int, int]:
    """(tensors, parameters) of ``n`` that stay whole under TP but whose gradients are partial sums
    under sequence parallel (each rank saw a slice of the sequence): a norm's weight (and bias), a
    row-parallel linear's bias. DTensor all-reduces each over the TP group in every micro-batch's
    backward."""
    if n.kind == "norm" and n.params:
        return max(1, round(n.params / int(n.dims.get("hidden") or n.params))), n.params
    if n.kind == "linear" and n.tp == "row":
        bias = n.params - int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
        return (1, bias) if bias > 0 else (0, 0)
    return 0, 0


def param_tensors(n: LayerNode, split: int = 1) -> list[int]:
    """Sizes of ``n``'s parameter tensors in the whole model: its weight or table (``split``
    slices of it when OSDP splits the operator) and what remains beside it (biases, the position
    table beside the token table; a norm's weight and bias)."""
    if n.kind == "norm":
        k, _ = sp_partial_grads(n)
        return [n.params // k] * k if k else []
    dims = n.dims
    main = int(dims.get("vocab", 0)) * int(dims.get("hidden", 0)) if n.kind == "embedding" else \
        int(dims.get("in", 0)) * int(dims.get("out", 0)) if n.kind == "linear" else n.params
    main = min(main, n.params) or n.params
    rest = n.params - main
    return [main // split] * split + ([rest] if rest > 0 else [])


def grad_tensors(n: LayerNode, local: float, coalesce: float, split: int = 1) -> tuple[Any, Any]:
    """(gradient tensors at least ``coalesce`` bytes, parameters of the smaller ones) of ``n``'s
    ``local`` parameters on one rank (each tensor its share of them); ``(0, 0)`` when
    ``coalesce`` is 0. Scalars or numpy arrays of ``local``."""
    if coalesce <= 0:
        return 0, 0.0
    sizes = [x for x in param_tensors(n, split) if x > 0] or [1]  # [1]: none, or a tied head's own copy
    ratio = np.asarray(local, dtype=float) / sum(sizes)
    big = sum((x * ratio * GRAD_REDUCE_BYTES >= coalesce).astype(int) for x in sizes)
    small = sum(np.where(x * ratio * GRAD_REDUCE_BYTES >= coalesce, 0.0, x * ratio) for x in sizes)
    return big, small


def fsdp_copies(dev: DeviceModel, full: Any, grads: Any, gathers: int) -> Any:
    """Seconds per micro-batch of FSDP2's copies around its collectives, which nothing hides (they
    run on the compute stream or hold the memory bandwidth): each all-gather's flat output copied
    out into the unsharded parameters, each reduce-scatter's input copied in from the unsharded
    gradients — a read and a write of ``full`` (``grads``) bytes each. Scalars or numpy arrays."""
    per_byte = dev.memory_time(1.0, "elementwise")  # linear in the bytes
    return (gathers * 2 * np.asarray(full, dtype=float) + 2 * np.asarray(grads, dtype=float)) * per_byte


def accumulate_time(dev: DeviceModel, grad_bytes: Any, n_mb: Any) -> Any:
    """Seconds per micro-batch of adding each micro-batch's gradients after the step's first into
    the ``grad_bytes`` held (whole, or the shards FSDP2 reduce-scatters each micro-batch into):
    ``grad_accumulate_passes`` passes at an add's bandwidth, averaged over the ``n_mb``
    micro-batches. Scalars or numpy arrays."""
    n_mb = np.asarray(n_mb, dtype=float)
    later = np.maximum(n_mb - 1.0, 0.0) / np.maximum(n_mb, 1.0)
    return dev.c.grad_accumulate_passes * grad_bytes * dev.memory_time(1.0, "add") * later


def extra_all_reduces(big: Any, small: Any, coalesce: float) -> Any:
    """Collectives beyond the one a replicated group's gradient all-reduce is priced as, for its
    ``big`` tensors and ``small`` parameters (:func:`grad_tensors`): one per big tensor, the small
    ones' share of the flat buffers of ``coalesce`` bytes they ride in (coalesced across units, so
    a fraction); 0 when gradients are bucketed per unit (``coalesce`` 0)."""
    if coalesce <= 0:
        return 0.0
    return big + small * GRAD_REDUCE_BYTES / coalesce - 1
