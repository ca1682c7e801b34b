"""The step-time figure (``shardplan plot --kind timeline``) and the schedule simulation that checks the
cost model's pipeline formulas.

The figure draws what the step-time breakdown says (``shardplan explain``): one bar of the step as the
plan prices it, its segments the breakdown's components (compute split into forward and backward by
the cost model's ratio on the slowest rank), and, with a pipeline, one row per pipeline rank whose
segments are that rank's share of each component and whose idle time (waiting on the slowest rank)
makes every row sum to the step time. Components are totals over the step, drawn side by side, not
in execution order: a micro-batch-by-micro-batch Gantt chart of 64 ranks and 256 micro-batches is
unreadable, and the simulated schedule's length is not the priced step time.
"""

from __future__ import annotations

import heapq
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.plots_common import SMALL, freeze, new_figure, plan_title, renderer_of, thin_ticks
from planner.reprice import StageTimes, predicted_dict, priced_plan
from vocab.errors import ShardplanError
from vocab.plan import Plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from profiler.graph import LayerGraph

FORWARD, BACKWARD, BUBBLE, OTHER = "forward compute", "backward compute", "bubble", "other"
#: the order segments are drawn in, left to right (names as ``planner.explain.time_breakdown`` gives them)
ORDER = (FORWARD, BACKWARD, "compute", "recompute", OTHER, "exposed tp comm", "exposed cp comm", "exposed ep comm",
         "exposed dp comm", "exposed pp comm", BUBBLE, "optimizer", "offload")
COLORS = {FORWARD: "#4c72b0", "compute": "#4c72b0", BACKWARD: "#dd8452", "recompute": "#e5c03d",
          OTHER: "#4d4d4d", "tp": "#c44e52", "cp": "#e377c2", "ep": "#8172b2", "dp": "#7a1e12", "pp": "#17becf",
          BUBBLE: "#d9d9d9", "optimizer": "#937860", "offload": "#55a868"}
_COMM = re.compile(r"exposed (\w+) comm")


def component_color(name: str) -> str:
    """The colour of a breakdown component, by its name."""
    m = _COMM.fullmatch(name)
    return COLORS.get(m.group(1) if m else name, "#8c8c8c")


def _order(name: str) -> int:
    return ORDER.index(name) if name in ORDER else len(ORDER)


# ---- what the figure draws ---------------------------------------------------------------------

@dataclass
class Rows:
    """Per pipeline rank, the (component, seconds) segments of one step, each row summing to the step;
    ``worst`` the slowest rank (the breakdown's), ``forward_share`` of its compute."""

    segments: list[list[tuple[str, float]]]
    worst: int
    forward_share: float
    notes: list[str] = field(default_factory=list)

    def groups(self, rel: float = 1e-9) -> list[tuple[int, int, list[tuple[str, float]]]]:
        """Runs of consecutive ranks whose segments agree (to ``rel`` of the step): (first, last,
        segments), the slowest rank's own segments for its run."""
        out: list[tuple[int, int, list[tuple[str, float]]]] = []
        tol = rel * max((v for seg in self.segments for _, v in seg), default=1.0)
        for r, seg in enumerate(self.segments):
            if out and _alike(out[-1][2], seg, tol * len(seg)):
                a, _, prev = out[-1]
                out[-1] = (a, r, seg if r == self.worst else prev)
            else:
                out.append((r, r, seg))
        return out


def _alike(a: list[tuple[str, float]], b: list[tuple[str, float]], tol: float) -> bool:
    return len(a) == len(b) and all(x == y and abs(u - w) <= tol for (x, u), (y, w) in zip(a, b, strict=True))


