"""Configurations the cost model prices at once: named arrays of mesh degrees and modes.

Every cost formula is written over these arrays (shape ``(C,)``); pricing one plan is pricing
one configuration (``ConfigArrays.of_strategy``). Configurations are
:class:`vocab.strategy.MeshConfig` objects: strategies without their per-unit choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import Any

import numpy as np

from vocab.strategy import DEGREES, MeshConfig, MeshFacts, Strategy, num_microbatches

F = np.ndarray
#: the numeric columns of :class:`ConfigArrays`, as named by :class:`MeshConfig`: the mesh
#: degrees, the expert-tensor-parallel ranks (0: as tp), then the micro-batch size and the virtual
#: stages per rank
NUMBERS = (*DEGREES, "etp", "micro_batch", "vpp")
#: the boolean columns of :class:`ConfigArrays`, each what a :class:`MeshConfig` says
MODES: dict[str, Callable[[MeshConfig], bool]] = {
    "sequence_parallel": lambda c: c.sequence_parallel,
    "tsp": lambda c: c.tp_mode == "tsp",
    "ulysses": lambda c: c.cp_mode == "ulysses",
    "alltoall": lambda c: c.cp_rotate == "alltoall",  # the ring passes K/V point to point, step by step
}


@dataclass(frozen=True)
class AxisGroup:
    """A communication group: ``size`` ranks ``stride`` apart in the global rank order (scalars,
    or arrays over configurations)."""

    size: Any
    stride: Any


@dataclass
class ConfigArrays(MeshFacts):
    """Configuration arrays (length C): the columns :data:`NUMBERS` as floats, the schedule names,
    the columns :data:`MODES` as booleans; the mesh facts (:class:`vocab.strategy.MeshFacts`) as
    arrays."""

    pp: F
    dp_replicate: F
    dp_shard: F
    cp: F
    tp: F
    ep: F
    etp: F
    micro_batch: F
    vpp: F
    schedule: np.ndarray  # object array of schedule names
    sequence_parallel: F
    tsp: F  # tp_mode == "tsp"
    ulysses: F  # cp_mode == "ulysses"
    alltoall: F  # cp_rotate == "alltoall": the ring passes K/V point to point, step by step

    @classmethod
    def of(cls, configs: Sequence[MeshConfig]) -> ConfigArrays:
        numbers = attrgetter(*NUMBERS)
        values = np.array([numbers(c) for c in configs], dtype=float).reshape(-1, len(NUMBERS)).T
        modes = np.array([tuple(f(c) for f in MODES.values()) for c in configs], dtype=bool).reshape(-1, len(MODES)).T
        schedule = np.empty(len(configs), dtype=object)
        schedule[:] = [c.schedule for c in configs]
        return cls(**dict(zip(NUMBERS, map(np.ascontiguousarray, values), strict=True)), schedule=schedule,
                   **dict(zip(MODES, map(np.ascontiguousarray, modes), strict=True)))

    @classmethod
    def of_strategy(cls, s: Strategy) -> ConfigArrays:
        """One configuration: the mesh and modes of ``s``."""
        return one_config(MeshConfig.of(s))

    @property
    def size(self) -> int:
        return len(self.tp)

    def num_microbatches(self, global_batch: int) -> F:
        """Micro-batches per step (:func:`vocab.strategy.num_microbatches`)."""
        return num_microbatches(global_batch, self.dp, self.micro_batch)

    # ---- communication groups (global rank order: pp, dp_replicate, dp_shard, cp, tp; the experts'
    # ranks of a stage replica in the order edp, ep, etp, etp innermost: Megatron's and torchtitan's) ---
    @property
    def tp_group(self) -> AxisGroup:
        return AxisGroup(self.tp, np.ones_like(self.tp))

    @property
    def cp_group(self) -> AxisGroup:
        return AxisGroup(self.cp, self.tp)

    @property
    def shard_group(self) -> AxisGroup:
        """dp_shard x cp: the group ZeRO/FSDP shards dense states over."""
        return AxisGroup(self.shard, self.tp)

    @property
    def expert_shard_group(self) -> AxisGroup:
        """What expert states are sharded over (:attr:`vocab.strategy.MeshFacts.expert_shard`)."""
        return AxisGroup(self.expert_shard, self.expert_tp * self.ep)

    @property
    def ep_group(self) -> AxisGroup:
        return AxisGroup(self.ep, self.expert_tp)

    @property
    def expert_tp_group(self) -> AxisGroup:
        """The ranks that split each expert's width (the tp group where ``etp`` is unset)."""
        return AxisGroup(self.expert_tp, np.ones_like(self.tp))

    @property
    def replicate_group(self) -> AxisGroup:
        return AxisGroup(self.dp_replicate, self.tp * self.shard)

    @property
    def pp_group(self) -> AxisGroup:
        return AxisGroup(self.pp, self.tp * self.dp_all)

    def rows(self, idx: np.ndarray) -> ConfigArrays:
        """The configurations at ``idx``."""
        return ConfigArrays(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


@lru_cache(maxsize=4096)
def one_config(cfg: MeshConfig) -> ConfigArrays:
    """The arrays of one configuration (shared: nothing writes to them)."""
    return ConfigArrays.of([cfg])
