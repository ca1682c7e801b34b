"""Cost of one unit (embedding, a block, the head) on one rank, for one micro-batch.

The one implementation of every per-unit formula, written over arrays: ``C`` configurations
(:class:`ConfigArrays`) times ``O`` options of the unit (:class:`UnitOption`: recomputation, and
per operator sharding, offload and OSDP split). Pricing one plan is this pricer on one
configuration and one option (``UnitCost.at``). Work that an option does not change is computed
once per distinct value of what it depends on: compute per split pattern, activations and
TP/CP/EP traffic per (recomputation, split pattern), data-parallel states and collectives per
(per-operator sharding and offload, split pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from costmodel.configs import AxisGroup, ConfigArrays
from costmodel.device import DeviceModel
from costmodel.experts import (
    dispatch_time,
    expert_tp_time,
    gathered_input_bytes,
    gathers_over_tp,
    load_imbalance,
    overlap_runs,
    router_divisor,
    routes_whole_input,
)
from costmodel.gradients import (
    GATHER_BYTES,
    GRAD_REDUCE_BYTES,
    sp_partial_grads,
)
from costmodel.node_costs import (
    GEMM_KINDS,
    TP_SPLIT_OUTPUTS,
    act_width,
    carries_weights,
    local_params,
    node_times,
    saved_widths,
    tp_divisor,
)
from costmodel.recompute import OP_POLICIES, Kept, selective
from costmodel.state_groups import each_distinct, group_costs, state_bytes
from profiler.graph import LayerNode
from vocab.strategy import LayerStrategy, Strategy, Workload

F = np.ndarray


@dataclass(frozen=True)
class OpChoice:
    """What an option gives one operator: its parameters' sharding and offload, and its OSDP split."""

    sharding: str = "replicate"
    offload: str = "none"
    split: int = 1


@dataclass(frozen=True)
class UnitOption:
    """One layer strategy of a unit: the unit's recomputation and sharding (the window its
    gradient sync may hide under) and every operator's :class:`OpChoice`, in node order."""

    recompute: str
    sharding: str
    ops: tuple[OpChoice, ...]

    @classmethod
    def uniform(cls, nodes: Sequence[LayerNode], sharding: str, recompute: str, offload: str,
                large: frozenset[str] = frozenset(), split: int = 1) -> UnitOption:
        """Every operator ``sharding``; those named in ``large`` ZeRO-3 (OSDP's per-operator
        sharding) split ``split`` ways."""
        big = OpChoice("zero3" if large else sharding, offload, split)
        plain = OpChoice(sharding, offload)
        return cls(recompute, sharding, tuple(big if n.name in large else plain for n in nodes))

    @classmethod
    def of_strategy(cls, name: str, nodes: Sequence[LayerNode], s: Strategy,
                    ls: LayerStrategy | None = None) -> UnitOption:
        """The unit's choices in ``s``: its entry, operator entries inside it; ``ls`` forces one
        strategy on every operator."""
        unit = ls or s.for_unit(name)
        per = [ls or s.for_op(name, n.name) for n in nodes]
        return cls(unit.recompute, unit.sharding, tuple(OpChoice(p.sharding, p.offload, p.split) for p in per))


#: what a unit costs per option (arrays of shape (C, O), or floats after :meth:`UnitCost.at`);
#: times in seconds per micro-batch unless said otherwise, sizes in bytes
PER_OPTION = {
    "fwd": "forward compute", "bwd": "backward compute",
    "recompute": "forward work done again in backward",
    "accumulate": "adding later micro-batches' gradients into the held ones",
    "bwd_weight": "the part of backward that computes weight gradients (zero bubble)",
    "comm_tp": "exposed TP/SP/TSP traffic", "comm_cp": "exposed CP traffic", "comm_ep": "exposed EP traffic",
    "comm_dp": "exposed ZeRO-2/3 collectives",
    "step_comm": "gradient sync, once per step, exposable", "window": "compute the gradient sync can hide under",
    "optim": "optimizer step, per step", "offload": "host transfers not hidden, per step",
    "state_params": "compute copy of the parameters held between steps", "state_grads": "gradients on the device",
    "state_optim": "optimizer state on the device",
    "param_bytes": "exact parameter bytes (what a running job holds)", "grad_bytes": "exact gradient bytes",
    "optim_bytes": "exact optimizer bytes", "host_bytes": "offloaded states and activations in host memory (exact bytes)",
    "activations": "saved for backward", "pending": "held while its weight gradients wait (zero bubble)",
    "gathered": "transient: gathered ZeRO-3 parameters and unsharded gradients while it runs",
    "remat": "transient: activations rematerialised in backward",
    "hw_flops": "hardware FLOPs, recomputation included",
    "time": "the critical path: compute, recomputation, accumulation and exposed communication",
    "states": "parameters, gradients and optimizer state held between steps",
}


