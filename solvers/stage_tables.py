"""Pipeline stages: the least time of a rank holding some blocks, under its memory limit.

For a mesh with ``pp > 1`` and one uniform (sharding, offload), each unit chooses its
recomputation. Per (rank, units held) :class:`PipelineProblem` finds the least stage time whose
memory fits — exactly: for a single block class, the number of blocks that recompute fully is
enumerated (or, with two options, solved in closed form) for every block count at once; for
several classes, Pareto frontiers of (time, memory) are merged across classes. Everything but
the time is fixed by which units a stage holds (:class:`Fixed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from typing import Any

import numpy as np

from costmodel.assemble import boundary_time, bucket_bytes, recv_bytes
from costmodel.configs import one_config
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.pipeline import in_flight, weights_pending
from costmodel.unit_classes import block_classes, unit_classes, unit_names
from costmodel.units import UnitCost
from profiler.graph import LayerGraph
from solvers.chain import host_budget, memory_budget, price_options
from solvers.rank_tables import single_class_tables
from vocab.strategy import MeshConfig, Workload

INF = float("inf")


@dataclass
class Fixed:
    """Recomputation-independent totals of a set of units (per micro-batch unless said otherwise)."""

    states: float = 0.0
    gathered: float = 0.0
    sync: float = 0.0  # per-step gradient sync
    window: float = 0.0
    optim: float = 0.0
    offload: float = 0.0
    weight: float = 0.0  # weight-gradient part of backward (zero-bubble)


@dataclass
class StageCost:
    time: float
    choice: tuple  # (embedding option, head option, counts of options per block class)
    fixed: Fixed

    def exposed(self, c: CostConstants) -> float:
        return c.exposed(self.fixed.sync, c.dp_overlap * self.fixed.window)


class _Table:
    """Least stage times of one rank for every block count (one block class), plans made lazily."""

    def __init__(self, pp: PipelineProblem, k: int, emb: bool, head: bool, n_max: int, f: int,
                 rest: list[int]):
        self.pp, self.k, self.emb, self.head, self.f, self.rest = pp, k, emb, head, f, rest
        self.time = np.full(n_max + 1, INF)
        self.e = np.full(n_max + 1, -1)
        self.h = np.full(n_max + 1, -1)
        self.nf = np.zeros(n_max + 1, dtype=int)
        self.na = np.zeros(n_max + 1)
        self.made: dict[int, StageCost | None] = {}

    def get(self, n: int) -> StageCost | None:
        if n in self.made:
            return self.made[n]
        sc = None
        if np.isfinite(self.time[n]):
            f, rest, nf, na = self.f, self.rest, int(self.nf[n]), int(self.na[n])
            counts = Counter({f: nf, rest[0]: na} if rest else {f: nf})
            if len(rest) > 1:
                counts[rest[1]] = n - nf - na
            e, h = int(self.e[n]), int(self.h[n])
            choice = (None if e < 0 else e, None if h < 0 else h, {self.k: counts})
            sc = StageCost(float(self.time[n]), choice,
                           self.pp.fixed({self.k: n}, self.emb, self.head))
        self.made[n] = sc
        return sc


@dataclass(frozen=True)
class UnitView:
    """What the stage DP reads of a unit's cost (from :class:`UnitCost` or a price grid's arrays)."""

    time: float
    activations: float
    recompute_peak: float
    states: float
    gathered: float
    sync: float
    window: float
    optim: float
    offload: float
    weight: float
    out_bytes: float
    pending: float = 0.0  # added while its weight gradients wait (zero bubble)
    host: float = 0.0  # offloaded states in host memory

    def held(self, fly: float, pend: float) -> float:
        """Bytes of this unit's micro-batches in flight: ``fly`` of activations, ``pend`` of them
        also awaiting weight gradients (:func:`costmodel.pipeline.weights_pending`)."""
        return self.activations * fly + self.pending * pend

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(astuple(self))

    @classmethod
    def of(cls, u: UnitCost) -> UnitView:
        return cls(u.time, u.activations, u.remat, u.states, u.gathered, u.step_comm, u.window, u.optim, u.offload,
                   u.bwd_weight, u.out_bytes, u.pending, u.host_bytes)


@dataclass(frozen=True)
class Combo:
    """What every unit of a :class:`PipelineProblem` takes besides its recomputation: a sharding, an
    offload, and OSDP's operator option for its large operators (``split`` ways, ``mixed``:
    :func:`solvers.space.unit_options`; a class without large operators prices as without them)."""

    sharding: str
    offload: str = "none"
    split: int = 1
    mixed: bool = False


class PipelineProblem:
    """The stages of one pipeline mesh whose units all take one :class:`Combo`, each its own
    recomputation among ``recomputes``."""

    def __init__(self, graph: LayerGraph, dev: DeviceModel, cfg: MeshConfig, w: Workload, combo: Combo,
                 recomputes: tuple[str, ...], limit_gib: float, costs: dict[int, list[UnitView]] | None = None):
        """``costs``: per unit class, the costs under each of ``recomputes`` (priced here if not
        given)."""
        self.graph, self.dev, self.cfg, self.w, self.combo = graph, dev, cfg, w, combo
        self.sharding, self.offload, self.recomputes = combo.sharding, combo.offload, recomputes
        self.split, self.mixed, self.limit_gib = combo.split, combo.mixed, limit_gib
        reps, index = unit_classes(graph)
        names = unit_names(graph)
        self.emb = index[0] if names[0] == "embedding" else None
        self.head = index[-1] if names[-1] == "head" else None
        self.block_cls = block_classes(graph)
        self.kinds = sorted(set(self.block_cls))
        self.single = len(self.kinds) == 1
        self.m = w.global_batch // (cfg.dp * cfg.micro_batch)
        self.p, self.v = cfg.pp, cfg.vpp
        choices = [(combo.sharding, rc, combo.offload, combo.split, combo.mixed) for rc in recomputes]
        self.costs: dict[int, list[UnitView]] = costs or {
            k: [UnitView.of(u) for u in price_options(reps[k][0], reps[k][1], choices, cfg, dev, w)]
            for k in set(index)}
        self.bucket = bucket_bytes(dev.c, cfg.dp)
        self.budget = memory_budget(dev, cfg, limit_gib) + self.bucket
        self.host_budget = host_budget(dev) if combo.offload != "none" else None
        out = self.costs[self.block_cls[-1]][0].out_bytes
        self.p2p = float(boundary_time(dev, np.array([out]), one_config(cfg), self.p)[0])
        self.cache: dict[tuple, Any] = {}
        self.batch: dict[str, Any] | None = None
        self._fixed: dict[tuple, Fixed] = {}
        self._held, self._recv = self._per_rank(out)

    def _per_rank(self, out: float) -> tuple[list[tuple[float, float]], list[float]]:
        """Per rank, read in the stage DP's inner loops: (micro-batches in flight, those awaiting
        weight gradients), and the receive buffers' bytes (every stage boundary carries a block's
        output, ``out`` bytes)."""
        cfg, p, v = self.cfg, self.p, self.v
        ranks = np.arange(p)
        fly = np.broadcast_to(in_flight(cfg.schedule, ranks, p, self.m, v), ranks.shape)
        pend = np.broadcast_to(weights_pending(cfg.schedule, ranks, p, self.m, v), ranks.shape)
        held = [(float(f), float(w)) for f, w in zip(fly, pend, strict=True)]
        n = p * v  # a rank's virtual stages with a previous one, and with a next one
        prev = np.array([sum(k > 0 for k in range(r, n, p)) for r in ranks])
        nxt = np.array([sum(k < n - 1 for k in range(r, n, p)) for r in ranks])
        recv = recv_bytes(cfg.schedule, ranks, p, self.m, v, out * prev, out * nxt, self.w.recv_buffers)
        return held, [float(x) for x in np.broadcast_to(recv, ranks.shape)]

    @classmethod
    def lazy(cls, graph: LayerGraph, dev: DeviceModel, cfg: MeshConfig, w: Workload, combo: Combo,
             recomputes: tuple[str, ...], limit_gib: float) -> Callable[[], PipelineProblem]:
        """The problem of an operator option, priced when called."""
        return lambda: cls(graph, dev, cfg, w, combo, recomputes, limit_gib)

    def relaxed(self) -> PipelineProblem:
        """This problem without gathered parameters, where ZeRO-3 gathers any (a relaxation: only
        memory drops); the rest as it is."""
        if self.sharding != "zero3" and not self.mixed:
            return self
        costs = {k: [replace(u, gathered=0.0) for u in us] for k, us in self.costs.items()}
        return PipelineProblem(self.graph, self.dev, self.cfg, self.w, self.combo, self.recomputes, self.limit_gib,
                               costs)

    def held(self, r: int) -> tuple[float, float]:
        """Rank ``r``'s micro-batches in flight and those of them awaiting weight gradients."""
        return self._held[r]

    def recv(self, r: int) -> float:
        """Bytes of rank ``r``'s pipeline receive buffers."""
        return self._recv[r]

    def ends_held(self, ue: UnitView | None, uh: UnitView | None, fly: float, pend: float) -> float:
        """What the embedding ``ue`` and the head ``uh`` (with the loss's transients) hold."""
        return ((ue.held(fly, pend) if ue else 0.0)
                + (uh.held(fly, pend) + uh.activations * self.w.loss_buffer if uh else 0.0))

    def fixed(self, counts: dict[int, int], emb: bool, head: bool) -> Fixed:
        """What a rank holding ``counts`` blocks per class (and the embedding, the head) holds
        whatever recomputes (computed once per holding; callers only read it)."""
        key = (tuple(sorted(counts.items())), emb, head)
        if key not in self._fixed:
            self._fixed[key] = self._fixed_of(counts, emb, head)
        return self._fixed[key]

    def _fixed_of(self, counts: dict[int, int], emb: bool, head: bool) -> Fixed:
        f = Fixed()
        held = [(k, n) for k, n in counts.items() if n]
        held += ([(self.emb, 1)] if emb and self.emb is not None else []) + (
            [(self.head, 1)] if head and self.head is not None else [])
        for k, n in held:
            u = self.costs[k][0]
            f.states += n * u.states
            f.gathered = max(f.gathered, u.gathered)
            f.sync += n * u.sync
            f.window += n * u.window
            f.optim += n * u.optim
            f.offload += n * u.offload
            f.weight += n * u.weight
        return f

    def host_fits(self, emb: bool, head: bool, n_max: int) -> np.ndarray:
        """Whether a rank holding 0..n_max blocks of the only block class (and the embedding, the
        head) keeps its offloaded states within its share of the node's host memory."""
        n = np.arange(n_max + 1)
        if self.host_budget is None:
            return np.ones(n_max + 1, dtype=bool)
        return n * self.costs[self.kinds[0]][0].host + self.host({}, emb, head) <= self.host_budget

    def option_order(self) -> tuple[int, list[int]]:
        """The leanest option (full recomputation) and the others worth keeping, fastest first."""
        opts = self.costs[self.kinds[0]]
        order = sorted(range(len(opts)), key=lambda i: (opts[i].time, i))
        full = [i for i in order if opts[i].recompute_peak > 0]
        f = full[0] if full else min(order, key=lambda i: (opts[i].activations, i))
        rest = [i for i in order if i != f]
        if len(rest) == 2 and opts[rest[0]].activations <= opts[rest[1]].activations:
            rest = rest[:1]  # the faster option also uses no more memory
        return f, rest

    def times(self) -> np.ndarray:
        """(ranks × block counts) least stage times, one block class, one virtual stage per rank:
        every rank's table in one array computation (:func:`solvers.rank_tables.single_class_tables`),
        inf past the L-p+1 blocks a rank can hold."""
        if self.batch is None:
            p, L = self.p, len(self.block_cls)
            rows = [(r, r == 0, r == p - 1, 1 if r < p - 1 else 0) for r in range(p)]
            # a rank holds at most L-p+1 blocks (every other rank holds one): inf beyond
            got = single_class_tables(self, rows, np.arange(L - p + 2))
            pad = {"time": INF, "e": -1, "h": -1, "nf": 0, "na": 0.0}
            self.batch = {f: np.pad(x, ((0, 0), (0, p - 1)), constant_values=pad[f]) for f, x in got.items()}
        return self.batch["time"]

    def table(self, r: int) -> _Table:
        """Rank ``r``'s table (one block class, one virtual stage per rank)."""
        key = (r, r == 0, r == self.p - 1, 1 if r < self.p - 1 else 0)
        tab = self.cache.get(key)
        if tab is None:
            self.times()
            tab = self._table(key[1], key[2], len(self.block_cls), self.batch, r)  # type: ignore[arg-type]
            self.cache[key] = tab
        return tab

    def _table(self, emb: bool, head: bool, n_max: int, rows: dict[str, np.ndarray], i: int,
               at: np.ndarray | None = None) -> _Table:
        """Row ``i`` of :func:`single_class_tables`'s answer as a table of 0..n_max blocks (its
        counts ``at``; every count when None)."""
        tab = _Table(self, self.kinds[0], emb, head, n_max, *self.option_order())
        idx = slice(None) if at is None else at
        tab.time[idx], tab.e[idx], tab.h[idx] = rows["time"][i], rows["e"][i], rows["h"][i]
        tab.nf[idx], tab.na[idx] = rows["nf"][i], rows["na"][i]
        return tab

    def at(self, k: int, j: int, n: int) -> StageCost | None:
        """Stage ``k`` of a pipeline without interleaving, holding blocks ``j .. j+n-1``."""
        p = self.p
        if self.single:
            self.times()
            return self.table(k).get(n)
        held = dict(Counter(self.block_cls[j:j + n]))
        return self.stage(k, held, k == 0, k == p - 1, 1 if k < p - 1 else 0)

    def prefetch(self, requests: list[tuple[int, dict[int, int], bool, bool, int]]) -> None:
        """Price the :meth:`stage` ``requests`` (one block class) in one array computation."""
        if not self.single:
            return
        todo = [(r, e, h, b, c.get(self.kinds[0], 0)) for r, c, e, h, b in requests]
        todo = [key for key in dict.fromkeys(todo) if key not in self.cache]
        if not todo:
            return
        ns = np.array(sorted({key[4] for key in todo}))
        got = single_class_tables(self, [key[:4] for key in todo], ns)
        for i, key in enumerate(todo):
            j = int(np.searchsorted(ns, key[4]))  # the column of its count
            self.cache[key] = self._table(key[1], key[2], key[4], {f: x[:, j:j + 1] for f, x in got.items()}, i,
                                          ns[j:j + 1])

    def stage(self, r: int, counts: dict[int, int], emb: bool, head: bool, bounds: int) -> StageCost | None:
        """Least time of pipeline rank ``r`` holding ``counts`` blocks per class (and emb/head)."""
        if self.single:  # infinite where the host memory does not hold the blocks
            n = counts.get(self.kinds[0], 0)
            key = (r, emb, head, bounds, n)
            if key not in self.cache:
                self.prefetch([(r, counts, emb, head, bounds)])
            return self.cache[key].get(n)  # type: ignore[union-attr]
        if self.host_budget is not None and self.host(counts, emb, head) > self.host_budget:
            return None
        key = (r, tuple(sorted(counts.items())), emb, head, bounds)
        if key not in self.cache:
            self.cache[key] = [self._general(r, counts, emb, head, bounds)]
        return self.cache[key][0]

    def host(self, counts: dict[int, int], emb: bool, head: bool) -> float:
        """Host bytes of a rank's offloaded states holding ``counts`` blocks per class (and emb/head):
        they follow the problem's sharding and offload, whatever recomputes."""
        out = sum(n * self.costs[k][0].host for k, n in counts.items())
        for on, k in ((emb, self.emb), (head, self.head)):
            if on and k is not None:
                out += self.costs[k][0].host
        return out

    def _general(self, r: int, counts: dict[int, int], emb: bool, head: bool, bounds: int
                 ) -> StageCost | None:
        """Several block classes: Pareto frontiers of (time, memory) per class, merged."""
        fly, pend = self.held(r)
        fx = self.fixed(counts, emb, head)
        groups: list[tuple[int, int, bool]] = [(k, n, False) for k, n in sorted(counts.items()) if n]
        if emb and self.emb is not None:
            groups.append((self.emb, 1, False))
        if head and self.head is not None:
            groups.append((self.head, 1, True))
        caps = sorted({0.0} | {u.recompute_peak for k, _, _ in groups for u in self.costs[k]})
        best: StageCost | None = None
        for cap in caps:
            room = self.budget - self.bucket - fx.states - fx.gathered - cap - self.recv(r)
            front = [(bounds * self.p2p, 0.0, ())]
            for k, n, is_head in groups:
                opts = [(u.time, u.held(fly, pend) + (u.activations * self.w.loss_buffer if is_head else 0.0), i)
                        for i, u in enumerate(self.costs[k]) if u.recompute_peak <= cap]
                pts = [(t, mm, ((k, tuple(sorted(Counter(comp).items()))),))
                       for t, mm, comp in class_front(opts, n, room)]
                front = pareto_front([(a[0] + b[0], a[1] + b[1], a[2] + b[2])
                                 for a in front for b in pts if a[1] + b[1] <= room])
            if front and (best is None or front[0][0] < best.time):
                choice = {k: Counter(dict(c)) for k, c in _merge(front[0][2])}
                e = next(iter(choice.pop(self.emb))) if emb and self.emb in choice else None
                h = next(iter(choice.pop(self.head))) if head and self.head in choice else None
                best = StageCost(front[0][0], (e, h, choice), fx)
        return best


