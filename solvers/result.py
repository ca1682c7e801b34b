"""What a search returns: the best plan, how sure we are of it, and the runners-up."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from costmodel.report import Report
from solvers.space import axes_above_one
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
    bound: float | None  # proven lower bound on the optimal step time; None where none was proven
    status: str  # optimal, feasible or time_limit
    space: str
    solver: str  # which solver settled the best plan
    candidates: int  # plans priced (uniform grid cells plus per-layer options)
    time_s: float
    alternatives: list[Found] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float | None:
        """(objective - bound) / objective, None without a proven bound."""
        if self.bound is None:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective) if self.objective > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return 0.0 if self.objective <= 0 else self.options.get("global_batch", 0) / self.objective


def proven_bound(objective: float, left: list[float]) -> float | None:
    """The lower bound a search proves on the optimum: the least of ``objective`` and the bounds of
    what it left unsolved, or None where one of those proved none (-inf or NaN: a MIP stopped by its
    time limit before its first bound)."""
    if any(math.isnan(b) or b == -math.inf for b in left):
        return None
    return min([objective, *left])


def finite_or_none(x: float | None) -> float | None:
    """``x`` where it is a finite number, else None (what a plan document records of an infinite
    objective, a missing bound or a NaN gap)."""
    return x if x is not None and math.isfinite(x) else None


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


def parallel_axes(s: Strategy) -> int:
    """How many mesh axes ``s`` runs above 1 (pp, dp_replicate, dp_shard, cp, tp, ep): what a
    person has to set up and get right."""
    m = s.mesh
    return axes_above_one(m.pp, m.dp_replicate, m.dp_shard, m.cp, m.tp, m.ep)


def simpler_runner_up(fastest: Found, runners_up: list[Found], pair: float) -> tuple[int, Found] | None:
    """The runner-up (its index and plan) with the fewest parallel axes, fewer than ``fastest``'s,
    among those within ``pair`` of its step time (the fastest of them at equal axes); None if none.
    Read from the search's runners-up only: an offer, not an exact search (:func:`break_tie`)."""
    cutoff = fastest.step_time_s * (1.0 + pair)
    within = [(parallel_axes(f.strategy), f.step_time_s, i, f) for i, f in enumerate(runners_up)
              if f.step_time_s <= cutoff and parallel_axes(f.strategy) < parallel_axes(fastest.strategy)]
    if not within:
        return None
    _, _, i, found = min(within, key=lambda x: x[:3])
    return i, found


def break_tie(fastest: Found, pair: float, search_axes: Callable[[int, float], Found | None]) -> Found:
    """The plan to recommend: of the plans whose step time is within ``pair`` (the relative error of
    comparing two configurations of one job: the published sweeps' band) of the ``fastest``, the
    fastest of those with the fewest parallel axes (:func:`parallel_axes`). The cost model cannot tell
    them apart; the simpler plan is as likely to be the faster and less to get wrong.

    ``search_axes(a, cutoff)`` is the fastest plan of at most ``a`` axes faster than ``cutoff``
    seconds, or None: a search of the space narrowed to such meshes, so the answer is exact (the
    runners-up of the fastest's search are not enough: what cannot beat the fastest is pruned)."""
    cutoff = fastest.step_time_s * (1.0 + pair)
    for axes in range(1, parallel_axes(fastest.strategy)):
        found = search_axes(axes, cutoff)
        if found is not None and found.step_time_s <= cutoff:
            return found
    return fastest