class UnitCost:
    """One unit on one rank under C configurations and O options: every :data:`PER_OPTION`
    quantity as an array of shape (C, O), stacked from its per-option columns when first read;
    ``out_bytes`` (the activation sent to the next stage) and ``params`` (local parameters before
    data-parallel sharding) of shape (C,). :meth:`at` gives one configuration and option as floats."""

    def __init__(self, name: str, block: int | None, out_bytes: Any, params: Any,
                 columns: dict[str, list[F]] | None = None, values: dict[str, Any] | None = None,
                 has_attention: bool = False, has_experts: bool = False, rows: F | None = None):
        self.name, self.block = name, block
        self.out_bytes, self.params = out_bytes, params
        self.has_attention, self.has_experts = has_attention, has_experts
        self._columns = columns or {}
        self._rows = rows  # configuration i is row rows[i] of the columns
        self.__dict__.update(values or {})

    def __getattr__(self, attr: str) -> Any:
        columns = self.__dict__.get("_columns") or {}
        if attr not in columns:
            raise AttributeError(f"'UnitCost' has no '{attr}'")
        cols = columns[attr]  # O arrays of shape (C,)
        # (C, O) C-contiguous (rows are taken from it); one configuration: one cheap copy
        value = np.array(cols).T if len(cols[0]) == 1 else np.stack(cols, axis=1)
        if self.__dict__.get("_rows") is not None:
            value = value[self._rows]
        self.__dict__[attr] = value
        return value

    def reordered(self, rows: F) -> UnitCost:
        """The same costs with configuration ``i`` at row ``rows[i]`` of these (gathered when read)."""
        if self._rows is not None:
            rows = self._rows[rows]
        return UnitCost(self.name, self.block, np.asarray(self.out_bytes)[rows], np.asarray(self.params)[rows],
                        self._columns, has_attention=self.has_attention, has_experts=self.has_experts, rows=rows)

    def columns(self, attr: str) -> list[Any]:
        """The O per-option arrays (C,) of a :data:`PER_OPTION` quantity, as priced (an array shared
        by options is one object)."""
        columns = self.__dict__.get("_columns") or {}
        if attr in columns and self.__dict__.get("_rows") is None:
            return columns[attr]
        return list(np.asarray(getattr(self, attr)).T)

    @property
    def comm(self) -> dict[str, Any]:
        return {"tp": self.comm_tp, "cp": self.comm_cp, "ep": self.comm_ep, "dp": self.comm_dp}

    def at(self, i: int = 0, j: int = 0, name: str | None = None, block: int | None = None) -> UnitCost:
        """Configuration ``i`` under option ``j``, as floats (exact byte counts as integers)."""
        r = i if self._rows is None else int(self._rows[i])
        values = {f: (int if f.endswith("_bytes") else float)(self._columns[f][j][r]) for f in PER_OPTION}
        return UnitCost(self.name if name is None else name, self.block if name is None else block,
                        float(self.out_bytes[i]), int(self.params[i]), values=values,
                        has_attention=self.has_attention, has_experts=self.has_experts)


