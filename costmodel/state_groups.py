"""Model states, ZeRO/FSDP collectives and the optimizer step of a unit's parameters, over
configurations.

A unit's parameters fall into groups that share one (sharding, offload) and one data-parallel
group (dense, or expert). Under ZeRO-3 a group is gathered in pieces: OSDP operator splitting
makes each slice of a split operator its own piece, the unsplit operators together one more; the
current and the prefetched piece are alive at once, and in backward a piece's unsharded gradient,
the input of its reduce-scatter, beside them. Sources: ZeRO (Rajbhandari et al., 2020) for the
state bytes and collectives per stage, OSDP (Jiang et al., 2023) for operator splitting,
FSDP2's copy-in/copy-out around its collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from costmodel.configs import AxisGroup, ConfigArrays
from costmodel.device import DeviceModel
from costmodel.gradients import (
    GATHER_BYTES,
    GRAD_REDUCE_BYTES,
    accumulate_time,
    extra_all_reduces,
    fsdp_copies,
    grad_tensors,
)
from profiler.graph import LayerNode
from profiler.profile_schema import ADAM_BYTES_PER_PARAM
from vocab.strategy import Workload

if TYPE_CHECKING:
    from costmodel.units import OpChoice

F = np.ndarray
#: bytes per parameter by precision: (compute copy, gradient, optimizer incl. fp32 master), with the
#: ZeRO paper's 16-bit gradients; :func:`state_bytes` applies the workload's gradient dtype
STATE_BYTES = {"bf16": (2, 2, 12), "fp8": (2, 2, 12), "mxfp8": (2, 2, 12), "fp32": (4, 4, 8)}
#: bytes of optimizer state a host-side Adam step streams per parameter: fp32 master, two moments,
#: gradient (priced at ``CostConstants.host_adam_bytes_per_s``)
HOST_ADAM_STATE_BYTES = 16
#: bytes of an fp32 master weight
MASTER_BYTES = 4
SHARDING_LEVEL = {"replicate": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3_keep": 3}
_FIELDS = ("state_params", "state_grads", "state_optim", "param_bytes", "grad_bytes", "optim_bytes", "comm_dp",
           "step_comm", "optim", "offload", "gathered", "accumulate", "host_bytes")


def state_bytes(w: Workload) -> tuple[int, int, int]:
    """(compute copy, gradient, optimizer) bytes per parameter of ``w``. The optimizer holds the fp32
    master (16-bit training) and two fp32 moments; under ``adam_states = bf16`` (Megatron's
    precision-aware optimizer) the moments are bf16 and the master is the 16-bit remainder beside the
    bf16 parameter (megatron-core 0.16.1 ``optimizer/distrib_optimizer.py:796-806``: ``int16`` with
    ``store_param_remainders``, ``optimizer_config.py:192``, its default)."""
    pb, gb, ob = STATE_BYTES[w.precision]
    if w.adam_states == "bf16":
        ob = (master_bytes(w) if w.precision != "fp32" else 0) + 2 * 2  # 16-bit training has a master
    return pb, 4 if w.grad_dtype == "fp32" else gb, ob


def master_bytes(w: Workload) -> int:
    """Bytes of the optimizer's master weight of a 16-bit run: fp32, or its 16-bit remainder under
    ``adam_states = bf16``."""
    return 2 if w.adam_states == "bf16" else MASTER_BYTES


def adam_step_bytes(w: Workload) -> int:
    """Bytes an Adam step moves per parameter (:data:`ADAM_BYTES_PER_PARAM`, fp32 master and moments
    read and written); under ``adam_states = bf16`` those six are 2 bytes, not 4, where they exist."""
    if w.adam_states != "bf16":
        return ADAM_BYTES_PER_PARAM
    return ADAM_BYTES_PER_PARAM - 2 * 2 * (2 if w.precision == "fp32" else 3)


def grads_held(pp: Any, n_mb: Any) -> Any:
    """Whether every gradient is live beside the activations in flight: with accumulation over
    micro-batches or a pipeline the first backward leaves them there while later forwards build
    activations; with one micro-batch and no pipeline backward frees activations as it makes
    gradients, so the two never add up. Scalars or arrays."""
    return (np.asarray(pp) > 1) | (np.asarray(n_mb) > 1)


@dataclass
class StateGroup:
    """Parameters of a unit that share one sharding, per configuration: how many, the pieces
    ZeRO-3 gathers, the largest operator, and the gradient tensors DDP reduces alone or bucketed."""

    params: F
    slice_max: F
    slices: F
    rest: F
    largest: F
    big: Any  # gradient tensors all-reduced alone (``grad_coalesce_bytes``)
    small: Any  # parameters of the others, which share flat buffers

    @property
    def pieces(self) -> F:
        return np.maximum(1, self.slices + (self.rest > 0))

    @property
    def biggest_piece(self) -> F:
        return np.maximum(self.slice_max, self.rest)


def _group(nodes: list[LayerNode], local: list[np.ndarray], splits: list[int], coalesce: float) -> StateGroup:
    z = np.zeros(len(local[0]))
    g = StateGroup(np.zeros(len(z), dtype=np.int64), z, z, z, np.zeros(len(z), dtype=np.int64), 0, 0.0)
    for n, loc, k in zip(nodes, local, splits, strict=True):
        big, small = grad_tensors(n, loc, coalesce, k)
        g.big, g.small = g.big + big, g.small + small
        g.params = g.params + loc
        g.largest = np.maximum(g.largest, -(-loc // max(k, 1)))
        if k > 1:
            g.slice_max = np.where(loc > 0, np.maximum(g.slice_max, loc / k), g.slice_max)
            g.slices = g.slices + np.where(loc > 0, k, 0)
            g.rest = g.rest + np.where(loc > 0, 0, loc)
        else:
            g.rest = g.rest + loc
    return g


def group_costs(nodes: list[LayerNode], local: list[np.ndarray], ops: Sequence[OpChoice], dev: DeviceModel,
                cfg: ConfigArrays, w: Workload, fwd: F, bwd: F, memo: dict | None = None) -> dict[str, F]:
    """Every parameter group of the unit under per-operator choices ``ops``, summed. ``memo``
    keeps the groups and their collectives between calls for the same unit and configurations
    (options that group the same operators share them)."""
    memo = {} if memo is None else memo
    members: dict[tuple[str, str, bool], list[int]] = {}
    for i, (n, op) in enumerate(zip(nodes, ops, strict=True)):
        members.setdefault((op.sharding, op.offload, n.kind == "experts"), []).append(i)
    z = np.zeros(cfg.size)
    total = {k: (np.zeros(cfg.size, dtype=np.int64) if k.endswith("_bytes") else z) for k in _FIELDS}
    for (sharding, offload, expert), idx in sorted(members.items()):
        gkey = (tuple(idx), tuple(ops[i].split for i in idx), expert)
        if gkey not in memo:
            memo[gkey] = _group([nodes[i] for i in idx], [local[i] for i in idx], [ops[i].split for i in idx],
                                dev.c.grad_coalesce_bytes)
        grp = cfg.expert_shard_group if expert else cfg.shard_group
        part = _data_parallel(memo[gkey], sharding, offload, grp, dev, cfg, w, fwd, bwd, _Memo(memo, gkey))
        for k, v in part.items():
            total[k] = total[k] + v
    return total


class _Memo:
    """A group's collectives, each computed once: ``memo(kind, nbytes_tag, compute)``."""

    def __init__(self, memo: dict, gkey: tuple):
        self.memo, self.gkey = memo, gkey

    def __call__(self, tag: str, compute: Any) -> Any:
        key = (self.gkey, tag)
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


