"""OSDP by dynamic programming over the units, with memory (and the clipped term) discretised.

State after unit ``i``: memory used on an integer grid (and, when needed, Σ d on a second grid);
value: the least Σ a plus transition costs (the previous option joins the state when there are
transitions). The transient maxima are handled exactly by enumerating their caps ``G`` and ``R``
(over the values options take): under a cap only options with ``g <= G`` and ``r <= R`` are
allowed and the budget shrinks by ``G + R``.

The clipped term ``max(0, Σd)``: ``Σa <= f`` and ``Σ(a+d) <= f`` for every plan, so one-dimensional
DPs minimising each give two lower bounds and two candidate plans; when a candidate meets the
larger bound it is optimal. Otherwise a two-dimensional DP over (memory, Σd) settles it.

Discretisation, and its bound: the *conservative* run rounds every option's memory **up** to the
grid, so what it returns fits the true budget (Σ d is rounded to the nearest grid point and the
plan's objective recomputed exactly); the *relaxed* run rounds memory and d **down**, so its
optimum is a lower bound on the true one. The gap between the two is the discretisation error
actually incurred (``gap``); ``info`` also gives the a-priori bounds (units × grid step). For
integer data on small grids the step is 1 and the DP is exact.

The end-of-backward constraint (a problem with a ``tail``, see :mod:`solvers.chain`) is a second
memory dimension. When no plan can make it bind (every option's ``end - mem`` summed at its worst,
plus the tail, stays at or below zero) it is dropped and nothing changes. Otherwise the conservative
run asks ``Σ max(mem, end) <= budget - G - max(R, tail)``, which implies both constraints, and the
relaxed run drops it, which keeps its optimum a lower bound: the gap says what that cost.

A problem whose host-memory budget can bind (offloaded states of the node) has a third resource the
DP does not track: it answers ``unsupported`` and the ILP, which takes it as one more row, solves it.
"""

from __future__ import annotations

import math
import time
from itertools import product

import numpy as np

from solvers.chain import ChainProblem, ChainSolution, reduced

INF = np.inf
Run = tuple[float, list[int]] | None


def _grid(values: list[float], span: float, buckets: int) -> float:
    """Grid step: 1 for small integer data, else ``span / buckets``."""
    if span <= 0 or (all(float(v).is_integer() for v in values) and span <= buckets * 4):
        return 1.0
    return span / buckets