def rank_rows(plan: Plan, graph: LayerGraph | None = None) -> Rows | None:
    """Each pipeline rank's step from the cost model (the plan's model or ``graph``); None when the
    model cannot be had without an import."""
    import numpy as np

    try:
        pp = priced_plan(plan, graph)
    except (ShardplanError, ImportError, OSError):
        return None
    s, a, n = plan.strategy, pp.assembled, pp.n_mb
    step = plan.predicted.step_time_s
    tail = [("exposed dp comm", float(a.dp_exposed[0, 0])), ("optimizer", float(a.optim[0, 0]) + pp.pricer.dev.c.step_overhead_s),
            ("offload", float(a.offload[0, 0]))]
    parts = (("fwd", FORWARD), ("bwd", BACKWARD), ("recompute", "recompute"), ("accumulate", OTHER),
             ("comm_tp", "exposed tp comm"), ("comm_cp", "exposed cp comm"), ("comm_ep", "exposed ep comm"),
             ("comm_dp", "exposed dp comm"))
    rows, compute, notes = [], [], []
    for r in range(s.mesh.pp):
        units = [u for k in s.rank_stages(r) for u in pp.units[k]]
        busy = [(name, n * sum(float(getattr(u, attr)) for u in units)) for attr, name in parts]
        busy.append(("exposed pp comm", n * float(a.p2p[0, r])))
        compute.append((busy[0][1], busy[1][1]))
        idle = step - sum(v for _, v in busy) - sum(v for _, v in tail)
        if idle < -1e-9 * step:
            notes.append(f"rank {r} re-prices {-idle:.3g} s over the plan's step (its model changed?)")
        rows.append([(k, v) for k, v in [*busy, (BUBBLE, max(idle, 0.0)), *tail] if v > 0])
    worst = int(np.argmax(a.rank_time[0, 0]))
    f, b = compute[worst]
    return Rows(rows, worst, f / (f + b) if f + b > 0 else 0.5, notes)


def step_components(plan: Plan, rows: Rows | None) -> list[tuple[str, float]]:
    """The breakdown ``explain`` prints, compute split into forward and backward where the cost model
    tells the ratio (their sum is the breakdown's compute); in drawing order."""
    from planner.explain import time_breakdown

    out: list[tuple[str, float]] = []
    for comp in time_breakdown(predicted_dict(plan))["components"]:
        name, sec = comp["name"], float(comp["seconds"])
        if name == "compute" and rows is not None:
            fwd = sec * rows.forward_share
            out += [(FORWARD, fwd), (BACKWARD, sec - fwd)]
        else:
            out.append((name, sec))
    return sorted(out, key=lambda c: _order(c[0]))


# ---- the figure -------------------------------------------------------------------------------

def _bars(ax: Axes, y: float, segments: list[tuple[str, float]], height: float, tag: str) -> None:
    left = 0.0
    for name, sec in segments:
        ax.barh(y, sec, left=left, height=height, color=component_color(name), edgecolor="white",
                linewidth=0.4 if height > 0.5 else 0.0, gid=f"{tag}/{name}")
        left += sec


def plot_timeline(plan: Plan, ax: Axes | None = None, graph: LayerGraph | None = None) -> Figure:
    """One training step as the plan prices it: a bar of the step-time breakdown (``explain``'s
    components, compute split into forward and backward) and, with a pipeline, one row per rank
    (its forward, backward, recomputation, exposed communication, idle time, gradient sync,
    optimizer), every row the step time long. Per-rank rows need the plan's model (its preset,
    config file or recorded graph) or ``graph``."""
    s = plan.strategy
    p, v = s.mesh.pp, s.vpp
    m = s.num_microbatches(plan.inputs.workload.global_batch)
    step = plan.predicted.step_time_s
    rows = rank_rows(plan, graph)
    comps = step_components(plan, rows)
    owned = ax is None
    pipeline = rows is not None and p > 1
    groups = rows.groups() if rows is not None else []
    if ax is None:
        rows_h = min(max(1.2, 0.24 * len(groups)), 11.0) if pipeline else 0.0
        fig = new_figure((12.0, 2.6 + (rows_h + 0.9 if pipeline else 0.0)))
        if pipeline:
            top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.0, rows_h / 1.3])
            top.tick_params(axis="x", labelbottom=True)
        else:
            top, bottom = fig.add_subplot(), None
    else:
        fig, top, bottom = ax.figure, ax, None  # one axes: the step bar above the rank rows
    _bars(top, 0.0, comps, 0.6, "step")
    top.set_yticks([0.0], ["step"])
    top.set_ylim(-0.5, 0.5)
    top.set_xlim(0, step * 1.005)
    top.set_xlabel("time per step (s)")
    top.grid(axis="x", alpha=0.3)
    top.set_axisbelow(True)
    sched = (f"{s.schedule}" + (f" x{v}" if v > 1 else "") + f" schedule on {p} pipeline ranks" if p > 1
             else "no pipeline")
    notes = [] if rows is None else rows.notes[:2]
    if rows is None and p > 1:
        notes = ["per-rank rows need the plan's model, which does not load"]
    top.set_title(f"Step time {step:.4g} s: {sched}, {m} micro-batch{'es' if m != 1 else ''} per replica\n"
                  f"{plan_title(plan)}" + "".join(f"\n{n}" for n in notes), fontsize=10.5, wrap=True)
    named = dict(comps)
    extra: list[str] = []
    if pipeline:
        assert rows is not None
        _draw_ranks(top, bottom, rows, groups)
        extra = [n for _, _, seg in groups for n, _ in seg if n not in named]
    _legend(top, comps, rows, extra, pipeline, step, p)
    if owned:
        renderer_of(fig)
        freeze(fig, owned)
    return fig


