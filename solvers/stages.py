"""Pipeline meshes: per-layer recomputation and non-uniform stage boundaries, exactly.

For a mesh with ``pp > 1`` and one uniform (sharding, offload), each unit chooses its recomputation
and — with one virtual stage per rank — the stages choose their boundaries (at least one block
each; the embedding rides on the first stage, the head on the last). Everything but a stage's time
``T`` is fixed by which units it holds; ``T`` and the memory depend on the recomputation choices.

1. Per (rank, units held): the least ``T`` whose memory fits (:meth:`PipelineProblem.stage`) —
   exact: for a single block class, enumerate how many blocks recompute fully and fill the rest
   with the faster of the two other options as far as memory allows (closed form, all block
   counts at once); for several classes, Pareto frontiers of (time, memory) merged across classes.
2. Over the stages: a label-setting DP over (stages done, blocks done) whose labels carry the
   running maxima and sums the schedule's step time needs (``max T, Σ T, max(T - 2W), max
   exposed DP sync, max optimizer, max offload``), Pareto-pruned and pruned by a lower bound
   against the incumbent. Its optimum equals :func:`costmodel.estimate.estimate` of the plan.

With interleaved stages (``vpp > 1``) the split is the even one and each rank's choice is
independent (the schedule's step only grows with each ``T``).

Given several problems of one mesh (one per sharding and offload), each stage takes the one that
serves the pipeline best: the DP's candidates for a stage are the problems' stage costs, less the
ones another beats in everything the objective reads. (The search gives it one problem per mesh;
the ``staged`` space, where every unit takes its own, is :mod:`solvers.stage_ilp`'s MIP, which
its tests check against this DP on the plans whose stages each keep one.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.constants import CostConstants
from costmodel.estimate import rank_sends
from costmodel.pipeline import pipeline_step, ramp_step, ramp_terms, step_terms, time_shared
from profiler.graph import LayerGraph
from solvers.chain import option_strategy
from solvers.stage_tables import INF, Fixed, PipelineProblem, StageCost, UnitView, best_splits
from vocab.strategy import LayerStrategy, MeshConfig, Strategy, rank_blocks

__all__ = ["PipelineProblem", "PipelineSolution", "UnitView", "pipeline_objective", "pipeline_strategy",
           "solve_pipeline"]

@dataclass
class PipelineSolution:
    objective: float
    stage_layers: list[int] | None
    recompute: list[str]  # per unit, in order
    status: str = "optimal"
    labels: int = 0
    combos: list[tuple[str, str]] | None = None  # per unit, in order: (sharding, offload)
    operators: list[tuple[int, bool]] | None = None  # per unit, in order: (split, mixed); None: (1, False)


Cand = tuple[int, StageCost]  # (which problem: its sharding and offload, the stage's cost)


class _Label:
    __slots__ = ("vals", "parent", "n", "cost")

    def __init__(self, vals: tuple[float, ...], parent: _Label | None, n: int, cost: Cand | None):
        self.vals, self.parent, self.n, self.cost = vals, parent, n, cost


def _objective(pp: PipelineProblem, max_t: float, sum_t: float, fill: float, ex: float, opt: float,
               off: float) -> float:
    """The step time of stages whose label values are these (see :func:`_vals`)."""
    if max_t == INF:
        return INF
    c, m, p, v, sched = pp.dev.c, pp.m, pp.p, pp.v, pp.cfg.schedule
    pipe = pipeline_step(sched, m, p, v, max_t, sum_t, fill)
    ramp = ramp_step(sched, sum_t, max_t, fill, p, v)
    return float(time_shared(pipe, m, sum_t, p, pp.dev.share, ramp)) + ex + opt + off + c.step_overhead_s


def _vals(sc: StageCost, consts: CostConstants) -> tuple[float, ...]:
    """A stage's label values: (T, T, T - 2W, exposed sync, optimizer, offload), which
    :func:`_extend` joins into (max T, Σ T, the largest fill, and the other maxima)."""
    f = sc.fixed
    return (sc.time, sc.time, sc.time - 2 * f.weight, sc.exposed(consts), f.optim, f.offload)


def _extend(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return (max(a[0], b[0]), a[1] + b[1], max(a[2], b[2]), max(a[3], b[3]), max(a[4], b[4]), max(a[5], b[5]))


def _label_dims(pp: PipelineProblem) -> tuple[int, ...]:
    """The label values the objective reads: max T, Σ T where the schedule reads it (and on
    time-shared cores, whose step reads it under every schedule), the largest fill where the
    schedule or its ramp reads it, the per-step maxima."""
    _, on_sum, on_fill = step_terms(pp.cfg.schedule, pp.m, pp.p, pp.v)
    shared = pp.dev.share < 1.0
    reads_sum = on_sum != 0 or shared
    reads_fill = on_fill != 0 or (shared and ramp_terms(pp.cfg.schedule, pp.p, pp.v)[2] != 0)
    return (0,) + ((1,) if reads_sum else ()) + ((2,) if reads_fill else ()) + (3, 4, 5)


def solve_pipeline(problems: PipelineProblem | Sequence[PipelineProblem], incumbent: float = INF,
                   nonuniform: bool = True) -> PipelineSolution | None:
    """The fastest plan that fits, or None (or nothing better than ``incumbent``).

    ``problems``: one per (sharding, offload) of the same mesh; each stage (each rank, with
    interleaving) takes the one that serves the pipeline best — one problem, one uniform choice."""
    qs = [problems] if isinstance(problems, PipelineProblem) else list(problems)
    if qs[0].v > 1 or not nonuniform:
        return _solve_even(qs, incumbent, _label_dims(qs[0]))
    return _solve_free(qs, incumbent, _label_dims(qs[0]))


def _solve_even(qs: list[PipelineProblem], incumbent: float, dims: tuple[int, ...]) -> PipelineSolution | None:
    """:func:`solve_pipeline` on the even split: each rank's choice of problem, labels over the ranks."""
    pp = qs[0]
    L, p, v, consts = len(pp.block_cls), pp.p, pp.v, pp.dev.c
    per_rank, sends = rank_blocks(L, p, v), rank_sends(p, v)
    requests = [(r, dict(Counter(pp.block_cls[i] for i in per_rank[r])), r == 0, r == p - 1, sends[r])
                for r in range(p)]
    for q in qs:
        q.prefetch(requests)
    # per rank: (problem, its stage) of every problem whose stage fits
    stages = [[(s, sc) for s, q in enumerate(qs) if (sc := q.stage(*req)) is not None] for req in requests]
    if not all(stages):
        return None
    if np.isfinite(incumbent):  # every rank at its least of each term: no choice of the stages beats it
        least = np.array([np.min([_vals(sc, consts) for _, sc in st], axis=0) for st in stages])
        top = least.max(axis=0)
        if _objective(pp, top[0], float(least[:, 1].sum()), *top[2:]) >= incumbent:
            return None
    labels = [_Label((0.0, 0.0, -INF, 0.0, 0.0, 0.0), None, 0, None)]
    for r in range(p):
        cands = _undominated(stages[r], consts, dims)
        nxt: list[_Label] = []
        for lab in labels:
            for cand, sv in cands:
                _insert(nxt, _Label(_extend(lab.vals, sv) if r else sv, lab, len(per_rank[r]), cand), dims)
        labels = nxt
    best = min(labels, key=lambda lab: _objective(pp, *lab.vals))
    return _solution(qs, best, None, per_rank, len(labels))


