"""Hand-made plan documents: wrap a :class:`Strategy` into a :class:`vocab.plan.Plan`.

Useful for tests, examples and trying a strategy without running a solver. The ``predicted``
block holds placeholders (``solver.name == "user"``, status ``given``): nothing was priced.
"""

from __future__ import annotations

from profiler.transformer import build_graph
from runtime.model import resolve_config
from vocab.plan import ClusterRef, Plan, PlanInputs, Predicted, SolverInfo
from vocab.strategy import Strategy, Workload


def hand_plan(model: str, strategy: Strategy, seq_len: int = 32, global_batch: int = 8,
              accelerator: str = "cpu") -> Plan:
    """A plan for ``model`` (a runtime tiny model or a preset) that runs ``strategy`` as given."""
    cfg = resolve_config(model)
    world = strategy.mesh.world_size
    return Plan(
        inputs=PlanInputs(
            model=model, model_hash=build_graph(cfg, seq_len).content_hash(),
            cluster=ClusterRef(accelerator=accelerator, nodes=1, gpus_per_node=world, world_size=world, memory_gb=16),
            workload=Workload(seq_len=seq_len, global_batch=global_batch),
        ),
        strategy=strategy,
        predicted=Predicted(step_time_s=1.0, tokens_per_s_per_gpu=0.0, mfu=0.0, hfu=0.0, memory_peak_gib=0.0),
        solver=SolverInfo(name="user"),
    )
