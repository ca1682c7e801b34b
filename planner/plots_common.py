"""What the figures of :mod:`planner.plots` share: a new figure or the caller's axes, the title line
naming the plan's inputs, the pass that keeps texts from overlapping once the layout is known, and
the writing of a figure (:func:`save_figure`: same figure, same bytes)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

#: smallest font any figure uses (points): legible at the default size and dpi
SMALL = 7.5
#: the figures' resolution, also what ``save_plot`` writes at: text is measured (its hinted widths
#: vary with the pixel size) at the resolution it is laid out and drawn at
DPI = 150


def new_figure(size: tuple[float, float]) -> Figure:
    """A headless figure (Agg canvas, constrained layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: Path, fmt: str) -> None:
    """Write ``fig`` as ``fmt`` (``png``, ``svg``) at :data:`DPI`, whole or not at all, and the same
    bytes for the same figure: no date in the metadata, the SVG's element ids hashed with a fixed salt
    (not a random one)."""
    from matplotlib import rc_context

    from vocab.io import write_with

    metadata = {"Date": None} if fmt in ("svg", "pdf") else None
    with rc_context({"svg.hashsalt": "shardplan"}):
        write_with(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=DPI, metadata=metadata))


def new_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes, bool]:
    """``ax``'s figure and ``ax``, or a new figure of ``size`` with one axes; True when the figure is ours."""
    if ax is not None:
        return ax.figure, ax, False  # type: ignore[return-value]
    fig = new_figure(size)
    return fig, fig.add_subplot(), True


def cluster_name(plan: Plan) -> str:
    """``1024x h100-sxm``, as ``explain`` names the cluster."""
    c = plan.inputs.cluster
    return f"{c.world_size}x {c.accelerator}"


def target_name(plan: Plan) -> str:
    """``torchtitan 0.2.2``, or ``any``."""
    t = plan.inputs.target
    return f"{t.name} {t.version}" if t.version else t.name


def plan_title(plan: Plan) -> str:
    """The line every figure's title ends with: model, cluster, target and workload."""
    w = plan.inputs.workload
    return (f"{plan.inputs.model} on {cluster_name(plan)}, target {target_name(plan)}; "
            f"seq {w.seq_len}, global batch {w.global_batch}")


def renderer_of(fig: Figure) -> RendererBase | None:
    """The figure's renderer after a layout pass, or None where its canvas has none."""
    get = getattr(fig.canvas, "get_renderer", None)
    if get is None:
        return None
    fig.draw_without_rendering()
    return get()


def padded(bb: Bbox, pad: float = 1.0) -> Bbox:
    from matplotlib.transforms import Bbox

    return Bbox.from_extents(bb.x0 - pad, bb.y0 - pad, bb.x1 + pad, bb.y1 + pad)


def overlaps(a: Bbox, b: Bbox) -> bool:
    """Strict overlap of two display boxes (touching edges do not count)."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def thin_ticks(ax: Axes, axis: str, ticks: Sequence[float], labels: Sequence[str], priority: Iterable[int] = (),
               **text: Any) -> None:
    """Set the tick ``labels`` at ``ticks``, then keep only those that do not overlap one kept before
    (indices in ``priority`` first, then in order): dense categorical axes stay readable."""
    setter = ax.set_xticks if axis == "x" else ax.set_yticks
    setter(list(ticks), list(labels), **text)
    r = renderer_of(ax.figure)  # type: ignore[arg-type]
    if r is None:
        return
    boxes = [lb.get_window_extent(r) for lb in (ax.get_xticklabels() if axis == "x" else ax.get_yticklabels())]
    order = list(dict.fromkeys([*priority, *range(len(ticks))]))
    kept: list[int] = []
    for i in order:
        if all(not overlaps(padded(boxes[i]), boxes[j]) for j in kept):
            kept.append(i)
    kept.sort()
    if len(kept) < len(ticks):
        setter([ticks[i] for i in kept], [labels[i] for i in kept], **text)


def hide_overlapping(texts: Sequence[Text], renderer: RendererBase | None, inside: Sequence[Bbox | None] = ()) -> None:
    """Hide each text (in order) that overlaps one kept before it, or spills out of its box in
    ``inside`` (a box per text, None for no bound)."""
    if renderer is None:
        return
    kept: list[Bbox] = []
    for i, t in enumerate(texts):
        bb = t.get_window_extent(renderer)
        box = inside[i] if i < len(inside) else None
        spill = box is not None and (bb.x0 < box.x0 - 0.5 or bb.x1 > box.x1 + 0.5)
        if spill or any(overlaps(padded(bb), k) for k in kept):
            t.set_visible(False)
        else:
            kept.append(bb)


def freeze(fig: Figure, owned: bool) -> None:
    """Fix the layout that the text placement was measured against (our own figures only): saving
    does not lay it out again around texts that were hidden or placed since."""
    if owned:
        fig.draw_without_rendering()
        fig.set_layout_engine("none")
