"""Cost of one unit (embedding, a block, the head) on one rank, for one micro-batch.

Everything the pipeline and the memory model need is summed per unit here, so that identical
blocks are priced once and solvers can combine unit costs without re-walking the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.device import AxisGroup, DeviceModel
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
from profiler.graph import LayerNode
from profiler.profile_schema import ADAM_BYTES_PER_PARAM
from vocab.strategy import LayerStrategy, Strategy, Workload

GEMM_KINDS = ("linear", "router", "experts")
TP_SPLIT_ROLES = ("column", "row", "heads", "vocab")
TP_SPLIT_OUTPUTS = ("column", "heads", "vocab")  # roles whose output Megatron TP alone splits

# Bytes per parameter by precision: (compute copy, gradient, optimizer incl. fp32 master), with the
# ZeRO paper's 16-bit gradients; ``state_bytes`` applies the workload's gradient dtype.
STATE_BYTES = {"bf16": (2, 2, 12), "fp8": (2, 2, 12), "fp32": (4, 4, 8)}


def grads_held(pp: int, n_mb: int) -> bool:
    """Whether every gradient is live beside the activations in flight: with accumulation over
    micro-batches or a pipeline the first backward leaves them there while later forwards build
    activations; with one micro-batch and no pipeline backward frees activations as it makes
    gradients, so the two never add up."""
    return pp > 1 or n_mb > 1


def state_bytes(w: Workload) -> tuple[int, int, int]:
    """(compute copy, gradient, optimizer) bytes per parameter of ``w``."""
    pb, gb, ob = STATE_BYTES[w.precision]
    return pb, 4 if w.grad_dtype == "fp32" else gb, ob


#: the profile's bandwidth case each bandwidth-bound node kind is priced by (else ``elementwise``)
MEMORY_OPS = {"norm": "norm", "embedding": "embedding", "loss": "cross_entropy", "activation": "activation",
              "dropout": "dropout"}


def act_width(n: LayerNode | None, precision: str) -> float:
    """The graph counts activations as 2-byte (bf16) tensors: fp32 training doubles them, except the
    loss (its softmax is fp32 already) and dropout masks (one byte either way)."""
    if precision != "fp32" or (n is not None and n.kind in ("loss", "dropout")):
        return 1.0
    return 2.0


def traffic_width(n: LayerNode, precision: str) -> float:
    """Bytes moved by a bandwidth-bound op scale like its activations; the loss is fp32 already."""
    return act_width(n if n.kind == "loss" else None, precision)


@dataclass
class Groups:
    """The communication groups of a mesh (sizes and strides in global rank order)."""

    tp: AxisGroup
    cp: AxisGroup
    shard: AxisGroup  # dp_shard x cp: the group ZeRO/FSDP shards dense states over
    expert_shard: AxisGroup  # shard / ep: the group expert states are sharded over
    ep: AxisGroup
    replicate: AxisGroup  # dp_replicate
    dp_all: AxisGroup  # dp_shard x cp x dp_replicate: the whole data-parallel group
    pp: AxisGroup


def mesh_groups(dev: DeviceModel, strategy: Strategy) -> Groups:
    """The groups of :meth:`Strategy.group_sizes` with their strides on ``dev``'s cluster."""
    size = strategy.group_sizes()
    g = dev.axis_groups(strategy.mesh.axes())
    stride = g["cp"].stride  # the shard groups start at the cp axis
    return Groups(
        tp=g["tp"], cp=g["cp"], shard=AxisGroup(size["shard"], stride),
        expert_shard=AxisGroup(size["expert_shard"], stride * size["ep"]),
        ep=AxisGroup(size["ep"], stride), replicate=g["dp_replicate"],
        dp_all=AxisGroup(size["dp_all"], stride), pp=g["pp"],
    )


