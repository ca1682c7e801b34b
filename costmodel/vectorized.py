"""Price many *uniform* plans at once with numpy: mesh configurations × per-layer options.

A uniform plan gives every unit the same :class:`LayerStrategy` (no operator splitting) and splits
the blocks evenly over the (virtual) stages. :func:`price_grid` prices every pair of a list of
mesh configurations (mesh degrees, micro-batch, schedule, vpp, SP and TP/CP modes) and a list of
layer strategies (sharding × recomputation × offload). Its numbers are those of
:func:`costmodel.estimate.estimate` for the same strategy (a test holds them to 1e-9 relative);
compute times come from :class:`DeviceModel` itself (per distinct size), collectives from the same
α–β model written over arrays (or from the device model, per distinct call, under a measured
profile).

Configurations are any objects with the attributes ``pp dp_replicate dp_shard cp tp ep
micro_batch schedule vpp sequence_parallel tp_mode cp_mode`` that pass
:func:`costmodel.estimate.check`; this module does not check them again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from costmodel.device import DeviceModel
from costmodel.estimate import tied_table
from costmodel.pipeline import ramp_step, time_shared
from costmodel.report import GIB
from costmodel.units import TP_SPLIT_ROLES, state_bytes
from costmodel.vectorized_units import (
    GridOption,
    MeshLike,
    UnitArrays,
    _Cfg,
    _Net,
    _times,
    _unit,
    block_classes,
    unit_classes,
    unit_names,
)
from profiler.graph import LayerGraph, LayerNode
from profiler.hardware import Cluster
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload, even_split

if TYPE_CHECKING:
    from profiler.profile_schema import Profile

F = np.ndarray
__all__ = ["GridOption", "GridReport", "MeshLike", "UnitArrays", "block_classes", "compute_bound", "price_grid",
           "strategies_grid", "unit_classes", "unit_names"]


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
    units: list[UnitArrays] = field(default_factory=list)  # per unit class
    unit_index: list[int] = field(default_factory=list)  # class of every unit, in order
    p2p_total: F | None = None  # (C,) send/recv seconds of all stage boundaries per micro-batch

    @property
    def size(self) -> int:
        return int(self.step_time_s.size)

    def strategy(self, i: int, j: int) -> Strategy:
        c = self.configs[i]
        mesh = Mesh(pp=c.pp, dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, cp=c.cp, tp=c.tp, ep=c.ep)
        return Strategy(mesh=mesh, micro_batch=c.micro_batch, schedule=c.schedule, vpp=c.vpp,
                        sequence_parallel=c.sequence_parallel, tp_mode=c.tp_mode, cp_mode=c.cp_mode,
                        default=self.layer_strategy(j))

    def layer_strategy(self, j: int) -> LayerStrategy:
        o = self.options[j]
        if o.large:
            raise ValueError("an option with per-operator sharding is not a single layer strategy")
        return LayerStrategy(sharding=o.sharding, recompute=o.recompute,  # type: ignore[arg-type]
                             offload=o.offload)  # type: ignore[arg-type]


def price_grid(graph: LayerGraph, cluster: Cluster, w: Workload, configs: Sequence[MeshLike],
               options: Sequence[LayerStrategy | GridOption], profile: Profile | None = None,
               memory_limit_gib: float | None = None, device: DeviceModel | None = None,
               large_ops: Callable[[list[LayerNode]], Iterable[str]] | None = None) -> GridReport:
    """Price every uniform plan ``configs[i]`` with ``default=options[j]`` (even stage split).

    Options with ``large=True`` give the operators ``large_ops(unit nodes)`` names ZeRO-3 (their
    numbers are those of a plan with such operator entries; they are for bounds, not plans)."""
    dev = device or DeviceModel(cluster, profile)
    opts = [GridOption.of(o) for o in options]
    reps, index = unit_classes(graph)
    C, n_opt = len(configs), len(opts)
    limit = memory_limit_gib if memory_limit_gib is not None else cluster.memory_bytes / GIB
    out = {k: np.zeros((C, n_opt)) for k in ("step", "mem", "hfu")}
    n_mb = np.zeros(C)
    p2p_total = np.zeros(C)
    if C == 0:
        e = np.zeros((0, n_opt))
        return GridReport(list(configs), opts, e, e, e, e, e, e.astype(bool), np.zeros(0), limit)
    g = _Cfg.of(configs)
    net = _Net(dev)
    ua = [_unit(nodes, dev, net, g, w, opts, set(large_ops(nodes)) if large_ops else set())
          for _, nodes in reps]
    blocks = [k for k, (name, _) in zip(index, graph.blocks(), strict=True) if name.startswith("layers.")]
    names = [name for name, _ in graph.blocks()]
    pre = index[0] if names and names[0] == "embedding" else None
    post = index[-1] if names and names[-1] == "head" else None
    tied = 2.0 * tied_table(graph) * state_bytes(w)[1]  # the end of backward's tail, times tp
    for (p, v), rows in _groups(g).items():
        sl = np.array(rows)
        _combine(sl, int(p), int(v), blocks, pre, post, ua, g, dev, net, w, out, n_mb, p2p_total,
                 tied / g.tp[sl] if p == 1 else np.zeros(len(sl)))
    peak = dev.acc.peak_flops(w.precision) * cluster.world_size
    mfu_num = graph.train_flops * w.global_batch
    step = out["step"]
    tokens = w.global_batch * graph.seq_len
    return GridReport(
        configs=list(configs), options=opts, step_time_s=step, memory_peak_gib=out["mem"],
        tokens_per_s_per_gpu=tokens / step / cluster.world_size, mfu=mfu_num / step / peak,
        hfu=out["hfu"] / step / peak, fits=out["mem"] <= limit, num_microbatches=n_mb, memory_limit_gib=limit,
        units=ua, unit_index=index, p2p_total=p2p_total)


def _groups(g: _Cfg) -> dict[tuple[int, int], list[int]]:
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (p, v) in enumerate(zip(g.pp.astype(int), g.vpp.astype(int), strict=True)):
        groups.setdefault((int(p), int(v)), []).append(i)
    return groups


def _in_flight(sched: np.ndarray, r: int, p: int, m: F, v: int) -> F:
    if p == 1:
        return np.ones_like(m)
    return np.select([sched == "gpipe", sched == "interleaved", sched == "zb"],
                     [m, np.minimum(m, (p - r) + (p - 1) / v), np.minimum(m, float(p))], np.minimum(m, float(p - r)))


def _pending(sched: np.ndarray, r: int, p: int, m: F, v: int) -> F:
    """``pipeline.weights_pending`` over configurations."""
    if p == 1:
        return np.zeros_like(m)
    return np.where(sched == "zb", np.minimum(m * v, r + 1.0) / v, 0.0)


def _combine(sl: np.ndarray, p: int, v: int, blocks: list[int], pre: int | None, post: int | None,
             ua: list[UnitArrays], g: _Cfg, dev: DeviceModel, net: _Net, w: Workload,
             out: dict[str, F], n_mb: F, p2p_total: F, tail: F) -> None:
    """Step time and peak memory (both moments, as ``estimate._stage_memory``) of rows ``sl``."""
    c = dev.c
    K = len(ua)
    sizes = even_split(len(blocks), p * v)
    # units per rank: counts of each class; whether the rank's last unit is the head
    counts = np.zeros((p, K))
    bounds = np.zeros((p, K))  # stage boundaries (p2p) after a unit of class k, per rank
    start = 0
    for k, n in enumerate(sizes):
        st = blocks[start:start + n]
        start += n
        if k == 0 and pre is not None:
            counts[0, pre] += 1
        for cls in st:
            counts[k % p, cls] += 1
        if k == p * v - 1 and post is not None:
            counts[k % p, post] += 1
        elif k < p * v - 1:
            last = st[-1] if st else pre
            if last is not None:
                bounds[k % p, last] += 1
    # ranks holding the same units price alike: work on the distinct ones (weight = how many;
    # memory at the first and the last of them: the first keeps the most micro-batches in flight,
    # the last, with zero bubble, defers the most weight gradients; between them memory is monotone)
    sends_by_rank = bounds.copy()
    sig, first, inv, mult = np.unique(np.concatenate([counts, bounds], axis=1), axis=0, return_index=True,
                                      return_inverse=True, return_counts=True)
    last = np.array([np.flatnonzero(inv.reshape(-1) == j).max() for j in range(len(sig))])
    counts, bounds = sig[:, :K], sig[:, K:]
    dp = g.dpr[sl] * g.dps[sl]
    m = w.global_batch / (dp * g.b[sl])
    n_mb[sl] = m
    pp_stride = g.tp[sl] * g.cp[sl] * g.dps[sl] * g.dpr[sl]
    sends = [2 * net("send_recv", u.out_bytes[sl], np.full(len(sl), float(p)), pp_stride)
             if p > 1 else np.zeros(len(sl)) for u in ua]
    p2p = [c.exposed(t, t * c.pp_overlap) for t in sends]

    def per_rank(attr: str) -> F:  # (n, O, distinct ranks)
        return np.einsum("nok,rk->nor", np.stack([getattr(u, attr)[sl] for u in ua], axis=2), counts)

    t_r = per_rank("time") + np.einsum("nk,rk->nr", np.stack(p2p, axis=1), bounds)[:, None, :]
    p2p_total[sl] = np.einsum("nk,rk,r->n", np.stack(p2p, axis=1), bounds, mult)
    worst = t_r.max(axis=2)
    mm = m[:, None]
    sched = g.sched[sl][:, None]
    if p == 1:
        pipe = mm * worst
    else:
        f_r, w_r = per_rank("fwd"), per_rank("bwd_weight")
        fill = (f_r + (t_r - f_r - w_r) - w_r).max(axis=2)
        sum_t = (t_r * mult).sum(axis=2)
        pipe = np.select([sched == "interleaved", sched == "zb"],
                         [mm * worst + (p - 1) * worst / v, mm * worst + (p - 1) * np.maximum(fill, 0.0)],
                         (mm - 1) * worst + sum_t)
        pipe = time_shared(pipe, mm, sum_t, p, dev.share, ramp_step(sched, sum_t, worst, fill, p, v))
    exposed = c.exposed(per_rank("step_comm"), c.dp_overlap * per_rank("window")).max(axis=2)
    step = pipe + exposed + per_rank("optim").max(axis=2) + per_rank("offload").max(axis=2)
    step = step + c.step_overhead_s
    present = counts > 0
    mem = np.zeros_like(step)
    states, acts, grads = per_rank("states"), per_rank("activations"), per_rank("grads")
    pend = per_rank("pending")
    # bytes each rank sends (a block's output per boundary), which its neighbour keeps receive buffers for
    sent = np.einsum("nk,rk->nr", np.stack([u.out_bytes[sl] for u in ua], axis=1), sends_by_rank)
    unheld = (m <= 1)[:, None] if p == 1 else np.zeros((len(sl), 1), dtype=bool)  # not grads_held
    bucket = np.where(dp > 1, c.dp_bucket_bytes, 0.0)[:, None]
    for u in range(len(sig)):
        ks = np.flatnonzero(present[u])
        gath = np.max(np.stack([ua[k].gathered[sl] for k in ks]), axis=0)
        remat = np.max(np.stack([ua[k].remat[sl] for k in ks]), axis=0)
        buf = gath + remat + bucket
        if post is not None and counts[u, post] > 0:  # the head ends the last rank
            buf = buf + ua[post].activations[sl] * w.loss_buffer
        for r in {int(first[u]), int(last[u])}:
            fly, waiting = _in_flight(g.sched[sl], r, p, m, v), _pending(g.sched[sl], r, p, m, v)
            recv = ((m - fly) * sent[:, (r - 1) % p] + (m - waiting) * sent[:, r])[:, None] if p > 1 else 0.0
            run = states[:, :, u] - np.where(unheld, grads[:, :, u], 0.0) + buf + recv
            run = run + acts[:, :, u] * fly[:, None] + pend[:, :, u] * waiting[:, None]
            tot = np.maximum(run, states[:, :, u] + gath + bucket + tail[:, None] + recv)  # the end of backward
            mem = np.maximum(mem, tot + (c.context_bytes + c.fragmentation * tot))
    held = (counts * mult[:, None]).sum(axis=0)
    hw = np.einsum("nok,k->no", np.stack([u.hw_flops[sl] for u in ua], axis=2), held)
    out["step"][sl] = step
    out["mem"][sl] = mem / GIB
    out["hfu"][sl] = hw * mm * (g.dpr[sl] * g.dps[sl] * g.tp[sl] * g.cp[sl])[:, None]


def strategies_grid(strategies: Sequence[Strategy]
                    ) -> tuple[list[Any], list[GridOption], list[tuple[int, int]]]:
    """Configurations, options and (i, j) cells of a list of uniform strategies (for testing)."""
    from types import SimpleNamespace

    cfg_keys: dict[tuple, int] = {}
    opt_keys: dict[tuple, int] = {}
    cells = []
    configs: list[Any] = []
    options: list[LayerStrategy] = []
    for s in strategies:
        m = s.mesh
        ck = (m.pp, m.dp_replicate, m.dp_shard, m.cp, m.tp, m.ep, s.micro_batch, s.schedule, s.vpp,
              s.sequence_parallel, s.tp_mode, s.cp_mode)
        if ck not in cfg_keys:
            cfg_keys[ck] = len(configs)
            configs.append(SimpleNamespace(**dict(zip(
                ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "micro_batch", "schedule", "vpp",
                 "sequence_parallel", "tp_mode", "cp_mode"), ck, strict=True))))
        ok = (s.default.sharding, s.default.recompute, s.default.offload)
        if ok not in opt_keys:
            opt_keys[ok] = len(options)
            options.append(GridOption.of(s.default))
        cells.append((cfg_keys[ck], opt_keys[ok]))
    return configs, options, cells


def compute_bound(graph: LayerGraph, cluster: Cluster, w: Workload, configs: Sequence[MeshLike],
                  profile: Profile | None = None, device: DeviceModel | None = None) -> F:
    """Per configuration, a step time no plan with it beats: its forward and backward compute alone.

    Units at their fastest (no recomputation, no operator splitting, no exposed communication),
    stages perfectly balanced, plus the fixed per-step overhead: ``m·ΣT`` without a pipeline,
    ``((m-1)/p + 1)·ΣT`` for 1F1B/GPipe, ``(m + (p-1)/v)·ΣT/p`` interleaved, ``m·ΣT/p`` zero-bubble.
    """
    dev = device or DeviceModel(cluster, profile)
    if not configs:
        return np.zeros(0)
    g = _Cfg.of(configs)
    reps, index = unit_classes(graph)
    counts = np.bincount(np.array(index), minlength=len(reps))
    total = np.zeros(len(configs))
    for k, (_, nodes) in enumerate(reps):
        for n in nodes:
            static = n.tp in TP_SPLIT_ROLES or n.kind in ("activation", "experts", "loss")
            tdiv = np.where(g.tsp | static | g.sp, g.tp, 1.0)
            one = np.ones(len(configs))
            calls = np.maximum(1.0, n.dims.get("experts", 1) / g.ep) if n.kind == "experts" else one
            f, b = _times(dev, n, g.b / g.cp / tdiv, calls, tdiv, w.precision, w.attention_kernel)
            total += counts[k] * (f + b)
    m = w.global_batch / (g.dpr * g.dps * g.b)
    p, v = g.pp, g.vpp
    pipe = np.select([p == 1, g.sched == "interleaved", g.sched == "zb"],
                     [m * total, (m + (p - 1) / v) * total / p, m * total / p], ((m - 1) / p + 1) * total)
    ramp = ramp_step(g.sched, total, total / p, 0.0, p, v)  # balanced stages, no zero-bubble fill
    return time_shared(pipe, m, total, p, dev.share, ramp) + dev.c.step_overhead_s
