"""Per-operator compute time on one device, without parallelism: what ``profile model`` compares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.node_costs import node_times
from profiler.graph import LayerGraph
from profiler.hardware import Accelerator, Cluster
from vocab.strategy import Strategy, Workload

if TYPE_CHECKING:
    from profiler.profile_schema import LayerMeasurement, Profile


def layer_times(
    graph: LayerGraph, accelerator: Accelerator, profile: Profile | None = None, micro_batch: int = 1,
    precision: str = "bf16",
) -> dict[str, tuple[float, float]]:
    """Predicted (forward, backward) seconds of every operator for one micro-batch on one device."""
    dev = DeviceModel(Cluster(accelerator, 1, 1), profile)
    s = Strategy(micro_batch=micro_batch)
    w = Workload(seq_len=graph.seq_len, global_batch=micro_batch, precision=precision)  # type: ignore[arg-type]
    cfg = ConfigArrays.of_strategy(s)
    out = {}
    for n in graph.nodes:
        f, b = node_times(n, dev, cfg, w)
        out[n.name] = (float(f[0]), float(b[0]))
    return out


def with_predicted_times(rows: list[LayerMeasurement], graph: LayerGraph, accelerator: Accelerator,
                         profile: Profile | None = None) -> list[LayerMeasurement]:
    """``rows`` (``profiler.measure_model.measure_layers``) with the predicted forward and backward
    time of the same nodes (a block: the sum of its nodes) at the rows' micro-batch; fp16 rows are
    priced like bf16."""
    if not rows:
        return rows
    precision = "fp32" if rows[0].dtype == "fp32" else "bf16"
    pred = layer_times(graph, accelerator, profile=profile, micro_batch=rows[0].micro_batch, precision=precision)
    out = []
    for r in rows:
        members = graph.members(r.layer)
        out.append(r.model_copy(update={"predicted_fwd_s": sum(pred.get(n.name, (0.0, 0.0))[0] for n in members),
                                        "predicted_bwd_s": sum(pred.get(n.name, (0.0, 0.0))[1] for n in members)}))
    return out
