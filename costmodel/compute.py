"""Per-operator compute time on one device, without parallelism: what ``profile model`` compares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.device import DeviceModel
from costmodel.strategy import Strategy, Workload
from costmodel.units import node_times
from profiler.graph import LayerGraph
from profiler.hardware import Accelerator, Cluster

if TYPE_CHECKING:
    from profiler.profile_schema import Profile


def layer_times(
    graph: LayerGraph, accelerator: Accelerator, profile: Profile | None = None, micro_batch: int = 1,
    precision: str = "bf16",
) -> dict[str, tuple[float, float]]:
    """Predicted (forward, backward) seconds of every operator for one micro-batch on one device."""
    dev = DeviceModel(Cluster(accelerator, 1, 1), profile)
    s = Strategy(micro_batch=micro_batch)
    w = Workload(seq_len=graph.seq_len, global_batch=micro_batch, precision=precision)  # type: ignore[arg-type]
    return {n.name: node_times(n, dev, s, w) for n in graph.nodes}
