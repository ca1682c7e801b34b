"""Unit costs over many configurations at once: the array form of :mod:`costmodel.units`.

Every function here mirrors its scalar counterpart in :mod:`costmodel.units` (and the collective
model of :mod:`costmodel.device`) for uniform layer strategies; :mod:`costmodel.vectorized`
assembles the units into step times and memory. Compute times come from the device model itself,
once per distinct size, so a measured profile prices the same here as there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from costmodel.device import COLLECTIVE_FACTORS, DeviceModel
from costmodel.gradients import (
    GATHER_BYTES,
    GRAD_REDUCE_BYTES,
    accumulate_time,
    extra_all_reduces,
    fsdp_copies,
    grad_tensors,
    sp_partial_grads,
)
from costmodel.host import with_dtensor
from costmodel.units import (
    GEMM_KINDS,
    MEMORY_OPS,
    TP_SPLIT_OUTPUTS,
    TP_SPLIT_ROLES,
    act_width,
    attention_times,
    carries_weights,
    embedding_table_bytes,
    gemm_shape,
    state_bytes,
    traffic_width,
)
from profiler.graph import LayerGraph, LayerNode
from profiler.profile_schema import ADAM_BYTES_PER_PARAM
from vocab.strategy import LayerStrategy, Workload

F = np.ndarray


class MeshLike(Protocol):
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    micro_batch: int
    schedule: str
    vpp: int
    sequence_parallel: bool
    tp_mode: str
    cp_mode: str


def unit_names(graph: LayerGraph) -> list[str]:
    """The graph's unit names in order (cached on the graph)."""
    cached = graph.__dict__.get("_unit_names")
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    names = [n for n, _ in graph.blocks()]
    graph.__dict__["_unit_names"] = (len(graph.nodes), names)
    return names


def unit_classes(graph: LayerGraph) -> tuple[list[tuple[str, list[LayerNode]]], list[int]]:
    """Distinct units (first of each kind) and the class index of every unit in order (cached on the
    graph)."""
    cached = graph.__dict__.get("_unit_classes")
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1], cached[2]
    reps: list[tuple[str, list[LayerNode]]] = []
    keys: dict[tuple, int] = {}
    index = []
    for name, nodes in graph.blocks():
        key = (name if not name.startswith("layers.") else "layers",) + tuple(
            (n.name.split(".", 2)[-1] if n.block is not None else n.name, n.kind, n.params, n.fwd_flops,
             n.bwd_flops, n.act_saved_bytes, n.act_selective_bytes, n.act_tp_sharded, n.out_bytes,
             n.mem_bytes, n.causal, n.tp, tuple(sorted(n.dims.items()))) for n in nodes)
        if key not in keys:
            keys[key] = len(reps)
            reps.append((name, nodes))
        index.append(keys[key])
    graph.__dict__["_unit_classes"] = (len(graph.nodes), reps, index)
    return reps, index


def block_classes(graph: LayerGraph) -> list[int]:
    """The class (:func:`unit_classes`) of every transformer block, in order."""
    _, index = unit_classes(graph)
    return [k for k, n in zip(index, unit_names(graph), strict=True) if n.startswith("layers.")]


@dataclass
class _Cfg:
    """Configuration arrays (length C)."""

    pp: F
    dpr: F
    dps: F
    cp: F
    tp: F
    ep: F
    b: F
    vpp: F
    sched: np.ndarray  # object array of schedule names
    sp: F
    tsp: F
    uly: F

    @classmethod
    def of(cls, configs: Sequence[MeshLike]) -> _Cfg:
        def col(attr: str, dtype: Any = float) -> F:
            return np.array([getattr(c, attr) for c in configs], dtype=dtype)

        return cls(col("pp"), col("dp_replicate"), col("dp_shard"), col("cp"), col("tp"), col("ep"),
                   col("micro_batch"), col("vpp"), col("schedule", object), col("sequence_parallel", bool),
                   np.array([c.tp_mode == "tsp" for c in configs]),
                   np.array([c.cp_mode == "ulysses" for c in configs]))


