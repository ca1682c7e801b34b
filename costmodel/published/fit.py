"""Fit the few cost constants to published runs: globally, then per accelerator, never per row.

Only rows of reliability A or B take part; C rows and rows whose reliability is unknown are
reported (``validate``) but never fitted on. The time constants minimise a robust (pseudo-Huber)
loss of ``log(predicted / published)`` over distinct runs, each source weighted by
``1/sqrt(runs)`` so that a source with many rows does not drown the others. The memory constant
``fragmentation`` enters the peak linearly and is solved by least squares on the memory rows
(``context_bytes`` keeps its documented value). An accelerator gets its own GEMM efficiency only
when at least :data:`MIN_RUNS` runs from :data:`MIN_SOURCES` sources measured it; everything else
describes the software or is already relative to the hardware, and is global. The fp8 GEMM speed-up
is measured, not fitted (:class:`CostConstants`)."""

from __future__ import annotations

import csv
import hashlib
import io
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from costmodel.constants import CONSTANTS_PATH, CostConstants
from costmodel.published.runs import TIME_METRICS, PublishedRow
from costmodel.published.validate import ConstantsFor, predict, source_label
from costmodel.report import GIB
from vocab.errors import ShardplanError

#: Constants fitted on time-like metrics, with bounds. ``fsdp_overlap`` is not among them: the only
#: runs whose FSDP traffic is not hidden anyway are one source's slow-network runs, and without them
#: the fit traded the overlap against the compute efficiencies (it collapsed to 0 when that source
#: was held out). It keeps its documented value. Nor is ``memory_efficiency``: it is a streaming
#: kernel's fraction of HBM bandwidth, and what its old fitted value (0.27) absorbed is the eager
#: kernels' extra passes, which ``costmodel.kernels`` counts.
TIME_BOUNDS: dict[str, tuple[float, float]] = {
    "gemm_scale": (0.3, 1.2),
    "attention_efficiency": (0.1, 1.5),
    "tp_overlap": (0.0, 0.95),
    "step_overhead_s": (0.0, 2.0),
    "comm_interference": (0.0, 0.9),
}
#: Fitted per accelerator when enough runs measured it. Attention and memory efficiencies are already
#: relative to the accelerator's GEMM rate and HBM bandwidth; fitting them per accelerator as well
#: made held-out sources worse (leave-one-source-out), so they stay global.
HARDWARE = ("gemm_scale",)
MIN_RUNS, MIN_SOURCES = 10, 2
#: an error band rests on at least this many held-out published rows, from at least this many
#: sources; a slice with fewer is left to the wider one (accelerator and precision, accelerator, all)
BAND_MIN_ROWS, BAND_MIN_SOURCES = 10, 2
HUBER_DELTA = 0.10  # log-ratio scale beyond which a residual counts linearly, not quadratically


def fit_rows(rows: Sequence[PublishedRow]) -> list[PublishedRow]:
    """The rows a fit may use: reliability A or B."""
    return [r for r in rows if r.reliability in ("A", "B")]


@dataclass
class FitResult:
    """Fitted constants: a global section and per-accelerator overrides, with what they rest on."""

    default: dict[str, float]
    accelerators: dict[str, dict[str, float]] = field(default_factory=dict)
    support: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> rows, runs, sources
    bands: dict[str, dict[str, float]] = field(default_factory=dict)  # slice -> rows, sources, low, high, pair
    held_out: list[HeldOut] = field(default_factory=list)  # the leave-one-source-out predictions banded

    def constants(self, base: CostConstants | None = None) -> ConstantsFor:
        base = base or CostConstants()

        def get(acc: str) -> CostConstants:
            return base.with_overrides({**self.default, **self.accelerators.get(acc, {})})

        return get

    def to_yaml(self) -> dict[str, Any]:
        def section(name: str, consts: dict[str, float]) -> dict[str, Any]:
            sup = self.support.get(name, {})
            # a constant the optimiser pushed onto its zero bound is written as 0, not as 1e-18
            return {"constants": {k: 0.0 if abs(v) < 1e-12 else float(f"{v:.6g}") for k, v in sorted(consts.items())},
                    **sup}

        out: dict[str, Any] = {
            "default": section("default", self.default),
            "accelerators": {a: section(a, c) for a, c in sorted(self.accelerators.items())},
        }
        if self.bands:
            out["error_bands"] = {k: {"rows": int(v["rows"]), "sources": int(v["sources"]),
                                      **{f: round(v[f], 4) for f in ("low", "high", "pair")}}
                                  for k, v in sorted(self.bands.items())}
        if self.held_out:
            # every accelerator and precision with held-out rows, banded or not: what a band's text
            # says of the slice it was asked for (too few rows, or no run at all)
            out["held_out_rows"] = dict(sorted(Counter(h.slice for h in self.held_out).items()))
        return out


