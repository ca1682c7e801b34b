"""``shardplan explain | compare | plot | export``: read plan documents, show, draw and translate them.

Bad input (a missing or malformed plan, an unknown ``--kind`` or ``--to``, a wrong output suffix) is
one line on stderr and exit code 2, checked before anything is written; so is an export of a plan the
target cannot express (without ``--nearest``) or whose nearest plan does not fit. A plan never runs code:
where a command re-prices a plan it uses the model the plan names or the layer graph it records;
``--model`` on the command line (which may import a ``package.module:factory``) replaces it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from planner.cli import app, console, err_console, guard
from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from profiler.graph import LayerGraph
    from vocab.plan import Plan

MODEL_HELP = ("re-price with this model instead of the plan's: preset, config.json path or pkg.module:factory "
              "(a factory: imports and runs that code)")


def _print_json(data: object) -> None:
    """Indented JSON with sorted keys; NaN and infinities are refused (``ValueError``), never printed."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")


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
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Explain a plan: mesh on the nodes, schedule, per-stage memory, step time, solver, vs runner-up."""
    from planner.explain import explain_data, render_explain
    from vocab.plan import load_plan

    data = explain_data(load_plan(plan))
    if as_json:
        _print_json(data)
    else:
        render_explain(data, console)


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
) -> None:
    """Draw a plan: memory per stage, a step timeline, the per-layer strategy map or the Pareto frontier."""
    from planner.plots import KINDS, check_output, save_plot
    from vocab.errors import UnknownNameError
    from vocab.plan import load_plan

    if kind not in KINDS:
        raise UnknownNameError("plot kind", kind, KINDS)
    check_output(output)
    doc = load_plan(plan)
    save_plot(doc, kind, output, _cli_graph(model, doc) if kind == "timeline" else None)
    err_console.print(f"wrote {output}", highlight=False)


@app.command("export")
@guard
def export_cmd(
    plan: Path = typer.Argument(..., help="plan JSON"),
    to: str = typer.Option(..., "--to", help="torchtitan | megatron | deepspeed | nanotron | python (or shardplan)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="file to write (default: stdout)"),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    nearest: bool = typer.Option(False, "--nearest", help="where the target cannot express the plan, export the "
                                 "nearest plan it can (re-priced; refused when it does not fit)"),
) -> None:
    """Write a plan as a framework's configuration; refuse (exit 2) what the target cannot express."""
    from planner.exports import check_target, export, refusal
    from vocab.io import check_writable, write_atomic
    from vocab.plan import load_plan

    target = check_target(to)
    if output is not None:
        check_writable(output, "output")
    doc = load_plan(plan)
    result = export(doc, target, _cli_graph(model, doc))
    problem = refusal(result, nearest)
    if problem is not None:
        raise ShardplanError(problem)
    for i, line in enumerate(result.warnings()):
        err_console.print(("warning: " if i == 0 else "") + line, markup=False, highlight=False, soft_wrap=True)
    for note in result.notes:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if output is None:
        sys.stdout.write(result.text)
    else:
        write_atomic(output, result.text)
        err_console.print(f"wrote {output}", highlight=False)
