"""Fit a cluster's few device parameters to its own measured runs.

Each run is what ran (layer graph, cluster, strategy, workload) and its steady state
(:class:`costmodel.calibration.logs.Steady`). The time knobs (:mod:`costmodel.calibration.knobs`)
minimise the squared log-ratios of predicted to measured step time, bounded, by the
Levenberg–Marquardt of :mod:`costmodel.published.fit`; before any fit, the runs must *separate* the knobs: each
must change some run's time, and no combination of them may change every run's time alike (the
normalised sensitivities' smallest singular value at the prior, :data:`MIN_SEPARATION`). Memory
knobs enter the peak linearly (``T·(1 + fragmentation) + context``, ``T`` the tensors' peak) and are
solved in closed form on the runs whose log reports a ``reserved`` or ``process`` peak.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from costmodel.calibration.knobs import (
    DEFAULT_TIME,
    KNOBS,
    base_constants,
    check_names,
    device,
    prior,
    settings,
)
from costmodel.calibration.logs import Steady
from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from costmodel.constants import CostConstants
    from costmodel.report import Report
    from profiler.graph import LayerGraph
    from profiler.hardware import Cluster
    from vocab.strategy import Strategy, Workload

#: a knob that moves no run's step time by this much (log-ratio, for a 10% change) is not measured
MIN_EFFECT = 0.001
#: the smallest singular value of the column-normalised sensitivities the runs must give
MIN_SEPARATION = 0.05
STEP = 0.1  # the relative change a sensitivity is taken over


class CalibrationError(ShardplanError):
    """Runs that cannot calibrate the parameters asked for."""


@dataclass(frozen=True)
class Run:
    """One measured run: its names (configuration and log), what ran, and its steady state."""

    config: str
    log: str
    format: str
    graph: LayerGraph
    cluster: Cluster
    strategy: Strategy
    workload: Workload
    measured: Steady

    @property
    def memory_kind(self) -> str | None:
        """The measured peak a memory fit uses: ``reserved``, else ``process``, else None."""
        return next((k for k in ("reserved", "process") if k in self.measured.memory), None)


def report(run: Run, overrides: dict[str, float] | None = None, network: float = 1.0) -> Report:
    """The cost model's report of ``run`` with a calibration's constants and network factor."""
    from costmodel.estimate import estimate

    dev = device(run.cluster, overrides or {}, network)
    return estimate(run.graph, dev.cluster, run.strategy, run.workload, device=dev)


def tensor_peak(rep: Report) -> float:
    """Bytes of the worst rank's tensors at its peak: the peak less its context and fragmentation."""
    return max(st.total - st.overhead for st in rep.stages)


@dataclass
class Fitted:
    """A calibration: the knobs' fitted values and priors, the constants and network factor they
    give, and per run the measured and predicted step time and memory before and after."""

    accelerator: str
    values: dict[str, float]
    priors: dict[str, float]
    overrides: dict[str, float]
    network: float
    runs: list[dict[str, object]] = field(default_factory=list)

    def band(self) -> tuple[float, float]:
        """(low, high): the measured over the fitted step time less 1, at each run's 10th and 90th
        percentile: where a plan's real step time likely lies around its calibrated prediction."""
        lows = [float(r["low_s"]) / float(r["after_s"]) - 1 for r in self.runs]
        highs = [float(r["high_s"]) / float(r["after_s"]) - 1 for r in self.runs]
        return min(lows), max(highs)

    def errors(self, when: str, what: str = "time") -> list[float]:
        """Signed errors (predicted over measured, less 1) of every run ``before`` or ``after``."""
        key = (f"{when}_s", "step_time_s") if what == "time" else (f"{when}_memory", "memory")
        return [float(r[key[0]]) / float(r[key[1]]) - 1 for r in self.runs if r.get(key[1])]


def default_names(runs: Sequence[Run]) -> list[str]:
    """The time knobs of :data:`DEFAULT_TIME`, and the memory knobs the logs measure."""
    kinds = {r.memory_kind for r in runs}
    return [*DEFAULT_TIME, *(["fragmentation"] if kinds & {"reserved", "process"} else []),
            *(["context"] if "process" in kinds else [])]


