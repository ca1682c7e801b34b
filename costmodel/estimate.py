"""From (layer graph, cluster, strategy, workload) to a :class:`Report`: the cost model's one
pure entry point, the array pricer (:func:`costmodel.units.price_unit`) and the assembly
(:func:`costmodel.assemble.assemble`) on one configuration. Solvers reuse its pieces
(:func:`check`, :func:`stage_units`, :class:`UnitPricer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import numpy as np

from costmodel.assemble import Assembled, Layout, RankMemory, assemble
from costmodel.configs import ConfigArrays
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.node_costs import is_tied_head
from costmodel.pipeline import with_ends
from costmodel.report import GIB, Report, StageMemory, TimeBreakdown
from costmodel.state_groups import state_bytes
from costmodel.unit_classes import class_id, class_ids, unit_class_key, unit_names
from costmodel.units import UnitCost, UnitOption, price_unit
from profiler.graph import LayerGraph, LayerNode
from profiler.hardware import Cluster
from vocab.errors import ShardplanError
from vocab.rules import ModelShape, Subject, require
from vocab.strategy import LayerStrategy, MeshConfig, Strategy, Workload

if TYPE_CHECKING:
    from profiler.profile_schema import Profile


def check(graph: LayerGraph, cluster: Cluster, s: Strategy, w: Workload) -> int:
    """Raise :class:`ShardplanError` naming the first constraint ``s`` breaks (:data:`vocab.rules.RULES`),
    or that ``graph`` and ``w`` disagree on the sequence length, or a precision the accelerator cannot
    run (:meth:`profiler.hardware.Accelerator.precision_problem`); return micro-batches."""
    if graph.seq_len != w.seq_len:
        raise ShardplanError(f"the layer graph of {graph.model_id} is built for seq_len {graph.seq_len}, the workload "
                             f"trains seq_len {w.seq_len}: build the graph at the workload's sequence length")
    why = cluster.accelerator.precision_problem(w.precision)
    if why:
        raise ShardplanError(why)
    require(Subject(s, model_shape(graph), w.seq_len, w.global_batch, cluster.world_size, bare_end_stages=True))
    return s.num_microbatches(w.global_batch)


def model_shape(graph: LayerGraph) -> ModelShape:
    """What the validity rules read of a layer graph."""
    cfg = graph.config
    names = {n.name for n in graph.nodes} | {u for u, _ in graph.blocks()}
    return ModelShape(graph.model_id, *(int(cfg.get(k, 0) or 0) for k in ("heads", "kv_heads", "ffn_hidden", "experts")),
                      graph.num_blocks, names.__contains__)


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
    return with_ends([[blocks[i] for i in held] for held in s.stage_blocks(len(blocks))], pre, post)


#: units priced on a device model, by (unit class, choices, configuration, workload): plans priced
#: one after another on one device (a brute-force search, a sweep) share most of their units
_PRICED: WeakKeyDictionary[DeviceModel, dict[tuple, UnitCost]] = WeakKeyDictionary()


class UnitPricer:
    """Prices the units of one strategy, once per distinct (unit kind, choices)."""

    def __init__(self, dev: DeviceModel, s: Strategy, w: Workload):
        self.dev, self.s, self.w = dev, s, w
        self.cfg = ConfigArrays.of_strategy(s)
        self.priced: list[UnitCost] = []  # (1, 1) arrays, one per distinct unit
        self._index: dict[tuple, int] = {}
        self._options: dict[tuple, UnitOption] = {}
        self._known = _PRICED.setdefault(dev, {})
        self._flat = (MeshConfig.of(s), w)

    def index(self, name: str, nodes: list[LayerNode], ls: LayerStrategy | None = None,
              cls: int | None = None) -> int:
        """Index into :attr:`priced` of the unit under its entries in the strategy (or ``ls``);
        ``cls``: the unit's :func:`class_id`, when known."""
        eff = ls or self.s.for_unit(name)
        inside = () if ls is not None else tuple(  # operator entries that may name this unit's operators
            o for o in self.s.layers
            if o.unit.startswith(name + ".") or (not name.startswith("layers.") and not o.unit.startswith("layers.")))
        ckey = class_id(unit_class_key(name, nodes)) if cls is None else cls
        okey = (ckey, name if inside else None, eff, inside)
        option = self._options.get(okey)
        if option is None:
            option = self._options[okey] = UnitOption.of_strategy(name, nodes, self.s, ls)
        key = (ckey, option)
        if key not in self._index:
            self._index[key] = len(self.priced)
            known = key + self._flat
            if known not in self._known:
                self._known[known] = price_unit(name, nodes, self.dev, self.cfg, self.w, [option])
            self.priced.append(self._known[known])
        return self._index[key]

    def __call__(self, name: str, nodes: list[LayerNode], ls: LayerStrategy | None = None) -> UnitCost:
        """The unit's cost as floats."""
        return self.priced[self.index(name, nodes, ls)].at(0, 0, name, nodes[0].block)


