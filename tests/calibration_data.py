"""Test data of ``shardplan calibrate``: five runs per trainer, each a configuration exported for the
trainer and a log in its format written from a known set of constants (``TRUTH``), with the answers
(``answers.json``: the constants, and per run the steady step time and memory the log holds).

    python -m tests.calibration_data     # rewrites tests/data/calibration/

The GPU trainers' runs are Llama 3 8B on 16 H100s (two nodes) at 2,048 tokens, five meshes and global
batches each trainer can express; shardplan's own are GPT-2 on four CPU processes, as ``shardplan train``
runs them, as plan documents. A run's log is priced from the configuration read back through
``shardplan import``, as ``calibrate`` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "calibration"
#: the constants the logs are written from
TRUTH = {
    "gpu": {"compute": 0.85, "network": 0.6, "overhead": 0.25, "fragmentation": 0.12},
    "cpu": {"compute": 1.7, "network": 0.8, "overhead": 0.05, "fragmentation": 0.12, "context": 0.5 * 1024**3},
}
GPU = {"model": "llama3-8b", "cluster": "16xh100", "seq_len": 2048}
CPU = {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128}


def _strategy(pp: int = 1, dpr: int = 1, dps: int = 1, tp: int = 1, sharding: str = "zero1", mb: int = 1,
              sp: bool = False) -> Any:
    from vocab.strategy import LayerStrategy, Mesh, Strategy

    return Strategy(mesh=Mesh(pp=pp, dp_replicate=dpr, dp_shard=dps, cp=1, tp=tp), micro_batch=mb,
                    sequence_parallel=sp, default=LayerStrategy(sharding=sharding))


def cases(fmt: str) -> list[tuple[Any, int]]:
    """The five (strategy, global batch) runs of a trainer."""
    s = _strategy
    return {
        "megatron": [(s(dps=16), 32), (s(dps=8, tp=2, sp=True), 64), (s(pp=2, dps=4, tp=2, sp=True), 128),
                     (s(dpr=16, sharding="replicate"), 16), (s(dps=4, tp=4, sp=True), 256)],
        "torchtitan": [(s(dps=16, sharding="zero3"), 32), (s(dps=8, tp=2, sp=True, sharding="zero3"), 64),
                       (s(dpr=2, dps=8, sharding="zero3"), 128), (s(dpr=2, dps=4, tp=2, sp=True, sharding="zero3"), 16),
                       (s(dps=4, tp=4, sp=True, sharding="zero3"), 256)],
        "deepspeed": [(s(dps=16), 32), (s(dps=16, sharding="zero2"), 64), (s(dps=16, sharding="zero3"), 128),
                      (s(dps=16, sharding="zero3"), 16), (s(dps=16), 256)],
        "nanotron": [(s(dps=16), 32), (s(dps=8, tp=2), 64), (s(pp=2, dps=4, tp=2), 128), (s(dps=16), 16),
                     (s(dps=4, tp=4), 256)],
        "shardplan": [(s(dpr=4, sharding="replicate"), 8), (s(dps=4, sharding="zero3"), 16), (s(dps=2, tp=2), 8),
                      (s(pp=2, dpr=2, sharding="replicate", mb=2), 16), (s(tp=4), 32)],
    }[fmt]


def config_plan(fmt: str, strategy: Any, global_batch: int, out: Path) -> Path:
    """The run's configuration written for the trainer (a plan document for shardplan's runtime)."""
    from planner.api import target_behaviour
    from planner.reprice import price
    from planner.trainers import export
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from vocab.plan import TargetRef
    from vocab.strategy import Workload
    from vocab.targets import load_target

    base = CPU if fmt == "shardplan" else GPU
    t = load_target(fmt)
    w = Workload(seq_len=base["seq_len"], global_batch=global_batch,
                 precision="fp32" if fmt == "shardplan" else "bf16", **target_behaviour(t, "bf16"))
    plan = price(load_model(base["model"], base["seq_len"]), parse_cluster(base["cluster"]), strategy, w,
                 model=base["model"])
    plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(
        update={"target": TargetRef(name=t.name, version=t.version or None)})})
    if fmt == "shardplan":
        out = out.with_suffix(".json")
        plan.save(out)
        return out
    e = export(plan, fmt)
    out = out.with_suffix(e.suffix)
    out.write_text(e.text)
    return out


def import_options(fmt: str) -> dict[str, Any]:
    """What ``calibrate`` needs besides a configuration (a DeepSpeed JSON names no model, cluster or
    sequence length)."""
    return {"model": GPU["model"], "cluster": GPU["cluster"], "seq_len": GPU["seq_len"]} if fmt == "deepspeed" else {}


def write_run(fmt: str, config: Path, truth: dict[str, float], terms: bool = False) -> dict[str, Any]:
    """The run's log, priced from its configuration with ``truth``; its answers."""
    from costmodel.calibration import synthetic
    from costmodel.calibration.check import priced_parts
    from costmodel.calibration.fit import MEMORY_OF, Run, report, tensor_peak
    from costmodel.calibration.knobs import base_constants, settings
    from planner.calibration import ImportOptions, plan_of
    from planner.reprice import plan_cluster, plan_graph

    plan = plan_of(config, ImportOptions(**import_options(fmt)))
    cl = plan_cluster(plan)
    overrides, network = settings(truth, base_constants(cl))
    run = Run(str(config), "", fmt, plan_graph(plan), cl, plan.strategy, plan.inputs.workload, None)  # type: ignore[arg-type]
    rep = report(run, overrides, network)
    c = base_constants(cl).with_overrides(overrides)
    t = tensor_peak(rep)
    memory = {k: f(t, c.fragmentation, c.context_bytes) for k, f in MEMORY_OF.items()}
    w = plan.inputs.workload
    parts = priced_parts(rep.to_dict()) if terms else {}
    synth = synthetic.SynthRun(w.global_batch, w.seq_len, cl.world_size, synthetic.step_times(rep.step_time_s),
                               memory, parts)
    log = config.with_suffix(".log")
    log.write_text(synthetic.WRITERS[fmt](synth))
    return {"config": config.name, "log": log.name, "step_time_s": rep.step_time_s, "memory": memory,
            "terms": parts}


def write_all(root: Path = DATA) -> None:
    """Every trainer's five runs and its answers under ``root``."""
    for fmt in ("megatron", "torchtitan", "deepspeed", "nanotron", "shardplan"):
        d = root / fmt
        d.mkdir(parents=True, exist_ok=True)
        truth = TRUTH["cpu" if fmt == "shardplan" else "gpu"]
        runs = []
        for i, (s, gb) in enumerate(cases(fmt)):
            config = config_plan(fmt, s, gb, d / f"run{i}")
            runs.append(write_run(fmt, config, truth, terms=fmt in ("megatron", "deepspeed")))
        (d / "answers.json").write_text(json.dumps({"truth": truth, **import_options(fmt), "runs": runs},
                                                   indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_all()
