"""Throughput against memory (``shardplan plot --kind pareto``): the plan and the alternatives the
search kept, the Pareto frontier of those that fit, and the per-GPU limit. Points carry a number
(the plan: ``plan``) placed where it overlaps no other label and no marker, with a leader line when
it sits away from its point; a key below lists each number's strategy, step time and memory."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from planner.compare import short_strategy
from planner.plots_common import SMALL, freeze, new_axes, overlaps, padded, plan_title, renderer_of
from planner.reprice import memory_limit_gib, predicted_dict
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backend_bases import RendererBase
    from matplotlib.figure import Figure
    from matplotlib.transforms import Bbox

PLAN, FITS, OVER = "#d62728", "#4c72b0", "#999999"
RADII = (3, 8, 14, 22, 32, 45, 60, 80, 100, 125)  # points from the marker's centre
KEY_TITLE = "key: label, strategy, step time, peak memory per GPU"
LINE_FROM = 14  # a leader line from this far
ANGLES = (40, 140, -40, -140, 0, 180, 90, -90, 65, 115, -65, -115)


def frontier(xy: list[tuple[float, float]], fits: list[bool]) -> list[int]:
    """Indices of the fitting points no other fitting point beats on both memory and throughput,
    by memory."""
    out, best = [], -math.inf
    for i in sorted((i for i in range(len(xy)) if fits[i]), key=lambda i: (xy[i][0], -xy[i][1])):
        if xy[i][1] > best:
            out.append(i)
            best = xy[i][1]
    return out


def plot_pareto(plan: Plan, ax: Axes | None = None) -> Figure:
    """Throughput against peak memory per GPU for the plan and its alternatives, with the frontier."""
    pts: list[tuple[str, Any, dict[str, Any]]] = [("plan", plan.strategy, predicted_dict(plan))]
    pts += [(f"{i + 1}", a.strategy, a.predicted.model_dump()) for i, a in enumerate(plan.alternatives)]
    limit = memory_limit_gib(plan)
    xy = [(float(p["memory_peak_gib"]), float(p["tokens_per_s_per_gpu"])) for _, _, p in pts]
    fits = [x <= limit for x, _ in xy]
    front = frontier(xy, fits)
    fig, ax, owned = new_axes(ax, (11.0, 6.0 + 0.11 * len(pts)))
    sizes = _draw_points(ax, xy, fits, front, limit, legend=True)
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("throughput (tokens/s per GPU)")
    n_alt = len(plan.alternatives)
    note = "" if n_alt else " (no alternatives recorded)"
    ax.set_title(f"Throughput vs memory: the plan and {n_alt} alternatives the search kept{note}\n"
                 f"{plan_title(plan)}", fontsize=10.5, wrap=True)
    ys = [y for _, y in xy]
    span = (max(ys) - min(ys)) or max(ys) * 0.1 or 1.0
    ax.set_xlim(0, max(limit, max(x for x, _ in xy)) * 1.12)
    ax.set_ylim(max(0.0, min(ys) - 0.12 * span), max(ys) + 0.14 * span)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    leg = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    entries = [f"{name:>4}  {short_strategy(s)}  {p['step_time_s']:.4g} s/step, {p['memory_peak_gib']:.1f} GiB"
               + ("" if fits[i] else " (over)") for i, (name, s, p) in enumerate(pts)]
    from matplotlib.lines import Line2D

    blank = [Line2D([], [], linestyle="none") for _ in entries]
    ncols = 2 if len(entries) > 6 and max(map(len, entries)) <= 62 else 1
    key_kw: dict[str, Any] = {"handlelength": 0, "handletextpad": 0, "ncols": ncols, "title_fontsize": 8,
                              "prop": {"family": "monospace", "size": SMALL}, "frameon": False,
                              "title": KEY_TITLE}
    if owned:
        key = fig.legend(blank, entries, loc="outside lower center", **key_kw)
    else:
        key = ax.legend(blank, entries, loc="upper center", bbox_to_anchor=(0.5, -0.14), **key_kw)
        ax.add_artist(leg)
    r = renderer_of(fig)
    if r is not None:
        names = [name for name, _, _ in pts]
        order = [0, *front, *sorted(range(len(pts)), key=lambda i: -xy[i][1])]
        zoom = _zoom(ax, r, xy, fits, front, limit)
        placed: set[int] = set()
        blocked: list[Bbox] = []
        if zoom is not None:
            inset, near = zoom
            r = renderer_of(fig)
            assert r is not None
            placed = _place_labels(inset, r, names, xy, sizes, [i for i in order if i in near])
            blocked = [inset.get_tightbbox(r), _data_box(ax, [xy[i] for i in near], 6.0)]
            order = [i for i in order if i not in near]
        placed |= _place_labels(ax, r, names, xy, sizes, order, blocked)
        for i, text in enumerate(key.get_texts()):
            if i not in placed:
                text.set_color("#9a9a9a")
        if len(placed) < len(pts):
            key.set_title(KEY_TITLE + " (grey: not labelled on the plot, too crowded)")
    freeze(fig, owned)
    return fig


def _draw_points(ax: Axes, xy: list[tuple[float, float]], fits: list[bool], front: list[int], limit: float,
                 legend: bool) -> list[float]:
    """The frontier, the points and the limit; the markers' sizes (points squared)."""
    lab = (lambda t: t) if legend else (lambda t: None)
    if len(front) > 1:
        ax.step([xy[i][0] for i in front], [xy[i][1] for i in front], where="post", color="#555555", linewidth=1.2,
                label=lab("Pareto frontier (plans that fit)"), zorder=2)
    alt_fit = [i for i in range(1, len(xy)) if fits[i]]
    alt_over = [i for i in range(1, len(xy)) if not fits[i]]
    gid = "pareto" if legend else "pareto-zoom"
    if alt_fit:
        ax.scatter([xy[i][0] for i in alt_fit], [xy[i][1] for i in alt_fit], s=45, marker="o", color=FITS, zorder=3,
                   label=lab("alternative that fits"), gid=f"{gid}/fits")
    if alt_over:
        ax.scatter([xy[i][0] for i in alt_over], [xy[i][1] for i in alt_over], s=45, marker="x", color=OVER,
                   zorder=3, label=lab("alternative over the limit"), gid=f"{gid}/over")
    ax.scatter([xy[0][0]], [xy[0][1]], s=170, marker="*", color=PLAN, zorder=4, label=lab("this plan"),
               gid=f"{gid}/plan", edgecolor="white", linewidth=0.6)
    ax.axvline(limit, color=PLAN, linestyle="--", linewidth=1.2, label=lab(f"memory limit {limit:.1f} GiB"), zorder=1)
    return [170.0] + [45.0] * (len(xy) - 1)