def price_unit(name: str, nodes: Sequence[LayerNode], dev: DeviceModel, cfg: ConfigArrays, w: Workload,
               options: Sequence[UnitOption]) -> UnitCost:
    """The unit ``nodes`` under every configuration of ``cfg`` and every option."""
    nodes = list(nodes)
    C = cfg.size
    tp, cp, b = cfg.tp, cfg.cp, cfg.micro_batch
    scale = b / cp
    z = np.zeros(C)
    tdiv = [router_divisor(n, tp_divisor(n, cfg), cfg.tsp, tp, w.moe_tp, cfg.ep) for n in nodes]
    adiv = [router_divisor(n, np.where(cfg.tsp | cfg.sequence_parallel | n.act_tp_sharded, tp, 1.0), cfg.tsp, tp,
                           w.moe_tp, cfg.ep) for n in nodes]
    local = [local_params(n, cfg) for n in nodes]
    aw = [act_width(n, w.precision) for n in nodes]
    sw = saved_widths(nodes, aw, w, dev, cfg)
    acts = [n.act_saved_bytes * scale / d * a for n, d, a in zip(nodes, adiv, sw, strict=True)]
    # the experts' routed inputs, kept whole for every copy a rank's experts run (TSP: its own tokens)
    expert_tp = np.where(cfg.tsp, 1.0, cfg.expert_tp)
    whole = routes_whole_input(cfg.sequence_parallel, expert_tp, w.moe_tp, cfg.ep)
    acts = [x + gathered_input_bytes(n, n.act_saved_bytes * scale * a, tp, expert_tp, whole)
            if n.kind == "experts" else x for n, x, a in zip(nodes, acts, sw, strict=True)]
    sel = [n.act_selective_bytes * scale / d * a for n, d, a in zip(nodes, adiv, aw, strict=True)]
    hw = sum(((n.fwd_flops + n.bwd_flops) * scale / d for n, d in zip(nodes, tdiv, strict=True)), z)
    params = sum(local, np.zeros(C, dtype=np.int64))
    ew = act_width(None, w.precision)
    out_bytes = nodes[-1].out_bytes * b / cp / np.where(cfg.sequence_parallel | cfg.tsp, tp, 1.0) * ew
    traffic = _Traffic(nodes, cfg, w, aw, ew)
    grads_out = sum((n.out_bytes * scale / np.where(cfg.tsp | cfg.sequence_parallel | (n.tp in TP_SPLIT_OUTPUTS),
                                                    tp, 1.0) * a
                     for n, a in zip(nodes, aw, strict=True) if carries_weights(n) and n.kind != "loss"), z)
    first_acts = acts[0] if nodes[0].kind == "norm" else z
    policy = selective(nodes, w.selective)
    saved = _Saved(nodes, policy, acts, sel, first_acts, grads_out, hw, tdiv, scale, ew)
    tsp_buffers = _tsp_buffers(cfg, w, local, traffic.kv_bytes) if cfg.tsp.any() else None

    compute: dict[tuple, tuple[F, ...]] = {}
    held: dict[str, dict[str, F]] = {}  # what a recomputation mode keeps, whatever the splits
    by_rc: dict[tuple, dict[str, F]] = {}
    by_dp: dict[tuple, dict[str, F]] = {}
    groups: dict[tuple, Any] = {}  # parameter groups and their collectives, shared across options
    cols: list[dict[str, F]] = []
    whole: dict[tuple, dict[str, F]] = {}  # every quantity, per distinct combination of the parts
    for o in options:
        splits = tuple(op.split for op in o.ops)
        if splits not in compute:
            compute[splits] = _compute(nodes, dev, cfg, w, tdiv, splits, [k.recompute for k in policy])
        fwd, bwd, bwd_w, attn_fwd, attn_time, sel_fwd = compute[splits]
        if o.recompute not in held:
            held[o.recompute] = _held(o.recompute, saved, cfg, traffic, w)
        rk = (o.recompute, splits)
        if rk not in by_rc:
            full, part = o.recompute == "full", o.recompute == "selective"
            by_rc[rk] = {
                **held[o.recompute],
                "recompute": fwd if full else (sel_fwd if part else z),
                **traffic.comm(dev, _passes(cfg, o.recompute, w.selective), params, fwd + bwd, attn_time, attn_fwd),
            }
        dk = (tuple((op.sharding, op.offload) for op in o.ops), splits)
        if dk not in by_dp:
            by_dp[dk] = group_costs(nodes, local, o.ops, dev, cfg, w, fwd, bwd, groups)
        on_host = any(op.offload == "activations" for op in o.ops)
        key = (rk, dk, o.sharding in ("zero1", "zero2"), on_host)
        if key not in whole:
            col = {"fwd": fwd, "bwd": bwd, "bwd_weight": bwd_w, **by_rc[rk], **by_dp[dk],
                   "window": bwd + (fwd if key[2] else 0.0)}
            col["time"] = (col["fwd"] + col["bwd"] + col["recompute"] + col["accumulate"] + col["comm_tp"]
                           + col["comm_cp"] + col["comm_ep"] + col["comm_dp"])
            col["states"] = col["state_params"] + col["state_grads"] + col["state_optim"]
            if tsp_buffers is not None:
                col["gathered"] = col["gathered"] + tsp_buffers
            if on_host:
                col = activations_on_host(col, dev, cfg, w)
            whole[key] = col
        cols.append(whole[key])
    columns = {k: [col[k] for col in cols] for k in PER_OPTION}
    return UnitCost(name, nodes[0].block, out_bytes, params, columns,
                    has_attention=any(n.kind == "attention" for n in nodes),
                    has_experts=any(n.kind == "experts" for n in nodes))


