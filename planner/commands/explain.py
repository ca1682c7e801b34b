"""``shardplan explain | compare | plot | export``: read plan documents, show, draw and translate them.

Bad input (a missing or malformed plan, an unknown ``--kind`` or ``--to``, a wrong output suffix) is
one line on stderr and exit code 2, checked before anything is written; so is an export of a plan the
target cannot express (without ``--nearest``) or whose nearest plan does not fit. A plan never runs code
and never chooses a file: where a command re-prices a plan it uses the preset the plan names or the
layer graph it records; ``--model`` on the command line (which may import a ``package.module:factory``)
replaces it, and is needed for a plan whose model is a config path. The profile a plan names is used
only with ``--profile-from-plan`` (``--profile PATH`` gives one); without either, a note says it is
not loaded. Strings of a plan are printed literally.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from planner.cli import app, console, err_console, guard
from planner.layout import literal
from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from planner.reprice import PlanFiles
    from profiler.graph import LayerGraph
    from vocab.plan import Plan

PROFILE_HELP = "re-price with this measured profile"
FROM_PLAN_HELP = "re-price with the profile the plan names (a plan names its profile for the record only)"
MODEL_HELP = ("re-price with this model instead of the plan's: preset, config.json path or pkg.module:factory "
              "(a factory: imports and runs that code)")


def _print_json(data: object) -> None:
    """Indented JSON with sorted keys; NaN and infinities are refused (``ValueError``), never printed."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")


def _files(plan: Plan, profile: Path | None, profile_from_plan: bool, model: str | None) -> PlanFiles:
    """What re-pricing ``plan`` may use (:func:`planner.reprice.command_line_files`); its note on stderr."""
    from planner.reprice import command_line_files

    files, notes = command_line_files(plan, profile, profile_from_plan, model)
    for note in notes:
        err_console.print(literal(f"note: {note}"), soft_wrap=True)
    return files


def _cli_graph(model: str | None, plan: Plan) -> LayerGraph | None:
    """The layer graph of the command line's ``--model`` at the plan's sequence length (imports a
    factory: the user's explicit choice), or None without one."""
    if model is None:
        return None
    from profiler.models import load_model

    return load_model(model, plan.inputs.workload.seq_len)


@app.command("explain")
@guard
def explain_cmd(
    plan: Path = typer.Argument(..., help="plan JSON written by 'shardplan plan'"),
    calibration: Path | None = typer.Option(None, "--calibration", help="price the plan and its runners-up with "
                                            "this calibration of your cluster (shardplan calibrate) first"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    compare_with: Path | None = typer.Option(
        None, "--compare-with", help="a trainer's configuration (torchtitan TOML, Megatron-LM arguments, "
        "DeepSpeed JSON, nanotron YAML) priced beside the plan: its model, cluster, sequence length and limit"),
) -> None:
    """Explain a plan: mesh on the nodes, schedule, per-stage memory, step time, solver, vs runner-up."""
    from planner.explain import explain_data, render_explain
    from vocab.plan import load_plan

    doc = load_plan(plan)
    if calibration is not None:
        from costmodel.calibration.document import load_calibration
        from planner.calibration import calibrated_plan

        doc = calibrated_plan(doc, load_calibration(calibration))
    data = explain_data(doc)
    if compare_with is not None:
        from planner.compare_config import compared_config

        data["compared_with"] = compared_config(doc, compare_with)
    if as_json:
        _print_json(data)
    else:
        render_explain(data, console)
        if compare_with is not None:
            c = data["compared_with"]
            console.print(literal(f"compared with {c['file']} ({c['target']}): {c['mesh']}, step {c['step_time_s']:.4g} s "
                                  f"(global batch {c['global_batch']}), {c['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                                  f"{c['memory_peak_gib']:.1f} GiB: {c['verdict']}"))
            console.print(literal(c["where"]))


def _names(paths: list[Path]) -> list[str]:
    stems = [p.stem for p in paths]
    return [str(p) if stems.count(p.stem) > 1 else p.stem for p in paths]


@app.command("compare")
@guard
def compare_cmd(
    plans: list[Path] = typer.Argument(..., help="two or more plan JSON files"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Compare plans side by side, the differences first."""
    from planner.compare import compare, render_compare
    from vocab.plan import load_plan

    if len(plans) < 2:
        raise ShardplanError(f"compare needs at least two plans, got {len(plans)}")
    data = compare([load_plan(p) for p in plans], _names(plans))
    if as_json:
        _print_json(data)
    else:
        render_compare(data, console)


@app.command("plot")
@guard
def plot_cmd(
    plan: Path = typer.Argument(..., help="plan JSON"),
    kind: str = typer.Option("memory", "--kind", "-k", help="memory | timeline | layers | pareto"),
    output: Path = typer.Option(..., "--output", "-o", help="image to write: .png or .svg"),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP + " (timeline)"),
    profile: Path | None = typer.Option(None, "--profile", help=PROFILE_HELP + " (timeline)"),
    profile_from_plan: bool = typer.Option(False, "--profile-from-plan", help=FROM_PLAN_HELP + " (timeline)"),
) -> None:
    """Draw a plan: memory per stage, a step timeline, the per-layer strategy map or the Pareto frontier."""
    from planner.plots import KINDS, check_output, save_plot
    from planner.reprice import PlanFiles, opening
    from vocab.errors import UnknownNameError
    from vocab.plan import load_plan

    if kind not in KINDS:
        raise UnknownNameError("plot kind", kind, KINDS)
    check_output(output)
    doc = load_plan(plan)
    timeline = kind == "timeline"
    files = _files(doc, profile, profile_from_plan, model) if timeline else PlanFiles()
    with opening(files):
        save_plot(doc, kind, output, _cli_graph(model, doc) if timeline else None)
    err_console.print(literal(f"wrote {output}"), soft_wrap=True)


@app.command("export")
@guard
def export_cmd(
    plan: Path = typer.Argument(..., help="plan JSON"),
    to: str = typer.Option(..., "--to", help="torchtitan | megatron | deepspeed | nanotron | python (or shardplan)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="file to write (default: stdout)"),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    nearest: bool = typer.Option(False, "--nearest", help="where the target cannot express the plan, export the "
                                 "nearest plan it can (re-priced; refused when it does not fit)"),
    profile: Path | None = typer.Option(None, "--profile", help=PROFILE_HELP),
    profile_from_plan: bool = typer.Option(False, "--profile-from-plan", help=FROM_PLAN_HELP),
) -> None:
    """Write a plan as a framework's configuration; refuse (exit 2) what the target cannot express."""
    from planner.reprice import command_line_files, opening
    from planner.trainers import check_target, checked_export
    from vocab.io import check_writable, write_atomic
    from vocab.plan import load_plan

    target = check_target(to)
    if output is not None:
        check_writable(output, "output")
    doc = load_plan(plan)
    files, notes = command_line_files(doc, profile, profile_from_plan, model)
    with opening(files):
        result = checked_export(doc, target, _cli_graph(model, doc), nearest)
    for i, line in enumerate(result.warnings()):
        err_console.print(literal(("warning: " if i == 0 else "") + line), soft_wrap=True)
    for note in [*notes, *result.notes] if result.repriced is not None else result.notes:
        err_console.print(literal(f"note: {note}"), soft_wrap=True)
    if output is None:
        sys.stdout.write(result.text)
    else:
        write_atomic(output, result.text)
        err_console.print(literal(f"wrote {output}"), soft_wrap=True)
