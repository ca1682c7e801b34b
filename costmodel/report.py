"""The cost model's answer for one plan: step time and memory, with their breakdowns.

Keys are stable for scripts: ``step_time_s``, ``tokens_per_s_per_gpu``, ``mfu``, ``hfu``,
``memory_peak_gib`` (worst rank), ``time`` (breakdown, seconds per step) and ``stages``
(per pipeline stage memory breakdown in GiB and per-rank state bytes).

The plan vocabulary owns the report's shape: ``to_dict`` writes the keys of
:data:`vocab.plan.REPORT_KEYS`, :class:`vocab.plan.PredictedTime` and
:class:`vocab.plan.PredictedStage`, in their order, each read off the attribute of its name or,
without a unit suffix, of the name less it (``_s``: seconds as they are; ``_gib``: bytes in GiB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vocab.plan import REPORT_KEYS, PredictedStage, PredictedTime

GIB = 1024**3
#: report keys written only when states or activations are offloaded to host memory
HOST_KEYS = ("host_per_node_gib", "host_limit_per_node_gib")


def attribute_of(obj: object, key: str) -> str:
    """The attribute of ``obj`` that report key ``key`` reads: ``key`` itself, else ``key`` less its
    unit suffix (``_s`` or ``_gib``)."""
    if hasattr(obj, key):
        return key
    for suffix in ("_s", "_gib"):
        if key.endswith(suffix) and hasattr(obj, key.removesuffix(suffix)):
            return key.removesuffix(suffix)
    raise AttributeError(f"{type(obj).__name__} has no value for report key '{key}'")


def _value(obj: object, key: str) -> Any:
    """The value under report key ``key``: GiB from bytes, nested parts as their dicts, copies of
    lists and mappings."""
    name = attribute_of(obj, key)
    v = getattr(obj, name)
    if name != key and key.endswith("_gib"):
        return v / GIB
    if isinstance(v, TimeBreakdown | StageMemory):
        return v.to_dict()
    if isinstance(v, list):
        return [x.to_dict() if isinstance(x, StageMemory) else x for x in v]
    return dict(v) if isinstance(v, dict) else v


def report_dict(obj: object, keys: Iterable[str]) -> dict[str, Any]:
    """``obj``'s values under the report keys ``keys`` (lists and mappings copied)."""
    return {k: _value(obj, k) for k in keys}


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step on the critical path.

    ``compute`` is forward+backward of all micro-batches on the slowest stage, ``recompute`` the
    extra forward of recomputation, ``comm`` the exposed (not overlapped) communication per mesh
    axis (``dp``, ``tp``, ``cp``, ``ep``, ``pp``), ``bubble`` the pipeline's idle time,
    ``optimizer`` the optimizer step, ``offload`` host-device transfers that are not hidden.
    """

    compute: float = 0.0
    recompute: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.recompute + sum(self.comm.values()) + self.bubble + self.optimizer + self.offload

    def to_dict(self) -> dict[str, Any]:
        return report_dict(self, PredictedTime.model_fields)


@dataclass
class StageMemory:
    """Peak memory of one rank of a pipeline stage (bytes), with what it is made of at the moment
    of the peak (``phase``: ``backward``, its start with every activation in flight saved, or
    ``end of backward``, every gradient made); ``grads`` are the gradients live then."""

    stage: int
    first_block: int
    last_block: int  # inclusive; -1 when the stage holds no block
    units: list[str]
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    overhead: float = 0.0
    phase: str = "backward"
    # exact per-rank state bytes (what ``runtime`` measures): parameters, gradients, optimizer
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_bytes: int = 0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.overhead

    def to_dict(self) -> dict[str, Any]:
        return report_dict(self, PredictedStage.model_fields)


@dataclass
class Report:
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    memory_peak_gib: float
    time: TimeBreakdown
    stages: list[StageMemory]
    memory_limit_gib: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    num_microbatches: int
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    host_per_node_gib: float = 0.0  # offloaded states and activations in one node's host memory (worst rank x GPUs per node)
    host_limit_per_node_gib: float = 0.0  # what they may use there; 0 = not recorded, not bounded

    def to_dict(self) -> dict[str, Any]:
        keys = REPORT_KEYS if self.host_per_node_gib else [k for k in REPORT_KEYS if k not in HOST_KEYS]
        return report_dict(self, keys)
