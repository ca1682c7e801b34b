"""The per-layer choice problem both OSDP solvers solve, and how the cost model fills it in.

A chain of units (embedding, blocks, head) each picks one option. An option adds ``a`` to the
objective and ``mem`` to the memory, and has two *transient* sizes ``g`` and ``r`` of which only
the largest over the chain counts (gathered ZeRO-3 parameters, rematerialised activations). The
objective also has a clipped term ``max(0, Σ d)`` (gradient synchronisation not hidden under the
last backward) and, optionally, transition costs between the options of adjacent units. Memory has
a second moment when the problem has a ``tail`` (the end of backward: every gradient made, ``end``
per option, activations gone)::

    minimise  const + Σ a + Σ trans[i][c_i, c_i+1] + max(0, Σ d)
    s.t.      Σ mem + max g + max r <= budget
              Σ end + max g + tail  <= budget      (when tail is not None)

For one data-parallel mesh (no pipeline) this is exactly :func:`costmodel.estimate.estimate`'s
step time and peak memory (see :func:`mesh_problem`). Units with equal shapes share one option
list (``classes``), which is what lets the ILP count options per class instead of per unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.assemble import bucket_bytes
from costmodel.configs import ConfigArrays, one_config
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.estimate import tied_sum_bytes
from costmodel.report import GIB
from costmodel.state_groups import grads_held
from costmodel.unit_classes import unit_classes
from costmodel.units import UnitCost, UnitOption, price_unit
from profiler.graph import LayerGraph, LayerNode
from solvers.space import SpaceOptions, unit_options
from vocab.strategy import LayerStrategy, MeshConfig, Strategy, Workload

BUDGET_SAFETY = 1e-12  # relative: keeps the floating-point sum of a plan that fits below the limit


@dataclass(frozen=True)
class Option:
    a: float
    d: float = 0.0
    mem: float = 0.0
    g: float = 0.0
    r: float = 0.0
    key: Any = None
    end: float = 0.0  # memory at the end of backward (states with every gradient)
    host: float = 0.0  # offloaded states in host memory


@dataclass
class ChainProblem:
    options: list[list[Option]]  # per class
    classes: list[int]  # class of every unit, in chain order
    budget: float
    const: float = 0.0
    transitions: list[np.ndarray] | None = None  # len(classes) - 1 matrices (options_i x options_i+1)
    names: list[str] = field(default_factory=list)
    tail: float | None = None  # transient at the end of backward; None: no such constraint
    host_budget: float | None = None  # host bytes the rank's offloaded states may use; None: unbounded

    @property
    def units(self) -> int:
        return len(self.classes)

    def unit_options(self, i: int) -> list[Option]:
        return self.options[self.classes[i]]

    def objective(self, choice: Sequence[int]) -> float:
        opts = [self.unit_options(i)[c] for i, c in enumerate(choice)]
        val = self.const + sum(o.a for o in opts) + max(0.0, sum(o.d for o in opts))
        if self.transitions is not None:
            val += sum(float(t[choice[i], choice[i + 1]]) for i, t in enumerate(self.transitions))
        return val

    def memory(self, choice: Sequence[int]) -> float:
        opts = [self.unit_options(i)[c] for i, c in enumerate(choice)]
        g = max((o.g for o in opts), default=0.0)
        run = sum(o.mem for o in opts) + g + max((o.r for o in opts), default=0.0)
        return run if self.tail is None else max(run, sum(o.end for o in opts) + g + self.tail)

    def host(self, choice: Sequence[int]) -> float:
        return sum(self.unit_options(i)[c].host for i, c in enumerate(choice))

    def fits(self, choice: Sequence[int]) -> bool:
        return self.memory(choice) <= self.budget and (self.host_budget is None
                                                       or self.host(choice) <= self.host_budget)

    @property
    def host_binds(self) -> bool:
        """Whether the host budget can exclude a choice (the units' largest host bytes exceed it)."""
        if self.host_budget is None:
            return False
        return sum(max(o.host for o in self.unit_options(i)) for i in range(self.units)) > self.host_budget

    def counts(self) -> Counter[int]:
        return Counter(self.classes)


@dataclass
class ChainSolution:
    choice: list[int] | None  # option index per unit; None when infeasible
    objective: float  # exact objective of ``choice`` (inf when infeasible)
    bound: float  # proven lower bound on the optimum
    status: str  # optimal, feasible, time_limit, infeasible
    time_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        if self.choice is None or not np.isfinite(self.objective) or self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


def pareto(options: list[Option]) -> list[int]:
    """Indices of the options no other option beats or equals on every field (first of equals kept)."""
    if not options:
        return []
    v = np.array([(o.a, o.d, o.mem, o.g, o.r, o.end, o.host) for o in options])  # (n, fields)
    n = len(v)
    le = (v[:, None, :] <= v[None, :, :]).all(axis=2)  # le[j, i]: j is no worse than i everywhere
    equal = (v[:, None, :] == v[None, :, :]).all(axis=2)
    earlier = np.arange(n)[:, None] < np.arange(n)[None, :]  # j < i
    beats = le & (~equal | earlier)
    np.fill_diagonal(beats, False)
    return [int(i) for i in np.flatnonzero(~beats.any(axis=0))]


def reduced(prob: ChainProblem) -> tuple[ChainProblem, list[list[int]]]:
    """The problem without dominated options (only without transitions) and the index maps back."""
    if prob.transitions is not None:
        return prob, [list(range(len(o))) for o in prob.options]
    maps = [pareto(opts) for opts in prob.options]
    return ChainProblem(
        [[o[i] for i in m] for o, m in zip(prob.options, maps, strict=True)],
        prob.classes,
        prob.budget,
        prob.const,
        None,
        prob.names,
        prob.tail,
        prob.host_budget,
    ), maps


# ---- the cost model's chain: one mesh without pipeline parallelism --------------------------------


#: the kinds of operator OSDP can cut into slices: GEMMs and embedding tables
SPLITTABLE = ("linear", "embedding")


def large_ops(nodes: list[LayerNode], frac: float = 0.25, splittable: bool = False) -> list[str]:
    """Operators OSDP may shard apart from their unit: those with at least ``frac`` of the unit's
    largest operator's parameters; ``splittable``: of them, those it can also cut into slices."""
    biggest = max((n.params for n in nodes), default=0)
    return [n.name for n in nodes
            if biggest and n.params >= frac * biggest and (not splittable or n.kind in SPLITTABLE)]


def option_allowed(nodes: list[LayerNode], key: tuple) -> bool:
    """Whether option ``key = (sharding, recompute, offload, split, mixed)`` means anything for the
    unit: splitting needs an operator that can be cut, mixed sharding a large operator."""
    _, _, _, k, mixed = key
    return (k == 1 or bool(large_ops(nodes, splittable=True))) and (not mixed or bool(large_ops(nodes)))


def option_strategy(name: str, nodes: list[LayerNode], key: tuple) -> list[LayerStrategy]:
    """The plan entries of one unit under option ``key = (sharding, recompute, offload, split, mixed)``.

    The unit's entry carries the unit's sharding, recomputation and offload; its large operators
    get entries of their own when split (``split`` slices) or, with ``mixed``, sharded by ZeRO-3
    while the rest keeps the unit's sharding. An operator named like its unit (the LM ``head``)
    shares the unit's entry: then the other operators of the unit get entries of their own."""
    sh, rc, off, k, mixed = key
    cut = set(large_ops(nodes, splittable=True)) if k > 1 else set()
    ops = large_ops(nodes) if mixed else [op for op in large_ops(nodes) if op in cut]

    def big(op: str) -> LayerStrategy:
        return LayerStrategy(unit=op, sharding="zero3" if mixed else sh, offload=off,  # type: ignore[arg-type]
                             split=k if op in cut else 1)

    if name in ops:
        unit = big(name).model_copy(update={"recompute": rc})
        others = [
            LayerStrategy(unit=n.name, sharding=sh, offload=off)  # type: ignore[arg-type]
            for n in nodes
            if n.name not in ops
        ]
        return [unit, *others, *(big(op) for op in ops if op != name)]
    unit = LayerStrategy(unit=name, sharding=sh, recompute=rc, offload=off)  # type: ignore[arg-type]
    return [unit, *(big(op) for op in ops)]


def price_options(name: str, nodes: list[LayerNode], keys: Sequence[tuple], cfg: MeshConfig, dev: DeviceModel,
                  w: Workload) -> list[UnitCost]:
    """The unit's costs under every option of ``keys`` (:func:`option_strategy`), exactly as
    :func:`estimate` prices it inside a plan, priced in one call."""
    options = [UnitOption.of_strategy(name, nodes, cfg.strategy(layers=option_strategy(name, nodes, key)))
               for key in keys]
    priced = price_unit(name, nodes, dev, one_config(cfg), w, options)
    return [priced.at(0, j) for j in range(len(keys))]


class _Row:
    """Configuration ``i`` of a priced unit, every quantity an array over its options."""

    def __init__(self, priced: UnitCost, i: int = 0):
        self.priced, self.i = priced, i

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.priced, attr)[self.i]