def _draw_ranks(top: Axes, bottom: Axes | None, rows: Rows, groups: list[tuple[int, int, list[tuple[str, float]]]],
                ) -> None:
    """One row per run of alike pipeline ranks: on ``bottom``, else on ``top`` below the step bar."""
    target, base = (bottom, 0.0) if bottom is not None else (top, 1.5)
    labels = []
    for i, (a, b, seg) in enumerate(groups):
        label = (f"rank {a}" if a == b else f"ranks {a}-{b}") + (" (slowest)" if a <= rows.worst <= b else "")
        _bars(target, base + i, seg, 0.8, f"row/{label}")
        labels.append(label)
    slowest = next(i for i, (a, b, _) in enumerate(groups) if a <= rows.worst <= b)
    g = len(groups)
    if bottom is not None:
        bottom.set_ylim(g - 0.5, -0.5)
        bottom.set_ylabel("pipeline rank")
        bottom.set_xlabel("time per step (s)")
        bottom.grid(axis="x", alpha=0.3)
        bottom.set_axisbelow(True)
        bottom.set_title("per pipeline rank (alike ranks share a row): totals over the step, not in execution "
                         "order; idle = waiting on the slowest rank", fontsize=9, wrap=True)
        thin_ticks(bottom, "y", range(g), labels, [slowest], fontsize=SMALL if g > 12 else 8.5)
    else:
        top.set_ylim(base + g - 0.5, -0.5)
        thin_ticks(top, "y", [0.0, *(base + i for i in range(g))], ["step", *labels], [0, 1 + slowest],
                   fontsize=SMALL)


def _legend(top: Axes, comps: list[tuple[str, float]], rows: Rows | None, extra: list[str], pipeline: bool,
            step: float, p: int) -> None:
    """The legend of the step's components (seconds and share of the step), the components only
    other ranks have (``extra``), and idle time where only other ranks wait."""
    from matplotlib.patches import Patch

    named = dict(comps)
    accumulate = dict(rows.segments[rows.worst]).get(OTHER) if rows is not None else None
    why = {OTHER: " (gradient accumulation)"} if accumulate is not None and abs(accumulate - named.get(OTHER, 0.0)) \
        <= 1e-6 * step else {}
    handles = [Patch(color=component_color(n), label=f"{n}{why.get(n, '')}: {sec:.3g} s ({sec / step:.1%})")
               for n, sec in comps]
    handles += [Patch(color=component_color(n), label=f"{n} (other ranks only)") for n in dict.fromkeys(extra)]
    if pipeline and BUBBLE not in named:
        handles.append(Patch(color=component_color(BUBBLE), label="idle (other ranks)"))
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
               title="step breakdown, as 'shardplan explain'" + ("\nprints it (slowest rank)" if p > 1 else " prints it"),
               title_fontsize=8)


# ---- schedule simulation ------------------------------------------------------------------------

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
