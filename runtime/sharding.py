"""Data-parallel sharding per unit: which parameter gets which plan value, and FSDP2 for ZeRO-3.

How each plan value maps onto PyTorch (``N`` = ``dp_shard × cp`` ranks, ``R`` = ``dp_replicate``):

================  ============================================================  ===========================
plan value        PyTorch                                                       per-rank state at rest
================  ============================================================  ===========================
``replicate``     :class:`runtime.zero.ReplicatedParams` stage 0: gradient      params, grads, optimizer
                  all-reduce over R·N before the step (what DDP does, without   state whole
                  overlap; gradients under 1 MiB coalesced)
``zero1``         ``ReplicatedParams`` stage 1: DDP gradients; optimizer steps  params, grads whole;
                  a 1/N flat slice of each parameter; slices all-gathered       optimizer state 1/N
``zero2``         ``ReplicatedParams`` stage 2: gradients reduce-scattered in   params whole; grads and
                  a post-accumulate-grad hook, slices as in ``zero1``            optimizer state 1/N
``zero3``         ``fully_shard(unit, reshard_after_forward=True)``             everything 1/N
``zero3_keep``    ``fully_shard(unit, reshard_after_forward=False)``: gathered  everything 1/N (gathered
                  parameters kept from forward to backward                      params live fwd→bwd)
HSDP (R > 1)      ``fully_shard`` on the 2-D ``(dp_replicate, N)`` mesh:         as above, 1/N
                  placements ``(Replicate(), Shard(0))``
================  ============================================================  ===========================

With expert parallelism (``ep > 1``) the routed experts' weights (``moe.experts``) are sharded the
same way over ``efsdp`` (``N / ep``: the ranks holding the same experts) instead of ``N``, FSDP2
units of their own, their gradients averaged over the expert's replicas (:mod:`runtime.experts`
says why that is the mean loss's gradient).

FSDP2 has no ZeRO-1/2 of its own (``reshard_after_forward=False`` is ZeRO-3 whose gathered
parameters outlive forward, not ZeRO-2: parameters stay sharded at rest); that is why those
values use the runtime's own collectives. With ``N == 1`` every value is plain replication over R.
Each ``fully_shard`` call gets ``mp_policy`` (a ``MixedPrecisionPolicy``, fp32 by default; under
bf16 the other values' parameters become bf16 beside fp32 masters, :mod:`runtime.precision`) and, on
CUDA, ``CPUOffloadPolicy`` when the unit's ``offload`` is not ``none`` (FSDP2 offloads parameters,
gradients and optimizer state together; on CPU offloading is a no-op). The root module is
``fully_shard``-ed last (``reshard_after_forward=False``) with the parameters no unit took, e.g. a
tied embedding that the head shares; parameters of non-FSDP values are ``ignored_params``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from runtime import origins
from runtime.adapters import ModelAdapter
from runtime.mesh import RuntimeMesh
from runtime.precision import of_policy
from runtime.units import graph_name, resolve, unit_of
from runtime.zero import STAGES, ReplicatedParams
from vocab.strategy import LayerStrategy, Strategy

FSDP_VALUES = ("zero3", "zero3_keep")


def effective_value(ls: LayerStrategy, shard_size: int) -> str:
    """The sharding actually applied over a shard group of ``shard_size`` ranks (``dp_shard × cp``;
    for experts under expert parallelism ``dp_shard × cp / ep``): replication where it is 1."""
    return ls.sharding if shard_size > 1 else "replicate"


@dataclass
class ShardingResult:
    replicated: list[ReplicatedParams]
    fsdp_units: list[str]
    notes: list[str]


def _is_expert(path: str, rt: RuntimeMesh) -> bool:
    return rt.ep > 1 and ".moe.experts." in f".{path}"


def _fsdp(mods: list[nn.Module], rt: RuntimeMesh, ls: LayerStrategy, mp: MixedPrecisionPolicy,
          ignored: set[nn.Parameter], root: bool = False, experts: bool = False) -> None:
    offload: OffloadPolicy = CPUOffloadPolicy() if ls.offload != "none" and rt.device_type == "cuda" else OffloadPolicy()
    target = mods[0] if len(mods) == 1 else mods
    mesh = rt.expert_fsdp_mesh() if experts else rt.fsdp_mesh()
    before = [origins.snapshot(m) for m in mods]
    fully_shard(target, mesh=mesh, reshard_after_forward=False if root else ls.sharding == "zero3",
                mp_policy=mp, offload_policy=offload, ignored_params=ignored or None)
    for m, b in zip(mods, before, strict=True):  # FSDP2 chunks dim 0 over the mesh's last (shard) dim
        origins.after_sharding(m, b, {mesh.ndim - 1: 0})


def _current(stage: nn.Module, paths: dict[int, str], groups: dict[str, list[nn.Parameter]]) -> dict[str, list[nn.Parameter]]:
    """``groups`` with each parameter replaced by the one at its path (``paths``: by identity
    before) now: materialising a meta stage makes new Parameter objects."""
    now = dict(stage.named_parameters())
    return {v: [now[paths[id(p)]] for p in ps] for v, ps in groups.items()}


def shard(ad: ModelAdapter, stage: nn.Module, strategy: Strategy, rt: RuntimeMesh, groups: list[tuple[str, list[str]]],
          mp: MixedPrecisionPolicy, tied_in_stage: bool, ready: Callable[[nn.Module], None] | None = None) -> ShardingResult:
    """Apply data-parallel sharding to ``stage`` (the model or one pipeline stage).

    Args:
        groups: candidate FSDP units, most specific first: (graph name, module paths in ``stage``).
        tied_in_stage: the stage holds both ends of a tied embedding (they must share one unit).
        ready: called on ``stage`` once FSDP2 has sharded it, before the other values' parameters
            are taken (a meta stage is materialised there: FSDP2's shards only, whole replicas).
    """
    notes: list[str] = []
    by_value: dict[str, list[nn.Parameter]] = {}
    expert_by_value: dict[str, list[nn.Parameter]] = {}
    fsdp_params: set[nn.Parameter] = set()
    expert_units: list[tuple[str, nn.Module, LayerStrategy]] = []
    for path, p in stage.named_parameters():
        ls = resolve(strategy, graph_name(ad, path))
        if _is_expert(path, rt):
            value = effective_value(ls, rt.expert_shard_size)
            if value in FSDP_VALUES:
                owner = path.rsplit(".", 1)[0]
                if owner not in [u for u, _, _ in expert_units]:
                    expert_units.append((owner, stage.get_submodule(owner), ls))
            else:
                expert_by_value.setdefault(value, []).append(p)
            continue
        value = effective_value(ls, rt.shard_size)
        if value in FSDP_VALUES:
            fsdp_params.add(p)
        else:
            by_value.setdefault(value, []).append(p)
    custom = {p for ps in (*by_value.values(), *expert_by_value.values()) for p in ps}
    units: list[str] = []
    taken: set[int] = set()
    for path, mod, ls in expert_units:  # experts first: their own units on the expert mesh
        _fsdp([mod], rt, ls, mp, set(), experts=True)
        taken |= {id(q) for q in mod.parameters()}
        units.append(path)
    if fsdp_params:
        for gname, paths in groups:
            ls = resolve(strategy, gname)
            if effective_value(ls, rt.shard_size) not in FSDP_VALUES:
                continue
            mods = [stage.get_submodule(p) for p in paths]
            if tied_in_stage and unit_of(gname) == "embedding":
                notes.append("tied embedding: embedding and head weights are in the root FSDP unit")
                continue
            if tied_in_stage and unit_of(gname) == "head":  # the shared weight stays with the embedding
                mods = [m for m, p in zip(mods, paths, strict=True) if not p.endswith("head")]
            own = {id(q) for m in mods for q in m.parameters()} - taken
            if not mods or not any(id(q) in own for q in fsdp_params):
                continue
            _fsdp(mods, rt, ls, mp, custom)
            taken |= own
            units.append(gname)
        root_ls = resolve(strategy, "embed") if tied_in_stage else strategy.default
        _fsdp([stage], rt, root_ls, mp, custom, root=True)
        units.append("<root>")
    if ready is not None:
        paths = {id(p): n for n, p in stage.named_parameters()}
        ready(stage)
        by_value, expert_by_value = _current(stage, paths, by_value), _current(stage, paths, expert_by_value)
    shard_g, rep_g = rt.reduce_groups()
    prec = of_policy(mp)  # bf16: these parameters become bf16 beside fp32 masters (runtime.precision)
    dtypes = {"compute_dtype": prec.compute, "reduce_dtype": prec.reduce}
    replicated = [ReplicatedParams(STAGES[v], ps, shard_g, rep_g, rt.reduce_size, **dtypes)
                  for v, ps in sorted(by_value.items())]
    if expert_by_value:  # replicas of an expert: the same EP rank in every EP group
        eg = rt.expert_mesh().get_group("efsdp") if rt.expert_shard_size > 1 else None
        replicated += [ReplicatedParams(STAGES[v], ps, eg, rep_g, rt.reduce_size // rt.ep, **dtypes)
                       for v, ps in sorted(expert_by_value.items())]
    if rt.device_type != "cuda" and any(resolve(strategy, u).offload != "none" for u in ad.units()):
        notes.append("offload requested: a no-op on CPU")
    return ShardingResult(replicated=replicated, fsdp_units=units, notes=notes)
