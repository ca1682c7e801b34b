"""shardplan plot: the four figures draw the plan's own numbers legibly; the schedule simulation that checks
the pipeline formulas; atomic writes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from costmodel.pipeline import pipeline_time
from planner.cli import app
from planner.explain import time_breakdown
from planner.plots import KINDS, MEMORY_PARTS, frontier, plot, save_plot, schedule_order, simulate
from planner.reprice import StageTimes, memory_limit_gib, predicted_dict, stage_times, unit_stages, units_of
from tests.test_explain import FSDP, make_plan
from vocab.errors import ShardplanError
from vocab.plan import Plan

runner = CliRunner()
PIPE = {"mesh": {"pp": 4, "dp_shard": 2, "tp": 2}, "schedule": "interleaved", "vpp": 2,
        "default": {"sharding": "zero1", "recompute": "selective"},
        "layers": [{"unit": "layers.3", "sharding": "zero3", "recompute": "full", "split": 4}]}


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(PIPE, global_batch=32, alternatives=(FSDP, {"mesh": {"pp": 2, "dp_shard": 8}}))


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                                       ("zb", 4, 8, 1), ("interleaved", 4, 8, 2), ("1f1b", 1, 4, 1)])
def test_schedule_order_runs_every_pass_once(schedule: str, p: int, m: int, v: int) -> None:
    for r in range(p):
        order = schedule_order(schedule, p, m, v, r)
        assert Counter(order) == Counter([(k, i, c) for k in "FB" for i in range(m) for c in range(v)])
        for i in range(m):
            for c in range(v):
                assert order.index(("F", i, c)) < order.index(("B", i, c))


def _times(p: int, v: int, f: float = 1.0, b: float = 2.0, w: float = 1.0) -> StageTimes:
    k = p * v
    return StageTimes([f] * k, [b] * k, [w] * k, [0.0] * k, [0.0] * (k - 1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulation_matches_the_cost_model(schedule: str) -> None:
    p, m = 4, 8
    ops = simulate(schedule, _times(p, 1), p, m, 1)
    assert max(o.end for o in ops) == pytest.approx(pipeline_time(schedule, [3.0] * p, m)[0])


def test_interleaving_and_zero_bubble_shrink_the_bubble() -> None:
    p, m = 4, 8
    one = max(o.end for o in simulate("1f1b", _times(p, 1), p, m, 1))
    inter = max(o.end for o in simulate("interleaved", _times(p, 2, 0.5, 1.0, 0.5), p, m, 2))
    zb_ops = simulate("zb", _times(p, 1), p, m, 1)
    assert inter < one and max(o.end for o in zb_ops) < one
    assert Counter(o.kind for o in zb_ops) == {"F": p * m, "B": p * m, "W": p * m}
    for r in range(p):  # a rank never runs two things at once
        mine = sorted((o for o in zb_ops if o.rank == r), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def _processor_shared(ops: list, c: float) -> float:
    """The timeline's length when its ranks share ``c`` ranks' worth of cores, each busy rank at
    ``min(1, c / busy)`` of full speed: all busy ranks run at one rate, so the schedule keeps its
    order and each stretch with ``k`` ranks busy lasts ``max(1, k / c)`` times longer."""
    edges = sorted({t for o in ops for t in (o.start, o.end)})
    total = 0.0
    for a, b in zip(edges, edges[1:], strict=False):
        busy = sum(1 for o in ops if o.start <= (a + b) / 2 < o.end)
        total += (b - a) * max(1.0, busy / c)
    return total


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1), ("gpipe", 4, 8, 1),
                                            ("1f1b", 8, 16, 1), ("1f1b", 2, 4, 1), ("interleaved", 4, 8, 2),
                                            ("interleaved", 8, 16, 2)])
@pytest.mark.parametrize("share", [0.2, 0.4775, 0.7, 0.9])
def test_time_shared_pipeline_is_the_schedule_run_on_shared_cores(schedule: str, p: int, m: int, v: int,
                                                                  share: float) -> None:
    """Equal stages on time-shared cores: the cost model's step is the simulated schedule with every
    busy rank slowed to its share of the cores: exactly for GPipe and 1F1B; interleaved idles more
    in mid-schedule than its ramps say, and the model is up to 5% long there. The bound it replaced,
    ``max(share·pipe, m·Σ T / p)``, was up to 14% short on 1F1B and 6% on interleaved. (Zero-bubble
    is left out: at full speed this simulation already differs from the ZB-H1 formula by 10%.)"""
    f, b, w = 1.0, 2.0, 1.0
    ops = simulate(schedule, _times(p, v, f / v, b / v, w / v), p, m, v)
    exact = _processor_shared(ops, share * p)
    stage = [(f + b) / share] * p  # the cost model's stage times are at the shared speed
    model = pipeline_time(schedule, stage, m, v, [f / share] * p, [w / share] * p, share=share)[0]
    assert model == pytest.approx(exact, rel=0.05 if schedule == "interleaved" else 1e-9)
    assert model >= max(share * pipeline_time(schedule, stage, m, v, [f / share] * p, [w / share] * p)[0],
                        m * sum(stage) / p) - 1e-9


def test_timeline_of_a_real_plan_agrees_with_its_prediction() -> None:
    plan = make_plan({"mesh": {"pp": 4, "dp_shard": 4}, "default": {"sharding": "zero1"}})
    st = stage_times(plan)
    ops = simulate("1f1b", st, 4, plan.strategy.num_microbatches(32), 1)
    total = max(o.end for o in ops) + st.grad_sync + st.offload + st.optimizer
    assert st.exact and total == pytest.approx(plan.predicted.step_time_s, rel=0.02)


# ---- what the figures draw: the plan's own numbers ------------------------------------------------

NAMES = ["interleaved", "searched", "deep", "cpu"]


@pytest.fixture(scope="module")
def searched() -> Plan:
    """A searched plan: no pipeline, thirteen alternatives crowding around it on the Pareto plot."""
    from planner.api import plan as search

    return search("llama3-8b", "16xh100", seq_len=4096, global_batch=64)


@pytest.fixture(scope="module")
def deep() -> Plan:
    """32 pipeline stages (zero bubble), the last one the slowest."""
    return make_plan({"mesh": {"pp": 32}, "schedule": "zb"}, cluster="32xh100", global_batch=64)


@pytest.fixture(scope="module")
def cpu() -> Plan:
    """Time-shared CPU cores, where autograd accumulates gradients (the breakdown's "other")."""
    return make_plan({"mesh": {"pp": 2, "dp_shard": 2}}, cluster="4xcpu", seq_len=128, global_batch=8, model="gpt2",
                     precision="fp32")


@pytest.fixture(scope="module")
def plans(plan: Plan, searched: Plan, deep: Plan, cpu: Plan) -> dict[str, Plan]:
    return {"interleaved": plan, "searched": searched, "deep": deep, "cpu": cpu}


@pytest.fixture(scope="module")
def figures(plans: dict[str, Plan]) -> dict[tuple[str, str], Figure]:
    return {(name, kind): plot(p, kind) for name, p in plans.items() for kind in KINDS}


def _rects(fig: Figure, prefix: str) -> list[tuple[str, Rectangle]]:
    """The bars whose gid starts with ``prefix``, in drawing order."""
    return [(r.get_gid(), r) for ax in fig.axes for r in ax.patches
            if isinstance(r, Rectangle) and (r.get_gid() or "").startswith(prefix)]


def _close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-6, abs=1e-12)


