"""The per-layer strategy map (``shardplan plot --kind layers``): one column per unit (embedding,
transformer layers, head), one row per choice (pipeline stage, sharding, recomputation, offload,
OSDP split). Stages alternate two greys and carry their number where it fits; every setting has its
own colour, and "none" (no recomputation, no offload, no split) is white hatched in every row."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from planner.compare import short_strategy, unit_choices
from planner.plots_common import (
    SMALL,
    freeze,
    new_axes,
    overlaps,
    padded,
    plan_title,
    renderer_of,
    thin_ticks,
)
from planner.reprice import block_index, unit_stages, units_of
from vocab.errors import ShardplanError
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

#: the setting's fill colour; None draws "none" (white, hatched)
PALETTES: dict[str, dict[Any, str | None]] = {
    "sharding": {"replicate": "#bdbdbd", "zero1": "#c6dbef", "zero2": "#6baed6", "zero3_keep": "#2171b5",
                 "zero3": "#08306b"},
    "recompute": {"none": None, "selective": "#fdae6b", "full": "#d94801"},
    "offload": {"none": None, "optimizer": "#a1d99b", "params": "#238b45"},
}
STAGE_GREYS = ("#e3e3e3", "#a9a9a9")
NONE_HATCH, NONE_EDGE = "////", "#8c8c8c"
ROW_NAMES = {"stage": "pipeline stage", "sharding": "sharding", "recompute": "recompute", "offload": "offload",
             "split": "OSDP split"}


def split_color(k: int) -> str | None:
    if k <= 1:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    return to_hex(colormaps["Purples"](min(0.35 + math.log2(k) / 8, 1.0)))


def _runs(vals: list[Any]) -> list[tuple[Any, int, int]]:
    runs: list[tuple[Any, int, int]] = []
    for i, val in enumerate(vals):
        if runs and runs[-1][0] == val:
            runs[-1] = (val, runs[-1][1], i)
        else:
            runs.append((val, i, i))
    return runs


def _style(field: str, val: Any) -> dict[str, Any]:
    if field == "stage":
        return {"facecolor": STAGE_GREYS[val % 2], "edgecolor": "white"}
    color = split_color(val) if field == "split" else PALETTES[field].get(val, "#8c8c8c")
    if color is None:
        return {"facecolor": "white", "edgecolor": "white", "hatch": NONE_HATCH, "hatchcolor": NONE_EDGE}
    return {"facecolor": color, "edgecolor": "white"}


def plot_layers(plan: Plan, ax: Axes | None = None) -> Figure:
    """Rows: pipeline stage, sharding, recompute, offload, OSDP split; one column per unit."""
    units = units_of(plan)
    if not units:
        raise ShardplanError("cannot list the plan's units (no stages recorded and the model does not load)")
    s = plan.strategy
    where = unit_stages(s, units)
    rows: list[tuple[str, list[Any]]] = [
        ("stage", [where[u][0] for u in units]),
        *((f, [unit_choices(s, u)[f] for u in units]) for f in ("sharding", "recompute", "offload", "split")),
    ]
    fig, ax, owned = new_axes(ax, (12.0, 4.4))
    from matplotlib.patches import Patch

    handles: list[Patch] = []
    stage_texts: list[tuple[Text, tuple[float, float]]] = []
    none_used = False
    for y, (field, vals) in enumerate(rows):
        for val, a, b in _runs(vals):
            ax.barh(y, b - a + 1, left=a - 0.5, height=0.8, linewidth=0.6, gid=f"layers/{field}/{val}",
                    **_style(field, val))
            if field == "stage":
                stage_texts.append((ax.text((a + b) / 2, y, str(val), ha="center", va="center", fontsize=SMALL),
                                    (a - 0.5, b + 0.5)))
            elif field == "split" and val > 1:
                ax.text((a + b) / 2, y, f"x{val}", ha="center", va="center", fontsize=SMALL, color="white")
        used = list(dict.fromkeys(vals))
        if field in PALETTES:
            for v in PALETTES[field]:
                if v in used and PALETTES[field][v] is not None:
                    handles.append(Patch(**_style(field, v), label=f"{field}: {v}"))
        elif field == "split":
            handles += [Patch(**_style(field, k), label=f"OSDP split x{k}") for k in sorted(used) if k > 1]
        none_used = none_used or (field in ("recompute", "offload") and "none" in vals) or (field == "split" and 1 in vals)
    if none_used:
        handles.append(Patch(**_style("offload", "none"), label="none (no recompute / offload / split)"))
    vpp = s.vpp > 1
    ax.set_yticks(range(len(rows)), [("virtual stage" if vpp else ROW_NAMES["stage"]),
                                     *(ROW_NAMES[f] for f, _ in rows[1:])])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-0.5, len(units) - 0.5)
    ax.set_xlabel("unit (embedding, transformer layers L0..Ln, head)")
    n_stages = len(set(rows[0][1]))
    how = (f"{n_stages} virtual stages on {s.mesh.pp} ranks (stage k on rank k mod {s.mesh.pp})" if vpp
           else f"{n_stages} pipeline stage" + ("s" if n_stages > 1 else ""))
    ax.set_title(f"Per-layer strategy: {short_strategy(s)}; {how}\n{plan_title(plan)}", fontsize=10.5, wrap=True)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="settings",
              title_fontsize=8)
    names = [u.replace("layers.", "L").replace("embedding", "emb") for u in units]
    ticks = _regular(units)
    thin_ticks(ax, "x", ticks, [names[i] for i in ticks],
               [j for j, i in enumerate(ticks) if block_index(units[i]) is None], fontsize=SMALL)
    _label_stages(ax, stage_texts)
    freeze(fig, owned)
    return fig


def _label_stages(ax: Axes, texts: list[tuple[Text, tuple[float, float]]]) -> None:
    """Show the stage numbers at the smallest round step where each sits inside its stage and none
    overlap (every stage, every 2nd, 4th, 5th, ...)."""
    r = renderer_of(ax.figure)  # type: ignore[arg-type]
    if r is None:
        return
    boxes = [t.get_window_extent(r) for t, _ in texts]
    runs = [ax.transData.transform([(x0, 0), (x1, 0)])[:, 0] for _, (x0, x1) in texts]
    for step in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 256):
        show = [i for i, (t, _) in enumerate(texts) if int(t.get_text()) % step == 0]
        inside = all(runs[i][0] - 0.5 <= boxes[i].x0 and boxes[i].x1 <= runs[i][1] + 0.5 for i in show)
        if inside and not any(overlaps(padded(boxes[i]), boxes[j]) for i, j in zip(show, show[1:], strict=False)):
            break
    else:
        show = []
    for i, (t, _) in enumerate(texts):
        t.set_visible(i in show)


def _regular(units: list[str]) -> list[int]:
    """Tick positions: the first and last units and every block at a round step (about 24 ticks)."""
    blocks = len(units)
    step = next(k for k in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 100, 128, 10**9) if blocks / k <= 24)
    return [i for i, u in enumerate(units) if (b := block_index(u)) is None or b % step == 0]
