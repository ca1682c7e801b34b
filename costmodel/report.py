"""The cost model's answer for one plan: step time and memory, with their breakdowns.

Keys are stable for scripts: ``step_time_s``, ``tokens_per_s_per_gpu``, ``mfu``, ``hfu``,
``memory_peak_gib`` (worst rank), ``time`` (breakdown, seconds per step) and ``stages``
(per pipeline stage memory breakdown in GiB and per-rank state bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1024**3


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
        d = asdict(self)
        for k in ("params", "grads", "optimizer", "activations", "buffers", "overhead"):
            d[f"{k}_gib"] = d.pop(k) / GIB
        d["total_gib"] = self.total / GIB
        return d


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
    host_per_node_gib: float = 0.0  # offloaded states in one node's host memory (worst rank x GPUs per node)
    host_limit_per_node_gib: float = 0.0  # what they may use there; 0 = not recorded, not bounded

    def to_dict(self) -> dict[str, Any]:
        t = self.time
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "memory_peak_gib": self.memory_peak_gib,
            "memory_limit_gib": self.memory_limit_gib,
            "fits": self.fits,
            "num_microbatches": self.num_microbatches,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "time": {"compute_s": t.compute, "recompute_s": t.recompute,
                     "comm_s": dict(t.comm), "bubble_s": t.bubble, "optimizer_s": t.optimizer,
                     "offload_s": t.offload},
            "stages": [s.to_dict() for s in self.stages],
            "notes": list(self.notes),
            **({"host_per_node_gib": self.host_per_node_gib, "host_limit_per_node_gib": self.host_limit_per_node_gib}
               if self.host_per_node_gib else {}),
        }