def _solve_free(qs: list[PipelineProblem], incumbent: float, dims: tuple[int, ...]) -> PipelineSolution | None:
    """:func:`solve_pipeline` with free stage boundaries: labels over (stages done, blocks done),
    pruned by a bound on the rest."""
    pp = qs[0]
    L, p = len(pp.block_cls), pp.p
    if pp.single and np.isfinite(incumbent) and _quick_bound(qs) >= incumbent:
        return None
    minsum, minmax = _rest_bounds(qs)
    _, fill0, _, opt0, off0 = _totals(qs)
    if _objective(pp, minmax[0][0], minsum[0][0], fill0, 0.0, opt0, off0) >= incumbent:
        return None

    def bound(vals: tuple[float, ...], k: int, j: int) -> float:
        fill, opt, off = max(vals[2], fill0), max(vals[4], opt0), max(vals[5], off0)
        if k == p:
            return _objective(pp, vals[0], vals[1], fill, vals[3], opt, off)
        return _objective(pp, max(vals[0], minmax[k][j]), vals[1] + minsum[k][j], fill, vals[3], opt, off)

    layer: dict[int, list[_Label]] = {0: [_Label((0.0, 0.0, -INF, 0.0, 0.0, 0.0), None, 0, None)]}
    count = 0
    for k in range(p):
        layer, added = _next_stage(qs, layer, k, incumbent, dims, bound)
        count += added
    final = layer.get(L, [])
    if not final:
        return None
    best = min(final, key=lambda lab: _objective(pp, *lab.vals))
    sizes = [lab.n for lab in _chain(best)]
    return _solution(qs, best, sizes, rank_blocks(L, p, 1, sizes), count)


