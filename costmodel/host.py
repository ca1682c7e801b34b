"""Host time that DTensor tensor parallelism adds to an operator, on top of its device time.

shardplan's runtime applies Megatron-style TP through DTensor (``runtime/tensor_parallel.py``): a
column- or row-parallel linear and a vocabulary-parallel embedding become DTensor modules, a norm
under sequence parallelism a ``SequenceParallel`` one, and the loss runs as ``loss_parallel``'s
vocabulary-parallel cross-entropy; attention and activations stay on local tensors. Each such
module pays DTensor's Python dispatch in forward and backward, and the parallel loss makes more
passes over its logits than the fused one (``profiler/measure_dtensor.py`` measures both). On a CPU
one thread does the dispatch and the work, so the two add; on a GPU the host runs ahead of the
kernels and only the slower of the two counts (:meth:`DeviceModel.with_host`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from costmodel.device import DeviceModel
from profiler.graph import LayerNode

#: TP roles of a linear or embedding that the runtime makes a Colwise/RowwiseParallel module
DTENSOR_MODULE_ROLES = ("column", "row", "vocab")


def dtensor_role(n: LayerNode) -> str | None:
    """The DTensor module the runtime makes of ``n`` under Megatron TP: ``linear`` (column-, row-
    or vocabulary-parallel linear or embedding), ``norm`` (under sequence parallelism only),
    ``loss``; ``None`` for what runs on local tensors."""
    if n.kind in ("linear", "embedding") and n.tp in DTENSOR_MODULE_ROLES:
        return "linear"
    if n.kind in ("norm", "loss"):
        return n.kind
    return None


def with_dtensor(n: LayerNode, dev: DeviceModel, fwd: Any, bwd: Any, tp_on: Any, sequence_parallel: Any,
                 split: int = 1) -> tuple[Any, Any]:
    """``n``'s forward and backward seconds with DTensor's host time where ``tp_on`` (Megatron TP,
    tp > 1): the loss's traffic scaled by the parallel loss's measured ratio, each DTensor module's
    (every OSDP slice one) dispatch added on a CPU, the slower of host and device on a GPU.
    Scalars (one strategy) or numpy arrays over configurations, ``tp_on`` and
    ``sequence_parallel`` booleans or masks alike."""
    role = dtensor_role(n)
    on = np.asarray(tp_on) & (np.asarray(sequence_parallel) if role == "norm" else True)
    if role is None or not on.any():
        return fwd, bwd
    ratio = dev.loss_traffic_ratio() if role == "loss" else 1.0
    hf, hb = dev.dtensor_host(role)
    k = split if role == "linear" else 1
    return (np.where(on, dev.with_host(fwd * ratio, k * hf), fwd),
            np.where(on, dev.with_host(bwd * ratio, k * hb), bwd))
