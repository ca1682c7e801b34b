"""Figures of a plan (``shardplan plot``): memory per stage, the step time, the per-layer strategy
map, and the throughput/memory Pareto frontier of the plan and its alternatives.

Every figure draws the plan's own numbers: the step-time bar's segments are the breakdown
``shardplan explain`` prints, each per-rank row of the timeline sums to the step time, each stage's
memory bar to the stage's peak; titles name the model, the cluster and the target, axes carry units,
and texts that would overlap are thinned out once the layout is known.

Figures are built on :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot, no global
backend switch), so they work headless and inside notebooks alike. Every ``plot_*`` function draws
into ``ax`` when given, else into a new figure, and returns the figure. The figures live in
``planner.plots_memory``, ``plots_timeline``, ``plots_layers`` and ``plots_pareto``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from planner.plots_common import plan_title, save_figure
from planner.plots_layers import PALETTES, plot_layers
from planner.plots_memory import MEMORY_PARTS, plot_memory
from planner.plots_pareto import frontier, plot_pareto
from planner.plots_timeline import Op, plot_timeline, rank_rows, schedule_order, simulate, step_components
from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import check_writable
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from profiler.graph import LayerGraph

__all__ = ["FORMATS", "KINDS", "MEMORY_PARTS", "PALETTES", "PLOTTERS", "Op", "check_output", "frontier", "plan_title",
           "plot", "plot_layers", "plot_memory", "plot_pareto", "plot_timeline", "rank_rows", "save_plot",
           "schedule_order", "simulate", "step_components"]

KINDS = ("memory", "timeline", "layers", "pareto")
FORMATS = {".png": "png", ".svg": "svg"}


PLOTTERS = {"memory": plot_memory, "timeline": plot_timeline, "layers": plot_layers, "pareto": plot_pareto}


def plot(plan: Plan, kind: str = "memory", ax: Axes | None = None, graph: LayerGraph | None = None) -> Figure:
    """Draw ``kind``; ``graph`` (the timeline's model instead of the plan's) is used by ``timeline`` only."""
    if kind not in PLOTTERS:
        raise UnknownNameError("plot kind", kind, KINDS)
    if kind == "timeline":
        return plot_timeline(plan, ax, graph)
    return PLOTTERS[kind](plan, ax)


def check_output(path: str | Path) -> str:
    """The image format for ``path`` by its suffix (``.png`` or ``.svg``)."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise ShardplanError(f"output '{path}': the suffix must be .png or .svg")
    return fmt


def save_plot(plan: Plan, kind: str, path: str | Path, graph: LayerGraph | None = None) -> Path:
    """Draw and write atomically (a temporary file renamed over ``path``); nothing is left on error."""
    out = Path(path)
    fmt = check_output(out)
    if kind not in PLOTTERS:
        raise UnknownNameError("plot kind", kind, KINDS)
    check_writable(out, "output")
    fig = plot(plan, kind, graph=graph)
    save_figure(fig, out, fmt)
    return out