def memory_budget(dev: DeviceModel, cfg: MeshConfig, limit_gib: float) -> float:
    """Bytes of states, activations and transients a rank may hold under ``limit_gib``."""
    c = dev.c
    budget = (limit_gib * GIB - c.context_bytes) / (1 + c.fragmentation)
    budget -= bucket_bytes(c, cfg.dp)
    return budget * (1 - BUDGET_SAFETY)


def host_budget(dev: DeviceModel) -> float | None:
    """Host bytes a rank's offloaded states may use: its share of its node's host memory (None
    where the server's host memory is not recorded)."""
    host = dev.cluster.host_bytes_per_node / dev.cluster.gpus_per_node
    return host * (1 - BUDGET_SAFETY) if host else None


def mesh_problem(
    graph: LayerGraph, dev: DeviceModel, cfg: MeshConfig, w: Workload, opts: SpaceOptions, limit_gib: float
) -> ChainProblem:
    """The per-unit choice of one pipeline-free mesh configuration as a :class:`ChainProblem`."""
    return mesh_problems(graph, dev, [cfg], w, opts, limit_gib)[0]


def mesh_problems(
    graph: LayerGraph, dev: DeviceModel, cfgs: Sequence[MeshConfig], w: Workload, opts: SpaceOptions,
    limit_gib: float,
) -> list[ChainProblem]:
    """:func:`mesh_problem` of every mesh of ``cfgs``: meshes with the same options priced together,
    one pricer call per unit class (the pricer prices any number of configurations at once)."""
    if any(cfg.pp != 1 for cfg in cfgs):
        raise ValueError("mesh_problem is for meshes without pipeline parallelism")
    groups: dict[tuple, list[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault(tuple(unit_options(opts, cfg.shard)), []).append(i)
    out: list[ChainProblem | None] = [None] * len(cfgs)
    for keys, members in groups.items():
        for i, prob in zip(members, _problems(graph, dev, [cfgs[i] for i in members], w, list(keys), limit_gib),
                           strict=True):
            out[i] = prob
    return out  # type: ignore[return-value]


def _problems(graph: LayerGraph, dev: DeviceModel, cfgs: list[MeshConfig], w: Workload, keys: list[tuple],
              limit_gib: float) -> list[ChainProblem]:
    c = dev.c
    reps, index = unit_classes(graph)
    last = len(index) - 1
    names = [n for n, _ in graph.blocks()]
    arrays = ConfigArrays.of(cfgs)
    m = [w.global_batch // (cfg.dp * cfg.micro_batch) for cfg in cfgs]
    per_class = []  # per class: (its keys, per mesh the option fields)
    for k, (name, nodes) in enumerate(reps):
        is_head = names[last] == "head" and index[last] == k
        mine = [key for key in keys if option_allowed(nodes, key)]
        # an option's per-operator choices follow from its key alone: the first mesh's plan spells them
        options = [UnitOption.of_strategy(name, nodes, cfgs[0].strategy(layers=option_strategy(name, nodes, key)))
                   for key in mine]
        priced = price_unit(name, nodes, dev, arrays, w, options)
        per_class.append((mine, [unit_option(_Row(priced, i), m[i], c, None, head=w.loss_buffer if is_head else 0.0,
                                             held=bool(grads_held(1, m[i]))) for i in range(len(cfgs))]))
    host = host_budget(dev)
    out = []
    for i, cfg in enumerate(cfgs):
        options = []
        for mine, every in per_class:
            fields = {f: np.asarray(getattr(every[i], f), dtype=float).tolist() for f in _OPTION_FIELDS}
            options.append([Option(**{f: fields[f][j] for f in _OPTION_FIELDS}, key=key) for j, key in enumerate(mine)])
        tail = tied_sum_bytes(graph, 1, cfg.tp, w)
        offloads = any(o.host > 0 for opts_k in options for o in opts_k)
        out.append(ChainProblem(options, index, memory_budget(dev, cfg, limit_gib), c.step_overhead_s, None, names,
                                tail, host if offloads else None))
    return out


_OPTION_FIELDS = ("a", "d", "mem", "g", "r", "end", "host")


def unit_option(
    u: UnitCost | _Row, m: float, c: CostConstants, key: Any, head: float = 0.0, in_flight: float = 1.0,
    held: bool = True,
) -> Option:
    """``head``: the loss's transient memory as a multiple of the unit's activations (the head only);
    ``held``: whether the gradients are live beside the activations (:func:`grads_held`). ``u`` one
    option's costs, or every option's as arrays (:class:`_Row`): then every field is an array.

    The step's exposed gradient sync ``κ·ΣS + (1-κ)·max(0, Σ(S - overlap·W))`` (``c.exposed`` of the
    summed sync S and window W, κ the communication interference) splits into an additive part and
    a ``max(0, Σd)`` part, which is how the chain prices it."""
    states = u.states
    mem = states - (0.0 if held else u.state_grads) + u.activations * (in_flight + head)
    sync, k = u.step_comm, c.comm_interference
    return Option(
        a=m * u.time + u.optim + u.offload + k * sync,
        d=(1.0 - k) * (sync - c.dp_overlap * u.window),
        mem=mem,
        g=u.gathered,
        r=u.remat,
        key=key,
        end=states,
        host=u.host_bytes,
    )


def chain_strategy(graph: LayerGraph, cfg: MeshConfig, prob: ChainProblem, choice: Sequence[int]) -> Strategy:
    """The plan of a solved chain: the most common unit strategy as default, the others listed."""
    units = list(graph.blocks())
    keys = [prob.unit_options(i)[c].key for i, c in enumerate(choice)]
    top = Counter((k[0], k[1], k[2]) for k in keys).most_common(1)[0][0]
    default = LayerStrategy(sharding=top[0], recompute=top[1], offload=top[2])  # type: ignore[arg-type]
    layers: list[LayerStrategy] = []
    for (name, nodes), key in zip(units, keys, strict=True):
        entries = option_strategy(name, nodes, key)
        if (key[0], key[1], key[2]) != top or entries[0].split != 1 or entries[0].sharding != key[0]:
            layers.append(entries[0])
        layers += entries[1:]
    return cfg.strategy(default=default, layers=layers)
