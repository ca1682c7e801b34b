"""What a search returns: the best plan, how sure we are of it, and the runners-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from costmodel.report import Report
from vocab.strategy import Strategy


@dataclass
class Found:
    """One plan the search priced, with the cost model's report."""

    strategy: Strategy
    report: Report
    family: str  # fsdp, osdp, megatron or hybrid: the narrowest named space that holds the plan

    @property
    def step_time_s(self) -> float:
        return self.report.step_time_s

    @property
    def memory_gib(self) -> float:
        return self.report.memory_peak_gib


@dataclass
class SearchResult:
    """The optimum of a space (or the best found within a time limit, with a bound)."""

    best: Found
    objective: float  # step time of ``best`` (s), re-priced by estimate()
    bound: float  # proven lower bound on the optimal step time
    status: str  # optimal, feasible or time_limit
    space: str
    solver: str  # which solver settled the best plan
    candidates: int  # plans priced (uniform grid cells plus per-layer options)
    time_s: float
    alternatives: list[Found] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        return max(0.0, (self.objective - self.bound) / self.objective) if self.objective > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return 0.0 if self.objective <= 0 else self.options.get("global_batch", 0) / self.objective


def family_of(s: Strategy) -> str:
    """The narrowest named space holding ``s`` (see :mod:`solvers.space`)."""
    m = s.mesh
    uniform = not s.layers and s.stage_layers is None
    data_only = m.pp == 1 and m.tp == 1 and m.cp == 1 and m.ep == 1
    d = s.default
    if (
        uniform
        and data_only
        and d.sharding in ("zero2", "zero3", "zero3_keep")
        and d.offload in ("none", "params")
    ):
        return "fsdp"
    if data_only:
        return "osdp"
    if (
        uniform
        and m.dp_replicate == 1
        and d.sharding in ("replicate", "zero1")
        and d.offload == "none"
        and s.tp_mode == "megatron"
        and s.cp_mode == "ring"
        and (m.tp == 1 or s.sequence_parallel)
        and s.schedule in ("1f1b", "interleaved")
    ):
        return "megatron"
    return "hybrid"