def _data_box(ax: Axes, pts: list[tuple[float, float]], pad: float) -> Bbox:
    """The display box around data points, ``pad`` pixels wider."""
    from matplotlib.transforms import Bbox

    d = ax.transData.transform(pts)
    return Bbox.from_extents(d[:, 0].min() - pad, d[:, 1].min() - pad, d[:, 0].max() + pad, d[:, 1].max() + pad)


def _zoom(ax: Axes, r: RendererBase, xy: list[tuple[float, float]], fits: list[bool], front: list[int],
          limit: float) -> tuple[Axes, set[int]] | None:
    """Where three or more points crowd around the plan (markers closer than a label's width), an inset
    of that region in an empty corner of the axes; with the points it shows."""
    px = ax.figure.dpi / 72.0
    disp = ax.transData.transform(xy)
    near, todo = {0}, [0]
    while todo:
        j = todo.pop()
        for i in range(len(xy)):
            if i not in near and math.dist(disp[i], disp[j]) < 16 * px:
                near.add(i)
                todo.append(i)
    if len(near) < 3:
        return None
    box = ax.get_window_extent(r)
    crowd = _data_box(ax, [xy[i] for i in near], 30 * px)
    from matplotlib.transforms import Bbox

    for fx, fy in ((0.56, 0.09), (0.14, 0.09), (0.14, 0.56), (0.56, 0.56), (0.35, 0.09), (0.35, 0.56)):
        w, h = 0.38, 0.36
        x0, y0 = box.x0 + fx * box.width, box.y0 + fy * box.height
        room = Bbox.from_extents(x0 - 45 * px, y0 - 20 * px, x0 + w * box.width + 4 * px, y0 + h * box.height + 4 * px)
        if overlaps(room, crowd) or any(room.contains(x, y) for x, y in disp):
            continue
        inset = ax.inset_axes((fx, fy, w, h))
        _draw_points(inset, xy, fits, front, limit, legend=False)
        xs, ys = [xy[i][0] for i in near], [xy[i][1] for i in near]
        dx = (max(xs) - min(xs)) or abs(xs[0]) * 0.02 or 1.0
        dy = (max(ys) - min(ys)) or abs(ys[0]) * 0.02 or 1.0
        inset.set_xlim(min(xs) - 0.25 * dx, max(xs) + 0.25 * dx)
        inset.set_ylim(min(ys) - 0.3 * dy, max(ys) + 0.3 * dy)
        inset.tick_params(labelsize=SMALL)
        from matplotlib.ticker import MaxNLocator

        inset.xaxis.set_major_locator(MaxNLocator(4))
        inset.yaxis.set_major_locator(MaxNLocator(4))
        inset.grid(alpha=0.3)
        inset.set_title("zoom: around the plan", fontsize=SMALL, pad=3)
        ax.indicate_inset_zoom(inset, edgecolor="#555555")
        return inset, near
    return None