def best_splits(table: np.ndarray, join: Callable[[Any, Any], Any]) -> np.ndarray:
    """(ranks + 1, blocks + 1): entry ``[k, j]`` is the least ``join`` (``np.add`` or
    ``np.maximum``) of the values of ranks ``k..`` holding blocks ``j..`` in order, each at least
    one block, the last the rest; ``table[r, n]``: rank ``r`` holding ``n`` blocks (inf where it
    cannot). Inf where no split exists, and where ``j < k`` (the ranks before ``k`` hold a block
    each: no split reaches such an entry, and none is computed). Rank ``k`` then starts at a block
    in ``k .. L-(p-k)`` and holds at most ``L-p+1``."""
    p, L = table.shape[0], table.shape[1] - 1
    fin = np.isfinite(table)
    last = np.where(fin.any(axis=1), L - np.argmax(fin[:, ::-1], axis=1), 0)  # the last count that fits
    caps = np.minimum(last, L - p + 1)  # more do not fit, or leave a rank none
    width = max(int(caps.max()), 1)
    out = np.full((p + 1, L + 1 + width), INF)  # inf past L: no split ends beyond the last block
    out[p, L] = 0.0 if join is np.add else -INF
    nxt = np.arange(L + 1)[:, None] + np.arange(1, width + 1)[None, :]  # [j, n - 1]: where the next rank starts
    for k in range(p - 1, -1, -1):
        cap = int(caps[k])
        if cap < 1:
            break
        hi = L - (p - k) + 1
        out[k, k:hi] = join(table[k, 1:cap + 1][None, :], out[k + 1][nxt[k:hi, :cap]]).min(axis=1)
    return out[:, :L + 1]