def _breakdown(p: Plan) -> dict[str, float]:
    return {c["name"]: c["seconds"] for c in time_breakdown(predicted_dict(p))["components"]}


def _contiguous(bars: list[Rectangle]) -> bool:
    """Segments of one row laid end to end from zero."""
    return _close(bars[0].get_x(), 0.0) and all(_close(b.get_x(), a.get_x() + a.get_width())
                                                for a, b in zip(bars, bars[1:], strict=False))


@pytest.mark.parametrize("name", NAMES)
def test_timeline_draws_the_breakdown(plans: dict[str, Plan], figures: dict, name: str) -> None:
    """The step bar's segments are explain's components (compute split into forward and backward),
    summing to the step time; every per-rank row sums to the step time too, and the slowest rank's
    row adds up, component by component, to the breakdown."""
    p, fig = plans[name], figures[(name, "timeline")]
    step, parts = p.predicted.step_time_s, _breakdown(p)
    bars = _rects(fig, "step/")
    drawn: dict[str, float] = {}
    for gid, r in bars:
        drawn[gid.split("/", 1)[1]] = drawn.get(gid.split("/", 1)[1], 0.0) + r.get_width()
    assert _close(sum(drawn.values()), step) and _contiguous([r for _, r in bars])
    assert _close(drawn.pop("forward compute") + drawn.pop("backward compute"), parts.pop("compute"))
    assert drawn.keys() == parts.keys() and all(_close(drawn[k], parts[k]) for k in parts)
    assert drawn.get("exposed tp comm", 0.0) < 0.2 * step  # the old plot's "mostly comm" bars
    rows: dict[str, list[Rectangle]] = {}
    for gid, r in _rects(fig, "row/"):
        rows.setdefault(gid.split("/")[1], []).append(r)
    if p.strategy.mesh.pp == 1:
        assert not rows
        return
    ranks = []
    for label, segs in rows.items():
        assert _close(sum(r.get_width() for r in segs), step) and _contiguous(segs), label
        first, _, last = label.split(" (")[0].split(" ")[1].partition("-")
        ranks += range(int(first), int(last or first) + 1)
    assert sorted(ranks) == list(range(p.strategy.mesh.pp))
    slow = [segs for label, segs in rows.items() if label.endswith("(slowest)")]
    assert len(slow) == 1
    by_name: dict[str, float] = {}
    for r in slow[0]:
        n = r.get_gid().split("/")[2]
        by_name[n] = by_name.get(n, 0.0) + r.get_width()
    full = _breakdown(p)
    assert _close(by_name.pop("forward compute") + by_name.pop("backward compute"), full.pop("compute"))
    assert by_name.keys() == full.keys() and all(_close(by_name[k], full[k]) for k in full)


