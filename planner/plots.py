"""Figures of a plan (``shardplan plot``): memory per stage, a step timeline, the per-layer strategy map,
and the throughput/memory Pareto frontier of the plan and its alternatives.

Figures are built on :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot, no global
backend switch), so they work headless and inside notebooks alike. Every ``plot_*`` function draws
into ``ax`` when given, else into a new figure, and returns the figure.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.compare import label_units, short_strategy, unit_choices
from planner.reprice import StageTimes, memory_limit_gib, predicted_dict, stage_times, unit_stages, units_of
from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import check_writable
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from profiler.graph import LayerGraph

KINDS = ("memory", "timeline", "layers", "pareto")
FORMATS = {".png": "png", ".svg": "svg"}
MEMORY_PARTS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#55a868"),
                ("optimizer", "optimizer states", "#c44e52"), ("activations", "activations", "#8172b2"),
                ("buffers", "buffers", "#ccb974"), ("overhead", "overhead", "#64b5cd"))
OP_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "comm": "#8c1c13", "sync": "#8172b2",
             "optim": "#937860", "idle": "#eeeeee"}
PALETTES = {
    "sharding": {"replicate": "#d9d9d9", "zero1": "#c6dbef", "zero2": "#6baed6", "zero3_keep": "#3182bd",
                 "zero3": "#08519c"},
    "recompute": {"none": "#f4f4f4", "selective": "#fdae6b", "full": "#e6550d"},
    "offload": {"none": "#f4f4f4", "optimizer": "#a1d99b", "params": "#31a354"},
}


def _new_axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax  # type: ignore[return-value]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _title(plan: Plan) -> str:
    c, w = plan.inputs.cluster, plan.inputs.workload
    return f"{plan.inputs.model} on {c.world_size}x {c.accelerator}, seq {w.seq_len}, batch {w.global_batch}"


# ---- memory --------------------------------------------------------------------------------------

def plot_memory(plan: Plan, ax: Axes | None = None) -> Figure:
    """Stacked memory per pipeline stage (one GPU of each), against the per-GPU limit."""
    stages = predicted_dict(plan).get("stages") or []
    if not stages:
        raise ShardplanError("this plan records no per-stage memory (predicted.stages): nothing to plot")
    fig, ax = _new_axes(ax, (max(6.0, 1.2 * len(stages) + 4), 5.5))
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for key, label, color in MEMORY_PARTS:
        vals = [float(s.get(f"{key}_gib", 0.0)) for s in stages]
        ax.bar(xs, vals, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    limit = memory_limit_gib(plan)
    ax.axhline(limit, color="#d62728", linestyle="--", linewidth=1.5, label=f"limit {limit:.1f} GiB")
    for x, total in zip(xs, bottom, strict=True):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=9, xytext=(0, 2),
                    textcoords="offset points")
    labels = [f"stage {s.get('stage', i)}\n{label_units(s.get('units') or [])}".replace("embedding", "emb")
              for i, s in enumerate(stages)]
    ax.set_xticks(xs, labels, fontsize=8 if len(stages) > 6 else 9)
    ax.set_ylim(0, max(limit, max(bottom)) * 1.12)
    ax.set_xlabel("pipeline stage (one GPU of each)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"Memory per GPU by stage\n{_title(plan)}", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---- step timeline -------------------------------------------------------------------------------

@dataclass
class Op:
    rank: int
    kind: str  # F, B (input + weight gradients, or input only under zb) or W (zb weight gradients)
    mb: int
    chunk: int
    start: float
    busy_end: float  # compute done; exposed communication runs until ``end``
    end: float


def schedule_order(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple[str, int, int]]:
    """Rank ``r``'s (kind, micro-batch, chunk) order for GPipe, 1F1B/ZB-H1 or interleaved 1F1B (Megatron's
    order: warm-up forwards, then one forward and one backward in turn, then the remaining backwards)."""
    if p == 1:  # gradient accumulation: each micro-batch's backward right after its forward
        return [x for i in range(m) for c in range(v) for x in (("F", i, c), ("B", i, c))]
    if schedule == "gpipe":
        fwd = [("F", i, c) for c in range(v) for i in range(m)]
        return fwd + [("B", i, c) for c in reversed(range(v)) for i in range(m)]
    total = m * v
    f_ids = [((i // (p * v)) * p + i % p, (i // p) % v) for i in range(total)]
    b_ids = [((j // (p * v)) * p + j % p, v - 1 - (j // p) % v) for j in range(total)]
    warm = min(total, (p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1)
    out = [("F", *f_ids[i]) for i in range(warm)]
    for k in range(total - warm):
        out += [("F", *f_ids[warm + k]), ("B", *b_ids[k])]
    return out + [("B", *b_ids[k]) for k in range(total - warm, total)]


def simulate(schedule: str, st: StageTimes, p: int, m: int, v: int) -> list[Op]:
    """Run the schedule's per-rank order against stage times, earliest-start first.

    Forward of virtual stage ``k`` waits for stage ``k-1`` (plus the send); backward for ``k+1``.
    Under ``zb`` the weight-gradient half of backward is deferred to fill idle time (ZB-H1).
    """
    n_stages, zb = p * v, schedule == "zb"
    orders = [deque(schedule_order(schedule, p, m, v, r)) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free, pending = [0.0] * p, [deque() for _ in range(p)]  # type: ignore[var-annotated]
    ops: list[Op] = []

    def ready(kind: str, k: int, mb: int) -> float | None:
        if kind == "F":
            return 0.0 if k == 0 else _plus(done.get(("F", k - 1, mb)), st.p2p[k - 1])
        if k == n_stages - 1:
            return done.get(("F", k, mb))
        return _plus(done.get(("B", k + 1, mb)), st.p2p[k])

    while any(orders) or any(pending):
        cands: list[tuple[float, int, int]] = []
        for r in range(p):
            start = None
            if orders[r]:
                kind, mb, c = orders[r][0]
                t = ready(kind, c * p + r, mb)
                if t is not None:
                    start = max(free[r], t)
                    heapq.heappush(cands, (start, 0, r))
            if pending[r] and (start is None or start > free[r] or len(pending[r]) > p - r - 1):
                forced = len(pending[r]) > p - r - 1 or not orders[r]
                heapq.heappush(cands, (free[r], -1 if forced else 1, r))
        if not cands:
            raise ShardplanError(f"schedule '{schedule}' deadlocked in the timeline simulation")
        start, is_w, r = cands[0]
        if is_w != 0:
            mb, c = pending[r].popleft()
            k = c * p + r
            busy = start + st.wgt[k]
            ops.append(Op(r, "W", mb, c, start, busy, busy))
        else:
            kind, mb, c = orders[r].popleft()
            k = c * p + r
            dur = st.fwd[k] if kind == "F" else st.bwd[k] - (st.wgt[k] if zb else 0.0)
            busy = start + dur
            end = busy + st.comm[k] / 2
            done[(kind, k, mb)] = end
            ops.append(Op(r, kind, mb, c, start, busy, end))
            if zb and kind == "B":
                pending[r].append((mb, c))
        free[r] = ops[-1].end
    return ops


def _plus(t: float | None, dt: float) -> float | None:
    return None if t is None else t + dt


def plot_timeline(plan: Plan, ax: Axes | None = None, graph: LayerGraph | None = None) -> Figure:
    """One training step: each pipeline rank's forward/backward per micro-batch, exposed communication,
    idle time (the bubble), then the exposed gradient synchronisation and the optimizer step. Stage
    times come from the cost model with the plan's model (its preset, config file or recorded
    graph) or ``graph``."""
    s = plan.strategy
    p, v = s.mesh.pp, s.vpp
    m = s.num_microbatches(plan.inputs.workload.global_batch)
    st = stage_times(plan, graph)
    ops = simulate(s.schedule, st, p, m, v)
    pipe_end = max(o.end for o in ops)
    total = pipe_end + st.grad_sync + st.offload + st.optimizer
    scale, unit = (1.0, "s") if total >= 1 else (1e3, "ms")
    fig, ax = _new_axes(ax, (12.0, 1.6 + 0.55 * p))
    h = 0.7
    for r in range(p):
        ax.broken_barh([(0, total * scale)], (r - h / 2, h), color=OP_COLORS["idle"])
        mine = [o for o in ops if o.rank == r]
        for kind in ("F", "B", "W"):
            bars = [(o.start * scale, (o.busy_end - o.start) * scale) for o in mine if o.kind == kind]
            ax.broken_barh(bars, (r - h / 2, h), color=OP_COLORS[kind], edgecolor="white", linewidth=0.3)
        comm = [(o.busy_end * scale, (o.end - o.busy_end) * scale) for o in mine if o.end > o.busy_end]
        ax.broken_barh(comm, (r - h / 2, h), color=OP_COLORS["comm"])
        if len(mine) <= 48:
            for o in mine:
                ax.text((o.start + o.busy_end) / 2 * scale, r, str(o.mb), ha="center", va="center",
                        fontsize=7, color="white")
        tail = [(pipe_end * scale, (st.grad_sync + st.offload) * scale)]
        ax.broken_barh(tail, (r - h / 2, h), color=OP_COLORS["sync"])
        ax.broken_barh([((pipe_end + st.grad_sync + st.offload) * scale, st.optimizer * scale)],
                       (r - h / 2, h), color=OP_COLORS["optim"])
    from matplotlib.patches import Patch

    names = {"F": "forward", "B": "backward" + (" (input grads)" if s.schedule == "zb" else ""),
             "W": "weight gradients", "comm": "exposed tp/cp/ep/dp comm", "sync": "exposed grad sync + offload",
             "optim": "optimizer step", "idle": "idle (bubble)"}
    used = [k for k in names if k != "W" or s.schedule == "zb"]
    ax.legend(handles=[Patch(color=OP_COLORS[k], label=names[k]) for k in used], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=9)
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, total * scale * 1.01)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("pipeline rank")
    sched = f"{s.schedule}" + (f", {v} virtual stages per rank" if v > 1 else "") if p > 1 else "no pipeline"
    how = "" if st.exact else " (stage times spread evenly: model not loadable)"
    ax.set_title(f"One step: {sched}, {m} micro-batches; simulated {total:.4g} s, predicted "
                 f"{plan.predicted.step_time_s:.4g} s{how}\n{_title(plan)}", fontsize=11)
    return fig


# ---- per-layer strategy map ----------------------------------------------------------------------

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
    fig, ax = _new_axes(ax, (12.0, 4.2))
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    handles: list[Patch] = []
    tab = colormaps["tab20"]
    for y, (field, vals) in enumerate(rows):
        runs: list[tuple[Any, int, int]] = []
        for i, val in enumerate(vals):
            if runs and runs[-1][0] == val:
                runs[-1] = (val, runs[-1][1], i)
            else:
                runs.append((val, i, i))
        for val, a, b in runs:
            if field == "stage":
                color = tab(val % 20)
            elif field == "split":
                color = "#f4f4f4" if val == 1 else colormaps["Purples"](min(0.3 + val / 16, 1.0))
            else:
                color = PALETTES[field][val]
            ax.broken_barh([(a - 0.5, b - a + 1)], (y - 0.4, 0.8), color=color, edgecolor="white", linewidth=0.5)
            if field == "stage":
                ax.text((a + b) / 2, y, f"{val}", ha="center", va="center", fontsize=8)
            elif field == "split" and val > 1:
                ax.text((a + b) / 2, y, f"x{val}", ha="center", va="center", fontsize=8, color="white")
        if field in PALETTES:
            handles += [Patch(color=PALETTES[field][v], label=f"{field}: {v}") for v in PALETTES[field] if v in vals]
    step = max(1, len(units) // 16)
    ticks = sorted({0, len(units) - 1, *range(0, len(units), step)})
    ax.set_xticks(ticks, [units[i].replace("layers.", "L") for i in ticks], fontsize=8, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), ["(virtual) stage", "sharding", "recompute", "offload", "OSDP split"])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(-0.5, len(units) - 0.5)
    ax.set_xlabel("unit (embedding, transformer layers L0..Ln, head)")
    ax.set_title(f"Per-layer strategy: {short_strategy(s)}\n{_title(plan)}", fontsize=11)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


# ---- Pareto frontier -----------------------------------------------------------------------------

def plot_pareto(plan: Plan, ax: Axes | None = None) -> Figure:
    """Throughput against peak memory per GPU for the plan and its alternatives, with the frontier."""
    pts = [("this plan", plan.strategy, predicted_dict(plan))]
    pts += [(f"alt {i + 1}", a.strategy, a.predicted.model_dump()) for i, a in enumerate(plan.alternatives)]
    limit = memory_limit_gib(plan)
    fig, ax = _new_axes(ax, (11.0, 5.5))
    xy = [(p["memory_peak_gib"], p["tokens_per_s_per_gpu"]) for _, _, p in pts]
    front, best = [], -1.0
    for x, y in sorted(xy, key=lambda t: (t[0], -t[1])):
        if y > best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        ax.step([f[0] for f in front], [f[1] for f in front], where="post", color="#555555", linewidth=1.2,
                label="Pareto frontier")
    for i, ((name, _, _), (x, y)) in enumerate(zip(pts, xy, strict=True)):
        over = x > limit
        ax.scatter([x], [y], s=160 if i == 0 else 50, marker="*" if i == 0 else ("x" if over else "o"),
                   color="#d62728" if i == 0 else ("#999999" if over else "#4c72b0"), zorder=3,
                   label="this plan" if i == 0 else None)
        if len(pts) <= 16:
            ax.annotate(name, (x, y), fontsize=8, xytext=(5, 4 if i % 2 == 0 else -10), textcoords="offset points")
    ax.axvline(limit, color="#d62728", linestyle="--", linewidth=1.2, label=f"memory limit {limit:.1f} GiB")
    if len(pts) > 1:
        ax.scatter([], [], marker="o", color="#4c72b0", label="alternative (fits)")
    if any(x > limit for x, _ in xy):
        ax.scatter([], [], marker="x", color="#999999", label="alternative (over the limit)")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("throughput (tokens/s per GPU)")
    note = "" if plan.alternatives else " (no alternatives recorded)"
    ax.set_title(f"Throughput vs memory: plan and {len(plan.alternatives)} alternatives{note}\n{_title(plan)}",
                 fontsize=11)
    ys = [y for _, y in xy]
    ax.set_xlim(0, max(limit, max(x for x, _ in xy)) * 1.12)
    ax.set_ylim(min(ys) * 0.9, max(ys) * 1.06)
    ax.grid(alpha=0.3)
    leg = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if len(pts) <= 16:
        keyed = "\n".join(f"{name}: {short_strategy(s)}" for name, s, _ in pts)
        ax.text(1.01, 0.0, keyed, transform=ax.transAxes, fontsize=7, va="bottom", ha="left", family="monospace")
    ax.add_artist(leg)
    return fig


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
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = plot(plan, kind, graph=graph)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=out.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, format=fmt, dpi=150)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