@dataclass
class UnitCost:
    """One unit on one rank, per micro-batch unless said otherwise.

    Times in seconds, sizes in bytes. ``*_comm`` are exposed (not hidden) communication.
    """

    name: str
    block: int | None
    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0
    bwd_weight: float = 0.0  # part of ``bwd`` that computes weight gradients (zero-bubble)
    comm: dict[str, float] = field(default_factory=dict)  # exposed per micro-batch, by axis
    step_comm: dict[str, float] = field(default_factory=dict)  # exposable once per step, by axis
    step_comm_window: float = 0.0  # backward time the per-step gradient sync can hide under
    params: int = 0  # local parameters on this rank before data-parallel sharding
    state_params: float = 0.0  # bytes: compute copy of parameters held between steps
    state_grads: float = 0.0
    state_optim: float = 0.0
    param_bytes: int = 0  # exact state bytes, for comparison with a running job
    grad_bytes: int = 0
    optim_bytes: int = 0
    activations: float = 0.0  # saved for backward, per micro-batch
    pending: float = 0.0  # added while its weight gradients wait (zero bubble), per micro-batch
    gathered: float = 0.0  # transient: gathered parameters (ZeRO-3) live while it runs
    recompute_peak: float = 0.0  # transient: activations rematerialised in backward
    optim_time: float = 0.0  # optimizer step (per step)
    accumulate: float = 0.0  # adding later micro-batches' gradients into the held ones, per micro-batch
    offload_time: float = 0.0  # host transfers not hidden (per step)
    hw_flops: float = 0.0  # hardware FLOPs per micro-batch incl. recomputation
    out_bytes: float = 0.0  # activation sent to the next stage, per micro-batch

    @property
    def time(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.accumulate + sum(self.comm.values())


def _tp_div(n: LayerNode, s: Strategy) -> int:
    """How many ways TP (and SP / TSP) splits this node's work and activations."""
    tp = s.mesh.tp
    if tp == 1:
        return 1
    if s.tp_mode == "tsp" or n.tp in TP_SPLIT_ROLES or n.kind in ("activation", "experts", "loss"):
        return tp
    return tp if s.sequence_parallel else 1


def carries_weights(n: LayerNode) -> bool:
    """Whether ``n`` has weights of its own on a rank (a tied head's copy on the last pipeline stage
    too): the ops whose output gradients a deferred weight pass keeps (:func:`pending_bytes`)."""
    return bool(n.params) or (n.kind == "linear" and n.tp == "vocab")


def pending_bytes(n: LayerNode, s: Strategy, scale: float, aw: float, acts: float, held: bool = True) -> float:
    """What a micro-batch whose weight gradients are deferred holds of ``n`` beyond its saved
    activations ``acts``: the gradient at the op's output if the op has weights (torch keeps it for
    the weight pass; a column-parallel or vocabulary-parallel output is split by TP, a row-parallel
    or norm output only by sequence parallelism), less the loss's own saved activations, which go
    with the detached loss once the input gradients are made (``held``: whether they were saved,
    not recomputed). Measured per pending micro-batch of a GPT block and of the last stage, with and
    without recomputation (``tests/test_runtime_memory_model.py``)."""
    if n.kind == "loss":
        return -acts if held else 0.0
    if not carries_weights(n):
        return 0.0
    split = s.mesh.tp if (s.tp_mode == "tsp" or s.sequence_parallel or n.tp in TP_SPLIT_OUTPUTS) else 1
    return n.out_bytes * scale / split * aw


def _local_params(n: LayerNode, s: Strategy) -> int:
    """Parameters of this node on one rank after TP and EP (before data-parallel sharding).

    As Megatron and DTensor TP do: row-parallel biases and position tables stay whole on every
    TP rank; a tied LM head has its own copy of the embedding on the last pipeline stage.
    """
    tp, params = s.mesh.tp, n.params
    if n.kind == "linear" and n.tp == "vocab" and params == 0 and s.mesh.pp > 1:
        params = int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
    if n.kind == "experts":
        return params // (tp * s.mesh.ep)
    if tp == 1:
        return params
    if s.tp_mode == "tsp" or n.tp in ("column", "heads") or (n.tp == "vocab" and n.kind != "embedding"):
        return params // tp
    if n.tp == "row":
        weight = int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
        return weight // tp + (params - weight)
    if n.tp == "vocab":  # token table split by vocabulary; position and type tables whole
        table = int(n.dims.get("vocab", 0)) * int(n.dims.get("hidden", 0))
        return table // tp + (params - table)
    return params


def _act_div(n: LayerNode, s: Strategy) -> int:
    tp = s.mesh.tp
    if tp == 1:
        return 1
    return tp if (s.tp_mode == "tsp" or s.sequence_parallel or n.act_tp_sharded) else 1


def attention_times(n: LayerNode, dev: DeviceModel, flops: float, nbytes: float, prec: str, kernel: str
                    ) -> tuple[float, float]:
    """Flash attention at the kernel's rate; eager attention as two batched GEMMs over the whole
    score matrix (nothing skipped when causal) plus the bandwidth-bound passes over the scores."""
    if n.dims.get("eager"):
        return (dev.gemm_time(flops, prec) + dev.memory_time(nbytes, "softmax"),
                dev.gemm_time(flops, prec, backward=True) + dev.memory_time(nbytes, "softmax", backward=True))
    return dev.attention_time(flops, n.causal, kernel=kernel), dev.attention_time(flops, n.causal, True, kernel)


def gemm_shape(n: LayerNode, per_sample: float, tdiv: float, calls: float) -> tuple[float, float, float] | None:
    """(m, n, k) of one call of a linear node priced at ``per_sample`` samples per rank (micro-batch
    over cp) with TP dividing it ``tdiv`` ways: column-parallel GEMMs lose n, row-parallel ones k,
    sequence-split ones m; OSDP's ``calls`` slices split n."""
    if n.kind != "linear" or not n.dims.get("in") or not n.dims.get("out"):
        return None
    d_in, d_out = float(n.dims["in"]), float(n.dims["out"])
    m, nn, k = n.fwd_flops / (2 * d_in * d_out) * per_sample, d_out, d_in
    if tdiv > 1:
        if n.tp in ("column", "heads", "vocab"):
            nn /= tdiv
        elif n.tp == "row":
            k /= tdiv
        else:
            m /= tdiv
    return m, nn / calls, k


def embedding_table_bytes(n: LayerNode, tdiv: float, precision: str) -> float:
    """Bytes of the dense gradient an embedding's backward zeroes on one rank: its tables (token,
    and position where learned) in the parameter dtype, the token table split ``tdiv`` ways by
    vocabulary-parallel TP."""
    table = float(n.dims.get("vocab", 0)) * float(n.dims.get("hidden", 0))
    table = min(table, n.params) or n.params
    return (table / tdiv + (n.params - table)) * 2 * act_width(None, precision)


def node_times(n: LayerNode, dev: DeviceModel, s: Strategy, w: Workload, split: int = 1) -> tuple[float, float]:
    """Forward and backward seconds of one node for one micro-batch on one rank."""
    tdiv = _tp_div(n, s)
    scale = s.micro_batch / s.mesh.cp / tdiv
    flops = n.fwd_flops * scale
    prec = w.precision
    if n.kind in GEMM_KINDS:
        calls = float(split)
        if n.kind == "experts":
            flops *= dev.c.moe_imbalance
            calls = max(1.0, n.dims.get("experts", 1) / s.mesh.ep) * split
        shape = gemm_shape(n, s.micro_batch / s.mesh.cp, tdiv, calls)
        f = dev.gemm_time(flops / calls, prec, calls, shape=shape)
        b = dev.gemm_time(flops / calls, prec, calls, backward=True, shape=shape)
    elif n.kind == "attention":
        f, b = attention_times(n, dev, flops, n.mem_bytes * scale * act_width(n, prec), prec, w.attention_kernel)
    else:
        op = MEMORY_OPS.get(n.kind, "elementwise")
        nbytes = n.mem_bytes * scale * traffic_width(n, prec)
        f, b = dev.memory_time(nbytes, op), dev.memory_time(nbytes, op, backward=True)
        if n.kind == "embedding":
            b = dev.embedding_backward_time(nbytes, embedding_table_bytes(n, tdiv, prec))
    f, b = with_dtensor(n, dev, f, b, s.mesh.tp > 1 and s.tp_mode == "megatron", s.sequence_parallel, split)
    return float(f), float(b)


def unit_cost(
    name: str, nodes: list[LayerNode], dev: DeviceModel, s: Strategy, w: Workload, groups: Groups,
    ls: LayerStrategy | None = None,
) -> UnitCost:
    """Price a unit under its layer strategy.

    ``ls`` forces one strategy on every operator of the unit (solvers use this); by default the
    unit's entry in ``s`` applies, and operator entries may set their own ``split``.
    """
    forced = ls is not None
    ls = ls or s.for_unit(name)
    c = dev.c
    tp, cp, b = s.mesh.tp, s.mesh.cp, s.micro_batch
    scale = b / cp
    u = UnitCost(name=name, block=nodes[0].block)
    attn_fwd = attn_time = full_acts = fwd_flops = 0.0
    ep_bytes = cp_bytes = 0.0
    states: dict[tuple[str, str, bool], StateGroup] = {}  # by (sharding, offload, expert)
    tp_msgs = 0  # activation-sized TP all-reduces per pass (forward or backward)
    sp_grads, sp_params = 0, 0  # sequence parallel: gradients all-reduced over TP per micro-batch
    for n in nodes:
        nls = ls if forced else s.for_op(name, n.name)
        split = nls.split
        f, bw = node_times(n, dev, s, w, split=split)
        u.fwd += f
        u.bwd += bw
        if n.kind in GEMM_KINDS:
            u.bwd_weight += bw / 2
        fwd_flops += n.fwd_flops * scale / _tp_div(n, s)
        u.hw_flops += (n.fwd_flops + n.bwd_flops) * scale / _tp_div(n, s)
        aw = act_width(n, w.precision)
        acts = n.act_saved_bytes * scale / _act_div(n, s) * aw
        full_acts += acts
        if ls.recompute == "selective":
            acts -= n.act_selective_bytes * scale / _act_div(n, s) * aw
        u.activations += acts
        u.pending += pending_bytes(n, s, scale, aw, acts, held=ls.recompute != "full")
        if n.kind == "attention":
            attn_fwd += f
            attn_time += f + bw
            kv = n.dims.get("kv_heads", 1) * n.dims.get("head_dim", 1)
            cp_bytes += 2 * 2 * b * n.dims.get("seq", w.seq_len) * kv / tp * aw  # K and V, all of the sequence
        local = _local_params(n, s)
        grp = states.setdefault((nls.sharding, nls.offload, n.kind == "experts"), StateGroup())
        big, small = grad_tensors(n, local, c.grad_coalesce_bytes, split)
        grp.add(local, split, (int(big), float(small)))
        if n.kind == "experts":
            tok = b * w.seq_len / cp / (tp if s.sequence_parallel else 1)
            ep_bytes += 2 * tok * n.dims.get("top_k", 1) * n.dims.get("in", 0)
        if n.tp == "row" or (n.tp == "vocab" and n.kind in ("embedding", "linear")):
            tp_msgs += 1
        k, p = sp_partial_grads(n)
        sp_grads, sp_params = sp_grads + k, sp_params + p
    u.params = sum(g.params for g in states.values())
    ew = act_width(None, w.precision)
    u.out_bytes = nodes[-1].out_bytes * b / cp / (tp if (s.sequence_parallel or s.tp_mode == "tsp") else 1) * ew
    # ---- recomputation -----------------------------------------------------------------
    if ls.recompute == "full":
        first = nodes[0]
        u.activations = first.act_saved_bytes * scale / _act_div(first, s) * ew if first.kind == "norm" else 0.0
        u.recompute = u.fwd
        u.recompute_peak = full_acts
        u.hw_flops += fwd_flops
    elif ls.recompute == "selective":
        u.recompute = attn_fwd
    # ---- tensor / sequence / context / expert parallel communication ----------------------
    act_msg = 2.0 * b * w.seq_len / cp * _hidden(nodes) * ew
    passes = 3 if ls.recompute == "full" else 2  # forward, backward, and forward again
    if tp > 1 and s.tp_mode == "megatron":
        t = tp_msgs * passes * dev.collective_time("all_reduce", act_msg, groups.tp)
        if s.sequence_parallel:  # each all-reduce an all-gather + a reduce-scatter: one more wait
            t += tp_msgs * passes * dev.collective_wait("reduce_scatter", groups.tp)
            if sp_grads:
                t += sp_grads * dev.collective_time("all_reduce", sp_params / sp_grads * GRAD_REDUCE_BYTES, groups.tp)
        u.comm["tp"] = c.exposed(t, t * c.tp_overlap)
    elif tp > 1:  # TSP: weight shards streamed around the tp ring, K/V gathered for attention
        wbytes = GATHER_BYTES * u.params * tp
        t = passes * dev.collective_time("all_gather", wbytes, groups.tp)
        t += dev.collective_time("reduce_scatter", wbytes * GRAD_REDUCE_BYTES / GATHER_BYTES, groups.tp)
        t += passes * dev.collective_time("all_gather", cp_bytes, groups.tp)
        u.comm["tp"] = c.exposed(t, c.fsdp_overlap * (u.fwd + u.bwd))
    if cp > 1 and cp_bytes:
        if s.cp_mode == "ring":  # K/V gathered around the ring in forward, again plus dK/dV in backward
            t = dev.collective_time("all_gather", cp_bytes, groups.cp) * (passes + 1)
            u.comm["cp"] = c.exposed(t, c.cp_overlap * attn_time * passes / 2)
        else:  # Ulysses: all-to-all of q, k, v and of the output, forward and backward
            t = dev.collective_time("all_to_all", act_msg * 2 / tp, groups.cp)
            u.comm["cp"] = 2 * t * passes
    if ep_bytes and s.mesh.ep > 1:  # dispatch and combine, per pass
        t = dev.collective_time("all_to_all", ep_bytes, groups.ep)
        u.comm["ep"] = c.exposed(2 * t * passes, 2 * t * passes * c.ep_overlap)
    for (sharding, offload, expert), grp in sorted(states.items()):
        _data_parallel(u, grp, sharding, offload, groups.expert_shard if expert else groups.shard, dev, s, w, groups)
    # Gradients reduce under the last micro-batch's backward; a sharded optimizer's parameter
    # all-gather runs under the next step's first forward (Megatron --overlap-param-gather, FSDP
    # prefetch), so ZeRO-1/2 may hide their per-step traffic under a forward and a backward.
    u.step_comm_window = u.bwd + (u.fwd if ls.sharding in ("zero1", "zero2") else 0.0)
    return u


@dataclass
class StateGroup:
    """Parameters of a unit that share one sharding: how many, and the pieces ZeRO-3 gathers.

    OSDP operator splitting makes each slice of a split operator its own piece; the unsplit
    operators together form one more.
    """

    params: int = 0
    slice_max: float = 0.0
    slices: int = 0
    rest: int = 0
    largest: int = 0  # the largest operator's parameters (one slice of a split one)
    big: int = 0  # gradient tensors that are all-reduced alone (``grad_coalesce_bytes``)
    small: float = 0.0  # parameters of the others, which share flat buffers

    def add(self, local: int, split: int, tensors: tuple[int, float] = (0, 0.0)) -> None:
        self.big += tensors[0]
        self.small += tensors[1]
        self.params += local
        self.largest = max(self.largest, -(-local // max(split, 1)))
        if split > 1 and local:
            self.slice_max = max(self.slice_max, local / split)
            self.slices += split
        else:
            self.rest += local

    @property
    def pieces(self) -> int:
        return max(1, self.slices + (1 if self.rest else 0))

    @property
    def biggest_piece(self) -> float:
        return max(self.slice_max, float(self.rest))


def _hidden(nodes: list[LayerNode]) -> int:
    for n in nodes:
        if "hidden" in n.dims:
            return int(n.dims["hidden"])
        if "in" in n.dims:
            return int(n.dims["in"])
    return 0


def _data_parallel(
    u: UnitCost, sg: StateGroup, sharding: str, offload: str, grp: AxisGroup, dev: DeviceModel,
    s: Strategy, w: Workload, g: Groups,
) -> None:
    """Model states, ZeRO/FSDP collectives and the optimizer step of one group of parameters.

    Under ZeRO-3 the group is gathered in ``sg.pieces`` (more than one when OSDP splits
    operators), the current and the prefetched piece alive at once; in backward a piece's
    unsharded gradient, the input of its reduce-scatter, is alive beside them.
    """
    c = dev.c
    pb, gb, ob = state_bytes(w)
    params, d = sg.params, grp.size
    if not params:
        return
    shard = sharding if d > 1 else "replicate"  # nothing to shard over: plain replicas
    p_div, g_div, o_div = {"replicate": (1, 1, 1), "zero1": (1, 1, d), "zero2": (1, d, d)}.get(shard, (d, d, d))
    on_host_optim = offload in ("optimizer", "params")
    u.param_bytes += int(params * pb // p_div)
    u.grad_bytes += int(params * gb // g_div)
    u.optim_bytes += int(params * ob // o_div)
    u.state_params += 0.0 if offload == "params" else params * pb / p_div
    # ZeRO-Offload / FSDP2's CPU offload: reduced gradient shards stream to the host optimizer
    grads_on_device = 0.0 if on_host_optim and g_div > 1 else params * gb / g_div
    u.state_grads += grads_on_device
    u.state_optim += 0.0 if on_host_optim else params * ob / o_div
    local_opt = params / o_div
    n_mb = s.num_microbatches(w.global_batch)
    u.accumulate += float(accumulate_time(dev, grads_on_device, n_mb))
    # Adam reads and writes master, moments and gradient, and writes the compute copy.
    if on_host_optim:
        u.offload_time += dev.host_time(local_opt * (GRAD_REDUCE_BYTES + GATHER_BYTES)) * (1 - c.dp_overlap)
        u.optim_time += local_opt * 16 / 4e9  # host Adam at ~4 GB/s of state per GPU
    else:
        u.optim_time += dev.memory_time(local_opt * ADAM_BYTES_PER_PARAM, "optimizer")
    full = params * pb  # gathered in the compute dtype
    grads = params * GRAD_REDUCE_BYTES
    extra = extra_all_reduces(sg.big, sg.small, c.grad_coalesce_bytes)  # replicated: per-tensor collectives
    dp = u.comm.get("dp", 0.0)
    step = u.step_comm.get("dp", 0.0)
    if shard in ("zero3", "zero3_keep"):
        k = sg.pieces
        ag = k * dev.collective_time("all_gather", full / k, grp)
        rs = k * dev.collective_time("reduce_scatter", grads / k, grp)
        gathers = 1 if shard == "zero3_keep" else 2
        per_mb = ag * gathers + rs
        dp += c.exposed(per_mb, c.fsdp_overlap * (u.fwd + u.bwd)) + float(fsdp_copies(dev, full, grads, gathers))
        piece = min(sg.biggest_piece, params) if k > 1 else params
        u.gathered += gb * piece  # in backward: the piece's unsharded gradient, input of its reduce-scatter
        if shard == "zero3":  # current and prefetched piece
            u.gathered += 2 * pb * piece
        else:  # stays gathered between forward and backward
            u.state_params += full - params * pb / p_div
    elif shard == "zero2":
        dp += c.exposed(dev.collective_time("reduce_scatter", grads, grp), c.fsdp_overlap * u.bwd)
        step += dev.collective_time("all_gather", full, grp)
    elif shard == "zero1":
        step += dev.collective_time("reduce_scatter", grads, grp) + dev.collective_time("all_gather", full, grp)
    else:
        step += dev.collective_time("all_reduce", grads, grp) + extra * dev.collective_latency("all_reduce", grp)
    if shard in ("replicate", "zero1") and grads_held(s.mesh.pp, n_mb):
        u.gathered += gb * sg.largest  # accumulating: an operator's new gradient beside the one held
    if g.replicate.size > 1:  # HSDP: all-reduce the (sharded) gradients across replicas
        step += dev.collective_time("all_reduce", grads / (d if shard != "replicate" else 1), g.replicate)
        if shard == "replicate":
            step += extra * dev.collective_latency("all_reduce", g.replicate)
    if dp:
        u.comm["dp"] = dp
    if step:
        u.step_comm["dp"] = step