class _DP:
    def __init__(self, p: ChainProblem, mem_buckets: int, d_buckets: int):
        self.p = p
        opts = [o for row in p.options for o in row]
        self.d_mode = (
            "mixed"
            if any(o.d > 0 for o in opts) and any(o.d < 0 for o in opts)
            else ("fold" if any(o.d > 0 for o in opts) else "none")
        )
        self.mu = _grid([o.mem for o in opts] + [p.budget], max(p.budget, 0.0), mem_buckets)
        # the two-dimensional run keeps at most 8192 x 128 cells (a coarser grid only loosens it)
        self.mu2 = self.mu if self.mu == 1.0 or mem_buckets <= 8192 else max(p.budget, 0.0) / 8192
        d_buckets = min(d_buckets, 128)
        span = sum(
            max(o.d for o in p.unit_options(i)) - min(o.d for o in p.unit_options(i)) for i in range(p.units)
        )
        self.delta = _grid([o.d for o in opts], span, d_buckets) if self.d_mode == "mixed" else 1.0
        worst = sum(max(o.end - o.mem for o in p.unit_options(i)) for i in range(p.units))
        self.two = p.tail is not None and worst + p.tail > 0  # the end of backward can bind
        self.exact = self.mu == 1.0 and self.delta == 1.0 and not self.two

    def cap(
        self, allowed: list[list[int]], G: float, R: float, incumbent: float = INF
    ) -> tuple[float, list[tuple[float, list[int]]]]:
        """(lower bound, candidate plans with exact objectives) under one cap setting: options with
        ``g <= G`` and ``r <= R``.

        With a clipped term of both signs the two one-dimensional runs come first: a plan whose
        Σd <= 0 minimises Σa, or whose Σd >= 0 minimises Σ(a+d), is optimal for its grid, so the
        two-dimensional run is only needed when neither holds.
        """
        p = self.p
        relaxed = p.budget - G - R
        budgets = {False: relaxed, True: p.budget - G - max(R, p.tail or 0.0) if self.two else relaxed}
        lower, cands = -INF, []
        certified = {True: False, False: False}  # per rounding (up, down): no 2-D run needed
        roundings = (True,) if self.exact else (True, False)  # on an exact grid one run is both

        def take(res: Run, up: bool) -> bool:
            """Record a run; False when it proves nothing fits (only a relaxed or exact run can)."""
            nonlocal lower
            if res is None:
                return up and not self.exact
            if not up or self.exact:
                lower = max(lower, res[0])
            if p.fits(res[1]):
                cands.append((p.objective(res[1]), res[1]))
            return True

        for mode in [self.d_mode] if self.d_mode != "mixed" else ["none", "fold"]:
            for up in roundings:
                res = self.run(allowed, budgets[up], mode, up)
                if not take(res, up):
                    return INF, cands
                if res is None:
                    continue
                dsum = sum(p.unit_options(i)[c].d for i, c in enumerate(res[1]))
                if self.d_mode != "mixed" or (mode == "none" and dsum <= 0) or (mode == "fold" and dsum >= 0):
                    certified[up] = True
            if lower >= incumbent:
                return lower, cands
        for up in roundings:
            if not certified[up] and not take(self.run(allowed, budgets[up], "mixed", up), up):
                return INF, cands
        return lower, cands

    def run(self, allowed: list[list[int]], budget: float, mode: str, up: bool) -> Run:
        """(DP value, choice) of one cap setting; None when nothing fits."""
        p, mu, delta = self.p, (self.mu2 if mode == "mixed" else self.mu), self.delta
        if budget < 0:
            return None
        B = int(math.floor(budget / mu))
        units = []  # per unit: option indices, memory ints, d ints above the unit's least, values
        d_base = 0
        for i in range(p.units):
            k = p.classes[i]
            idx = allowed[k]
            o = [p.options[k][j] for j in idx]
            mem = [max(x.mem, x.end) if up and self.two else x.mem for x in o]
            ms = [max(int(math.ceil(x / mu)) if up else int(math.floor(x / mu)), 0) for x in mem]
            a = [x.a + (x.d if mode == "fold" else 0.0) for x in o]
            ds = [0] * len(o)
            if mode == "mixed":
                ds = [int(round(x.d / delta)) if up else int(math.floor(x.d / delta)) for x in o]
                lo = min(ds)
                d_base += lo
                ds = [x - lo for x in ds]
            units.append((idx, ms, ds, a))
        D = sum(max(u[2]) for u in units)
        trans = p.transitions
        V = np.full((1, B + 1, D + 1), INF)
        V[0, 0, 0] = 0.0
        back: list[tuple[np.ndarray, np.ndarray | None]] = []
        prev: list[int] = [0]
        for i, (idx, ms, ds, a) in enumerate(units):
            cand = np.full((len(idx), B + 1, D + 1), INF)
            pargs = np.zeros((len(idx), B + 1, D + 1), dtype=np.int32) if trans is not None else None
            flat = V.min(axis=0) if trans is None else None
            for s, (j, m, d, av) in enumerate(zip(idx, ms, ds, a, strict=True)):
                if m > B:
                    continue
                if trans is not None and i > 0:
                    t = np.asarray(trans[i - 1])[np.array(prev), j]
                    tot = V + t[:, None, None]
                    pb = np.argmin(tot, axis=0)
                    base = np.take_along_axis(tot, pb[None], 0)[0]
                    pargs[s, m:, d:] = pb[: B + 1 - m, : D + 1 - d]  # type: ignore[index]
                else:
                    base = flat if flat is not None else V[0]
                cand[s, m:, d:] = base[: B + 1 - m, : D + 1 - d] + av
            if trans is None:
                arg = np.argmin(cand, axis=0)
                V = np.take_along_axis(cand, arg[None], 0)
                back.append((arg, None))
            else:
                V = cand
                back.append((np.zeros(0, dtype=np.int32), pargs))
            prev = list(idx)
        clip = np.maximum(0.0, (np.arange(D + 1) + d_base) * delta) if mode == "mixed" else np.zeros(D + 1)
        total = V + clip[None, None, :]
        if not np.isfinite(total).any():
            return None
        slot, mm, dd = (int(x) for x in np.unravel_index(int(np.argmin(total)), total.shape))
        value = float(total[slot, mm, dd]) + p.const
        choice = [0] * p.units
        for i in range(p.units - 1, -1, -1):
            arg, pargs = back[i]
            s = int(arg[mm, dd]) if pargs is None else slot
            idx, ms, ds, _ = units[i]
            choice[i] = idx[s]
            if pargs is not None:
                slot = int(pargs[s, mm, dd])
            mm, dd = mm - ms[s], dd - ds[s]
        return value, choice


