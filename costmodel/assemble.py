"""From unit costs to a step: the one assembly of units into pipeline ranks, their step time and
their peak memory, over configurations.

A layout lists the units of every virtual stage as indices into a list of priced units
(:class:`costmodel.units.UnitCost`, arrays of shape (C, O)); virtual stage ``k`` lives on
pipeline rank ``k mod p``. Per rank: the time of a micro-batch (its units and the sends at its
stage boundaries), the schedule's step (:func:`costmodel.pipeline.schedule_time`), the gradient
sync exposed beyond the backward that hides it, the optimizer and host transfers; memory at the
two moments of the step (:func:`rank_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from costmodel.configs import ConfigArrays
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.pipeline import in_flight, recv_buffers, schedule_time, weights_pending
from costmodel.state_groups import grads_held
from costmodel.units import PER_OPTION, UnitCost
from vocab.strategy import Workload

F = np.ndarray


def bucket_bytes(c: CostConstants, dp: Any) -> Any:
    """Gradient buckets in flight on a rank with ``dp`` data-parallel replicas (``dp_bucket_bytes``),
    scalars or arrays."""
    if not isinstance(dp, np.ndarray):
        return c.dp_bucket_bytes if dp > 1 else 0.0
    return np.where(np.asarray(dp) > 1, c.dp_bucket_bytes, 0.0)


@dataclass
class Layout:
    """Units of each virtual stage (indices into the priced units), their counts per pipeline
    rank and the stage boundaries each rank sends across after a unit of each kind."""

    stages: list[list[int]]
    p: int
    classes: int
    head: int | None = None  # the index of the LM head, whose rank keeps the loss's transients
    counts: F = field(init=False)
    bounds: F = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros((self.p, self.classes))
        self.bounds = np.zeros((self.p, self.classes))
        last = len(self.stages) - 1
        for k, st in enumerate(self.stages):
            for cls in st:
                self.counts[k % self.p, cls] += 1
            if k < last and st:
                self.bounds[k % self.p, st[-1]] += 1

    @property
    def v(self) -> int:
        return len(self.stages) // self.p


@dataclass
class RankMemory:
    """One rank's memory parts at its peak (bytes, arrays over (configurations, options)):
    ``core_run`` is what the start of backward holds besides parameters and optimizer states,
    ``core_end`` what the end of backward holds besides them (``live`` of the gradients)."""

    params: F
    optim: F
    grads: F
    live: F
    acts: F
    core_run: F
    core_end: F
    param_bytes: F | None = None  # the byte counts: only when asked for (``detail``)
    grad_bytes: F | None = None
    optim_bytes: F | None = None

    @property
    def peak_tensors(self) -> F:
        return np.maximum(self.core_run, self.core_end) + self.params + self.optim

    def rank(self, i: int) -> RankMemory:
        """Rank ``i``'s parts, of parts that carry a last axis over ranks."""
        return RankMemory(*(None if (x := getattr(self, f.name)) is None else x[..., i] for f in fields(self)))


@dataclass
class Assembled:
    """Steps of rows of configurations under every option: arrays (n, O) unless said otherwise."""

    step: F
    memory: F  # bytes of the worst rank, allocator overhead included
    hw_flops: F  # hardware FLOPs of one step over all ranks
    n_mb: F  # (n,)
    p2p_total: F  # (n,): send/recv seconds of all stage boundaries per micro-batch
    host: F  # host bytes of the worst rank's offloaded states
    # per rank (n, O, p), filled with ``detail``
    rank_time: F | None = None
    pipe: F | None = None
    bubble: F | None = None
    dp_exposed: F | None = None
    optim: F | None = None
    offload: F | None = None
    ranks: list[RankMemory] | None = None
    p2p: F | None = None  # (n, p): exposed sends of each rank per micro-batch


def boundary_time(dev: DeviceModel, out_bytes: F, cfg: ConfigArrays, p: int) -> F:
    """Exposed seconds per micro-batch of one pipeline stage boundary, both ways: the activation
    sent forward and its gradient sent back (``out_bytes`` each), ``pp_overlap`` of it hidden."""
    if p == 1:
        return np.zeros(cfg.size)
    t = 2 * dev.collective_time("send_recv", out_bytes, cfg.pp_group)
    return dev.c.exposed(t, t * dev.c.pp_overlap)