def _tsp_buffers(cfg: ConfigArrays, w: Workload, local: list[F], kv_bytes: F) -> F:
    """TSP's transients while the unit runs: the whole sequence's K/V of every KV head, and, at the
    peak in backward, the largest operator's weight shards in flight (the one computed with and
    sent on, the one arriving; with two ranks only the first) with two of its gradient accumulators
    (the one sent on, the one arriving; fp32) — what :mod:`runtime.tsp`'s rings hold."""
    pb, _, _ = state_bytes(w)
    shard = np.max(np.stack(local), axis=0)
    weights = np.where(cfg.tp > 2, 2.0, 1.0)
    return np.where(cfg.tsp & (cfg.tp > 1), kv_bytes + shard * (weights * pb + 2 * GRAD_REDUCE_BYTES), 0.0)


def _compute(nodes: list[LayerNode], dev: DeviceModel, cfg: ConfigArrays, w: Workload, tdiv: list[F],
             splits: tuple[int, ...], recomputed: list[float]) -> tuple[F, ...]:
    """(forward, backward, weight-gradient part of backward, attention forward, attention forward
    and backward, forward recomputed under selective recomputation: ``recomputed`` of each
    operator's) seconds of the unit with its operators split ``splits`` ways."""
    z = np.zeros(cfg.size)
    fwd, bwd, bwd_w, attn_fwd, attn_time, sel_fwd = z, z, z, z, z, z
    for n, td, k, r in zip(nodes, tdiv, splits, recomputed, strict=True):
        f, bw = node_times(n, dev, cfg, w, td, k)
        fwd, bwd, sel_fwd = fwd + f, bwd + bw, sel_fwd + r * f
        if n.kind in GEMM_KINDS:
            bwd_w = bwd_w + bw / 2
        if n.kind == "attention":
            attn_fwd, attn_time = attn_fwd + f, attn_time + f + bw
    return fwd, bwd, bwd_w, attn_fwd, attn_time, sel_fwd


@dataclass
class _Saved:
    """What a unit's operators save for backward and compute, per configuration, whatever it
    recomputes: the nodes with the selective policy's choice for each (``policy``), each operator's
    saved bytes (``acts``) and the part of them selective recomputation drops (``sel``), the unit's
    input when its first operator saves it (``first_acts``), the output gradients of its weight
    GEMMs (``grads_out``), its hardware FLOPs (``hw``), each operator's tensor-parallel divisor
    (``tdiv``), the micro-batch over ``cp`` (``scale``: each rank's share of the sequences) and bytes
    per activation element (``ew``)."""

    nodes: list[LayerNode]
    policy: list[Kept]
    acts: list[F]
    sel: list[F]
    first_acts: F
    grads_out: F
    hw: F
    tdiv: list[F]
    scale: F
    ew: float


def activations_on_host(col: dict[str, F], dev: DeviceModel, cfg: ConfigArrays, w: Workload) -> dict[str, F]:
    """A unit whose saved activations go to host memory (offload ``activations``: Transformer Engine's
    CPU offload, TE 2.9 ``pytorch/cpu_offload.py:303-560``, every tensor the layer saves marked for it):
    what it keeps is copied down on a side stream after its forward and freed, and copied up before its
    backward, so the device holds it only around the unit's own work (the ``remat`` transient, as a
    recomputed unit does) and the host holds one micro-batch's. Each copy hides under the unit's own
    forward (down) or backward (up) compute, the rest exposed, every micro-batch: Transformer Engine's
    window of later layers (``layer_window_map``) can hide more on a slow link, which is not counted."""
    kept = col["activations"]
    move = each_distinct(dev.host_time, kept)
    exposed = np.maximum(move - col["fwd"], 0.0) + np.maximum(move - col["bwd"], 0.0)
    return {**col, "activations": 0.0 * kept, "remat": np.maximum(col["remat"], kept),
            "host_bytes": col["host_bytes"] + np.ceil(kept).astype(np.int64),
            "offload": col["offload"] + exposed * cfg.num_microbatches(w.global_batch)}