@pytest.mark.parametrize("name", NAMES)
def test_memory_bars_are_the_stages(plans: dict[str, Plan], figures: dict, name: str) -> None:
    """Each stage's bar: its parts as the plan records them, summing to the stage's peak; the longest
    bar is the plan's peak."""
    p, fig = plans[name], figures[(name, "memory")]
    stages = predicted_dict(p)["stages"]
    totals = []
    for st in stages:
        segs = _rects(fig, f"memory/{st['stage']}/")
        assert [g.rsplit("/", 1)[1] for g, _ in segs] == [k for k, _, _ in MEMORY_PARTS]
        for gid, r in segs:
            assert _close(r.get_width(), st[gid.rsplit("/", 1)[1] + "_gib"])
        assert _contiguous([r for _, r in segs])
        totals.append(sum(r.get_width() for _, r in segs))
        assert _close(totals[-1], st["total_gib"])
    assert _close(max(totals), p.predicted.memory_peak_gib)


@pytest.mark.parametrize("name", NAMES)
def test_layers_cover_every_unit_once(plans: dict[str, Plan], figures: dict, name: str) -> None:
    """Every row spans all units; each stage's run is as wide as its units; every setting drawn has
    its own colour (or hatch) in the legend, "none" one hatched white entry."""
    p, fig = plans[name], figures[(name, "layers")]
    units = units_of(p)
    where = unit_stages(p.strategy, units)
    for field in ("stage", "sharding", "recompute", "offload", "split"):
        segs = _rects(fig, f"layers/{field}/")
        assert _close(sum(r.get_width() for _, r in segs), len(units))
        assert _close(segs[0][1].get_x(), -0.5) and _contiguous_from(segs)
    widths = Counter()
    for gid, r in _rects(fig, "layers/stage/"):
        widths[int(gid.rsplit("/", 1)[1])] += r.get_width()
    assert widths == Counter(k for k, _ in where.values())
    legend = fig.axes[0].get_legend()
    styles = [(tuple(h.get_facecolor()), h.get_hatch()) for h in legend.legend_handles]
    assert len(set(styles)) == len(styles)
    nones = [t.get_text() for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True) if h.get_hatch()]
    assert len(nones) <= 1 and all(t.startswith("none") for t in nones)


