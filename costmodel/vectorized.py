"""Price many *uniform* plans at once: mesh configurations × layer strategies.

A uniform plan gives every unit the same layer strategy (no operator splitting) and splits the
blocks evenly over the (virtual) stages. :func:`price_grid` prices every pair of a list of mesh
configurations (mesh degrees, micro-batch, schedule, vpp, SP and TP/CP modes) and a list of
layer strategies (sharding × recomputation × offload) with the cost model's one unit pricer
(:func:`costmodel.units.price_unit`) and its one assembly (:func:`costmodel.assemble.assemble`):
:func:`costmodel.estimate.estimate` is the same computation on one configuration.

Configurations are :class:`vocab.strategy.MeshConfig` objects that
pass :func:`costmodel.estimate.check`; this module does not check them again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from costmodel.assemble import Layout, Stacked, assemble
from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import host_fits, tied_sum_bytes
from costmodel.pipeline import balanced_coef, ramp_step, time_shared, with_ends
from costmodel.report import GIB
from costmodel.unit_classes import block_classes, unit_classes, unit_names
from costmodel.units import UnitCost, UnitOption, price_unit
from profiler.graph import LayerGraph, LayerNode
from profiler.hardware import Cluster
from vocab.strategy import LayerStrategy, MeshConfig, Strategy, Workload, even_split

if TYPE_CHECKING:
    from profiler.profile_schema import Profile

F = np.ndarray
__all__ = ["GridOption", "GridReport", "block_classes", "compute_bound", "price_grid",
           "strategies_grid", "unit_classes", "unit_names"]


@dataclass(frozen=True)
class GridOption:
    """A layer strategy every unit takes; ``large``: the large operators (``price_grid``'s
    ``large_ops``) use ZeRO-3 instead (OSDP's per-operator sharding, without splitting)."""

    sharding: str = "replicate"
    recompute: str = "none"
    offload: str = "none"
    large: bool = False

    @classmethod
    def of(cls, o: LayerStrategy | GridOption) -> GridOption:
        return o if isinstance(o, GridOption) else cls(o.sharding, o.recompute, o.offload)


@dataclass
class GridReport:
    """Uniform plans of ``configs × options``: arrays of shape (C, O) unless said otherwise."""

    configs: list[Any]
    options: list[GridOption]
    step_time_s: F
    memory_peak_gib: F
    tokens_per_s_per_gpu: F
    mfu: F
    hfu: F
    fits: F
    num_microbatches: F  # (C,)
    memory_limit_gib: float
    units: list[UnitCost] = field(default_factory=list)  # per unit class
    unit_index: list[int] = field(default_factory=list)  # class of every unit, in order
    p2p_total: F | None = None  # (C,) send/recv seconds of all stage boundaries per micro-batch

    @property
    def size(self) -> int:
        return int(self.step_time_s.size)

    def strategy(self, i: int, j: int) -> Strategy:
        return self.configs[i].strategy(default=self.layer_strategy(j))

    def layer_strategy(self, j: int) -> LayerStrategy:
        o = self.options[j]
        if o.large:
            raise ValueError("an option with per-operator sharding is not a single layer strategy")
        return LayerStrategy(sharding=o.sharding, recompute=o.recompute,  # type: ignore[arg-type]
                             offload=o.offload)  # type: ignore[arg-type]


def grid_layout(graph: LayerGraph, p: int, v: int) -> Layout:
    """The units of each virtual stage of a uniform plan (blocks split evenly), as unit classes."""
    _, index = unit_classes(graph)
    names = unit_names(graph)
    blocks = [k for k, name in zip(index, names, strict=True) if name.startswith("layers.")]
    pre = [index[0]] if names and names[0] == "embedding" else []
    post = [index[-1]] if names and names[-1] == "head" else []
    stages, start = [], 0
    for n in even_split(len(blocks), p * v):
        stages.append(blocks[start:start + n])
        start += n
    return Layout(with_ends(stages, pre, post), p, max(index) + 1, post[0] if post else None)


def price_grid(graph: LayerGraph, cluster: Cluster, w: Workload, configs: Sequence[MeshConfig],
               options: Sequence[LayerStrategy | GridOption], profile: Profile | None = None,
               memory_limit_gib: float | None = None, device: DeviceModel | None = None,
               large_ops: Callable[[list[LayerNode]], Iterable[str]] | None = None,
               recompute_blocks_only: bool = False) -> GridReport:
    """Price every uniform plan ``configs[i]`` with ``default=options[j]`` (even stage split).

    Options with ``large=True`` give the operators ``large_ops(unit nodes)`` names ZeRO-3 (their
    numbers are those of a plan with such operator entries; they are for bounds, not plans). With
    ``recompute_blocks_only`` the units outside the blocks (embedding, head) recompute nothing, as in
    trainers that checkpoint transformer blocks only (torchtitan, Megatron-LM)."""
    dev = device or DeviceModel(cluster, profile)
    opts = [GridOption.of(o) for o in options]
    reps, index = unit_classes(graph)
    C, n_opt = len(configs), len(opts)
    limit = memory_limit_gib if memory_limit_gib is not None else cluster.memory_bytes / GIB
    if C == 0:
        e = np.zeros((0, n_opt))
        return GridReport(list(configs), opts, e, e, e, e, e, e.astype(bool), np.zeros(0), limit)
    # configurations with one (pp, vpp) next to each other: each takes one assembly, on a slice
    whole = ConfigArrays.of(configs)
    order = np.lexsort((whole.vpp, whole.pp))
    cfg = whole.rows(order)
    ua = []
    for name, nodes in reps:
        large = frozenset(large_ops(nodes)) if large_ops else frozenset()
        block = not recompute_blocks_only or name.startswith("layers.")
        uopts = [UnitOption.uniform(nodes, o.sharding, o.recompute if block else "none", o.offload,
                                    large if o.large else frozenset()) for o in opts]
        ua.append(price_unit(name, nodes, dev, cfg, w, uopts))
    out = {k: np.zeros((C, n_opt)) for k in ("step", "mem", "hw")}
    host_ok = np.ones((C, n_opt), dtype=bool)  # offloaded states fit the node's host memory
    n_mb, p2p_total = np.zeros(C), np.zeros(C)
    tail = tied_sum_bytes(graph, cfg.pp, cfg.tp, w)
    key = np.stack([cfg.pp, cfg.vpp])
    starts = np.flatnonzero(np.r_[True, (key[:, 1:] != key[:, :-1]).any(axis=0)])
    stacked = Stacked(ua)
    for s, e in zip(starts, np.r_[starts[1:], C], strict=True):
        sl = slice(s, e)
        a = assemble(ua, grid_layout(graph, int(key[0, s]), int(key[1, s])), cfg.rows(sl), dev, w, tail[sl],
                     stacked=stacked.take(sl))
        out["step"][sl], out["mem"][sl], out["hw"][sl] = a.step, a.memory / GIB, a.hw_flops
        host_ok[sl] = host_fits(a.host, cluster)
        n_mb[sl], p2p_total[sl] = a.n_mb, a.p2p_total
    back = np.argsort(order)  # the caller's order
    out = {k: v[back] for k, v in out.items()}
    host_ok = host_ok[back]
    n_mb, p2p_total, ua = n_mb[back], p2p_total[back], [u.reordered(back) for u in ua]
    peak = dev.acc.peak_flops(w.precision) * cluster.world_size
    step = out["step"]
    tokens = w.global_batch * graph.seq_len
    return GridReport(
        configs=list(configs), options=opts, step_time_s=step, memory_peak_gib=out["mem"],
        tokens_per_s_per_gpu=tokens / step / cluster.world_size, mfu=graph.train_flops * w.global_batch / step / peak,
        hfu=out["hw"] / step / peak, fits=(out["mem"] <= limit) & host_ok, num_microbatches=n_mb, memory_limit_gib=limit,
        units=ua, unit_index=index, p2p_total=p2p_total)


def strategies_grid(strategies: Sequence[Strategy]
                    ) -> tuple[list[MeshConfig], list[GridOption], list[tuple[int, int]]]:
    """Configurations, options and (i, j) cells of a list of uniform strategies (for testing)."""
    cfg_keys: dict[MeshConfig, int] = {}
    opt_keys: dict[GridOption, int] = {}
    cells = []
    for s in strategies:
        cfg, opt = MeshConfig.of(s), GridOption.of(s.default)
        cells.append((cfg_keys.setdefault(cfg, len(cfg_keys)), opt_keys.setdefault(opt, len(opt_keys))))
    return list(cfg_keys), list(opt_keys), cells


def compute_bound(graph: LayerGraph, cluster: Cluster, w: Workload, configs: Sequence[MeshConfig],
                  profile: Profile | None = None, device: DeviceModel | None = None) -> F:
    """Per configuration, a step time no plan with it beats: its compute and the tensor-, context-
    and expert-parallel communication no option hides.

    Units at their fastest: the pricer's forward, backward and exposed TP/CP/EP traffic without
    recomputation or operator splitting (every option adds to these: recomputation re-runs work and
    traffic, splitting slices GEMMs; sharding and offload leave them alone and add ZeRO traffic,
    gradient accumulation and host copies, bounded below by nothing), stages perfectly balanced
    (:func:`costmodel.pipeline.balanced_coef`), plus the fixed per-step overhead.
    """
    dev = device or DeviceModel(cluster, profile)
    if not configs:
        return np.zeros(0)
    cfg = ConfigArrays.of(configs)
    reps, index = unit_classes(graph)
    counts = np.bincount(np.array(index), minlength=len(reps))
    total = np.zeros(len(configs))
    for k, (name, nodes) in enumerate(reps):
        u = price_unit(name, nodes, dev, cfg, w, [UnitOption.uniform(nodes, "replicate", "none", "none", frozenset())])
        total += counts[k] * (u.fwd + u.bwd + u.comm_tp + u.comm_cp + u.comm_ep)[:, 0]
    m = w.global_batch / (cfg.dp * cfg.micro_batch)
    p, v, sched = cfg.pp, cfg.vpp, cfg.schedule
    pipe = balanced_coef(sched, m, p, v) * total  # balanced stages, no zero-bubble fill
    ramp = ramp_step(sched, total, total / p, 0.0, p, v)
    return time_shared(pipe, m, total, p, dev.share, ramp) + dev.c.step_overhead_s