def assemble(ua: Sequence[UnitCost], layout: Layout, cfg: ConfigArrays, dev: DeviceModel, w: Workload,
             tail: F, detail: bool = False, stacked: StackedRows | None = None) -> Assembled:
    """Step time and peak memory of configurations ``cfg`` (one pipeline degree, ``layout.p``)
    under every option of the priced units ``ua``;
    ``tail`` (n,) the end of backward's transient (:func:`costmodel.estimate.tied_sum_bytes`).
    ``detail`` keeps every rank's parts; ``stacked``, the units already stacked at ``cfg``
    (:meth:`Stacked.take`)."""
    c, p, v = dev.c, layout.p, layout.v
    K = len(ua)
    m = cfg.num_microbatches(w.global_batch)
    sched = cfg.schedule[:, None]
    if detail:  # every rank its own
        sig, first, last, mult = layout.counts, np.arange(p), np.arange(p), np.ones(p)
        bounds = layout.bounds
    else:  # ranks holding the same units price alike: the first keeps the most micro-batches in
        # flight, the last (zero bubble) defers the most weight gradients; between them memory is monotone
        both = np.concatenate([layout.counts, layout.bounds], axis=1)
        kinds, first, inv, mult = np.unique(both, axis=0, return_index=True, return_inverse=True,
                                            return_counts=True)
        last = np.zeros(len(kinds), dtype=np.int64)
        np.maximum.at(last, inv.reshape(-1), np.arange(p))  # each kind's last rank
        sig, bounds = kinds[:, :K], kinds[:, K:]

    units = stacked if stacked is not None else Stacked(ua).take(slice(None))

    def per_rank(attr: str) -> F:  # (n, O, distinct ranks)
        return units.mix(attr, sig)

    out = units("out_bytes")  # (n, K)
    p2p = np.stack([boundary_time(dev, out[:, k], cfg, p) for k in range(K)], axis=1)  # (n, K)
    p2p_rank = p2p @ bounds.T  # (n, distinct ranks)
    t_r = per_rank("time") + p2p_rank[:, None, :]
    f_r, w_r = per_rank("fwd"), per_rank("bwd_weight")
    pipe, bubble = schedule_time(sched, t_r, m[:, None], p, v, f_r, w_r, dev.share, mult)
    dp_exposed = c.exposed(per_rank("step_comm"), c.dp_overlap * per_rank("window")).max(axis=2)
    optim, offload = per_rank("optim").max(axis=2), per_rank("offload").max(axis=2)
    step = pipe + dp_exposed + optim + offload + c.step_overhead_s
    # bytes each rank sends across its stage boundaries, which its neighbour keeps receive buffers for
    sent = out @ layout.bounds.T  # (n, p)
    ranks = [(j, r) for j in range(len(sig)) for r in sorted({int(first[j]), int(last[j])})]
    rs = np.array([r for _, r in ranks])
    fly = np.broadcast_to(in_flight(sched, rs, p, m[:, None], v), (len(m), len(rs)))  # (n, ranks)
    waiting = np.broadcast_to(weights_pending(sched, rs, p, m[:, None], v), (len(m), len(rs)))
    recv = (recv_bytes(sched, rs, p, m[:, None], v, sent[:, (rs - 1) % p], sent[:, rs], w.recv_buffers)
            if p > 1 else np.zeros((len(m), len(rs))))
    mem = rank_memory(units, sig[[j for j, _ in ranks]], layout, cfg, dev, w, Transients(fly, waiting, recv, tail),
                      detail)
    tensors = mem.peak_tensors.max(axis=-1)
    memory = tensors + c.context_bytes + c.fragmentation * tensors
    held = (sig * mult[:, None]).sum(axis=0)
    hw = units.mix("hw_flops", held[None, :])[..., 0]
    hw = hw * m[:, None] * (cfg.dp * cfg.tp * cfg.cp)[:, None]
    host = per_rank("host_bytes").max(axis=2)
    a = Assembled(step, memory, hw, m, (p2p_rank * mult).sum(axis=1), host)
    if detail:
        a.rank_time, a.pipe, a.bubble, a.dp_exposed = t_r, pipe, bubble, dp_exposed
        a.optim, a.offload, a.ranks, a.p2p = optim, offload, [mem.rank(i) for i in range(len(ranks))], p2p_rank
    return a


def recv_bytes(schedule: Any, r: Any, p: int, m: Any, v: int, sent_in: Any, sent_out: Any,
               kind: str = "per_micro_batch") -> Any:
    """Bytes of the receive buffers pipeline rank ``r`` keeps beyond its activations
    (:func:`costmodel.pipeline.recv_buffers`): ``sent_in`` bytes arrive per micro-batch at its
    stages with a previous stage (what rank ``r - 1`` sends), ``sent_out`` bytes of output
    gradients at its stages with a next one (what it sends itself)."""
    fwd, grad = recv_buffers(schedule, r, p, m, v, kind)
    return fwd * sent_in + grad * sent_out