@dataclass
class _Sharded:
    """A parameter group under one sharding over a data-parallel group of ``d`` ranks, per
    configuration: its ZeRO level (0 where there is nothing to shard over), what each state is
    divided by, whether the sharded parameter is the fp32 master (FSDP under ``zero3_master =
    parameter``) and the bytes per parameter of the compute copy, gradient and optimizer
    (``pbs``/``obs``: as sharded, the master moved from the optimizer to the parameter)."""

    params_i: F
    params: F
    d: Any
    level: F
    keep: bool
    p_div: F
    g_div: F
    o_div: F
    master: F
    pb: int
    gb: int
    pbs: F
    obs: F

    @classmethod
    def of(cls, sg: StateGroup, sharding: str, d: Any, w: Workload) -> _Sharded:
        pb, gb, ob = state_bytes(w)
        level = np.where(d > 1, SHARDING_LEVEL[sharding], 0)  # nothing to shard over: plain replicas
        p_div, g_div, o_div = (np.where(level >= k, d, 1.0) for k in (3, 2, 1))
        # FSDP's sharded parameter is the fp32 master (4 bytes, the optimizer keeps the moments): a
        # 16-bit copy exists only gathered; DeepSpeed shards a 16-bit copy beside the optimizer's master
        master = (level == 3) & (w.zero3_master == "parameter") & (w.precision != "fp32")
        pbs = np.where(master, MASTER_BYTES, pb).astype(np.int64)
        obs = np.where(master, ob - master_bytes(w), ob).astype(np.int64)
        return cls(sg.params, sg.params.astype(float), d, level, sharding == "zero3_keep", p_div, g_div, o_div,
                   master, pb, gb, pbs, obs)