def _held(recompute: str, u: _Saved, cfg: ConfigArrays, traffic: _Traffic, w: Workload) -> dict[str, F]:
    """What a unit keeps for backward under ``recompute`` (its activations, the transient its
    backward rematerialises, the output gradients a deferred weight pass holds) and its hardware
    FLOPs (``u.hw`` and the forward FLOPs it recomputes)."""
    z = np.zeros(cfg.size)
    nodes, acts = u.nodes, u.acts
    full, part = recompute == "full", recompute == "selective"
    frac = [1.0] * len(nodes) if full else [k.recompute for k in u.policy] if part else [0.0] * len(nodes)
    flops = u.hw + sum((n.fwd_flops * u.scale / d * f for n, d, f in zip(nodes, u.tdiv, frac, strict=True)), z)
    if full or (part and w.selective in OP_POLICIES):  # checkpointed: its input and what the policy keeps
        kept = u.first_acts if full else _kept_outputs(nodes, u.policy, cfg, traffic, w, u.scale, u.ew, u.first_acts)
        return {"activations": kept, "remat": sum(acts, z), "pending": u.grads_out, "hw_flops": flops}
    kept_acts = [a - s for a, s in zip(acts, u.sel, strict=True)] if part else acts
    loss_held = sum((k for n, k in zip(nodes, kept_acts, strict=True) if n.kind == "loss"), z)
    return {"activations": sum(kept_acts, z), "remat": z, "pending": u.grads_out - loss_held, "hw_flops": flops}


def _kept_outputs(nodes: list[LayerNode], policy: list[Kept], cfg: ConfigArrays, traffic: _Traffic, w: Workload,
                  scale: F, ew: float, first_acts: F) -> F:
    """Bytes a unit checkpointed under an op-level policy (:mod:`costmodel.recompute`) keeps: its
    input and the outputs the policy keeps, TP-split where the operator splits its output (a
    row-parallel GEMM's is a whole partial sum); under Megatron TP the collectives' outputs too that
    it keeps: the reduce-scatters' with sequence parallelism (``op`` and ``gemms``), the
    all-gathers' with it and the all-reduces' without it (``gemms``)."""
    tp = cfg.tp
    out = first_acts
    for n, k in zip(nodes, policy, strict=True):
        if k.out_bytes:
            split = n.tp in TP_SPLIT_OUTPUTS or n.kind == "experts"
            out = out + k.out_bytes * scale / np.where(cfg.tsp | split, tp, 1.0) * ew
    one = traffic.act_msg / 2  # one activation of the unit's hidden width
    megatron = (tp > 1) & ~cfg.tsp
    sp = np.where(cfg.sequence_parallel, one / tp, 0.0)
    if w.selective == "gemms":
        sp = sp + one
    return out + np.where(megatron, traffic.tp_msgs * sp, 0.0)


def tsp_weight_passes(recompute: str, policy: str) -> int:
    """Passes of a unit's weights round TSP's rings per micro-batch, as :mod:`runtime.tsp` runs them:
    forward and backward, and forward again inside backward under full recomputation and under a
    selective policy that recomputes more than the attention core (the rings sit in every weighted
    operator: saved GEMM outputs do not spare the norms' and tables' shards)."""
    return 3 if recompute == "full" or (recompute == "selective" and policy != "attention") else 2


