"""``shardplan calibrate``: the cost model's device constants fitted on the user's own runs; ``shardplan
check``: a running job's log against its plan.

``calibrate CONFIG LOG [CONFIG LOG ...] -o cluster.yaml`` reads each configuration (a plan document, or
a trainer's file as ``import`` reads it) and its log, takes each run's steady state, fits a few
parameters (:mod:`costmodel.calibration.knobs`) and writes the calibration; it refuses, in one line,
runs that cannot separate the parameters asked for. ``plan``, ``estimate``, ``explain`` and ``sweep``
take the file with ``--calibration``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, guard, print_json
from planner.layout import kv_table, literal, literal_lines
from planner.options import int_option
from vocab.errors import ShardplanError

FROM_HELP = "torchtitan | megatron | deepspeed | nanotron | shardplan: the trainer of the configurations (default: " \
            "a plan document, else from each file's suffix)"
FORMAT_HELP = "megatron | torchtitan | deepspeed | nanotron | shardplan (default: told from the log's lines)"
GIB = 1024.0**3


def _fit_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ShardplanError("--fit names no parameter")
    from costmodel.calibration.knobs import check_names

    check_names(names)
    return names


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _runs_table(fitted: Any) -> Table:
    t = Table(title="runs: steady step time, measured and priced before and after the fit")
    for col in ("run", "measured s", "before", "after", "memory GiB"):
        t.add_column(col, justify="left" if col == "run" else "right", overflow="fold")
    for r in fitted.runs:
        mem = "-"
        if r.get("memory"):
            mem = (f"{r['memory'] / GIB:.3g} {r['memory_kind']}\n{_pct(r['before_memory'] / r['memory'] - 1)} -> "
                   f"{_pct(r['after_memory'] / r['memory'] - 1)}")
        spread = (r["high_s"] - r["low_s"]) / r["step_time_s"]
        t.add_row(literal_lines([Path(str(r["config"])).name, f"{r['format']}, {r['records'] - r['warmup']} of "
                                 f"{r['records']} records"]),
                  f"{r['step_time_s']:.4g}\n±{spread / 2:.1%}",
                  f"{r['before_s']:.4g}\n{_pct(r['before_s'] / r['step_time_s'] - 1)}",
                  f"{r['after_s']:.4g}\n{_pct(r['after_s'] / r['step_time_s'] - 1)}", mem)
    return t


def _params_table(doc: dict[str, Any]) -> Table:
    t = Table(title=f"parameters fitted on {doc['accelerator']}")
    for col in ("parameter", "prior", "fitted", "moved", "bounds"):
        t.add_column(col, justify="left" if col == "parameter" else "right")
    for p in doc["parameters"]:
        moved = "-" if p["moved"] is None else _pct(p["moved"])
        scale, unit = (GIB, " GiB") if p["name"] == "context" else (1.0, "")
        t.add_row(p["name"], f"{p['prior'] / scale:.4g}{unit}", f"{p['value'] / scale:.4g}{unit}", moved,
                  f"{p['bounds'][0] / scale:.3g}-{p['bounds'][1] / scale:.3g}")
    return t


def _summary(doc: dict[str, Any]) -> str:
    err = doc["error"]
    b, a = err["before"]["step_time"], err["after"]["step_time"]
    line = (f"step time error on these runs: median {b['median_abs']:.1%} -> {a['median_abs']:.1%}, worst "
            f"{b['max_abs']:.1%} -> {a['max_abs']:.1%}")
    if err["after"]["memory"]:
        mb, ma = err["before"]["memory"], err["after"]["memory"]
        line += f"; memory: median {mb['median_abs']:.1%} -> {ma['median_abs']:.1%}"
    band = doc["band"]
    return line + f"; band {band['low']:+.1%} to {band['high']:+.1%}"


@app.command("calibrate")
@guard
def calibrate_cmd(
    paths: list[Path] = typer.Argument(..., help="CONFIG LOG pairs: a run's configuration (plan JSON or trainer "
                                       "file) and its training log"),
    output: Path = typer.Option(..., "--output", "-o", help="the calibration to write (.yaml)"),
    fit: str | None = typer.Option(None, "--fit", help="parameters to fit, comma-separated, of compute (or gemm "
                                   "and memory), network, overhead, fragmentation, context (default: compute, network, "
                                   "overhead, and the memory ones the logs measure)"),
    trainer: str | None = typer.Option(None, "--from", help=FROM_HELP),
    model: str | None = typer.Option(None, "--model", "-m", help="the configurations' model, where they do not name it"),
    cluster: str | None = typer.Option(None, "--cluster", "-c", help="the configurations' cluster, where they do not "
                                       "name it"),
    seq_len: int | None = int_option(None, "--seq-len", minimum=1, help="tokens per sample, where the configurations "
                                     "do not say it"),
    log_format: str | None = typer.Option(None, "--log-format", help=FORMAT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the calibration as JSON"),
) -> None:
    """Fit the cost model's device constants to your cluster's own runs (configurations and logs)."""
    from costmodel.calibration.document import write_calibration
    from costmodel.calibration.fit import calibrate
    from planner.calibration import ImportOptions, load_run, pairs
    from vocab.io import check_writable

    if output.suffix.lower() not in (".yaml", ".yml"):
        raise ShardplanError(f"-o must name a .yaml file, got '{output}'")
    check_writable(output, "-o")
    names = _fit_names(fit)
    opts = ImportOptions(trainer, model, cluster, seq_len)
    runs = [load_run(c, lg, opts, log_format) for c, lg in pairs(paths)]
    fitted = calibrate(runs, names)
    doc = write_calibration(fitted, output)
    if as_json:
        print_json(doc)
        return
    console.print(_runs_table(fitted))
    console.print(_params_table(doc))
    console.print(literal(_summary(doc)), soft_wrap=True)
    console.print(literal(f"wrote {output}"), soft_wrap=True)


@app.command("check")
@guard
def check_cmd(
    plan: Path = typer.Argument(..., help="the plan the job runs (plan JSON, or the trainer's configuration)"),
    log: Path = typer.Argument(..., help="the job's training log"),
    log_format: str | None = typer.Option(None, "--log-format", help=FORMAT_HELP),
    calibration: Path | None = typer.Option(None, "--calibration", help="price the plan with this calibration "
                                            "(shardplan calibrate) first"),
    trainer: str | None = typer.Option(None, "--from", help=FROM_HELP),
    model: str | None = typer.Option(None, "--model", "-m", help="the configuration's model, where it names none"),
    cluster: str | None = typer.Option(None, "--cluster", "-c", help="the configuration's cluster, where it names none"),
    seq_len: int | None = int_option(None, "--seq-len", minimum=1, help="tokens per sample, where the configuration "
                                     "does not say it"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Compare a running job's log with its plan: step time part by part, memory, the likeliest cause."""
    from costmodel.calibration.check import compare
    from costmodel.calibration.document import load_calibration
    from costmodel.calibration.knobs import base_constants
    from costmodel.calibration.logs import read_log, steady
    from planner.calibration import ImportOptions, calibrated_plan, check_sizes, plan_of, recorded
    from planner.reprice import PlanFiles, opening, plan_cluster, plan_graph

    cal = load_calibration(calibration) if calibration is not None else None
    doc = plan_of(plan, ImportOptions(trainer, model, cluster, seq_len))
    run_log = read_log(log, log_format)
    check_sizes(doc, run_log)
    if cal is not None:
        with opening(PlanFiles(models=frozenset([model] if model else []))):
            doc = calibrated_plan(doc, cal, plan_graph(doc))
    cal = recorded(doc)
    cl = plan_cluster(doc)
    consts = base_constants(cl).with_overrides(cal.constants if cal else {})
    w = doc.inputs.workload
    measured = steady(run_log, w.global_batch, w.seq_len, cl.world_size)
    result = compare(doc.predicted.model_dump(), measured, consts.fragmentation, consts.context_bytes)
    if as_json:
        print_json({"log": str(log), "format": run_log.format, "records": measured.records,
                    "warmup": measured.warmup, **result.to_dict()})
        return
    console.print(_check_table(result.rows, f"{log.name} ({run_log.format}, {measured.used} of {measured.records} "
                                            f"records) against {plan.name}"))
    console.print(literal(f"likeliest cause: {result.cause}"), soft_wrap=True)
    console.print(literal(f"memory: {result.memory_note}"), soft_wrap=True)


def _check_table(rows: list[dict[str, Any]], title: str) -> Table:
    t = kv_table(literal(title))
    for r in rows:
        unit = r["unit"]
        scale, shown = (GIB, "GiB") if unit == "B" else (1.0, "s")
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "not priced"
        t.add_row(r["what"], f"{r['measured'] / scale:.4g} {shown} measured, {r['predicted'] / scale:.4g} {shown} "
                             f"priced: {ratio}")
    return t