def _contiguous_from(segs: list[tuple[str, Rectangle]]) -> bool:
    return all(_close(b.get_x(), a.get_x() + a.get_width()) for (_, a), (_, b) in zip(segs, segs[1:], strict=False))


@pytest.mark.parametrize("name", NAMES)
def test_pareto_points_are_the_predictions(plans: dict[str, Plan], figures: dict, name: str) -> None:
    p, fig = plans[name], figures[(name, "pareto")]
    ax = fig.axes[0]
    pts = {c.get_gid(): [tuple(xy) for xy in c.get_offsets()] for c in ax.collections if c.get_gid()}
    assert pts["pareto/plan"] == [(pytest.approx(p.predicted.memory_peak_gib, rel=1e-6),
                                   pytest.approx(p.predicted.tokens_per_s_per_gpu, rel=1e-6))]
    alts = sorted(pts.get("pareto/fits", []) + pts.get("pareto/over", []))
    want = sorted((a.predicted.memory_peak_gib, a.predicted.tokens_per_s_per_gpu) for a in p.alternatives)
    assert alts == [pytest.approx(w, rel=1e-6) for w in want]
    limit = memory_limit_gib(p)
    assert all(x > limit for x, _ in pts.get("pareto/over", [])) and all(x <= limit for x, _ in pts.get("pareto/fits", []))


def test_frontier_keeps_the_undominated_plans_that_fit() -> None:
    xy = [(10.0, 5.0), (5.0, 4.0), (12.0, 4.5), (20.0, 9.0), (6.0, 3.0)]
    assert frontier(xy, [True, True, True, False, True]) == [1, 0]


def _drawn_texts(fig: Figure) -> list[Text]:
    """The texts a draw actually renders (visible, not empty, ticks inside the view)."""
    seen: list[Text] = []
    draw = Text.draw

    def record(self: Text, renderer: object) -> None:
        if self.get_visible() and self.get_text().strip():
            seen.append(self)
        draw(self, renderer)

    Text.draw = record  # type: ignore[method-assign]
    try:
        fig.canvas.draw()
    finally:
        Text.draw = draw  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", NAMES)
def test_each_kind_is_legible(plans: dict[str, Plan], figures: dict, name: str, kind: str) -> None:
    """Titled with the model, the cluster and the target; units on the axes; no two texts (tick
    labels, legends, annotations, titles) overlap; none leaves the figure or is smaller than 7 pt."""
    p, fig = plans[name], figures[(name, kind)]
    ax = fig.axes[0]
    title = ax.get_title()
    c = p.inputs.cluster
    assert p.inputs.model in title and f"{c.world_size}x {c.accelerator}" in title
    assert f"target {p.inputs.target.name}" in title
    assert ax.get_legend() is not None
    unit = {"memory": ("GiB", None), "timeline": ("(s)", None), "pareto": ("(GiB)", "(tokens/s per GPU)"),
            "layers": ("unit", None)}[kind]
    assert unit[0] in ax.get_xlabel() and (unit[1] is None or unit[1] in ax.get_ylabel())
    texts = _drawn_texts(fig)
    r = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in texts]
    page = fig.bbox
    for s, b in boxes:
        assert page.x0 - 0.5 <= b.x0 and b.x1 <= page.x1 + 0.5 and page.y0 - 0.5 <= b.y0 and b.y1 <= page.y1 + 0.5, s
    for t in texts:
        assert t.get_fontsize() >= 7, t.get_text()
    for i, (s, a) in enumerate(boxes):
        for u, b in boxes[i + 1:]:
            w = min(a.x1, b.x1) - max(a.x0, b.x0)
            h = min(a.y1, b.y1) - max(a.y0, b.y0)
            assert w <= 0.5 or h <= 0.5, f"{s!r} overlaps {u!r}"
    ticks = [t for t in texts if t in set(ax.get_xticklabels()) | set(ax.get_yticklabels())]
    assert ticks  # the tick labels are among the texts checked