def class_front(opts: list[tuple[float, float, int]], n: int, room: float
                ) -> list[tuple[float, float, tuple[int, ...]]]:
    """The (time, memory) Pareto front of ``n`` identical blocks, each run with one of ``opts``
    (time, memory, option), within ``room`` of memory: fronts of 1, 2, .. n blocks, each the last
    extended by one block. Time and memory add over blocks, so a point dominated for ``m`` blocks
    stays dominated by the same extension of its dominator: the front is exact, at the cost of the
    fronts' sizes, not of the ``C(n + k - 1, k - 1)`` ways to choose (a 58-block class with six
    options has 7 million). Each point carries its blocks' options as a tuple."""
    front: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for _ in range(n):
        nxt = [(t + ot, m + om, comp + (i,)) for t, m, comp in front for ot, om, i in opts if m + om <= room]
        front = pareto_front(nxt)
        if not front:
            return []
    return front


def pareto_front(pts: list[tuple[float, float, tuple]]) -> list[tuple[float, float, tuple]]:
    """Points no other point beats in both time and memory, fastest first."""
    out: list[tuple[float, float, tuple]] = []
    for p in sorted(pts, key=lambda x: (x[1], x[0])):
        if not out or p[0] < out[-1][0]:
            out.append(p)
    return sorted(out, key=lambda x: (x[0], x[1]))


def _merge(parts: tuple) -> list[tuple[int, tuple]]:
    merged: dict[int, Counter[int]] = {}
    for k, comp in parts:
        merged.setdefault(k, Counter()).update(dict(comp))
    return [(k, tuple(sorted(c.items()))) for k, c in merged.items()]