def calibrate(runs: Sequence[Run], names: Sequence[str] | None = None) -> Fitted:
    """Fit ``names`` (default :func:`default_names`) to ``runs``; raises :class:`CalibrationError`
    when the runs cannot separate them."""
    if not runs:
        raise CalibrationError("no runs to calibrate on")
    accs = sorted({r.cluster.accelerator.name for r in runs})
    if len(accs) > 1:
        raise CalibrationError(f"the runs are on {' and '.join(accs)}: calibrate one accelerator at a time")
    names = list(default_names(runs) if names is None else names)
    check_names(names)
    base = base_constants(runs[0].cluster)
    time_knobs = [n for n in names if KNOBS[n].measured_by == "time"]
    mem_knobs = [n for n in names if KNOBS[n].measured_by == "memory"]
    priors = {n: prior(n, base) for n in names}
    values = dict(priors)
    if time_knobs:
        values.update(_fit_time(runs, time_knobs, base, priors))
    if mem_knobs:
        values.update(_fit_memory(runs, mem_knobs, base))
    overrides, network = settings(values, base)
    fitted = Fitted(accs[0], values, priors, overrides, network)
    fitted.runs = [_compare(r, base, overrides, network) for r in runs]
    return fitted


def _log_times(runs: Sequence[Run], values: dict[str, float], base: CostConstants) -> np.ndarray:
    overrides, network = settings(values, base)
    return np.array([math.log(report(r, overrides, network).step_time_s) for r in runs])


def _fit_time(runs: Sequence[Run], names: list[str], base: CostConstants,
              priors: dict[str, float]) -> dict[str, float]:
    if len(runs) < len(names):
        raise CalibrationError(f"{len(names)} time parameters ({', '.join(names)}) need at least {len(names)} runs, "
                               f"got {len(runs)}")
    measured = np.log([r.measured.step_time_s for r in runs])
    best = search(runs, names, base, priors, measured)
    separable(runs, names, base, best)
    return best


def _overhead(times: np.ndarray, measured: np.ndarray, at: float, bounds: tuple[float, float]) -> tuple[float, float]:
    """(overhead, cost): the step overhead that best fits ``measured`` log times, given predicted
    ``times`` priced with overhead ``at`` (it adds to every step: no re-pricing needed)."""
    lo, hi = bounds[0] - at, bounds[1] - at
    lo = max(lo, -float(np.min(times)) * (1 - 1e-9))

    def cost(d: float) -> float:
        r = np.log(times + d) - measured
        return float(r @ r)

    a, b = lo, hi
    for _ in range(200):  # golden section: the cost is unimodal in the added seconds
        c1, c2 = b - GOLD * (b - a), a + GOLD * (b - a)
        if cost(c1) <= cost(c2):
            b = c2
        else:
            a = c1
        if b - a < 1e-12 * max(1.0, abs(a)):
            break
    d = (a + b) / 2
    return at + d, cost(d)


GOLD = (math.sqrt(5) - 1) / 2
GRID = {1: 13, 2: 7, 3: 5}  # points per factor knob of the starting grid, by the number of factor knobs
GRID_SPAN = 8.0  # the grid spans the prior / GRID_SPAN to the prior x GRID_SPAN


def search(runs: Sequence[Run], names: list[str], base: CostConstants, priors: dict[str, float],
           measured: np.ndarray) -> dict[str, float]:
    """The knobs minimising the squared log-ratios: a geometric grid over the factors (the overhead
    solved exactly at every point), then a bounded Levenberg–Marquardt from the three best points;
    the lowest cost wins (ties to the earlier start: deterministic)."""
    factors = [n for n in names if KNOBS[n].factor]
    points = GRID.get(len(factors), 4)
    axes = [[min(max(priors[n] * GRID_SPAN ** (2 * i / (points - 1) - 1), KNOBS[n].bounds[0]), KNOBS[n].bounds[1])
             for i in range(points)] for n in factors]
    starts: list[tuple[float, dict[str, float]]] = []
    for combo in itertools.product(*axes):
        x = {**priors, **dict(zip(factors, combo, strict=True))}
        x = {n: x[n] for n in names}
        if "overhead" in names:
            times = np.exp(_log_times(runs, x, base))
            x["overhead"], cost = _overhead(times, measured, x["overhead"], KNOBS["overhead"].bounds)
        else:
            r = _log_times(runs, x, base) - measured
            cost = float(r @ r)
        starts.append((cost, x))
    starts.sort(key=lambda cx: cx[0])
    fits = [projected_lm(runs, names, base, x, measured) for _, x in starts[:3]]
    return min(fits, key=lambda xc: xc[1])[0]


def _u(name: str, x: float) -> float:
    return math.log(x) if KNOBS[name].factor else x


def _x(name: str, u: float) -> float:
    return math.exp(u) if KNOBS[name].factor else u


