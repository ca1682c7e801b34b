"""Memory per pipeline stage (``shardplan plot --kind memory``): one horizontal bar per stage, its
segments the parts ``explain`` lists (parameters, gradients, optimizer states, activations, buffers,
overhead), each bar as long as the stage's peak, against the per-GPU limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.compare import label_units
from planner.plots_common import (
    SMALL,
    freeze,
    hide_overlapping,
    new_axes,
    plan_title,
    renderer_of,
    thin_ticks,
)
from planner.reprice import memory_limit_gib, predicted_dict
from vocab.errors import ShardplanError
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MEMORY_PARTS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#55a868"),
                ("optimizer", "optimizer states", "#c44e52"), ("activations", "activations", "#8172b2"),
                ("buffers", "buffers", "#ccb974"), ("overhead", "overhead", "#64b5cd"))


def short_units(units: list[str]) -> str:
    """``emb + L0-3``, ``L120-125 + head``: a stage's units in a tick label."""
    return label_units(units).replace("layers.", "L").replace("embedding", "emb") if units else "no units"


def plot_memory(plan: Plan, ax: Axes | None = None) -> Figure:
    """Stacked memory of one GPU of each pipeline stage at its peak, against the per-GPU limit."""
    stages = predicted_dict(plan).get("stages") or []
    if not stages:
        raise ShardplanError("this plan records no per-stage memory (predicted.stages): nothing to plot")
    n = len(stages)
    fig, ax, owned = new_axes(ax, (11.0, min(max(3.2, 1.9 + 0.19 * n), 15.0)))
    ys = list(range(n))
    left = [0.0] * n
    for key, label, color in MEMORY_PARTS:
        vals = [float(s.get(f"{key}_gib", 0.0)) for s in stages]
        bars = ax.barh(ys, vals, left=left, height=0.7, color=color, label=label, edgecolor="white",
                       linewidth=0.4 if n <= 16 else 0.0)
        for s, rect in zip(stages, bars, strict=True):
            rect.set_gid(f"memory/{s.get('stage')}/{key}")
        left = [a + b for a, b in zip(left, vals, strict=True)]
    limit = memory_limit_gib(plan)
    peak = max(range(n), key=lambda i: left[i])
    ax.axvline(limit, color="#d62728", linestyle="--", linewidth=1.5, label=f"limit {limit:.1f} GiB per GPU")
    totals = [ax.text(t, y, f" {t:.1f}" + (" GiB (peak)" if y == peak else ""), va="center", ha="left",
                      fontsize=SMALL + (0.5 if y == peak else 0.0), fontweight="bold" if y == peak else "normal",
                      bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.0})
              for y, t in enumerate(left)]
    ax.set_xlim(0, max(limit, left[peak]) * 1.16)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("memory of one GPU of the stage, at its peak (GiB)")
    ax.set_ylabel("pipeline stage")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fit = "fits" if left[peak] <= limit else "DOES NOT FIT"
    ax.set_title(f"Memory per GPU by pipeline stage: peak {left[peak]:.1f} of {limit:.1f} GiB "
                 f"(stage {stages[peak].get('stage', peak)}), {fit}\n{plan_title(plan)}", fontsize=10.5, wrap=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="per GPU", title_fontsize=8)
    labels = [f"stage {s.get('stage', i)}: {short_units(list(s.get('units') or []))}" for i, s in enumerate(stages)]
    thin_ticks(ax, "y", ys, labels, [peak], fontsize=SMALL if n > 8 else 9)
    hide_overlapping([totals[peak], *(t for i, t in enumerate(totals) if i != peak)], renderer_of(fig))
    freeze(fig, owned)
    return fig
