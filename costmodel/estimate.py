"""From (layer graph, cluster, strategy, workload) to a :class:`Report`: the cost model's one
pure entry point. Solvers reuse its pieces (:func:`check`, :func:`stage_units`, unit costs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.pipeline import in_flight, pipeline_time, recv_buffers, weights_pending
from costmodel.report import GIB, Report, StageMemory, TimeBreakdown
from costmodel.units import Groups, UnitCost, grads_held, mesh_groups, state_bytes, unit_cost
from profiler.graph import LayerGraph, LayerNode
from profiler.hardware import Cluster
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy, Strategy, Workload

if TYPE_CHECKING:
    from profiler.profile_schema import Profile


def bucket_bytes(c: CostConstants, dp: int) -> float:
    """Gradient buckets in flight on a rank with ``dp`` data-parallel replicas (see ``dp_bucket_bytes``)."""
    return c.dp_bucket_bytes if dp > 1 else 0.0


def check(graph: LayerGraph, cluster: Cluster, s: Strategy, w: Workload) -> int:
    """Raise :class:`ShardplanError` naming the first constraint ``s`` breaks; return micro-batches."""
    m, cfg = s.mesh, graph.config
    if m.world_size != cluster.world_size:
        raise ShardplanError(
            f"mesh pp*dp_replicate*dp_shard*cp*tp = {m.pp}*{m.dp_replicate}*{m.dp_shard}*{m.cp}*{m.tp} = "
            f"{m.world_size} does not match the cluster's {cluster.world_size} GPUs"
        )
    heads, kv = int(cfg.get("heads", 0) or 0), int(cfg.get("kv_heads", 0) or 0)
    if heads and heads % m.tp:
        raise ShardplanError(f"tp={m.tp} does not divide the {heads} attention heads")
    if kv and kv % m.tp and m.tp % kv:
        raise ShardplanError(f"tp={m.tp} and the {kv} KV heads: one must divide the other")
    experts = int(cfg.get("experts", 0) or 0)
    if m.ep > 1 and not experts:
        raise ShardplanError(f"ep={m.ep} needs a mixture-of-experts model; {graph.model_id} has no experts")
    if experts and experts % m.ep:
        raise ShardplanError(f"ep={m.ep} does not divide the {experts} experts")
    blocks = graph.num_blocks
    if m.pp * s.vpp > max(blocks, 1):
        raise ShardplanError(f"pp*vpp = {m.pp}*{s.vpp} = {m.pp * s.vpp} stages for only {blocks} layers")
    if s.stage_layers is not None and sum(s.stage_layers) != blocks:
        raise ShardplanError(f"stage_layers sum to {sum(s.stage_layers)}, the model has {blocks} layers")
    if m.cp > 1:
        if w.seq_len % (2 * m.cp):
            raise ShardplanError(f"cp={m.cp}: seq_len {w.seq_len} must be divisible by 2*cp for load-balanced attention")
        if s.cp_mode == "ulysses" and heads % (m.tp * m.cp):
            raise ShardplanError(f"Ulysses cp={m.cp} with tp={m.tp} needs heads ({heads}) divisible by tp*cp")
    if s.tp_mode == "tsp" and s.sequence_parallel:
        raise ShardplanError("tp_mode 'tsp' already shards the sequence; drop sequence_parallel")
    per_step = m.dp * s.micro_batch
    if w.global_batch % per_step:
        raise ShardplanError(
            f"global batch {w.global_batch} is not divisible by dp*micro_batch = {m.dp}*{s.micro_batch} = {per_step}"
        )
    n_mb = w.global_batch // per_step
    if s.schedule == "interleaved" and n_mb % m.pp:
        raise ShardplanError(f"interleaved schedule: {n_mb} micro-batches must be a multiple of pp={m.pp}")
    names = {n.name for n in graph.nodes} | {u for u, _ in graph.blocks()}
    unknown = [ls.unit for ls in s.layers if ls.unit not in names]
    if unknown:
        raise ShardplanError(f"layer strategies name units the model does not have: {unknown[:5]}")
    return n_mb


def rank_sends(p: int, v: int = 1) -> list[int]:
    """Stage boundaries each pipeline rank sends across per micro-batch (virtual stage ``k`` sends
    to ``k + 1``; the last one sends nothing)."""
    return [len(range(r, p * v - 1, p)) for r in range(p)]


def stage_units(graph: LayerGraph, s: Strategy) -> list[list[tuple[str, list[LayerNode]]]]:
    """Units of each *virtual* stage (:meth:`Strategy.stage_blocks`); embedding on the first, head on the last."""
    units = list(graph.blocks())
    blocks = [u for u in units if u[0].startswith("layers.")]
    pre = [u for u in units if u[0] == "embedding"]
    post = [u for u in units if u[0] == "head"]
    out = [[blocks[i] for i in held] for held in s.stage_blocks(len(blocks))]
    out[0] = pre + out[0]
    out[-1] = out[-1] + post
    return out


def _signature(nodes: list[LayerNode]) -> tuple:
    """Equal for identical blocks: everything but the block index in the names."""
    return tuple((n.name.split(".", 2)[-1], n.kind, n.params, n.fwd_flops, n.act_saved_bytes) for n in nodes)


class UnitPricer:
    """Prices units, once per distinct (block shape, layer strategy)."""

    def __init__(self, dev: DeviceModel, s: Strategy, w: Workload):
        self.dev, self.s, self.w = dev, s, w
        self.groups: Groups = mesh_groups(dev, s)
        self._cache: dict[tuple, UnitCost] = {}

    def __call__(self, name: str, nodes: list[LayerNode], ls: LayerStrategy | None = None) -> UnitCost:
        eff = ls or self.s.for_unit(name)
        op_overrides = tuple(  # operator entries inside this unit (outside the stack: all such entries)
            o for o in self.s.layers
            if o.unit.startswith(name + ".") or (not name.startswith("layers.") and not o.unit.startswith("layers."))
        ) if ls is None else ()
        key = (name.startswith("layers."), _signature(nodes), eff, op_overrides)
        hit = self._cache.get(key)
        if hit is None:
            hit = unit_cost(name, nodes, self.dev, self.s, self.w, self.groups, ls)
            self._cache[key] = hit
        return hit if hit.name == name else replace(hit, name=name, block=nodes[0].block)


def estimate(
    graph: LayerGraph, cluster: Cluster, strategy: Strategy, workload: Workload,
    profile: Profile | None = None, memory_limit_gib: float | None = None, device: DeviceModel | None = None,
) -> Report:
    """Step time and per-rank memory of ``strategy`` for ``graph`` on ``cluster``."""
    n_mb = check(graph, cluster, strategy, workload)
    dev = device or DeviceModel(cluster, profile)
    price = UnitPricer(dev, strategy, workload)
    vstages = stage_units(graph, strategy)
    costs = [[price(name, nodes) for name, nodes in st] for st in vstages]
    return combine(costs, graph, cluster, strategy, workload, n_mb, dev, memory_limit_gib)


def combine(
    costs: list[list[UnitCost]], graph: LayerGraph, cluster: Cluster, s: Strategy, w: Workload,
    n_mb: int, dev: DeviceModel, memory_limit_gib: float | None = None,
) -> Report:
    """Assemble unit costs of each virtual stage into the step time and per-rank memory."""
    p, v, c = s.mesh.pp, s.vpp, dev.c
    groups = mesh_groups(dev, s)
    ranks = [[u for k in s.rank_stages(r) for u in costs[k]] for r in range(p)]
    p2p = []
    for st in costs[:-1]:
        nbytes = st[-1].out_bytes if st else 0.0
        t = 2 * dev.collective_time("send_recv", nbytes, groups.pp) if p > 1 else 0.0
        p2p.append(c.exposed(t, t * c.pp_overlap))
    rank_fb = []
    for r in range(p):
        t = sum(u.time for u in ranks[r]) + sum(p2p[k] for k in range(r, len(p2p), p))
        rank_fb.append(t)
    rank_f = [sum(u.fwd for u in ranks[r]) for r in range(p)]
    rank_w = [sum(u.bwd_weight for u in ranks[r]) for r in range(p)]
    pipe, bubble = pipeline_time(s.schedule, rank_fb, n_mb, v, rank_f, rank_w, share=dev.share)
    # Per-step gradient synchronisation, hidden under the last micro-batch's backward.
    step_comm = [sum(sum(u.step_comm.values()) for u in ranks[r]) for r in range(p)]
    window = [sum(u.step_comm_window for u in ranks[r]) for r in range(p)]
    dp_exposed = max(c.exposed(sc, c.dp_overlap * wd) for sc, wd in zip(step_comm, window, strict=True))
    optim = max(sum(u.optim_time for u in ranks[r]) for r in range(p))
    offload = max(sum(u.offload_time for u in ranks[r]) for r in range(p))
    step = pipe + dp_exposed + optim + offload + c.step_overhead_s

    worst = max(range(p), key=lambda r: rank_fb[r])
    comm: dict[str, float] = {}
    for u in ranks[worst]:
        for axis, t in u.comm.items():
            comm[axis] = comm.get(axis, 0.0) + t * n_mb
    comm["pp"] = sum(p2p[k] for k in range(worst, len(p2p), p)) * n_mb
    comm["dp"] = comm.get("dp", 0.0) + dp_exposed
    time = TimeBreakdown(
        compute=sum(u.fwd + u.bwd for u in ranks[worst]) * n_mb,
        recompute=sum(u.recompute for u in ranks[worst]) * n_mb,
        comm=comm, bubble=bubble, optimizer=optim + c.step_overhead_s, offload=offload,
    )
    tail = tied_sum_bytes(graph, s, w)
    stages = [_stage_memory(r, ranks[r], costs, s, w, n_mb, c, tail, recv_bytes(costs, s, r, n_mb))
              for r in range(p)]
    tokens = w.global_batch * graph.seq_len
    model_flops = graph.train_flops * w.global_batch
    hw_flops = sum(u.hw_flops for st in costs for u in st) * n_mb * s.mesh.dp_replicate * s.mesh.dp_shard
    hw_flops *= s.mesh.tp * s.mesh.cp
    peak = dev.acc.peak_flops(w.precision if w.precision != "fp32" else "fp32") * cluster.world_size
    mem_peak = max(st.total for st in stages) / GIB
    limit = memory_limit_gib if memory_limit_gib is not None else cluster.memory_bytes / GIB
    return Report(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / cluster.world_size,
        mfu=model_flops / step / peak, hfu=hw_flops / step / peak, memory_peak_gib=mem_peak,
        time=time, stages=stages, memory_limit_gib=limit, model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops, num_microbatches=n_mb, fits=mem_peak <= limit,
    )


def recv_bytes(costs: list[list[UnitCost]], s: Strategy, r: int, n_mb: int) -> float:
    """Bytes of the receive buffers pipeline rank ``r`` keeps beyond its activations
    (:func:`costmodel.pipeline.recv_buffers`): each virtual stage's inputs and output gradients are
    the size of the activation at its boundaries."""
    p, v = s.mesh.pp, s.vpp
    n = p * v
    fwd, grad = recv_buffers(s.schedule, r, p, n_mb, v)
    out = [st[-1].out_bytes if st else 0.0 for st in costs]
    return (fwd * sum(out[k - 1] for k in range(r, n, p) if k > 0)
            + grad * sum(out[k] for k in range(r, n, p) if k < n - 1))


def tied_table(graph: LayerGraph) -> int:
    """Elements of the embedding table an LM head shares (0 when the head has its own weight)."""
    for n in graph.nodes:
        if n.kind == "linear" and n.tp == "vocab" and n.params == 0:
            return int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
    return 0


def tied_sum_bytes(graph: LayerGraph, s: Strategy, w: Workload) -> float:
    """Transient at the end of backward when the LM head shares the embedding's table on one rank
    (no pipeline): autograd adds the embedding's gradient to the head's, holding the new gradient
    and the sum beside the old one — two more copies of the rank's (TP-local, unreduced) table."""
    return 0.0 if s.mesh.pp > 1 else 2.0 * tied_table(graph) / s.mesh.tp * state_bytes(w)[1]