def projected_lm(runs: Sequence[Run], names: list[str], base: CostConstants, x0: dict[str, float],
                 measured: np.ndarray, iters: int = 60) -> tuple[dict[str, float], float]:
    """Levenberg–Marquardt on the log of each factor and the value of each value knob, every step
    projected into the bounds; (knobs, cost)."""
    lo = np.array([_u(n, max(KNOBS[n].bounds[0], 1e-12) if KNOBS[n].factor else KNOBS[n].bounds[0]) for n in names])
    hi = np.array([_u(n, KNOBS[n].bounds[1]) for n in names])

    def resid(u: np.ndarray) -> np.ndarray:
        return _log_times(runs, {n: _x(n, float(v)) for n, v in zip(names, u, strict=True)}, base) - measured

    u = np.clip([_u(n, x0[n]) for n in names], lo, hi)
    r = resid(u)
    cost, lam = float(r @ r), 1e-3
    for _ in range(iters):
        jac = np.empty((len(r), len(u)))
        for j in range(len(u)):
            h = 1e-5 * max(1.0, abs(u[j]))
            d = u.copy()
            d[j] = u[j] + h if u[j] + h <= hi[j] else u[j] - h
            jac[:, j] = (resid(d) - r) / (d[j] - u[j])
        g, a = jac.T @ r, jac.T @ jac
        # a knob on a bound that the gradient pushes outward stays there this step (the active set)
        free = ~(((u <= lo) & (g > 0)) | ((u >= hi) & (g < 0)))
        if not free.any():
            break
        af, gf = a[np.ix_(free, free)], g[free]
        moved = False
        while lam < 1e10:
            step = np.zeros_like(u)
            step[free] = np.linalg.solve(af + lam * np.diag(np.diag(af) + 1e-12), -gf)
            un = np.clip(u + step, lo, hi)
            rn = resid(un)
            if float(rn @ rn) < cost:
                moved = float(np.max(np.abs(un - u))) > 1e-10 and cost - float(rn @ rn) > 1e-14 * cost
                u, r, cost, lam = un, rn, float(rn @ rn), max(lam / 10, 1e-9)
                break
            lam *= 10
        if not moved or cost < 1e-20:
            break
    return {n: _x(n, float(v)) for n, v in zip(names, u, strict=True)}, cost


def sensitivities(runs: Sequence[Run], names: list[str], base: CostConstants, x0: dict[str, float]) -> np.ndarray:
    """d log(step time) of each run per knob: for a factor, per relative change; for a value, per
    change of :data:`STEP` of the run's measured step time (seconds) or of the value's range."""
    at = _log_times(runs, x0, base)
    cols = []
    typical = float(np.median([r.measured.step_time_s for r in runs]))
    for n in names:
        k = KNOBS[n]
        if k.factor:
            dx = x0[n] * STEP
        else:
            dx = STEP * (typical if n == "overhead" else k.bounds[1] - k.bounds[0])
        up = x0[n] + dx if x0[n] + dx <= k.bounds[1] else x0[n] - dx
        cols.append((_log_times(runs, {**x0, n: up}, base) - at) / ((up - x0[n]) / dx))
    return np.array(cols).T


def separable(runs: Sequence[Run], names: list[str], base: CostConstants, x0: dict[str, float]) -> None:
    """Raise :class:`CalibrationError` (one line) unless the runs separate the time knobs."""
    jac = sensitivities(runs, names, base, x0)
    flat = [n for n, col in zip(names, jac.T, strict=True) if float(np.max(np.abs(col))) < MIN_EFFECT]
    if flat:
        raise CalibrationError(
            f"the runs cannot separate {', '.join(flat)}: a change of it moves no run's step time (the runs have "
            f"nothing it prices); fit without it (--fit {','.join(n for n in names if n not in flat) or 'NAMES'}) "
            "or add runs that exercise it")
    separated_or_refuse(jac, names, "step time")


def separated_or_refuse(jac: np.ndarray, names: list[str], what: str) -> None:
    """Refuse when a combination of the knobs (columns of ``jac``) changes every run's ``what`` alike."""
    norm = jac / np.linalg.norm(jac, axis=0)
    _, sv, vt = np.linalg.svd(norm, full_matrices=False)
    if len(names) > 1 and sv[-1] < MIN_SEPARATION:
        v = vt[-1]
        alike = [n for n, w in zip(names, v, strict=True) if abs(w) > 0.3]
        raise CalibrationError(
            f"the runs cannot separate {' from '.join(alike)}: they change every run's {what} alike (separation "
            f"{sv[-1]:.3f} < {MIN_SEPARATION}); add runs that differ in {_differ_hint(alike)}, or fit fewer "
            f"parameters (--fit {','.join(n for n in names if n != alike[-1])})")