def solve_dp(
    prob: ChainProblem,
    mem_buckets: int = 4096,
    d_buckets: int = 64,
    time_limit: float | None = None,
    refine: int = 3,
    work: float = 4e7,
) -> ChainSolution:
    """Best choice per unit found by the DP, with a proven lower bound (see the module notes).

    While the result is not proven optimal, the grids are refined (8x, up to ``refine`` times, as
    long as units × options × buckets stays under ``work``): the best plan of every run and the
    largest of their lower bounds are kept."""
    t0 = time.perf_counter()
    if prob.host_binds:  # a second budget the DP's one memory dimension does not track
        return ChainSolution(None, INF, -INF, "unsupported", 0.0,
                             {"reason": "the host memory budget binds: only the ILP takes two budgets"})
    red, maps = reduced(prob)
    best: tuple[float, list[int]] | None = None
    lower = -INF
    info: dict = {}
    timed_out = False
    width = max(len(row) for row in red.options)
    for round_ in range(refine + 1):
        dp = _DP(red, mem_buckets * 8**round_, d_buckets * 2**round_)
        best, low, timed_out = _grid_run(red, dp, best, t0, time_limit)
        lower = max(lower, low)
        info = {
            "mem_grid_bytes": dp.mu,
            "d_grid": dp.delta,
            "mem_error_bound": dp.mu * red.units,
            "d_error_bound": dp.delta * red.units if dp.d_mode == "mixed" else 0.0,
            "exact_grid": dp.exact,
            "refinements": round_,
        }
        done = best is None or (best[0] - min(lower, best[0])) <= 1e-12 * max(abs(best[0]), 1e-300)
        if done or dp.exact or timed_out or red.units * width * mem_buckets * 8 ** (round_ + 1) > work:
            break
    dt = time.perf_counter() - t0
    if best is None:
        return ChainSolution(None, INF, lower, "time_limit" if timed_out else "infeasible", dt, info)
    obj, choice = best
    bound = min(lower, obj)
    optimal = (obj - bound) <= 1e-12 * max(abs(obj), 1e-300)
    status = "optimal" if optimal else ("time_limit" if timed_out else "feasible")
    return ChainSolution(
        [maps[red.classes[i]][c] for i, c in enumerate(choice)], obj, bound, status, dt, info
    )


def _grid_run(
    red: ChainProblem, dp: _DP, best: tuple[float, list[int]] | None, t0: float, time_limit: float | None
) -> tuple[tuple[float, list[int]] | None, float, bool]:
    """One DP at one grid, every cap setting: (best plan so far, lower bound, timed out)."""
    opts_all = [o for row in red.options for o in row]
    caps = []
    for G, R in product(sorted({0.0} | {o.g for o in opts_all}), sorted({0.0} | {o.r for o in opts_all})):
        allowed = [[j for j, o in enumerate(row) if o.g <= G and o.r <= R] for row in red.options]
        if red.budget - G - R >= 0 and all(allowed[k] for k in set(red.classes)):
            caps.append((_relaxed(red, allowed, dp.d_mode), G, R, allowed))
    caps.sort(key=lambda c: (c[0], c[1], c[2]))
    lower = INF
    timed_out = False
    for relax, G, R, allowed in caps:
        if best is not None and relax >= best[0]:
            lower = min(lower, relax)
            continue
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            timed_out = True
            lower = min(lower, relax)
            continue
        low, cands = dp.cap(allowed, G, R, best[0] if best is not None else INF)
        lower = min(lower, low)
        for obj, choice in cands:
            if best is None or obj < best[0] - 1e-15 * abs(obj):
                best = (obj, choice)
    return best, lower, timed_out


def _relaxed(p: ChainProblem, allowed: list[list[int]], d_mode: str) -> float:
    """Objective ignoring memory (and the best transitions): a lower bound under these caps."""
    a = sum(
        min(p.options[k][j].a + (p.options[k][j].d if d_mode == "fold" else 0.0) for j in allowed[k])
        for k in p.classes
    )
    d = sum(min(p.options[k][j].d for j in allowed[k]) for k in p.classes) if d_mode == "mixed" else 0.0
    tmin = sum(float(np.min(t)) for t in p.transitions) if p.transitions is not None else 0.0
    return p.const + a + max(0.0, d) + tmin