def _next_stage(qs: list[PipelineProblem], layer: dict[int, list[_Label]], k: int, incumbent: float,
                dims: tuple[int, ...], bound: Callable[[tuple[float, ...], int, int], float]
                ) -> tuple[dict[int, list[_Label]], int]:
    """The labels after stage ``k`` (by blocks done) from those before it, and how many were added:
    stage ``k`` takes ``n`` blocks from ``j`` on, leaving at least one to each later stage."""
    pp = qs[0]
    L, p, consts = len(pp.block_cls), pp.p, pp.dev.c
    nxt: dict[int, list[_Label]] = {}
    count = 0
    for j in sorted(layer):
        hi = L - j if k == p - 1 else L - j - (p - k - 1)
        lo = hi if k == p - 1 else 1
        for n in range(lo, hi + 1):
            cands = _undominated([(s, sc) for s, q in enumerate(qs) if (sc := q.at(k, j, n)) is not None],
                                 consts, dims)
            if not cands:  # more blocks only need more memory
                break
            grew = False
            for cand, sv in cands:
                for lab in layer[j]:
                    vals = _extend(lab.vals, sv) if lab.cost is not None else sv
                    if bound(vals, k + 1, j + n) >= incumbent:
                        continue
                    grew = True
                    _insert(nxt.setdefault(j + n, []), _Label(vals, lab, n, cand), dims)
                    count += 1
            if not grew and pp.cfg.schedule != "zb" and (pp.m - 1) * min(sv[0] for _, sv in cands) >= incumbent:
                break
    return nxt, count


def pipeline_objective(qs: Sequence[PipelineProblem], per_unit: Sequence[tuple[int, int]],
                       ranks: list[list[int]], sizes: list[int] | None) -> PipelineSolution:
    """The plan where every unit (embedding, blocks, head) takes ``per_unit`` = (problem,
    recomputation), rank ``r`` holding the blocks ``ranks[r]``: its step time, exactly as the DP's
    objective reads it, with ``status`` "infeasible" when a rank's memory does not fit."""
    pp = qs[0]
    c, p, v = pp.dev.c, pp.p, pp.v
    fly = [pp.held(r) for r in range(p)]
    emb = 1 if pp.emb is not None else 0
    units: list[list[tuple[UnitView, float]]] = [[] for _ in range(p)]  # (unit, bytes in flight)
    for r, held in enumerate(ranks):
        units[r] = [(u, u.held(*fly[r])) for i in held
                    for u in [qs[per_unit[emb + i][0]].costs[pp.block_cls[i]][per_unit[emb + i][1]]]]
    if pp.emb is not None:
        ue = qs[per_unit[0][0]].costs[pp.emb][per_unit[0][1]]
        units[0].append((ue, pp.ends_held(ue, None, *fly[0])))
    if pp.head is not None:
        uh = qs[per_unit[-1][0]].costs[pp.head][per_unit[-1][1]]
        units[-1].append((uh, pp.ends_held(None, uh, *fly[-1])))
    sends = rank_sends(p, v)
    vals, fits = [], True
    for r in range(p):
        us = [u for u, _ in units[r]]
        t = sum(u.time for u in us) + sends[r] * pp.p2p
        f = Fixed(sync=sum(u.sync for u in us), window=sum(u.window for u in us), optim=sum(u.optim for u in us),
                  offload=sum(u.offload for u in us), weight=sum(u.weight for u in us))
        vals.append(_vals(StageCost(t, (), f), c))
        mem = (sum(u.states + held for u, held in units[r]) + max((u.gathered for u in us), default=0.0) + pp.recv(r)
               + max((u.recompute_peak for u in us), default=0.0))
        fits = fits and mem <= pp.budget - pp.bucket
        host = sum(u.host for u in us)
        fits = fits and (pp.host_budget is None or host <= pp.host_budget)
    total = vals[0]
    for sv in vals[1:]:
        total = _extend(total, sv)
    recompute = [pp.recomputes[r] for _, r in per_unit]
    sol = PipelineSolution(_objective(pp, *total), sizes, recompute, "optimal" if fits else "infeasible")
    return with_problems(sol, [qs[s] for s, _ in per_unit])