def _stage_memory(r: int, units: list[UnitCost], costs: list[list[UnitCost]], s: Strategy, w: Workload,
                  n_mb: int, c: CostConstants, tail: float = 0.0, recv: float = 0.0) -> StageMemory:
    """Peak of one rank: the larger of two moments of the step.

    * ``backward`` — its start, when the activations in flight are all saved: states (gradients
      only if :func:`grads_held`) + activations (with zero bubble, the output gradients that
      micro-batches awaiting their weight gradients keep) + the largest gathered ZeRO-3 unit + the largest
      rematerialised unit + DP buckets + the loss's transients;
    * ``end of backward`` — every gradient made: states + the largest gathered unit + DP buckets +
      ``tail`` (:func:`tied_sum_bytes`);
    and at both the pipeline's receive buffers ``recv`` (:func:`recv_bytes`), kept between steps.
    Between the two, backward trades activations for gradients unit by unit.
    """
    p, v = s.mesh.pp, s.vpp
    blocks = [u.block for u in units if u.block is not None]
    acts = (sum(u.activations for u in units) * in_flight(s.schedule, r, p, n_mb, v)
            + sum(u.pending for u in units) * weights_pending(s.schedule, r, p, n_mb, v))
    gathered = max((u.gathered for u in units), default=0.0)
    remat = max((u.recompute_peak for u in units), default=0.0)
    bucket = bucket_bytes(c, s.mesh.dp)
    loss = units[-1].activations * w.loss_buffer if units and units[-1].name == "head" else 0.0
    grads = sum(u.state_grads for u in units)
    live = grads if grads_held(p, n_mb) else 0.0
    run = live + acts + gathered + remat + bucket + loss + recv
    end = grads + gathered + bucket + tail + recv
    phase, live, acts, buffers = (("backward", live, acts, run - live - acts) if run >= end
                                  else ("end of backward", grads, 0.0, end - grads))
    st = StageMemory(
        stage=r, first_block=min(blocks) if blocks else -1, last_block=max(blocks) if blocks else -1,
        units=[u.name for u in units],
        params=sum(u.state_params for u in units), grads=live,
        optimizer=sum(u.state_optim for u in units), activations=acts, buffers=buffers, phase=phase,
        param_bytes=sum(u.param_bytes for u in units), grad_bytes=sum(u.grad_bytes for u in units),
        optim_bytes=sum(u.optim_bytes for u in units),
    )
    st.overhead = c.context_bytes + c.fragmentation * st.total
    return st