def _data_parallel(sg: StateGroup, sharding: str, offload: str, grp: AxisGroup, dev: DeviceModel,
                   cfg: ConfigArrays, w: Workload, fwd: F, bwd: F, once: _Memo) -> dict[str, F]:
    """Model states, ZeRO/FSDP collectives and the optimizer step of one group of parameters."""
    g = _Sharded.of(sg, sharding, grp.size, w)
    out = _states(g, offload)
    n_mb = cfg.num_microbatches(w.global_batch)
    out["accumulate"] = accumulate_time(dev, out["state_grads"], n_mb)
    out.update(_host_step(g, offload, dev, w, n_mb))
    comm, step = _collectives(g, sg, grp, dev, cfg, fwd, bwd, once)
    out["comm_dp"] = comm
    piece = np.where(sg.pieces > 1, np.minimum(sg.biggest_piece, g.params), g.params)
    gathered = np.where(g.level == 3, g.gb * piece + (0.0 if g.keep else 2 * g.pb * piece), 0.0)
    if g.keep:  # stays gathered between forward and backward
        # the gathered 16-bit copy beside the shard: the shard is part of it, unless it is the fp32 master
        full = g.params * g.pb
        out["state_params"] = out["state_params"] + np.where(
            g.level == 3, full - np.where(g.master, 0.0, g.params * g.pb / g.p_div), 0.0)
    held = grads_held(cfg.pp, n_mb)
    gathered = gathered + np.where((g.level <= 1) & held, g.gb * sg.largest, 0.0)  # a new gradient beside the held
    out["step_comm"] = step
    out["gathered"] = gathered
    has = g.params_i > 0
    return {k: np.where(has, v, 0) if k.endswith("_bytes") else np.where(has, v, 0.0) for k, v in out.items()}


def _states(g: _Sharded, offload: str) -> dict[str, Any]:
    """The group's state bytes per rank (exact counts, and as priced: nothing on the device where
    it is offloaded)."""
    params_i, params = g.params_i, g.params
    on_host = offload in ("optimizer", "params")
    out: dict[str, Any] = {
        "param_bytes": params_i * g.pbs // g.p_div.astype(np.int64),
        "grad_bytes": params_i * g.gb // g.g_div.astype(np.int64),
        "optim_bytes": params_i * g.obs // g.o_div.astype(np.int64),
        "state_params": 0.0 * params if offload == "params" else params * g.pbs / g.p_div,
    }
    # ZeRO-Offload / FSDP2's CPU offload: reduced gradient shards stream to the host optimizer
    out["state_grads"] = np.where(on_host & (g.g_div > 1), 0.0, params * g.gb / g.g_div)
    out["state_optim"] = 0.0 * params if on_host else params * g.obs / g.o_div
    return out