def _chain(last: _Label) -> list[_Label]:
    """The stages' labels that led to ``last``, first stage first."""
    out = []
    lab: _Label | None = last
    while lab is not None and lab.cost is not None:
        out.append(lab)
        lab = lab.parent
    return out[::-1]


def _undominated(cands: list[Cand], consts: CostConstants, dims: tuple[int, ...]) -> list[tuple[Cand, tuple[float, ...]]]:
    """The candidates of one stage (with their label values) that no other beats in every ``dims``."""
    vals = [(c, _vals(c[1], consts)) for c in cands]
    if len(vals) < 2:
        return vals
    keep: list[_Label] = []
    for c, sv in vals:
        _insert(keep, _Label(sv, None, 0, c), dims)
    return [(lab.cost, lab.vals) for lab in keep]  # type: ignore[misc]


def _solution(qs: list[PipelineProblem], best: _Label, sizes: list[int] | None, ranks: list[list[int]],
              labels: int) -> PipelineSolution:
    """The plan of the label ``best``: per unit its recomputation, sharding and offload."""
    pp = qs[0]
    cands: list[Cand] = [lab.cost for lab in _chain(best)]  # type: ignore[misc]
    obj = _objective(pp, *best.vals)
    sol = PipelineSolution(obj, sizes, _recompute(pp, [sc for _, sc in cands], ranks), labels=labels)
    return with_problems(sol, unit_problems([qs[s] for s, _ in cands], ranks))


def unit_problems(taken: Sequence[PipelineProblem], ranks: list[list[int]]) -> list[PipelineProblem]:
    """The problem (its sharding, offload and operator option) of every unit in order, when rank
    ``r`` (its blocks ``ranks[r]``) took ``taken[r]``: the embedding goes with the first rank, the
    head with the last."""
    pp = taken[0]
    per_block: list[PipelineProblem] = [pp] * len(pp.block_cls)
    for q, idx in zip(taken, ranks, strict=True):
        for i in idx:
            per_block[i] = q
    return ([taken[0]] if pp.emb is not None else []) + per_block + ([taken[-1]] if pp.head is not None else [])


def with_problems(sol: PipelineSolution, units: Sequence[PipelineProblem]) -> PipelineSolution:
    """``sol`` with every unit's (sharding, offload) and operator option from ``units``."""
    sol.combos = [(q.sharding, q.offload) for q in units]
    ops = [(q.split, q.mixed) for q in units]
    sol.operators = ops if any(o != (1, False) for o in ops) else None
    return sol


def _quick_bound(qs: list[PipelineProblem]) -> float:
    """Step time no partition beats: the least slowest stage (exact, from the stage tables) and
    the least total (every unit at its fastest, memory ignored)."""
    t = _min_times(qs)
    L = t.shape[1] - 1
    vals = np.unique(t[np.isfinite(t)])
    if not len(vals):
        return INF
    lo, hi = 0, len(vals) - 1
    if ((t <= vals[hi]).sum(axis=1) < 1).any() or (t <= vals[hi]).sum() < L:
        return INF
    while lo < hi:  # the least slowest-stage time τ with Σ_r max{n: T_r(n) <= τ} >= L
        mid = (lo + hi) // 2
        caps = (t <= vals[mid]).sum(axis=1)
        if (caps >= 1).all() and caps.sum() >= L:
            hi = mid
        else:
            lo = mid + 1
    return _objective(qs[0], float(vals[lo]), *_totals(qs))


def _min_times(qs: list[PipelineProblem]) -> np.ndarray:
    """(ranks × block counts) least stage times over the problems (one block class)."""
    t = qs[0].times()
    for q in qs[1:]:
        t = np.minimum(t, q.times())
    return t