@dataclass
class PricedPlan:
    """One strategy priced: its distinct units, the units of each virtual stage (as indices into
    them) and the assembly with every rank's parts."""

    pricer: UnitPricer
    vstages: list[list[tuple[str, list[LayerNode]]]]
    layout: Layout
    assembled: Assembled
    n_mb: int

    @property
    def units(self) -> list[list[UnitCost]]:
        """Every virtual stage's unit costs, as floats."""
        return [[self.pricer.priced[k].at(0, 0, name, nodes[0].block) for k, (name, nodes) in zip(ks, st, strict=True)]
                for ks, st in zip(self.layout.stages, self.vstages, strict=True)]


def price_plan(graph: LayerGraph, cluster: Cluster, strategy: Strategy, workload: Workload,
               profile: Profile | None = None, device: DeviceModel | None = None) -> PricedPlan:
    """The array pricer and the assembly on one configuration, every rank's parts kept."""
    n_mb = check(graph, cluster, strategy, workload)
    dev = device or DeviceModel(cluster, profile)
    price = UnitPricer(dev, strategy, workload)
    vstages = stage_units(graph, strategy)
    ids = dict(zip(unit_names(graph), class_ids(graph), strict=True))
    stages = [[price.index(name, nodes, cls=ids[name]) for name, nodes in st] for st in vstages]
    head = stages[-1][-1] if vstages[-1] and vstages[-1][-1][0] == "head" else None
    layout = Layout(stages, strategy.mesh.pp, len(price.priced), head)
    tail = tied_sum_bytes(graph, price.cfg.pp, price.cfg.tp, workload)
    a = assemble(price.priced, layout, price.cfg, dev, workload, tail, detail=True)
    return PricedPlan(price, vstages, layout, a, n_mb)


def estimate(
    graph: LayerGraph, cluster: Cluster, strategy: Strategy, workload: Workload,
    profile: Profile | None = None, memory_limit_gib: float | None = None, device: DeviceModel | None = None,
) -> Report:
    """Step time and per-rank memory of ``strategy`` for ``graph`` on ``cluster``, with the
    breakdowns of the slowest rank and the memory of every rank."""
    pp = price_plan(graph, cluster, strategy, workload, profile, device)
    return _report(pp, graph, cluster, strategy, workload, memory_limit_gib)


def _report(pp: PricedPlan, graph: LayerGraph, cluster: Cluster, s: Strategy, w: Workload,
            memory_limit_gib: float | None) -> Report:
    """The :class:`Report` of a priced plan: breakdowns at the slowest rank."""
    a, ua, layout, vstages, n_mb = pp.assembled, pp.pricer.priced, pp.layout, pp.vstages, pp.n_mb
    dev = pp.pricer.dev
    c, p = dev.c, s.mesh.pp
    rank_t = a.rank_time[0, 0]
    worst = int(np.argmax(rank_t))
    counts = layout.counts[worst]
    held = [k for k in range(len(ua)) if counts[k]]

    def on_worst(attr: str) -> float:
        return float(sum(float(getattr(ua[k], attr)[0, 0]) * counts[k] for k in held))

    comm: dict[str, float] = {}
    for axis, flag in (("tp", s.mesh.tp > 1), ("cp", s.mesh.cp > 1 and any(ua[k].has_attention for k in held)),
                       ("ep", s.mesh.ep > 1 and any(ua[k].has_experts for k in held))):
        if flag:
            comm[axis] = on_worst(f"comm_{axis}") * n_mb
    if on_worst("comm_dp"):
        comm["dp"] = on_worst("comm_dp") * n_mb
    comm["pp"] = float(a.p2p[0, worst]) * n_mb
    comm["dp"] = comm.get("dp", 0.0) + float(a.dp_exposed[0, 0])
    optim = float(a.optim[0, 0])
    time = TimeBreakdown(compute=(on_worst("fwd") + on_worst("bwd")) * n_mb, recompute=on_worst("recompute") * n_mb,
                         comm=comm, bubble=float(a.bubble[0, 0]), optimizer=optim + c.step_overhead_s,
                         offload=float(a.offload[0, 0]))
    stages = [_stage_memory(r, a.ranks[r], [u for k in s.rank_stages(r) for u in vstages[k]], c)
              for r in range(p)]
    step = float(a.step[0, 0])
    tokens = w.global_batch * graph.seq_len
    model_flops = graph.train_flops * w.global_batch
    hw_flops = float(a.hw_flops[0, 0])
    peak = dev.acc.peak_flops(w.precision) * cluster.world_size
    mem_peak = max(st.total for st in stages) / GIB
    limit = memory_limit_gib if memory_limit_gib is not None else cluster.memory_bytes / GIB
    host, host_ok = float(host_per_node(a.host[0, 0], cluster)), bool(host_fits(a.host[0, 0], cluster))
    rep = Report(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / cluster.world_size,
        mfu=model_flops / step / peak, hfu=hw_flops / step / peak, memory_peak_gib=mem_peak,
        time=time, stages=stages, memory_limit_gib=limit, model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops, num_microbatches=n_mb,
        fits=mem_peak <= limit and host_ok,
        host_per_node_gib=host / GIB, host_limit_per_node_gib=cluster.host_bytes_per_node / GIB if host else 0.0,
    )
    if host and not cluster.host_bytes_per_node:
        rep.notes.append(f"the host memory of a {cluster.accelerator.name} node is not recorded: the "
                         f"{host / GIB:.0f} GiB offloaded per node are not checked against it")
    elif not host_ok:
        rep.notes.append(f"what is offloaded needs {host / GIB:.0f} GiB of host memory per node; a "
                         f"{cluster.accelerator.name} node has {cluster.host_bytes_per_node / GIB:.0f} GiB for them")
    return rep