def _passes(cfg: ConfigArrays, recompute: str, policy: str) -> dict[str, Any]:
    """Forward and backward passes of a unit's TP, CP and EP communication (forward again under full
    recomputation): the ``op`` policy re-runs its sequence-parallel all-gathers (its all-reduces
    without sequence parallelism), and a policy that recomputes attention re-runs the context-parallel
    exchange inside it; TSP's weight rings as :func:`tsp_weight_passes` says."""
    full, part = recompute == "full", recompute == "selective"
    tp: Any = 3 if full else 2
    if part and policy == "op":
        tp = 2 + np.where(cfg.sequence_parallel, 0.5, 1.0)
    cp = 3 if full or (part and policy != "op") else 2
    return {"tp": tp, "cp": cp, "ep": 3 if full else 2, "full": full, "tsp": tsp_weight_passes(recompute, policy)}


class _Traffic:
    """Tensor-, context- and expert-parallel traffic of a unit: its message sizes, and the exposed
    seconds per micro-batch for a number of passes (forward and backward; forward again under full
    recomputation)."""

    def __init__(self, nodes: list[LayerNode], cfg: ConfigArrays, w: Workload, aw: list[float], ew: float):
        self.cfg, self.w = cfg, w
        tp, cp, b = cfg.tp, cfg.cp, cfg.micro_batch
        z = np.zeros(cfg.size)
        self.ep_bytes, self.kv_bytes = z, z
        self.moe_in_bytes = 0.0  # the MoE layers' inputs (16-bit) of a micro-batch's tokens on a cp rank
        self.routing = (1, 1, 0, 0)  # experts, top-k, expert groups, groups chosen
        self.tp_msgs = self.sp_grads = self.sp_params = 0
        for n, a in zip(nodes, aw, strict=True):
            if n.kind == "attention":
                kv = n.dims.get("kv_heads", 1) * n.dims.get("head_dim", 1)
                # K and V of the whole sequence (2 bytes a value, ``a`` times that in fp32): every
                # KV head under TSP (each rank attends all heads of its tokens), the rank's heads else
                self.kv_bytes = self.kv_bytes + 2 * 2 * b * n.dims.get("seq", w.seq_len) * kv * a
            if n.kind == "experts":  # what each rank dispatches: all the tokens, or its sequence share
                whole = routes_whole_input(cfg.sequence_parallel, cfg.expert_tp, w.moe_tp, cfg.ep)
                tok = b * w.seq_len / cp / np.where(whole, 1.0, tp)
                self.ep_bytes = self.ep_bytes + 2 * tok * n.dims.get("top_k", 1) * n.dims.get("in", 0)
                self.moe_in_bytes = self.moe_in_bytes + 2 * b * w.seq_len / cp * n.dims.get("in", 0)
                self.routing = (int(n.dims.get("experts", 1)), int(n.dims.get("top_k", 1)),
                                int(n.dims.get("groups", 0)), int(n.dims.get("group_top_k", 0)))
            if n.tp == "row" or (n.tp == "vocab" and n.kind in ("embedding", "linear")):
                self.tp_msgs += 1
            k, p = sp_partial_grads(n)
            self.sp_grads, self.sp_params = self.sp_grads + k, self.sp_params + p
        self.act_msg = 2.0 * b * w.seq_len / cp * _hidden(nodes) * ew
        self.cp_bytes = self.kv_bytes / tp  # what a context-parallel ring gathers: the tp rank's heads

    def ring(self, dev: DeviceModel, passes: int, attn_fwd: F, attn_bwd: F) -> F:
        """Exposed seconds of ring attention over ``cp`` ranks for a micro-batch, forward ``passes - 1``
        times and backward once. Each pass runs ``cp`` steps, one block of the sequence's K/V each;
        every step after the first adds an attention launch and merges its partial output into the
        running one (the fp32 output read twice and written once).

        * ``alltoall`` (point to point: Megatron's p2p, torchtitan's alltoall): before each of the
          ``cp - 1`` later steps the next block arrives from the ring's neighbour while the current
          step's attention runs (``cp_overlap`` of it); the step waits on the slowest link of the
          ring (the scale-out network once the ring leaves a scale-up domain). Backward passes the
          K/V block and its dK/dV on, twice the bytes, under the step's backward attention.
        * ``allgather``: the whole K/V is all-gathered while the rank attends its own block, then the
          other blocks run back to back; backward gathers again and reduce-scatters dK/dV after.
        """
        cfg, c = self.cfg, dev.c
        cp, grp = cfg.cp, cfg.cp_group
        steps = np.maximum(cp - 1, 0)
        step_f, step_b = attn_fwd / cp * c.cp_overlap, attn_bwd / cp * c.cp_overlap
        out = self.act_msg / cfg.tp  # this rank's attention output (its queries, its heads)
        merge_bytes = np.broadcast_to(3 * 2.0 * out, cp.shape)  # fp32: twice the 16-bit output
        merge = each_distinct(dev.memory_time, merge_bytes) + c.gemm_overhead_s
        block = self.cp_bytes / cp
        p2p_f = steps * c.exposed(dev.collective_time("send_recv", block, grp), step_f)
        p2p_b = steps * c.exposed(dev.collective_time("send_recv", 2 * block, grp), step_b)
        gather = dev.collective_time("all_gather", self.cp_bytes, grp)
        ag_f = c.exposed(gather, step_f)
        ag_b = c.exposed(gather, step_b) + dev.collective_time("reduce_scatter", self.cp_bytes, grp)
        fwd = np.where(cfg.alltoall, p2p_f, ag_f) + steps * merge
        bwd = np.where(cfg.alltoall, p2p_b, ag_b) + steps * c.gemm_overhead_s
        return (passes - 1) * fwd + bwd

    def tsp_volumes(self, params: F) -> tuple[F, F, F]:
        """TSP, per micro-batch, the bytes of: a pass's all-gather of the unit's weights (every rank's
        shard of ``params``, in the dtype the runtime computes and sends them: fp32 under fp32, else
        bf16), the reduce-scatter of their gradients (fp32, once) and a pass's all-gather of the
        whole sequence's K/V."""
        sent = params * self.cfg.tp
        return (4 if self.w.precision == "fp32" else GATHER_BYTES) * sent, GRAD_REDUCE_BYTES * sent, self.kv_bytes

    def comm(self, dev: DeviceModel, passes: dict[str, Any], params: F, compute: F, attn_time: F, attn_fwd: F
             ) -> dict[str, F]:
        """Exposed TP, CP and EP seconds of a micro-batch over the ``passes`` of each
        (:func:`_passes`)."""
        cfg, c = self.cfg, dev.c
        tp, cp, ep = cfg.tp, cfg.cp, cfg.ep
        tpg = cfg.tp_group
        # Megatron TP: an all-reduce of the activation per row-parallel (and vocabulary) op and pass;
        # under SP an all-gather and a reduce-scatter (one more wait), and the partial gradients of
        # the weights that stay whole
        z = np.zeros(cfg.size)
        comm_tp = comm_cp = comm_ep = z
        megatron, tsp = (tp > 1) & ~cfg.tsp, (tp > 1) & cfg.tsp
        if megatron.any():
            meg = self.tp_msgs * passes["tp"] * dev.collective_time("all_reduce", self.act_msg, tpg)
            if (megatron & cfg.sequence_parallel).any():
                sp = self.tp_msgs * passes["tp"] * dev.collective_wait("reduce_scatter", tpg)
                if self.sp_grads:
                    sp = sp + self.sp_grads * dev.collective_time(
                        "all_reduce", self.sp_params / self.sp_grads * GRAD_REDUCE_BYTES, tpg)
                meg = meg + np.where(cfg.sequence_parallel, sp, 0.0)
            comm_tp = np.where(megatron, c.exposed(meg, meg * c.tp_overlap), comm_tp)
        if tsp.any():  # TSP: weight shards streamed around the tp ring, K/V gathered for attention
            wbytes, gbytes, kv = self.tsp_volumes(params)
            t = passes["tsp"] * dev.collective_time("all_gather", wbytes, tpg)
            t = t + dev.collective_time("reduce_scatter", gbytes, tpg)
            t = t + passes["tp"] * dev.collective_time("all_gather", kv, tpg)
            comm_tp = np.where(tsp, c.exposed(t, c.fsdp_overlap * compute), comm_tp)
        # CP: ring step by step (:meth:`ring`); Ulysses — all-to-all of q, k, v and of the output,
        # forward and backward
        context = (cp > 1) & (self.cp_bytes > 0)
        if (context & ~cfg.ulysses).any():
            comm_cp = np.where(context & ~cfg.ulysses, self.ring(dev, passes["cp"], attn_fwd, attn_time - attn_fwd), comm_cp)
        if (context & cfg.ulysses).any():
            uly = 2 * dev.collective_time("all_to_all", self.act_msg * 2 / tp, cfg.cp_group) * passes["cp"]
            comm_cp = np.where(context & cfg.ulysses, uly, comm_cp)
        experts = (self.ep_bytes > 0) & (ep > 1)
        if experts.any():  # EP: dispatch and combine, per pass; hidden under the paired micro-batch's compute
            load = load_imbalance(dev, ep, self.w.moe_capacity_factor)
            one = dispatch_time(dev, self.ep_bytes * load, cfg.ep_group, self.routing, self.w.moe_dispatch == "dedup")
            a2a = 2 * one * passes["ep"]
            paired = (self.w.moe_overlap == "1f1b") & overlap_runs(cfg.pp, cfg.vpp, passes["full"])
            comm_ep = np.where(experts, c.exposed(a2a, np.where(paired, compute, a2a * c.ep_overlap)), comm_ep)
        return {"comm_tp": comm_tp, "comm_cp": comm_cp, "comm_ep": comm_ep + self.expert_tp_comm(dev, passes)}

    def expert_tp_comm(self, dev: DeviceModel, passes: dict[str, Any]) -> F:
        """Seconds of a micro-batch's MoE collectives over tensor-parallel ranks under sequence
        parallelism (``Workload.moe_tp``): ``dispatcher``, each rank's routed copies all-gathered over
        the expert-TP ranks after the dispatch and reduce-scattered back
        (:func:`costmodel.experts.expert_tp_time`); ``gathered``, the layer's input tokens all-gathered
        over tp before routing and its output reduce-scattered (torchtitan's
        ``PrepareModuleInputOutput``); ``gathered_without_ep``, so where ep = 1, nothing where ep > 1
        (:func:`costmodel.experts.gathers_over_tp`)."""
        cfg, z = self.cfg, np.zeros(self.cfg.size)
        sp = (self.ep_bytes > 0) & cfg.sequence_parallel & ~cfg.tsp
        gathers = gathers_over_tp(self.w.moe_tp, cfg.ep)
        out = z
        if (sp & gathers & (cfg.tp > 1)).any():
            t = dev.collective_time("all_gather", self.moe_in_bytes, cfg.tp_group)
            t = t + dev.collective_time("reduce_scatter", self.moe_in_bytes, cfg.tp_group)
            out = np.where(sp & gathers & (cfg.tp > 1), passes["ep"] * t, out)
        if self.w.moe_tp != "dispatcher" or not (sp & (cfg.expert_tp > 1)).any():
            return out  # torchtitan's layer: no expert-TP collective beside its gather
        received = self.ep_bytes * load_imbalance(dev, cfg.ep, self.w.moe_capacity_factor)
        return np.where(sp & (cfg.expert_tp > 1), passes["ep"] * expert_tp_time(dev, received, cfg.expert_tp_group), out)