def _totals(qs: list[PipelineProblem]) -> tuple[float, float, float, float, float]:
    """Bounds on (Σ T, max fill, max exposed sync, max optimizer, max offload) of any partition:
    every unit at its fastest, and each maximum at least the mean over the ranks."""
    pp = qs[0]
    if pp.__dict__.get("_totals") is not None and len(qs) == 1:
        return pp.__dict__["_totals"]
    p = pp.p
    units = Counter(pp.block_cls + [k for k in (pp.emb, pp.head) if k is not None])  # class -> units
    total = sum(n * min(u.time for q in qs for u in q.costs[k]) for k, n in units.items()) + (p - 1) * pp.p2p
    weight = sum(n * max(q.costs[k][0].weight for q in qs) for k, n in units.items())
    optim = sum(n * min(q.costs[k][0].optim for q in qs) for k, n in units.items())
    offload = sum(n * min(q.costs[k][0].offload for q in qs) for k, n in units.items())
    out = (total, (total - 2 * weight) / p, 0.0, optim / p, offload / p)
    if len(qs) == 1:
        pp.__dict__["_totals"] = out
    return out


def _rest_bounds(qs: list[PipelineProblem]) -> tuple[np.ndarray, np.ndarray]:
    """Least Σ T and least max T of the stages k.. holding blocks j.. (each minimised alone)."""
    pp = qs[0]
    L, p = len(pp.block_cls), pp.p
    minsum = np.full((p + 1, L + 1), INF)
    minmax = np.full((p + 1, L + 1), INF)
    minsum[p][L], minmax[p][L] = 0.0, 0.0
    if not pp.single:
        for k in range(p - 1, -1, -1):
            for j in range(L - (p - k) + 1):
                hi = L - j if k == p - 1 else L - j - (p - k - 1)
                lo = hi if k == p - 1 else 1
                t = np.array([min((sc.time for q in qs if (sc := q.at(k, j, n)) is not None), default=INF)
                              for n in range(lo, hi + 1)])
                if len(t):
                    minsum[k][j] = np.min(t + minsum[k + 1][j + lo:j + hi + 1])
                    minmax[k][j] = np.min(np.maximum(t, minmax[k + 1][j + lo:j + hi + 1]))
        return minsum, minmax
    times = _min_times(qs)
    return best_splits(times, np.add), best_splits(times, np.maximum)


def _insert(labels: list[_Label], new: _Label, dims: tuple[int, ...]) -> None:
    nv = [new.vals[d] for d in dims]
    for lab in labels:
        if all(lab.vals[d] <= x for d, x in zip(dims, nv, strict=True)):
            return
    labels[:] = [lab for lab in labels if not all(x <= lab.vals[d] for d, x in zip(dims, nv, strict=True))]
    labels.append(new)


def _recompute(pp: PipelineProblem, costs: list[StageCost], blocks: list[list[int]]) -> list[str]:
    """Recomputation of every unit (embedding, blocks, head) from the stages' option counts."""
    per_block = [""] * len(pp.block_cls)
    emb = head = pp.recomputes[0]
    for r, (sc, idx) in enumerate(zip(costs, blocks, strict=True)):
        e, h, counts = sc.choice
        if r == 0 and e is not None:
            emb = pp.recomputes[e]
        if h is not None:
            head = pp.recomputes[h]
        pools = {k: sorted(c.elements()) for k, c in counts.items()}
        for i in idx:
            per_block[i] = pp.recomputes[pools[pp.block_cls[i]].pop(0)]
    out = [emb] if pp.emb is not None else []
    return out + per_block + ([head] if pp.head is not None else [])


def pipeline_strategy(graph: LayerGraph, cfg: MeshConfig, sol: PipelineSolution) -> Strategy:
    """The plan of a pipeline solution: the commonest (sharding, recompute, offload) as the default,
    every other unit listed (with its operators' entries where it splits them or shards them apart)."""
    units = list(graph.blocks())
    combos = sol.combos or [("replicate", "none")] * len(units)
    ops = sol.operators or [(1, False)] * len(units)
    triples = [(sh, rc, off) for (sh, off), rc in zip(combos, sol.recompute, strict=True)]
    top = Counter(triples).most_common(1)[0][0]
    default = LayerStrategy(sharding=top[0], recompute=top[1], offload=top[2])  # type: ignore[arg-type]
    layers: list[LayerStrategy] = []
    for (name, nodes), t, (k, mixed) in zip(units, triples, ops, strict=True):
        if (k, mixed) != (1, False):
            layers += option_strategy(name, nodes, (*t, k, mixed))
        elif t != top:
            layers.append(LayerStrategy(unit=name, sharding=t[0], recompute=t[1], offload=t[2]))  # type: ignore[arg-type]
    return cfg.strategy(default=default, layers=layers, stage_layers=sol.stage_layers)