def host_per_node(host: Any, cluster: Cluster) -> Any:
    """Host bytes of one node's offloaded states: the worst rank's (``host``, bytes per GPU) on
    every GPU of the node."""
    return np.multiply(host, cluster.gpus_per_node, dtype=float)


def host_fits(host: Any, cluster: Cluster) -> Any:
    """Whether offloaded states of ``host`` bytes per GPU fit the node's host memory (always, where
    the accelerator's server memory is not recorded)."""
    cap = cluster.host_bytes_per_node
    return host_per_node(host, cluster) <= cap if cap else np.ones(np.shape(host), dtype=bool)


def _stage_memory(r: int, rm: RankMemory, units: list[tuple[str, list[LayerNode]]], c: CostConstants) -> StageMemory:
    """One rank's :class:`StageMemory` at the larger of its two moments (:func:`rank_memory`)."""
    blocks = [nodes[0].block for _, nodes in units if nodes[0].block is not None]
    run, end = float(rm.core_run[0, 0]), float(rm.core_end[0, 0])
    live, acts = float(rm.live[0, 0]), float(rm.acts[0, 0])
    grads = float(rm.grads[0, 0])
    phase, live, acts, buffers = (("backward", live, acts, run - live - acts) if run >= end
                                  else ("end of backward", grads, 0.0, end - grads))
    st = StageMemory(
        stage=r, first_block=min(blocks) if blocks else -1, last_block=max(blocks) if blocks else -1,
        units=[name for name, _ in units], params=float(rm.params[0, 0]), grads=live,
        optimizer=float(rm.optim[0, 0]), activations=acts, buffers=buffers, phase=phase,
        param_bytes=int(rm.param_bytes[0, 0]), grad_bytes=int(rm.grad_bytes[0, 0]),
        optim_bytes=int(rm.optim_bytes[0, 0]),
    )
    st.overhead = c.context_bytes + c.fragmentation * st.total
    return st


def tied_table(graph: LayerGraph) -> int:
    """Elements of the embedding table an LM head shares (0 when the head has its own weight)."""
    for n in graph.nodes:
        if is_tied_head(n):
            return int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
    return 0


def tied_sum_bytes(graph: LayerGraph, pp: Any, tp: Any, w: Workload) -> Any:
    """Transient at the end of backward when the LM head shares the embedding's table on one rank
    (no pipeline): autograd adds the embedding's gradient to the head's, holding the new gradient
    and the sum beside the old one — two more copies of the rank's (TP-local, unreduced) table.
    Scalars or arrays of the pipeline and TP degrees."""
    out = np.where(np.asarray(pp) > 1, 0.0, 2.0 * tied_table(graph) / np.asarray(tp, dtype=float) * state_bytes(w)[1])
    return float(out) if out.ndim == 0 else out