def tsp_volumes(nodes: Sequence[LayerNode], cfg: ConfigArrays, w: Workload) -> tuple[F, F, F]:
    """:meth:`_Traffic.tsp_volumes` of a unit's ``nodes``: what its TSP rings move per micro-batch."""
    nodes = list(nodes)
    traffic = _Traffic(nodes, cfg, w, [act_width(n, w.precision) for n in nodes], act_width(None, w.precision))
    return traffic.tsp_volumes(sum((local_params(n, cfg) for n in nodes), np.zeros(cfg.size, dtype=np.int64)))


def _hidden(nodes: list[LayerNode]) -> int:
    for n in nodes:
        if "hidden" in n.dims:
            return int(n.dims["hidden"])
        if "in" in n.dims:
            return int(n.dims["in"])
    return 0


def unit_cost(name: str, nodes: Sequence[LayerNode], dev: DeviceModel, s: Strategy, w: Workload,
              ls: LayerStrategy | None = None) -> UnitCost:
    """The unit under its entries in ``s`` (or ``ls`` on every operator), as floats."""
    cfg = ConfigArrays.of_strategy(s)
    return price_unit(name, nodes, dev, cfg, w, [UnitOption.of_strategy(name, nodes, s, ls)]).at(0, 0)


__all__ = ["AxisGroup", "OpChoice", "UnitCost", "UnitOption", "activations_on_host", "price_unit", "unit_cost"]