def _differ_hint(names: list[str]) -> str:
    hints = {"compute": "size of step (global batch)", "gemm": "the share of GEMMs", "memory": "memory-bound work",
             "network": "communication (data-parallel size, nodes)", "overhead": "length of step (global batch)",
             "fragmentation": "tensor memory", "context": "tensor memory"}
    return " and ".join(dict.fromkeys(hints[n] for n in names))


def _fit_memory(runs: Sequence[Run], names: list[str], base: CostConstants) -> dict[str, float]:
    """The memory knobs by bounded linear least squares on the relative error of the peak."""
    rows = [(r, r.memory_kind) for r in runs if r.memory_kind]
    if "context" in names and not any(k == "process" for _, k in rows):
        raise CalibrationError("the runs cannot separate context: no log reports the process's peak memory (only "
                               "the allocator's); fit without it")
    if not rows:
        raise CalibrationError(f"the runs cannot separate {', '.join(names)}: no log reports a reserved or process "
                               "peak memory")
    tens = np.array([tensor_peak(report(r)) for r, _ in rows])
    y = np.array([r.measured.memory[k] for r, k in rows])
    proc = np.array([1.0 if k == "process" else 0.0 for _, k in rows])
    cols = {"fragmentation": tens / y, "context": proc / y}
    fixed = (tens + tens * base.fragmentation * ("fragmentation" not in names)
             + proc * base.context_bytes * ("context" not in names)) / y
    a = np.array([cols[n] for n in names]).T
    if len(rows) < len(names):
        raise CalibrationError(f"{len(names)} memory parameters need {len(names)} runs with memory, got {len(rows)}")
    separated_or_refuse(a, names, "peak memory")
    return dict(zip(names, bounded_lstsq(a, 1.0 - fixed, [KNOBS[n].bounds for n in names]), strict=True))


def bounded_lstsq(a: np.ndarray, b: np.ndarray, bounds: list[tuple[float, float]]) -> list[float]:
    """``argmin |a·x - b|`` with every ``x_j`` in its bounds: the unconstrained solution if it is
    inside, else the best over the faces of the box (each variable free or at one of its bounds;
    a few variables only)."""
    best: tuple[float, list[float]] | None = None
    for pins in itertools.product((None, 0, 1), repeat=a.shape[1]):
        free = [j for j, p in enumerate(pins) if p is None]
        x = np.array([bounds[j][p] if p is not None else 0.0 for j, p in enumerate(pins)])
        if free:
            sol, *_ = np.linalg.lstsq(a[:, free], b - a @ x, rcond=None)
            x[free] = sol
        if any(not lo - 1e-12 <= v <= hi + 1e-12 for v, (lo, hi) in zip(x, bounds, strict=True)):
            continue
        cost = float(np.sum((a @ x - b) ** 2))
        if best is None or cost < best[0] - 1e-15:
            best = (cost, [float(v) for v in x])
    assert best is not None  # every variable at a bound is always feasible
    return best[1]


def _compare(run: Run, base: CostConstants, overrides: dict[str, float], network: float) -> dict[str, object]:
    """A run's measured and predicted (before, after) step time and memory."""
    before, after = report(run), report(run, overrides, network)
    kind = run.memory_kind or ("allocated" if "allocated" in run.measured.memory else None)
    m = run.measured
    out: dict[str, object] = {"config": run.config, "log": run.log, "format": run.format, "records": m.records,
                              "warmup": m.warmup, "step_time_s": m.step_time_s, "low_s": m.low_s, "high_s": m.high_s,
                              "before_s": before.step_time_s, "after_s": after.step_time_s}
    if kind is not None:
        consts = base.with_overrides(overrides)
        out.update(memory_kind=kind, memory=m.memory[kind], before_memory=memory_of(before, kind, base),
                   after_memory=memory_of(after, kind, consts))
    return out


#: the predicted peak each memory kind of a log measures, of the tensors' peak ``t``, the allocator's
#: slack ``f`` and the context ``c`` (:data:`costmodel.calibration.logs.MEMORY_KINDS`)
MEMORY_OF = {"allocated": lambda t, f, c: t, "reserved": lambda t, f, c: t * (1 + f),
             "process": lambda t, f, c: t * (1 + f) + c}


def memory_of(rep: Report, kind: str, c: CostConstants) -> float:
    """The predicted peak of ``kind`` (:data:`MEMORY_OF`) of a report priced with constants ``c``."""
    return MEMORY_OF[kind](tensor_peak(rep), c.fragmentation, c.context_bytes)
