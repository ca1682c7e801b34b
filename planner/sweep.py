"""``sweep()``: plan over a grid of cluster sizes, accelerators, global batches, sequence lengths,
memory limits, targets and spaces; one row per point, as a pandas DataFrame.

    from planner.sweep import sweep
    df = sweep("llama3-70b", gpus=[256, 512, 1024], accelerator="h100", global_batch=[512, 1024],
               seq_len=8192, tokens=15e12, gpu_hour_cost=2.5)

Every point is what ``shardplan plan`` answers for it (the same search: its fastest plan); a
point where no plan fits keeps its row, with the reason in ``status``. Points run in worker
processes (``workers``; two by default where there are several points), the largest clusters
first; each worker keeps one device model per cluster, so the points of a cluster share their
priced collectives. ``top_k=0``: a sweep wants each point's best plan, not its runners-up, and
the search prunes harder without them (the best plan is the same).

:func:`mesh_heatmap` prices one point once per (tp, pp) cell: the fastest plan with exactly those
degrees, the rest of the space free.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from planner.request import Request, check_fields
from vocab.arguments import typed
from vocab.errors import ShardplanError

#: the axes a sweep may vary, in the order of its table's columns
AXES = ("accelerator", "gpus", "global_batch", "seq_len", "memory_limit_gib", "target", "space")
#: the columns of a point's plan, after the axes
PLAN_COLUMNS = ("status", "mesh", "tp", "pp", "cp", "ep", "dp_replicate", "dp_shard", "micro_batch", "schedule",
                "vpp", "step_time_s", "tokens_per_s_per_gpu", "tokens_per_s", "mfu", "hfu", "memory_peak_gib",
                "memory_used_limit_gib", "train_days", "gpu_hours", "cost")
MAX_POINTS = 2000


@dataclass(frozen=True, kw_only=True)
class Point:
    """One point of a sweep: a cluster of ``gpus`` ``accelerator`` s, a workload, the per-GPU memory
    limit (None: the accelerator's memory less the reserve), the target and the space searched."""

    accelerator: str = "h100"
    gpus: int
    global_batch: int = 1024
    seq_len: int = 4096
    memory_limit_gib: float | None = None
    target: str = "shardplan"
    space: str = "full"

    def request(self, model: Any, cluster: Any, **options: Any) -> Request:
        """The planning request of this point for ``model`` on ``cluster`` (its cluster, or a device
        model's), no runners-up kept; ``options``: other fields of :class:`planner.request.Request`."""
        return Request(model, cluster, self.seq_len, self.global_batch, memory_limit_gib=self.memory_limit_gib,
                       space=self.space, target=self.target, top_k=0, **options)


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs and prices beyond its grid: ``tokens`` to train and ``gpu_hour_cost`` (the
    days, GPU-hours and cost of each point), ``workers`` (processes; 1 runs in this one),
    ``progress`` (told ``(done, total)``), and ``calibration``
    (:class:`costmodel.calibration.document.Calibration`: every point priced with it)."""

    tokens: float | None = None
    gpu_hour_cost: float | None = None
    workers: int | None = None
    progress: Callable[[int, int], None] | None = None
    calibration: Any = None


def _values(name: str, value: Any) -> list[Any]:
    """A sweep argument as a list of distinct values, in the order given."""
    vals = list(value) if isinstance(value, Iterable) and not isinstance(value, str) else [value]
    if not vals:
        raise ShardplanError(f"sweep: {name} lists no values")
    return list(dict.fromkeys(vals))


def grid(accelerator: Any, gpus: Any, global_batch: Any, seq_len: Any, memory_limit_gib: Any = None,
         target: Any = "shardplan", space: Any = "full") -> list[Point]:
    """Every point of the grid (the product of the axes' values), checked before any search."""
    axes = [_values(n, v) for n, v in zip(AXES, (accelerator, gpus, global_batch, seq_len, memory_limit_gib,
                                                   target, space), strict=True)]
    for name, vals in zip(("gpus", "global_batch", "seq_len"), axes[1:4], strict=True):
        bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ShardplanError(f"sweep: {name} takes positive integers, got {bad[0]!r}")
    bad_lim = [v for v in axes[4] if v is not None and not (isinstance(v, int | float) and math.isfinite(v) and v > 0)]
    if bad_lim:
        raise ShardplanError(f"sweep: memory_limit_gib takes positive numbers of GiB, got {bad_lim[0]!r}")
    n = math.prod(len(v) for v in axes)
    if n > MAX_POINTS:
        raise ShardplanError(f"sweep: {n:,} points; sweep at most {MAX_POINTS:,} at once")
    return [Point(**dict(zip(AXES, combo, strict=True))) for combo in itertools.product(*axes)]


def _row(point: Point, planned: Any, tokens: float | None, gpu_hour_cost: float | None) -> dict[str, Any]:
    """A point's table row from its plan."""
    from planner.compare import mesh_text

    p = planned.plan
    s, pred = p.strategy, p.predicted
    m = s.mesh
    tok_s = pred.tokens_per_s_per_gpu * point.gpus
    days = tokens / tok_s / 86400 if tokens else math.nan
    hours = days * 24 * point.gpus if tokens else math.nan
    return {**asdict(point), "status": "ok", "mesh": mesh_text(s), "tp": m.tp, "pp": m.pp, "cp": m.cp, "ep": m.ep,
            "dp_replicate": m.dp_replicate, "dp_shard": m.dp_shard, "micro_batch": s.micro_batch,
            "schedule": s.schedule if m.pp > 1 else "none", "vpp": s.vpp, "step_time_s": pred.step_time_s,
            "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "tokens_per_s": tok_s, "mfu": pred.mfu,
            "hfu": pred.hfu, "memory_peak_gib": pred.memory_peak_gib,
            "memory_used_limit_gib": p.inputs.memory_limit_gib, "train_days": days, "gpu_hours": hours,
            "cost": hours * gpu_hour_cost if tokens and gpu_hour_cost is not None else math.nan,
            "plan": p.model_dump_json()}


def _empty_row(point: Point, reason: str) -> dict[str, Any]:
    return {**asdict(point), **dict.fromkeys(PLAN_COLUMNS, math.nan), "status": reason, "mesh": "", "schedule": "",
            "plan": ""}


_DEVICES: dict[tuple, Any] = {}  # per worker: a device model per cluster, shared by its points


def _solve(args: tuple[Any, Point, float | None, float | None, Any]) -> dict[str, Any]:
    """One point (in a worker): its plan's row, or its reason when nothing fits."""
    from planner.api import search_plan
    from profiler.hardware import parse_cluster

    model, point, tokens, cost, calibration = args
    try:
        key = (point.gpus, point.accelerator)
        if key not in _DEVICES:
            from costmodel.device import DeviceModel

            _DEVICES[key] = DeviceModel(parse_cluster(f"{point.gpus}x{point.accelerator}"))
        dev = _DEVICES[key]
        planned = search_plan(point.request(model, dev.cluster, calibration=calibration), device=dev)
    except ShardplanError as e:
        return _empty_row(point, str(e))
    return _row(point, planned, tokens, cost)


@typed
def sweep(model: Any, gpus: Any, accelerator: Any = "h100", global_batch: Any = 1024, seq_len: Any = 4096,
          memory_limit_gib: Any = None, target: Any = "shardplan", space: Any = "full", **options: Any) -> Any:
    """Plan every point of the grid (each axis one value or a list); a DataFrame with a row per
    point: the axes, ``status`` ("ok" or why nothing fits), the plan's mesh, degrees, schedule,
    step time, tokens/s (per GPU and in all), MFU, HFU, peak memory and the limit it was held to,
    and with ``tokens`` the days and GPU-hours to train that many tokens (and the ``cost`` at
    ``gpu_hour_cost`` a GPU-hour), and the plan document (``plan``, JSON). ``options``: the fields of
    :class:`SweepOptions` (``tokens``, ``gpu_hour_cost``, ``workers``, ``progress``, ``calibration``:
    every accelerator of the grid must be the calibration's)."""
    import pandas as pd

    import planner.api  # noqa: F401  (loaded once here: forked workers start with it)

    check_fields("sweep", options, SweepOptions)
    o = SweepOptions(**options)
    tokens, gpu_hour_cost = o.tokens, o.gpu_hour_cost
    if tokens is not None and not (math.isfinite(tokens) and tokens > 0):
        raise ShardplanError(f"sweep: tokens must be a positive number, got {tokens}")
    if gpu_hour_cost is not None and not (math.isfinite(gpu_hour_cost) and gpu_hour_cost >= 0):
        raise ShardplanError(f"sweep: the GPU-hour cost must be a number >= 0, got {gpu_hour_cost}")
    if isinstance(model, str) and ":" not in model:  # a pkg.module:factory is traced by each point
        from profiler.models import resolve_config

        resolve_config(model)  # an unknown model fails once, before any point
    points = grid(accelerator, gpus, global_batch, seq_len, memory_limit_gib, target, space)
    _check_names(points)
    _check_calibrated(points, o.calibration)
    order = sorted(range(len(points)), key=lambda i: -points[i].gpus)  # the slowest first
    jobs = [(model, points[i], tokens, gpu_hour_cost, o.calibration) for i in order]
    n_workers = min(o.workers if o.workers is not None else min(2, os.cpu_count() or 1), len(jobs))
    rows = _run(jobs, order, n_workers if isinstance(model, str | dict) else 1, o.progress)
    df = pd.DataFrame([rows[i] for i in range(len(points))])
    df.insert(0, "model", model_name(model))
    df.attrs.update(model=model_name(model), tokens=tokens, gpu_hour_cost=gpu_hour_cost)
    return df[["model", *AXES, *PLAN_COLUMNS, "plan"]]


def _run(jobs: list[tuple[Any, ...]], order: list[int], workers: int, progress: Callable[[int, int], None] | None,
         ) -> dict[int, dict[str, Any]]:
    """The row of each point (by its index in the grid; ``order[j]`` is job ``j``'s), in this process
    or in ``workers`` processes."""
    rows: dict[int, dict[str, Any]] = {}
    if workers <= 1:
        for done, (i, job) in enumerate(zip(order, jobs, strict=True), 1):
            rows[i] = _solve(job)
            if progress:
                progress(done, len(jobs))
        return rows
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for done, (i, row) in enumerate(zip(order, pool.map(_solve, jobs), strict=True), 1):
            rows[i] = row
            if progress:
                progress(done, len(jobs))
    return rows


def model_name(model: Any) -> str:
    """How a sweep's table names its model."""
    return model if isinstance(model, str) else str(getattr(model, "get", lambda *_: None)("name") or "model")


def _check_names(points: Sequence[Point]) -> None:
    """Unknown accelerators, targets and spaces fail once, naming the value, before any search."""
    from profiler.hardware import parse_cluster
    from solvers.space import SPACES
    from vocab.targets import load_target

    for acc in {p.accelerator for p in points}:
        parse_cluster(f"1x{acc}")
    for t in {p.target for p in points}:
        load_target(t)
    for s in {p.space for p in points}:
        if s not in SPACES:
            raise ShardplanError(f"unknown search space '{s}'; known: {', '.join(SPACES)}")


def _check_calibrated(points: Sequence[Point], calibration: Any) -> None:
    """A calibration prices the accelerator it was fitted on: every point's must be it."""
    if calibration is None:
        return
    from costmodel.calibration.document import Calibration
    from profiler.hardware import accelerator as find

    if not isinstance(calibration, Calibration):
        raise ShardplanError(f"sweep: calibration must be a Calibration (shardplan calibrate), got "
                             f"{type(calibration).__name__}")

    other = sorted({find(p.accelerator).name for p in points} - {calibration.accelerator})
    if other:
        raise ShardplanError(f"the calibration {calibration.path} was fitted on {calibration.accelerator} runs; the "
                             f"sweep also plans on {', '.join(other)}")


def mesh_heatmap(model: Any, gpus: int, tp: Sequence[int] = (1, 2, 4, 8), pp: Sequence[int] = (1, 2, 4, 8, 16),
                 calibration: Any = None, **axes: Any) -> Any:
    """One point's fastest plan per (tp, pp) cell: a DataFrame with a row per cell (``status``
    "ok", or why the cell has no plan: no such mesh, nothing fits), its step time, tokens/s/GPU,
    MFU, memory and mesh. ``axes``: the other fields of the :class:`Point` (``accelerator``,
    ``global_batch``, ``seq_len``...). The other mesh axes (data, context, expert parallelism,
    micro-batching, schedule, per-layer choices) stay free; no tie-break (each cell is its own
    fastest); ``calibration`` as in :func:`sweep`."""
    import pandas as pd

    from costmodel.device import DeviceModel
    from planner.api import search_plan
    from planner.compare import mesh_text
    from profiler.hardware import parse_cluster

    check_fields("mesh_heatmap", axes, Point)
    point = Point(gpus=gpus, **axes)
    dev = DeviceModel(parse_cluster(f"{gpus}x{point.accelerator}"))
    rows = []
    for t, p in itertools.product(tp, pp):
        row: dict[str, Any] = {"tp": t, "pp": p}
        try:
            request = point.request(model, dev.cluster, tie_break=False, degrees={"tp": t, "pp": p},
                                    calibration=calibration)
            planned = search_plan(request, device=dev)
        except ShardplanError as e:
            rows.append({**row, "status": str(e), "step_time_s": math.nan, "tokens_per_s_per_gpu": math.nan,
                         "mfu": math.nan, "memory_peak_gib": math.nan, "mesh": ""})
            continue
        pred = planned.plan.predicted
        rows.append({**row, "status": "ok", "step_time_s": pred.step_time_s,
                     "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, "mfu": pred.mfu,
                     "memory_peak_gib": pred.memory_peak_gib, "mesh": mesh_text(planned.plan.strategy)})
    df = pd.DataFrame(rows)
    df.attrs.update(model=model_name(model), gpus=gpus, accelerator=point.accelerator,
                    global_batch=point.global_batch, seq_len=point.seq_len, target=point.target)
    return df