class Stacked:
    """The priced units' arrays of one attribute side by side, stacked once: (units, C, O) in memory,
    viewed (n, O, units). Mixing the units of a slice of configurations is then one matrix product
    on a view, and every per-rank result (n, O, ranks) keeps its ranks outermost in memory (reducing
    over ranks is an elementwise maximum)."""

    def __init__(self, ua: Sequence[UnitCost]):
        self.ua = ua
        self._whole: dict[str, F] = {}

    def whole(self, attr: str) -> F:
        """(units, C, O) of a per-option quantity, (units, C) of a per-configuration one; a column
        shared by several options is written from one array."""
        if attr not in self._whole:
            self._whole[attr] = self._build(attr)
        return self._whole[attr]

    def _build(self, attr: str) -> F:
        if attr not in PER_OPTION:  # per configuration (out_bytes)
            return np.stack([np.asarray(getattr(u, attr), dtype=float) for u in self.ua])
        cols0 = self.ua[0].columns(attr)
        out = np.empty((len(self.ua), len(cols0[0]), len(cols0)))
        for k, u in enumerate(self.ua):
            shared: dict[int, tuple[F, list[int]]] = {}
            for j, col in enumerate(u.columns(attr)):
                shared.setdefault(id(col), (col, []))[1].append(j)
            for col, js in shared.values():
                out[k][:, js] = col[:, None]
        return out

    def take(self, rows: slice) -> StackedRows:
        """The configurations ``rows`` (a slice: views, nothing copied)."""
        return StackedRows(self, rows)


class StackedRows:
    """Configurations ``rows`` (a slice) of a :class:`Stacked`."""

    def __init__(self, whole: Stacked, rows: slice = slice(None)):
        self.source, self.rows = whole, rows

    def slab(self, attr: str) -> F:
        """(units, n, O) or (units, n): rows of configurations, each contiguous."""
        return self.source.whole(attr)[:, self.rows]

    def __call__(self, attr: str) -> F:
        """(n, O, units), or (n, units) for a per-configuration quantity."""
        v = self.slab(attr)
        return v.transpose(1, 2, 0) if v.ndim == 3 else v.T

    def mix(self, attr: str, weights: F) -> F:
        """``attr`` of R mixes of the units, ``weights`` (R, units): (n, O, R), as one 2-D product."""
        v = self.slab(attr)
        return (weights @ v.reshape(len(v), -1)).reshape(len(weights), *v.shape[1:]).transpose(1, 2, 0)


@dataclass
class Transients:
    """What R pipeline ranks hold beside their units' states, each (n, R) but ``tail``: ``fly``
    micro-batches in flight (:func:`costmodel.pipeline.in_flight`), ``waiting`` awaiting weight
    gradients (:func:`costmodel.pipeline.weights_pending`), ``recv`` bytes of receive buffers
    (:func:`recv_bytes`), and ``tail`` (n,) the end of backward's transient
    (:func:`costmodel.estimate.tied_sum_bytes`)."""

    fly: F
    waiting: F
    recv: F
    tail: F


def rank_memory(units: StackedRows, counts: F, layout: Layout, cfg: ConfigArrays, dev: DeviceModel, w: Workload,
                held_by: Transients, counts_bytes: bool = True) -> RankMemory:
    """Peak memory parts of R pipeline ranks, rank ``i`` holding ``counts[i]`` of each unit (R, K),
    beside ``held_by``'s micro-batches and buffers (:class:`Transients`); every part (n, O, R). The
    larger of two moments of the step:

    * start of backward, the activations in flight all saved: states (gradients only if
      :func:`grads_held`) + activations (with zero bubble, the output gradients that micro-batches
      awaiting their weight gradients keep) + the largest gathered ZeRO-3 unit + the largest
      rematerialised unit + DP buckets + the loss's transients;
    * end of backward, every gradient made: states + the largest gathered unit + DP buckets +
      ``tail``;
    and at both the pipeline's receive buffers (:func:`costmodel.pipeline.recv_buffers`), kept
    between steps. Between the two, backward trades activations for gradients unit by unit.
    ``counts_bytes`` adds the exact byte counts of parameters, gradients and optimizer states.
    """
    c, p = dev.c, layout.p
    m = cfg.num_microbatches(w.global_batch)
    held = counts > 0  # (R, K)
    fly, waiting, tail = held_by.fly, held_by.waiting, held_by.tail

    def total(attr: str) -> F:
        return units.mix(attr, counts)

    def largest(attr: str) -> F:  # the largest unit each rank holds (sizes are >= 0), unit by unit
        v = units.slab(attr)
        out = np.zeros((len(counts), *v.shape[1:]))
        for r, k in zip(*np.nonzero(held), strict=True):
            np.maximum(out[r], v[k], out=out[r])
        return out.transpose(1, 2, 0)

    bucket = bucket_bytes(c, cfg.dp)[:, None, None]
    recv = held_by.recv[:, None, :]
    acts = total("activations") * fly[:, None, :] + total("pending") * waiting[:, None, :]
    h = layout.head
    loss = units("activations")[..., h, None] * w.loss_buffer * held[:, h] if h is not None else 0.0
    grads = total("state_grads")
    live = np.where(grads_held(p, m)[:, None, None], grads, 0.0)
    gath = largest("gathered")
    core_run = live + acts + gath + largest("remat") + bucket + loss + recv
    core_end = grads + gath + bucket + tail[:, None, None] + recv
    mem = RankMemory(total("state_params"), total("state_optim"), grads, live, acts, core_run, core_end)
    if counts_bytes:
        mem.param_bytes, mem.grad_bytes, mem.optim_bytes = (
            total("param_bytes"), total("grad_bytes"), total("optim_bytes"))
    return mem