class _Net:
    """Collective times over arrays of (bytes, group size, group stride)."""

    def __init__(self, dev: DeviceModel):
        self.dev = dev
        acc = dev.acc
        self.up, self.out, self.eff = acc.scale_up, acc.scale_out, acc.busbw_efficiency
        self.domain = dev.cluster.scale_up_domain
        self.scalar = bool(dev.profile is not None and dev.profile.comm)

    def __call__(self, kind: str, nbytes: Any, n: F, stride: F) -> F:
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=float), n.shape)
        if self.scalar:
            from costmodel.device import AxisGroup

            return np.array([self.dev.collective_time(kind, float(x), AxisGroup(int(s), int(t)))
                             for x, s, t in zip(nbytes, n, stride, strict=True)])
        up_bw = self.up.gbps * 1e9 * self.eff
        out_bw = self.out.gbps * 1e9 * self.eff
        fac = COLLECTIVE_FACTORS[kind]
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = fac(n)
            log_n = np.ceil(np.log2(np.maximum(n, 1)))
            steps = np.ones_like(n) if kind == "send_recv" else log_n * (2 if kind == "all_reduce" else 1)
            dom_k = np.minimum(n, np.maximum(self.domain // np.maximum(stride, 1), 1))
            k = np.where(stride >= self.domain, 1, np.gcd(dom_k.astype(np.int64), n.astype(np.int64)))
            m = n // k
            single = steps * self.up.latency_us * 1e-6 + factor * nbytes / up_bw
            if kind == "send_recv":
                multi = self.out.latency_us * 1e-6 + nbytes / out_bw
            else:
                intra = np.where(k > 1, fac(k) * nbytes / up_bw, 0.0)
                inter = fac(m) * (nbytes / k) / out_bw
                if kind == "all_to_all":
                    inter = factor * nbytes * (1 - (k - 1) / np.maximum(n - 1, 1)) / out_bw
                lat = steps * np.where(k > 1, self.up.latency_us, 0.0) * 1e-6 + np.ceil(
                    np.log2(np.maximum(m, 1))) * self.out.latency_us * 1e-6
                multi = lat + np.maximum(intra, inter)
            t = np.where(m == 1, single, multi)
        return np.where((n <= 1) | (nbytes <= 0), 0.0, t)

    def latency(self, kind: str, n: F, stride: F) -> F:
        """:meth:`DeviceModel.collective_latency` over arrays of group sizes and strides."""
        return 2 * self(kind, 1.0, n, stride) - self(kind, 2.0, n, stride) - self.wait(kind, n)

    def wait(self, kind: str, n: F) -> F:
        """:meth:`DeviceModel.collective_wait` over an array of group sizes."""
        if not self.scalar:
            return np.zeros(len(n))
        from costmodel.device import AxisGroup

        return np.array([self.dev.collective_wait(kind, AxisGroup(int(x), 1)) for x in n])


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
class UnitArrays:
    """One unit class under every (configuration, option): arrays of shape (C, O)."""

    time: F
    fwd: F
    bwd_weight: F
    step_comm: F
    window: F
    optim: F
    offload: F
    states: F  # parameters, gradients and optimizer state
    grads: F  # the gradients among the states
    activations: F
    pending: F  # added while its weight gradients wait (zero bubble): units.pending_bytes
    gathered: F
    remat: F
    hw_flops: F
    out_bytes: F  # (C,)


def _each(fn: Any, x: F) -> F:
    """``fn`` of every element, called once per distinct value."""
    uniq, inv = np.unique(x, return_inverse=True)
    return np.array([fn(float(v)) for v in uniq])[inv.reshape(-1)] if len(uniq) else np.zeros_like(x)


def _times(dev: DeviceModel, n: LayerNode, scale: F, calls: F, tdiv: F, prec: str, kernel: str
           ) -> tuple[F, F]:
    """Forward and backward seconds of ``n`` per distinct (scale, calls, TP division), via the device model."""
    by_shape = dev.measured("gemm")
    if (by_shape and n.kind in GEMM_KINDS) or n.kind == "embedding":  # GEMMs by shape, tables by TP
        uniq, inv = np.unique(np.stack([scale, calls, np.broadcast_to(tdiv, scale.shape)]), axis=1,
                              return_inverse=True)
    else:  # one sortable complex key per (scale, calls): much faster than unique rows
        uniq_c, inv = np.unique(scale + 1j * calls, return_inverse=True)
        uniq = np.stack([uniq_c.real, uniq_c.imag, np.ones(len(uniq_c))])
    fwd, bwd = np.empty(uniq.shape[1]), np.empty(uniq.shape[1])
    op = MEMORY_OPS.get(n.kind, "elementwise")
    for i, (sc, cl, td) in enumerate(uniq.T):
        flops = n.fwd_flops * sc
        if n.kind in GEMM_KINDS:
            if n.kind == "experts":
                flops *= dev.c.moe_imbalance
            shape = gemm_shape(n, sc * td, td, cl)
            fwd[i] = dev.gemm_time(flops / cl, prec, cl, shape=shape)
            bwd[i] = dev.gemm_time(flops / cl, prec, cl, backward=True, shape=shape)
        elif n.kind == "attention":
            fwd[i], bwd[i] = attention_times(n, dev, flops, n.mem_bytes * sc * act_width(n, prec), prec, kernel)
        else:
            nbytes = n.mem_bytes * sc * traffic_width(n, prec)
            fwd[i], bwd[i] = dev.memory_time(nbytes, op), dev.memory_time(nbytes, op, backward=True)
            if n.kind == "embedding":
                bwd[i] = dev.embedding_backward_time(nbytes, embedding_table_bytes(n, td, prec))
    inv = inv.reshape(-1)
    return fwd[inv], bwd[inv]


def _local(n: LayerNode, g: _Cfg) -> np.ndarray:
    """``units._local_params`` over configurations: parameters on one rank after TP and EP."""
    tp = g.tp.astype(np.int64)
    params = np.full(len(tp), n.params, dtype=np.int64)
    if n.kind == "linear" and n.tp == "vocab" and n.params == 0:  # a tied head's own copy on the last stage
        params = np.where(g.pp > 1, int(n.dims.get("in", 0)) * int(n.dims.get("out", 0)), params)
    if n.kind == "experts":
        return params // (tp * g.ep.astype(np.int64))
    whole = n.tp in ("column", "heads") or (n.tp == "vocab" and n.kind != "embedding")
    out = np.where(g.tsp | whole, params // tp, params)
    if n.tp == "row" and not whole:
        weight = int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
        out = np.where(g.tsp, out, weight // tp + (params - weight))
    elif n.tp == "vocab" and n.kind == "embedding":
        table = int(n.dims.get("vocab", 0)) * int(n.dims.get("hidden", 0))
        out = np.where(g.tsp, out, table // tp + (params - table))
    return np.where(tp == 1, params, out)


def _unit(nodes: list[LayerNode], dev: DeviceModel, net: _Net, g: _Cfg, w: Workload,
          opts: Sequence[GridOption], large: set[str]) -> UnitArrays:
    c, C = dev.c, len(g.tp)
    tp, cp, b, ep = g.tp, g.cp, g.b, g.ep
    scale = b / cp
    z = np.zeros(C)
    fwd, bwd, bwd_w, fwd_flops, hw, acts, acts_sel = (z.copy() for _ in range(7))
    attn_fwd, attn_time, cp_bytes, ep_bytes = z.copy(), z.copy(), z.copy(), z.copy()
    groups: dict[tuple[bool, bool], np.ndarray] = {}  # local parameters by (large operator, expert)
    largest: dict[tuple[bool, bool], np.ndarray] = {}  # its largest operator, by the same key
    tensors: dict[tuple[bool, bool], tuple[Any, Any]] = {}  # (big gradient tensors, small ones' parameters)
    tp_msgs = sp_grads = sp_params = 0
    first_acts, grads_out, loss_acts = z.copy(), z.copy(), z.copy()
    for i, n in enumerate(nodes):
        static = n.tp in TP_SPLIT_ROLES or n.kind in ("activation", "experts", "loss")
        tdiv = np.where(g.tsp | static | g.sp, tp, 1.0)
        adiv = np.where(g.tsp | g.sp | n.act_tp_sharded, tp, 1.0)
        calls = np.maximum(1.0, n.dims.get("experts", 1) / ep) if n.kind == "experts" else np.ones(C)
        f, bw = _times(dev, n, b / cp / tdiv, calls, tdiv, w.precision, w.attention_kernel)
        f, bw = with_dtensor(n, dev, f, bw, (g.tp > 1) & ~g.tsp, g.sp)
        fwd += f
        bwd += bw
        if n.kind in GEMM_KINDS:
            bwd_w += bw / 2
        fwd_flops += n.fwd_flops * scale / tdiv
        hw += (n.fwd_flops + n.bwd_flops) * scale / tdiv
        aw = act_width(n, w.precision)
        a = n.act_saved_bytes * scale / adiv * aw
        acts += a
        acts_sel += a - n.act_selective_bytes * scale / adiv * aw
        if i == 0:
            first_acts = a if n.kind == "norm" else z
        if n.kind == "loss":
            loss_acts = loss_acts + a
        elif carries_weights(n):  # as units.pending_bytes
            split = np.where(g.tsp | g.sp | (n.tp in TP_SPLIT_OUTPUTS), tp, 1.0)
            grads_out = grads_out + n.out_bytes * scale / split * aw
        if n.kind == "attention":
            attn_fwd += f
            attn_time += f + bw
            kv = n.dims.get("kv_heads", 1) * n.dims.get("head_dim", 1)
            cp_bytes += 2 * 2 * b * n.dims.get("seq", w.seq_len) * kv / tp * aw
        key = (n.name in large, n.kind == "experts")
        groups[key] = groups.get(key, np.zeros(C, dtype=np.int64)) + _local(n, g)
        largest[key] = np.maximum(largest.get(key, np.zeros(C, dtype=np.int64)), _local(n, g))
        big, small = grad_tensors(n, _local(n, g), c.grad_coalesce_bytes)
        had_big, had_small = tensors.get(key, (0, 0.0))
        tensors[key] = (had_big + big, had_small + small)
        if n.kind == "experts":
            tok = b * w.seq_len / cp / np.where(g.sp, tp, 1.0)
            ep_bytes += 2 * tok * n.dims.get("top_k", 1) * n.dims.get("in", 0)
        if n.tp == "row" or (n.tp == "vocab" and n.kind in ("embedding", "linear")):
            tp_msgs += 1
        k, p = sp_partial_grads(n)
        sp_grads, sp_params = sp_grads + k, sp_params + p
    params = sum(groups.values(), np.zeros(C, dtype=np.int64))
    ew = act_width(None, w.precision)
    out_bytes = nodes[-1].out_bytes * b / cp / np.where(g.sp | g.tsp, tp, 1.0) * ew
    hidden = next((int(n.dims["hidden"]) if "hidden" in n.dims else int(n.dims["in"])
                   for n in nodes if "hidden" in n.dims or "in" in n.dims), 0)
    act_msg = 2.0 * b * w.seq_len / cp * hidden * ew
    # ---- per recompute mode: activations, recompute, TP/CP/EP communication ----------------
    rc_cols: dict[str, tuple[F, ...]] = {}
    for rc in {o.recompute for o in opts}:
        passes = 3 if rc == "full" else 2
        comm = z.copy()
        meg = tp_msgs * passes * net("all_reduce", act_msg, tp, np.ones(C))
        sp = tp_msgs * passes * net.wait("reduce_scatter", tp)
        if sp_grads:
            sp = sp + sp_grads * net("all_reduce", sp_params / sp_grads * GRAD_REDUCE_BYTES, tp, np.ones(C))
        meg = meg + np.where(g.sp, sp, 0.0)
        meg = c.exposed(meg, meg * c.tp_overlap)
        wbytes = GATHER_BYTES * params * tp
        t = passes * net("all_gather", wbytes, tp, np.ones(C))
        t = t + net("reduce_scatter", wbytes * GRAD_REDUCE_BYTES / GATHER_BYTES, tp, np.ones(C))
        t = t + passes * net("all_gather", cp_bytes, tp, np.ones(C))
        tsp = c.exposed(t, c.fsdp_overlap * (fwd + bwd))
        comm += np.where(tp > 1, np.where(g.tsp, tsp, meg), 0.0)
        ring = c.exposed(net("all_gather", cp_bytes, cp, tp) * (passes + 1), c.cp_overlap * attn_time * passes / 2)
        uly = 2 * net("all_to_all", act_msg * 2 / tp, cp, tp) * passes
        comm += np.where((cp > 1) & (cp_bytes > 0), np.where(g.uly, uly, ring), 0.0)
        ep_stride = g.tp
        a2a = 2 * net("all_to_all", ep_bytes, ep, ep_stride) * passes
        comm += np.where((ep_bytes > 0) & (ep > 1), c.exposed(a2a, a2a * c.ep_overlap), 0.0)
        if rc == "full":
            rc_cols[rc] = (first_acts, fwd, acts, hw + fwd_flops, comm, grads_out)
        elif rc == "selective":
            rc_cols[rc] = (acts_sel, attn_fwd, z, hw, comm, grads_out - loss_acts)
        else:
            rc_cols[rc] = (acts, z, z, hw, comm, grads_out - loss_acts)
    # ---- per option: parameter groups by (sharding, offload, expert), as units.py forms them ---
    dp = _DataParallel(groups, net, g, dev, w, fwd, bwd, largest, tensors)
    cols = []
    for o in opts:
        a, rec, peak, hwf, comm, pend = rc_cols[o.recompute]
        st, dp_comm, step, opt_t, off_t, gath, grads, acc = dp.option(o)
        win = bwd + (fwd if o.sharding in ("zero1", "zero2") else 0.0)
        cols.append((fwd + bwd + rec + comm + dp_comm + acc, step, opt_t, off_t, st, a, gath, peak, hwf, win, grads, pend))
    arr = [np.stack([col[k] for col in cols], axis=1) for k in range(12)]
    return UnitArrays(time=arr[0], fwd=np.repeat(fwd[:, None], len(opts), 1),
                      bwd_weight=np.repeat(bwd_w[:, None], len(opts), 1), step_comm=arr[1],
                      window=arr[9], optim=arr[2], offload=arr[3], states=arr[4], grads=arr[10],
                      activations=arr[5], pending=arr[11], gathered=arr[6], remat=arr[7], hw_flops=arr[8], out_bytes=out_bytes)


class _DataParallel:
    """``units._data_parallel`` over configurations, per parameter group and per option."""

    def __init__(self, groups: dict[tuple[bool, bool], np.ndarray], net: _Net, g: _Cfg, dev: DeviceModel,
                 w: Workload, fwd: F, bwd: F, largest: dict[tuple[bool, bool], np.ndarray],
                 tensors: dict[tuple[bool, bool], tuple[Any, Any]]):
        self.groups, self.net, self.g, self.dev, self.w, self.fwd, self.bwd = groups, net, g, dev, w, fwd, bwd
        self.largest = largest  # the largest operator's local parameters, per group key
        self.tensors = tensors  # units.StateGroup's big and small, per group key
        self.n_mb = w.global_batch // (g.dpr * g.dps * g.b)
        self.held = (g.pp > 1) | (self.n_mb > 1)  # units.grads_held
        self.colls: dict[tuple, dict[str, Any]] = {}
        self.parts: dict[tuple, tuple[F, ...]] = {}

    def option(self, o: GridOption) -> tuple[F, ...]:
        by: dict[tuple[str, bool], list[tuple[bool, bool]]] = {}
        for key in sorted(self.groups):
            shard = "zero3" if (o.large and key[0]) else o.sharding
            by.setdefault((shard, key[1]), []).append(key)
        total = [np.zeros(len(self.fwd)) for _ in range(8)]
        for (shard, expert), keys in sorted(by.items()):
            part = self._part(tuple(keys), shard, o.offload, expert)
            for acc, val in zip(total, part, strict=True):
                acc += val
        return tuple(total)

    def _coll(self, keys: tuple, expert: bool) -> dict[str, Any]:
        if keys not in self.colls:
            g, net = self.g, self.net
            pb = state_bytes(self.w)[0]
            params_i = sum((self.groups[k] for k in keys), np.zeros(len(self.fwd), dtype=np.int64))
            d, stride = (g.dps * g.cp // g.ep, g.tp * g.ep) if expert else (g.dps * g.cp, g.tp)
            repl_n, repl_s = g.dpr, g.tp * g.cp * g.dps
            params = params_i.astype(float)
            full, grads = params * pb, params * GRAD_REDUCE_BYTES
            coalesce = self.dev.c.grad_coalesce_bytes
            extra = extra_all_reduces(sum(self.tensors[k][0] for k in keys), sum(self.tensors[k][1] for k in keys),
                                      coalesce)
            self.colls[keys] = {
                "params": params, "has": params_i > 0, "d": d, "full": full,
                "ag": net("all_gather", full, d, stride), "rs": net("reduce_scatter", grads, d, stride),
                "ar": net("all_reduce", grads, d, stride), "repl_n": repl_n,
                "repl_sharded": net("all_reduce", grads / d, repl_n, repl_s),
                "repl_full": net("all_reduce", grads, repl_n, repl_s)}
            if coalesce > 0:  # more collectives than one per unit
                self.colls[keys]["ar"] += extra * net.latency("all_reduce", d, stride)
                self.colls[keys]["repl_full"] += extra * net.latency("all_reduce", repl_n, repl_s)
        return self.colls[keys]

    def _part(self, keys: tuple, sharding: str, offload: str, expert: bool) -> tuple[F, ...]:
        ck = (keys, sharding, offload, expert)
        if ck in self.parts:
            return self.parts[ck]
        c, dev, fwd, bwd = self.dev.c, self.dev, self.fwd, self.bwd
        pb, gb, ob = state_bytes(self.w)
        grp = self._coll(keys, expert)
        params, d, full, has = grp["params"], grp["d"], grp["full"], grp["has"]
        z = np.zeros(len(fwd))
        on_host = offload in ("optimizer", "params")
        keep = sharding == "zero3_keep"
        sh = np.where(d > 1, {"replicate": 0, "zero1": 1, "zero2": 2}.get(sharding, 3), 0)
        p_div, g_div, o_div = (np.where(sh >= k, d, 1.0) for k in (3, 2, 1))
        sp_ = 0.0 if offload == "params" else params * pb / p_div
        local_opt = params / o_div
        if on_host:
            off_t = _each(dev.host_time, local_opt * (GRAD_REDUCE_BYTES + GATHER_BYTES)) * (1 - c.dp_overlap)
            opt_t = local_opt * 16 / 4e9
        else:
            off_t, opt_t = z, _each(lambda x: dev.memory_time(x, "optimizer"), local_opt * ADAM_BYTES_PER_PARAM)
        ag, rs = grp["ag"], grp["rs"]
        z3_comm = c.exposed(ag * (1 if keep else 2) + rs, c.fsdp_overlap * (fwd + bwd)) + fsdp_copies(
            dev, full, params * GRAD_REDUCE_BYTES, 1 if keep else 2)
        u_comm = np.select([sh == 3, sh == 2], [z3_comm, c.exposed(rs, c.fsdp_overlap * bwd)], 0.0)
        u_step = np.select([sh == 2, sh == 1, sh == 0], [ag, rs + ag, grp["ar"]], 0.0)
        repl = np.where(sh > 0, grp["repl_sharded"], grp["repl_full"])
        u_step = u_step + np.where(grp["repl_n"] > 1, repl, 0.0)
        u_gath = np.where(sh == 3, (0.0 if keep else 2 * full) + params * gb, 0.0)  # + the unsharded gradient
        big = np.max(np.stack([self.largest[k] for k in keys]), axis=0)
        u_gath = u_gath + np.where((sh <= 1) & self.held, gb * big, 0.0)  # accumulating: new beside held
        grads_on_gpu = np.where(on_host & (g_div > 1), 0.0, params * gb / g_div)  # sharded ones stream to host
        u_states = sp_ + grads_on_gpu + (0.0 if on_host else params * ob / o_div) + np.where(
            (sh == 3) & keep, full - params * pb / p_div, 0.0)
        acc = accumulate_time(dev, grads_on_gpu, self.n_mb)
        out = tuple(np.where(has, v, 0.0) for v in (u_states, u_comm, u_step, opt_t, off_t, u_gath, grads_on_gpu, acc))
        self.parts[ck] = out
        return out