# ---- the optimiser: Levenberg–Marquardt on bounded, transformed parameters -------------------

def _to_z(x: float, lo: float, hi: float) -> float:
    p = min(max((x - lo) / (hi - lo), 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def _from_z(z: float, lo: float, hi: float) -> float:
    return lo + (hi - lo) / (1 + math.exp(-max(min(z, 40.0), -40.0)))


def _robust(r: np.ndarray) -> np.ndarray:
    """Residuals whose squares are the pseudo-Huber loss of ``r``."""
    rho = HUBER_DELTA**2 * (np.sqrt(1 + (r / HUBER_DELTA) ** 2) - 1)
    return np.sign(r) * np.sqrt(2 * rho)


def levenberg_marquardt(resid, x0: dict[str, float], bounds: dict[str, tuple[float, float]],
                        iters: int = 30, tol: float = 1e-7) -> tuple[dict[str, float], float]:
    """Minimise ``sum(resid(x)**2)`` over the named, bounded parameters."""
    names = list(x0)
    z = np.array([_to_z(x0[n], *bounds[n]) for n in names])

    def xs(zv: np.ndarray) -> dict[str, float]:
        return {n: _from_z(float(v), *bounds[n]) for n, v in zip(names, zv, strict=True)}

    r = resid(xs(z))
    cost, lam, h = float(r @ r), 1e-2, 1e-3
    for _ in range(iters):
        jac = np.empty((len(r), len(z)))
        for j in range(len(z)):
            dz = z.copy()
            dz[j] += h
            jac[:, j] = (resid(xs(dz)) - r) / h
        g, a = jac.T @ r, jac.T @ jac
        improved = False
        while lam < 1e8:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -g)
            r_new = resid(xs(z + step))
            c_new = float(r_new @ r_new)
            if c_new < cost:
                improved = cost - c_new > tol * max(cost, 1e-12)
                z, r, cost, lam = z + step, r_new, c_new, max(lam / 3, 1e-7)
                break
            lam *= 4
        if not improved:
            break
    return xs(z), cost


def _multi_start(resid, x0: dict[str, float], bounds: dict[str, tuple[float, float]],
                 ) -> tuple[dict[str, float], float]:
    """Levenberg–Marquardt from ``x0`` and from the quarter and three-quarter points of every bound
    box (the overlaps and overheads trade against the efficiencies: one start can stall on a
    bound); the lowest loss wins, ties to the earlier start, so the fit is deterministic."""
    starts = [x0] + [{n: lo + q * (hi - lo) for n, (lo, hi) in ((n, bounds[n]) for n in x0)} for q in (0.25, 0.75)]
    best: tuple[dict[str, float], float] | None = None
    for x in starts:
        got = levenberg_marquardt(resid, x, bounds)
        if best is None or got[1] < best[1] - 1e-12:
            best = got
    assert best is not None
    return best


# ---- fitting -----------------------------------------------------------------------------------

def _runs(rows: Sequence[PublishedRow]) -> dict[tuple, list[PublishedRow]]:
    out: dict[tuple, list[PublishedRow]] = {}
    for r in rows:
        if r.metric in TIME_METRICS:
            out.setdefault(r.key, []).append(r)
    return out


def _time_residuals(rows: Sequence[PublishedRow], base: CostConstants, fixed: dict[str, float],
                    per_acc: dict[str, dict[str, float]] | None = None):
    runs = _runs(rows)
    reps = [rs[0] for rs in runs.values()]
    per_source: dict[str, int] = {}
    for r in reps:
        per_source[r.source] = per_source.get(r.source, 0) + 1
    weights = np.array([1 / math.sqrt(per_source[r.source]) for r in reps])
    members = [rs for rs in runs.values()]

    def resid(x: dict[str, float]) -> np.ndarray:
        def consts(acc: str) -> CostConstants:
            return base.with_overrides({**fixed, **(per_acc or {}).get(acc, {}), **x})

        preds, _ = predict([r for rs in members for r in rs], consts)
        by_row = {id(p.row): p.log_ratio for p in preds}
        out = np.array([np.mean([by_row.get(id(r), 1.0) for r in rs]) for rs in members])
        return _robust(out) * weights

    return resid, len(reps), len(per_source)


def fit_time(rows: Sequence[PublishedRow], base: CostConstants | None = None,
             names: Sequence[str] | None = None, per_accelerator: bool = True) -> FitResult:
    """Fit ``names`` (default :data:`TIME_BOUNDS`) globally on A/B rows, then the hardware efficiencies
    per accelerator."""
    base = base or CostConstants()
    rows = fit_rows(rows)
    names = list(TIME_BOUNDS) if names is None else list(names)
    x0 = {n: getattr(base, n) for n in names}
    resid, n_runs, n_src = _time_residuals(rows, base, {})
    if not n_runs:
        raise ShardplanError("no time-like rows of reliability A or B to fit on")
    best, _ = _multi_start(resid, x0, TIME_BOUNDS)
    result = FitResult(default=best, support={"default": _support(rows)})
    if not per_accelerator:
        return result
    for acc in sorted({r.cluster.accelerator.name for r in rows}):
        acc_rows = [r for r in rows if r.cluster.accelerator.name == acc]
        sup = _support(acc_rows)
        if sup["runs"] < MIN_RUNS or sup["sources"] < MIN_SOURCES:
            continue
        hw = [n for n in HARDWARE if n in best]
        fixed = {k: v for k, v in best.items() if k not in hw}
        res_acc, _, _ = _time_residuals(acc_rows, base, fixed)
        local, _ = levenberg_marquardt(res_acc, {n: best[n] for n in hw}, TIME_BOUNDS)
        result.accelerators[acc] = local
        result.support[acc] = sup
    return result


def _support(rows: Sequence[PublishedRow]) -> dict[str, Any]:
    time = [r for r in rows if r.metric in TIME_METRICS]
    return {"rows": len(time), "runs": len(_runs(time)), "sources": len({r.source for r in time}),
            "source_names": sorted({source_label(r.source) for r in time})}


def training_stack(source: str) -> str:
    """The trainer a published source ran (``pytorch/torchtitan`` for every torchtitan benchmark
    file): what allocates its memory, so what a memory fit must see two of."""
    first = source.split(" ", 1)[0]
    return first if "/" in first else source


def fit_memory(rows: Sequence[PublishedRow], constants: ConstantsFor) -> tuple[dict[str, float], dict[str, Any]]:
    """``fragmentation`` from the measured peaks, ``context_bytes`` kept at its documented value,
    once the peaks come from :data:`MIN_SOURCES` trainers (:func:`training_stack`) at least.

    The peak is ``T·(1 + fragmentation) + context`` with ``T`` the tensors' peak, so the relative
    least-squares fraction has a closed form. The two overheads are nearly collinear across runs
    that all fill the device, so only the fraction is fitted.
    """
    mem = [r for r in fit_rows(rows) if r.metric == "memory_GiB_peak"]
    support = {"memory_rows": len(mem), "memory_sources": len({r.source for r in mem}),
               "memory_stacks": len({training_stack(r.source) for r in mem})}
    if len(mem) < 3 or support["memory_stacks"] < MIN_SOURCES:  # one trainer's allocator is no physics
        return {}, {**support, "memory_fitted": False}

    def consts(acc: str) -> CostConstants:
        return constants(acc).with_overrides({"fragmentation": 0.0})

    preds, _ = predict(mem, consts)
    ctx = np.array([constants(p.row.cluster.accelerator.name).context_bytes for p in preds])
    y = np.array([p.row.value * GIB for p in preds])
    t = np.array([p.predicted * GIB for p in preds]) - ctx  # the tensors' peak
    a, r = t / y, 1 - (t + ctx) / y
    frag = float(np.clip((a @ r) / (a @ a), 0.0, 1.0))
    return {"fragmentation": frag}, {**support, "memory_fitted": True}


def fit_constants(rows: Sequence[PublishedRow], base: CostConstants | None = None) -> FitResult:
    """Time constants, then memory constants, on the A/B rows of ``rows`` (no bands)."""
    result = fit_time(rows, base)
    mem, sup = fit_memory(rows, result.constants(base))
    result.default.update(mem)
    result.support.setdefault("default", {}).update(sup)
    return result


def fit(rows: Sequence[PublishedRow], base: CostConstants | None = None, jobs: int = 1) -> FitResult:
    """Time constants, then memory constants, on the A/B rows of ``rows``; then the error bands of
    the model on runs it was not fitted on: each source's rows predicted by constants fitted on the
    other sources (:func:`held_out_predictions`, ``jobs`` refits at a time), their errors banded per
    slice (:func:`error_bands`)."""
    result = fit_constants(rows, base)
    result.held_out = held_out_predictions(rows, base, jobs)
    result.bands = error_bands(result.held_out)
    return result


def _held_out_source(args: tuple[Sequence[PublishedRow], str, CostConstants | None]) -> list[HeldOut]:
    rows, source, base = args
    others = [r for r in rows if r.source != source]
    mine = [r for r in fit_rows(rows) if r.source == source and r.metric in TIME_METRICS]
    if not mine or not _runs(fit_rows(others)):
        return []
    preds, _ = predict(mine, fit_constants(others, base).constants(base))
    return held_out_records(preds)


def held_out_predictions(rows: Sequence[PublishedRow], base: CostConstants | None = None,
                         jobs: int = 1) -> list[HeldOut]:
    """Leave one source out: every source's time-like A/B rows predicted by the constants that
    :func:`fit_constants` fits on the other sources' rows (one refit per source; ``jobs`` of them
    in parallel processes). A source alone in ``rows`` has nothing to be fitted on and no held-out
    rows. Deterministic: each refit is, and the records come back in source order."""
    sources = sorted({r.source for r in fit_rows(rows) if r.metric in TIME_METRICS})
    tasks = [(rows, s, base) for s in sources]
    if jobs > 1 and len(tasks) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            parts = list(pool.map(_held_out_source, tasks))
    else:
        parts = [_held_out_source(t) for t in tasks]
    return [h for part in parts for h in part]


@dataclass(frozen=True)
class HeldOut:
    """One time-like published row as a prediction of constants fitted without its source: what a
    band is computed from, and what ``shardplan fit`` writes beside the constants
    (:func:`write_held_out`)."""

    row: int  # line in the published-runs CSV
    source: str
    model: str
    accelerator: str
    precision: str
    gpus: int
    run: str  # equal for the rows of one run (a digest of ``PublishedRow.key``)
    published_tps: float
    predicted_tps: float

    @property
    def time_error(self) -> float:
        """Published over predicted step time, less 1 (``Prediction.time_error``)."""
        return self.published_tps / self.predicted_tps - 1.0

    @property
    def slice(self) -> str:
        return f"{self.accelerator}/{self.precision}"

    @property
    def sweep(self) -> tuple:
        """``validate.sweep_key``: one source's model on one cluster."""
        return (self.source, self.model, self.accelerator, self.gpus)


HELD_OUT_FIELDS = ("row", "source", "model", "accelerator", "precision", "gpus", "run", "published_tps",
                   "predicted_tps")


def held_out_records(preds: Sequence[Any]) -> list[HeldOut]:
    """:class:`HeldOut` records of the time-like predictions of ``preds`` (``validate.Prediction``)."""
    out = []
    for p in preds:
        if p.time_error is None:
            continue
        r = p.row
        out.append(HeldOut(r.row, r.source, r.model, r.cluster.accelerator.name, r.workload.precision,
                           r.cluster.world_size, hashlib.sha1(repr(r.key).encode()).hexdigest()[:12],
                           float(p.published_tps), float(p.predicted_tps)))
    return out


def band_slices(h: HeldOut) -> tuple[str, str, str]:
    """The slices a row belongs to, widest first: ``all``, its accelerator, accelerator/precision."""
    return ("all", h.accelerator, h.slice)


def error_bands(preds: Sequence[Any], low_q: float = 10.0, high_q: float = 90.0) -> dict[str, dict[str, float]]:
    """Per slice — every row (``all``), per accelerator, per accelerator and precision
    (``h100-sxm/fp8``) — the 10th and 90th percentiles of the signed step-time error (the published
    time over the predicted, less 1) of ``preds`` (:class:`HeldOut` records, or
    ``validate.Prediction``: :func:`fit` gives the leave-one-source-out ones), and ``pair``: the
    90th percentile of the error of the ratio of two runs of one sweep (one model on one cluster,
    the configuration apart), the band within which two plans' predicted times are not told apart
    (their shared errors cancel; a sweep is one source's, so both runs of a pair were predicted
    with the same held-out constants). Slices of fewer than ``BAND_MIN_ROWS`` rows or
    ``BAND_MIN_SOURCES`` sources are left to the wider one; a slice of fewer than ``BAND_MIN_ROWS``
    pairs takes ``high - low`` as its pair band."""
    recs = [p if isinstance(p, HeldOut) else None for p in preds]
    if any(r is None for r in recs):
        recs = held_out_records(preds)
    slices: dict[str, list[HeldOut]] = {}
    for h in recs:
        for key in band_slices(h):
            slices.setdefault(key, []).append(h)
    out: dict[str, dict[str, float]] = {}
    for k, hs in slices.items():
        n_src = len({h.source for h in hs})
        if len(hs) < BAND_MIN_ROWS or n_src < BAND_MIN_SOURCES:
            continue
        errs = [h.time_error for h in hs]
        low, high = float(np.percentile(errs, low_q)), float(np.percentile(errs, high_q))
        pairs = _pair_errors(hs)
        pair = float(np.percentile(pairs, high_q)) if len(pairs) >= BAND_MIN_ROWS else high - low
        out[k] = {"rows": len(hs), "sources": n_src, "low": low, "high": high, "pair": pair}
    return out


def _pair_errors(recs: Sequence[HeldOut]) -> list[float]:
    """|log(predicted ratio / published ratio)| of every pair of distinct runs of one sweep (a run's
    published throughput: the mean over its rows)."""
    runs: dict[str, list[HeldOut]] = {}
    for h in recs:
        runs.setdefault(h.run, []).append(h)
    sweeps: dict[tuple, list[tuple[float, float]]] = {}
    for hs in runs.values():
        sweeps.setdefault(hs[0].sweep, []).append((float(np.mean([h.published_tps for h in hs])), hs[0].predicted_tps))
    return [abs(math.log(qa / qb) - math.log(pa / pb))
            for members in sweeps.values() for i, (pa, qa) in enumerate(members) for pb, qb in members[i + 1:]]


def band_coverage(band: dict[str, float], recs: Sequence[HeldOut]) -> tuple[int, int]:
    """(rows whose error lies within ``band``'s low and high, rows): how often the band held."""
    inside = sum(band["low"] <= h.time_error <= band["high"] for h in recs)
    return inside, len(recs)


def write_held_out(recs: Sequence[HeldOut], path: str | Path) -> Path:
    """The held-out predictions as CSV (:data:`HELD_OUT_FIELDS`), in source and row order."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(HELD_OUT_FIELDS)
    for h in sorted(recs, key=lambda h: (h.source, h.row)):
        w.writerow([h.row, h.source, h.model, h.accelerator, h.precision, h.gpus, h.run,
                    repr(h.published_tps), repr(h.predicted_tps)])
    p = Path(path)
    p.write_text(buf.getvalue())
    return p


def read_held_out(path: str | Path) -> list[HeldOut]:
    with Path(path).open(newline="") as f:
        return [HeldOut(int(d["row"]), d["source"], d["model"], d["accelerator"], d["precision"], int(d["gpus"]),
                        d["run"], float(d["published_tps"]), float(d["predicted_tps"])) for d in csv.DictReader(f)]


def write_constants(result: FitResult, path: str | Path = CONSTANTS_PATH, header: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(result.to_yaml(), sort_keys=False, allow_unicode=True)
    p.write_text((header + "\n" if header else "") + text)
    return p