def _host_step(g: _Sharded, offload: str, dev: DeviceModel, w: Workload, n_mb: F) -> dict[str, Any]:
    """The group's host memory, host transfers and optimizer step."""
    c, params, params_i = dev.c, g.params, g.params_i
    on_host = offload in ("optimizer", "params")
    local_opt = params / g.o_div
    # what stays in host memory: the host optimizer's fp32 master, moments and gradient, and under
    # parameter offload a 16-bit parameter shard beside it unless the shard is the master (FSDP2)
    host = params_i * HOST_ADAM_STATE_BYTES // g.o_div.astype(np.int64) if on_host else 0 * params_i
    if offload == "params" and w.precision != "fp32":
        host = host + np.where(g.master, 0, params_i * g.pbs // g.p_div.astype(np.int64))
    out: dict[str, Any] = {"host_bytes": host}
    if offload == "params":  # FSDP2's CPU offload: every gather copies the shard up, every backward sends its gradient down
        # the shard that moves is the one kept: FSDP's fp32 master under ``zero3_master = parameter``
        per_mb = params / g.p_div * g.pbs * (1 if g.keep else 2) + params / g.g_div * GRAD_REDUCE_BYTES
        out["offload"] = each_distinct(dev.host_time, per_mb) * n_mb * (1 - c.dp_overlap)
        out["optim"] = local_opt * HOST_ADAM_STATE_BYTES / c.host_adam_bytes_per_s
    elif on_host:  # ZeRO-Offload: Adam on the host; the accumulated gradients down, parameters up, once a step
        out["offload"] = each_distinct(dev.host_time, local_opt * (GRAD_REDUCE_BYTES + GATHER_BYTES)) * (1 - c.dp_overlap)
        out["optim"] = local_opt * HOST_ADAM_STATE_BYTES / c.host_adam_bytes_per_s
    else:
        out["offload"] = 0.0 * params
        out["optim"] = each_distinct(lambda x: dev.memory_time(x, "optimizer"), local_opt * adam_step_bytes(w))
    return out


def _collectives(g: _Sharded, sg: StateGroup, grp: AxisGroup, dev: DeviceModel, cfg: ConfigArrays, fwd: F, bwd: F,
                 once: _Memo) -> tuple[F, F]:
    """(seconds of the group's data-parallel collectives in each micro-batch, exposed; seconds of
    those once a step): ZeRO-3's gathers and reduce-scatters, ZeRO-1/2's, the replicas'
    all-reduce, and HSDP's all-reduce across replicas."""
    c, params, level = dev.c, g.params, g.level
    full, grads = params * g.pb, params * GRAD_REDUCE_BYTES  # gathered in the compute dtype, reduced in fp32
    k = sg.pieces
    z = 0.0 * params
    comm, step = z, z
    extra = extra_all_reduces(sg.big, sg.small, c.grad_coalesce_bytes)  # DDP's per-tensor collectives
    if (level == 3).any():  # ZeRO-3: gathered and reduce-scattered piece by piece, gathered once or twice
        gathers = 1 if g.keep else 2
        ag = once("ag pieces", lambda: k * dev.collective_time("all_gather", full / k, grp))
        rs = once("rs pieces", lambda: k * dev.collective_time("reduce_scatter", grads / k, grp))
        z3 = c.exposed(ag * gathers + rs, c.fsdp_overlap * (fwd + bwd)) + fsdp_copies(dev, full, grads, gathers)
        comm = np.where(level == 3, z3, comm)
    if ((level == 1) | (level == 2)).any():  # ZeRO-2: reduce-scatter per micro-batch; ZeRO-1: per step
        rs_whole = once("rs", lambda: dev.collective_time("reduce_scatter", grads, grp))
        ag_whole = once("ag", lambda: dev.collective_time("all_gather", full, grp))
        comm = np.where(level == 2, c.exposed(rs_whole, c.fsdp_overlap * bwd), comm)
        step = np.select([level == 2, level == 1], [ag_whole, rs_whole + ag_whole], step)
    if (level == 0).any():  # replicas: one all-reduce, and DDP's extra collectives
        ar = once("ar", lambda: dev.collective_time("all_reduce", grads, grp)
                  + extra * dev.collective_latency("all_reduce", grp))
        step = np.where(level == 0, ar, step)
    # HSDP: the (sharded) gradients all-reduced across replicas
    rep = cfg.replicate_group
    if (rep.size > 1).any():
        rep_t = np.where(level > 0, once("hsdp sharded", lambda: dev.collective_time("all_reduce", grads / g.d, rep)),
                         once("hsdp whole", lambda: dev.collective_time("all_reduce", grads, rep)
                              + extra * dev.collective_latency("all_reduce", rep)))
        step = step + np.where(rep.size > 1, rep_t, 0.0)
    return comm, step


def each_distinct(fn: Any, x: F) -> F:
    """``fn`` of every element, called once per distinct value."""
    uniq, inv = np.unique(x, return_inverse=True)
    return np.array([fn(float(v)) for v in uniq])[inv.reshape(-1)] if len(uniq) else np.zeros_like(x)
