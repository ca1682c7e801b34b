"""Runs of the user's cluster read for ``shardplan calibrate`` and ``check``, and a calibration
applied to a plan.

A run is a configuration and its log. The configuration is a plan document (what ``shardplan train``
ran) or a trainer's file read through ``shardplan import`` (:func:`planner.trainers.import_plan`); the
log is read by its trainer's parser (:mod:`costmodel.calibration.formats`) and reduced to its steady
state with the run's global batch, sequence length and GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from costmodel.calibration.document import Calibration
    from costmodel.calibration.fit import Run
    from costmodel.calibration.logs import RunLog
    from vocab.plan import Plan


def is_plan_document(path: Path) -> bool:
    """Whether ``path`` holds a plan document (a JSON object with ``schema_version`` and ``strategy``),
    not a trainer's configuration."""
    from vocab.io import read_text

    if path.suffix.lower() != ".json":
        return False
    head = read_text(path, "configuration")[:65536]
    return '"schema_version"' in head and '"strategy"' in head


@dataclass(frozen=True)
class ImportOptions:
    """What reading a trainer's configuration may need besides the file (``shardplan import``'s
    ``--from``, ``--model``, ``--cluster``, ``--seq-len``: a DeepSpeed JSON names none of them)."""

    trainer: str | None = None
    model: str | None = None
    cluster: str | None = None
    seq_len: int | None = None


def plan_of(config: Path, opts: ImportOptions = ImportOptions()) -> Plan:
    """The plan a configuration runs: the plan document itself, or the trainer's file imported."""
    from planner.trainers import import_plan
    from vocab.plan import load_plan

    if opts.trainer is None and is_plan_document(config):
        return load_plan(config)
    return import_plan(config, opts.trainer, opts.model, opts.cluster, opts.seq_len)


def check_sizes(plan: Plan, log: RunLog) -> None:
    """The log's global batch and sequence length, where it prints them, are the configuration's."""
    w = plan.inputs.workload
    for what, said, planned in (("global batch", log.global_batch, w.global_batch),
                                ("sequence length", log.seq_len, w.seq_len)):
        if said is not None and said != planned:
            raise ShardplanError(f"{log.origin} trained a {what} of {said:,}; its configuration says {planned:,}")


def load_run(config: Path, log_path: Path, opts: ImportOptions = ImportOptions(), log_format: str | None = None) -> Run:
    """One run: the plan its configuration runs and the steady state of its log."""
    from costmodel.calibration.fit import Run
    from costmodel.calibration.logs import read_log, steady
    from planner.reprice import PlanFiles, opening, plan_cluster, plan_graph

    plan = plan_of(config, opts)
    log = read_log(log_path, log_format)
    check_sizes(plan, log)
    w = plan.inputs.workload
    with opening(PlanFiles(models=frozenset([opts.model] if opts.model else []))):
        graph = plan_graph(plan)
    cl = plan_cluster(plan)
    return Run(str(config), str(log_path), log.format, graph, cl, plan.strategy, w,
               steady(log, w.global_batch, w.seq_len, cl.world_size))


def pairs(paths: list[Path]) -> list[tuple[Path, Path]]:
    """``CONFIG LOG [CONFIG LOG ...]`` as pairs."""
    if not paths or len(paths) % 2:
        raise ShardplanError(f"give the runs as CONFIG LOG pairs; got {len(paths)} path(s)")
    return [(paths[i], paths[i + 1]) for i in range(0, len(paths), 2)]


def calibrated_plan(plan: Plan, calibration: Calibration, graph: Any = None) -> Plan:
    """``plan`` (and its runners-up) priced again with ``calibration``, which it then records."""
    from costmodel.estimate import estimate
    from planner.reprice import plan_cluster, plan_graph
    from vocab.plan import Alternative, CalibrationRef, Predicted

    graph = graph if graph is not None else plan_graph(plan)
    dev = calibration.device(plan_cluster(plan))
    limit = plan.inputs.memory_limit_gib

    def priced(s: Any) -> Predicted:
        return Predicted(**estimate(graph, dev.cluster, s, plan.inputs.workload, None, limit, device=dev).to_dict())

    inputs = plan.inputs.model_copy(update={"calibration": CalibrationRef(**calibration.ref())})
    return plan.model_copy(update={
        "inputs": inputs, "predicted": priced(plan.strategy),
        "alternatives": [Alternative(strategy=a.strategy, predicted=priced(a.strategy)) for a in plan.alternatives]})


def recorded(plan: Plan) -> Calibration | None:
    """The calibration a plan was priced with (``inputs.calibration``), or None."""
    from costmodel.calibration.document import Calibration

    ref = getattr(plan.inputs, "calibration", None)
    return Calibration.from_ref(ref.model_dump()) if ref is not None else None