@pytest.mark.parametrize("kind", KINDS)
def test_plot_into_given_axes(plan: Plan, kind: str) -> None:
    """Into the caller's axes: same numbers, the caller's layout left alone."""
    from matplotlib.figure import Figure as Fig

    fig = Fig()
    ax = fig.add_subplot()
    assert plot(plan, kind, ax=ax) is fig and plan.inputs.model in ax.get_title()
    assert fig.get_layout_engine() is None
    if kind == "timeline":
        total = sum(r.get_width() for _, r in _rects(fig, "step/"))
        assert _close(total, plan.predicted.step_time_s)
        assert all(_close(sum(r.get_width() for g, r in _rects(fig, "row/") if g.split("/")[1] == label),
                          plan.predicted.step_time_s) for label in {g.split("/")[1] for g, _ in _rects(fig, "row/")})


def test_timeline_without_a_loadable_model_draws_the_breakdown(plan: Plan) -> None:
    """Without the model: the breakdown's bar (compute in one piece), no per-rank rows, and the title says why."""
    lost = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"model": "no-such-model"})})
    assert not stage_times(lost).exact
    fig = plot(lost, "timeline")
    drawn = {g.split("/", 1)[1]: r.get_width() for g, r in _rects(fig, "step/")}
    parts = _breakdown(lost)
    assert drawn.keys() == parts.keys() and all(_close(drawn[k], parts[k]) for k in parts)
    assert not _rects(fig, "row/") and "does not load" in fig.axes[0].get_title()


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_cli_writes_png_and_svg(plan: Plan, tmp_path: Path, suffix: str) -> None:
    plan.save(tmp_path / "p.json")
    for kind in KINDS:
        out = tmp_path / f"{kind}{suffix}"
        r = runner.invoke(app, ["plot", str(tmp_path / "p.json"), "--kind", kind, "-o", str(out)])
        assert r.exit_code == 0, r.output
        data = out.read_bytes()
        assert data.startswith(b"\x89PNG") if suffix == ".png" else (b"<svg" in data[:2000])
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(["p.json", *(f"{k}{suffix}" for k in KINDS)])


@pytest.mark.parametrize(("args", "message"), [
    (["--kind", "bogus"], "unknown plot kind 'bogus'"),
    (["--kind", "memory", "-o", "{tmp}/out.pdf"], "must be .png or .svg"),
    (["--kind", "memory", "-o", "{tmp}/p.json/out.png"], "is not a directory"),
    (["--kind", "memory", "-o", "{tmp}/sub.png"], "is a directory"),
])
def test_cli_bad_options_write_nothing(plan: Plan, tmp_path: Path, args: list[str], message: str) -> None:
    plan.save(tmp_path / "p.json")
    if "{tmp}/sub.png" in args:
        (tmp_path / "sub.png").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out.png")]
    r = runner.invoke(app, ["plot", str(tmp_path / "p.json"), *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_file()) == ["p.json"]


def test_cli_missing_plan_writes_nothing(tmp_path: Path) -> None:
    r = runner.invoke(app, ["plot", str(tmp_path / "none.json"), "-o", str(tmp_path / "out.png")])
    assert r.exit_code == 2 and "cannot read plan" in r.output
    assert not list(tmp_path.iterdir())


def test_failed_draw_leaves_no_file(plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("disk full")

    out = tmp_path / "m.png"
    out.write_bytes(b"old")
    monkeypatch.setattr(Figure, "savefig", boom)
    with pytest.raises(RuntimeError):
        save_plot(plan, "memory", out)
    assert [x.name for x in tmp_path.iterdir()] == ["m.png"] and out.read_bytes() == b"old"


def test_memory_plot_needs_stages(plan: Plan) -> None:
    pred = plan.predicted.model_dump()
    pred.pop("stages")
    bare = plan.model_copy(update={"predicted": type(plan.predicted)(**pred)})
    with pytest.raises(ShardplanError, match="per-stage memory"):
        plot(bare, "memory")
