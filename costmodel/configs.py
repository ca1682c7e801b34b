"""Configurations the cost model prices at once: named arrays of mesh degrees and modes.

Every cost formula is written over these arrays (shape ``(C,)``); pricing one plan is pricing
one configuration (``ConfigArrays.of_strategy``). Configurations are
:class:`vocab.strategy.MeshConfig` objects: strategies without their per-unit choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from vocab.strategy import MeshConfig, Strategy

F = np.ndarray


@dataclass(frozen=True)
class AxisGroup:
    """A communication group: ``size`` ranks ``stride`` apart in the global rank order (scalars,
    or arrays over configurations)."""

    size: Any
    stride: Any


@dataclass
class ConfigArrays:
    """Configuration arrays (length C); degrees as floats, modes as booleans."""

    pp: F
    dp_replicate: F
    dp_shard: F
    cp: F
    tp: F
    ep: F
    micro_batch: F
    vpp: F
    schedule: np.ndarray  # object array of schedule names
    sequence_parallel: F
    tsp: F  # tp_mode == "tsp"
    ulysses: F  # cp_mode == "ulysses"
    alltoall: F  # cp_rotate == "alltoall": the ring passes K/V point to point, step by step

    @classmethod
    def of(cls, configs: Sequence[MeshConfig]) -> ConfigArrays:
        degrees = np.array([(c.pp, c.dp_replicate, c.dp_shard, c.cp, c.tp, c.ep, c.micro_batch, c.vpp)
                            for c in configs], dtype=float).reshape(-1, 8).T
        modes = np.array([(c.sequence_parallel, c.tp_mode == "tsp", c.cp_mode == "ulysses",
                           c.cp_rotate == "alltoall") for c in configs], dtype=bool).reshape(-1, 4).T
        schedule = np.empty(len(configs), dtype=object)
        schedule[:] = [c.schedule for c in configs]
        pp, dpr, dps, cp, tp, ep, mb, vpp = (np.ascontiguousarray(d) for d in degrees)
        sp, tsp, uly, a2a = (np.ascontiguousarray(m) for m in modes)
        return cls(pp, dpr, dps, cp, tp, ep, mb, vpp, schedule, sp, tsp, uly, a2a)

    @classmethod
    def of_strategy(cls, s: Strategy) -> ConfigArrays:
        """One configuration: the mesh and modes of ``s``."""
        return one_config(MeshConfig.of(s))

    @property
    def size(self) -> int:
        return len(self.tp)

    @property
    def dp(self) -> F:
        return self.dp_replicate * self.dp_shard

    def num_microbatches(self, global_batch: int) -> F:
        """Micro-batches per step (:meth:`Strategy.num_microbatches`)."""
        return global_batch // (self.dp * self.micro_batch)

    # ---- communication groups (global rank order: pp, dp_replicate, dp_shard, cp, tp) ----------
    @property
    def tp_group(self) -> AxisGroup:
        return AxisGroup(self.tp, np.ones_like(self.tp))

    @property
    def cp_group(self) -> AxisGroup:
        return AxisGroup(self.cp, self.tp)

    @property
    def shard_group(self) -> AxisGroup:
        """dp_shard x cp: the group ZeRO/FSDP shards dense states over."""
        return AxisGroup(self.dp_shard * self.cp, self.tp)

    @property
    def expert_shard_group(self) -> AxisGroup:
        """The shard group over ep: what expert states are sharded over."""
        return AxisGroup(self.dp_shard * self.cp // self.ep, self.tp * self.ep)

    @property
    def ep_group(self) -> AxisGroup:
        return AxisGroup(self.ep, self.tp)

    @property
    def replicate_group(self) -> AxisGroup:
        return AxisGroup(self.dp_replicate, self.tp * self.cp * self.dp_shard)

    @property
    def pp_group(self) -> AxisGroup:
        return AxisGroup(self.pp, self.tp * self.cp * self.dp_shard * self.dp_replicate)

    def rows(self, idx: np.ndarray) -> ConfigArrays:
        """The configurations at ``idx``."""
        return ConfigArrays(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


@lru_cache(maxsize=4096)
def one_config(cfg: MeshConfig) -> ConfigArrays:
    """The arrays of one configuration (shared: nothing writes to them)."""
    return ConfigArrays.of([cfg])