def _place_labels(ax: Axes, r: RendererBase, names: list[str], xy: list[tuple[float, float]], sizes: list[float],
                  order: list[int], blocked: Sequence[Bbox] = ()) -> set[int]:
    """Annotate points in ``order`` (each once) where the label (with its leader line) overlaps no other
    label, leader line or ``blocked`` box, its text no marker, and it stays inside the axes; the
    indices placed."""
    from matplotlib.transforms import Bbox

    px = ax.figure.dpi / 72.0
    inside = ax.get_window_extent(r)
    disp = ax.transData.transform(xy)
    markers = []
    for (x, y), s in zip(disp, sizes, strict=True):
        rad = (math.sqrt(s) / 2 + 1) * px
        markers.append(Bbox.from_extents(x - rad, y - rad, x + rad, y + rad))
    taken: list[Bbox] = list(blocked)
    placed: set[int] = set()
    for i in dict.fromkeys(order):
        if not inside.contains(*disp[i]):
            continue
        kw = {"fontsize": 8, "fontweight": "bold" if i == 0 else "normal"}
        probe = ax.text(0, 0, names[i], transform=None, **kw)
        size = probe.get_window_extent(r)
        probe.remove()
        others = [d for j, d in enumerate(disp) if j != i]
        spot = _spot(disp[i], size.width, size.height, px, markers, taken, inside, others)
        if spot is None:
            continue
        (dx, dy), ha, va, box, line = spot
        ax.annotate(names[i], xy[i], xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, zorder=5,
                    arrowprops={"arrowstyle": "-", "color": "#777777", "linewidth": 0.6, "shrinkA": 1,
                                "shrinkB": 3} if line else None, **kw)
        taken.append(box)
        placed.add(i)
    return placed


def _spot(at: Any, w: float, h: float, px: float, markers: list[Bbox], taken: list[Bbox], inside: Bbox,
          others: Sequence[Any] = ()) -> tuple[tuple[float, float], str, str, Bbox, bool] | None:
    """The first offset (nearest first) where a ``w`` x ``h`` label of the point ``at`` fits; with a
    leader line when it sits far from the point or nearer another point (``others``) than its own."""
    from matplotlib.transforms import Bbox

    for rad in RADII:
        for ang in ANGLES:
            dx, dy = rad * math.cos(math.radians(ang)), rad * math.sin(math.radians(ang))
            ha = "left" if dx > 0.5 else ("right" if dx < -0.5 else "center")
            va = "bottom" if dy > 0.5 else ("top" if dy < -0.5 else "center")
            x0 = at[0] + dx * px - {"left": 0.0, "right": w, "center": w / 2}[ha]
            y0 = at[1] + dy * px - {"bottom": 0.0, "top": h, "center": h / 2}[va]
            text = Bbox.from_bounds(x0, y0, w, h)
            if not (inside.x0 <= text.x0 and text.x1 <= inside.x1 and inside.y0 <= text.y0 and text.y1 <= inside.y1):
                continue
            cx, cy = x0 + w / 2, y0 + h / 2
            own = math.dist((cx, cy), at)
            line = rad >= LINE_FROM or any(math.dist((cx, cy), o) <= own for o in others)
            box = Bbox.union([text, Bbox.from_extents(at[0], at[1], at[0], at[1])]) if line else text
            if any(overlaps(padded(box, 2.0), t) for t in taken) or any(overlaps(padded(text, 1.0), m) for m in markers):
                continue
            return (dx, dy), ha, va, box, line
    return None
