"""``apply_plan``: make a model train the way a plan says, inside an initialised process group.

Order of application (each step documented in its module):

1. check plan against model, process group and device (:mod:`runtime.validate`), changing nothing;
2. build the named mesh (:mod:`runtime.mesh`);
3. cut pipeline stages (:mod:`runtime.pipeline`); context parallelism (and TSP) tells attention
   and positions which tokens the rank holds (:mod:`runtime.context_parallel`); expert parallelism
   keeps this rank's experts (:mod:`runtime.experts`);
4. split operators (OSDP, :mod:`runtime.splitting`);
5. tensor / sequence parallelism (:mod:`runtime.tensor_parallel`), or TSP (:mod:`runtime.tsp`);
6. activation checkpointing (:mod:`runtime.checkpointing`);
7. data-parallel sharding per unit (:mod:`runtime.sharding`, :mod:`runtime.zero`);
8. pipeline schedule.

Then :func:`build_optimizer` makes a ``torch.optim`` optimizer over what this rank steps, with the
hooks ZeRO-1/2, DDP and tied pipeline embeddings need, and :func:`runtime.train.train_step` runs one
step for any plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from runtime import checkpointing, fp8, origins, splitting, tensor_parallel
from runtime.adapters import ModelAdapter, adapt
from runtime.context_parallel import ContextShard
from runtime.experts import ExpertShard, rebalance
from runtime.init import materialize
from runtime.mesh import RuntimeMesh, build_mesh, device_type, wrap_mesh
from runtime.origins import Origin
from runtime.pipeline import (
    PipelineRunner,
    TiedPair,
    build_pipeline,
    make_runner,
    tied_pair_group,
    tied_params,
)
from runtime.precision import Precision, of_policy
from runtime.precision import problems as precision_problems
from runtime.sharding import ShardingResult, shard
from runtime.tsp import TspGroup, apply_tsp
from runtime.units import resolve, slice_interleave, split_targets, unit_of
from runtime.validate import check
from runtime.zero import ReplicatedParams, local
from vocab.errors import ShardplanError
from vocab.plan import Plan
from vocab.strategy import Strategy


@dataclass
class AppliedPlan:
    """What ``apply_plan`` did on this rank (``model._shardplan``)."""

    strategy: Strategy
    mesh: RuntimeMesh
    adapter: ModelAdapter
    stages: list[nn.Module]
    replicated: list[ReplicatedParams] = field(default_factory=list)
    fsdp_units: list[str] = field(default_factory=list)
    pipeline: PipelineRunner | None = None
    tied: TiedPair | None = None
    notes: list[str] = field(default_factory=list)


class PipelinedModel(nn.Module):
    """This rank's pipeline stages; train it with :func:`runtime.train.train_step`."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model runs through its schedule: use runtime.train_step(model, ...)")


def applied(model: nn.Module) -> AppliedPlan:
    info = getattr(model, "_shardplan", None)
    if info is None:
        raise ShardplanError("this model has no plan applied (call runtime.apply_plan first)")
    return info


def _strategy_of(plan: Any) -> tuple[Strategy, dict[str, Any] | None]:
    """The strategy of a plan document or a bare strategy, and the model facts a document records."""
    if isinstance(plan, Strategy):
        return plan, None
    if isinstance(plan, Plan):
        return plan.strategy, {"name": plan.inputs.model, "hash": plan.inputs.model_hash,
                               "seq_len": plan.inputs.workload.seq_len}
    raise ShardplanError(f"apply_plan needs a vocab.plan.Plan or a vocab.strategy.Strategy, got {type(plan).__name__}")


ARCH_FIELDS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "activation", "norm",
               "position", "bias", "qkv_bias", "tied_embeddings", "experts", "max_seq")


def _model_config(ad: ModelAdapter) -> Any:
    from profiler.models import config_from_hf

    try:
        return ad.model.cfg if ad.kind == "reference" else config_from_hf(ad.model.config.to_dict())
    except ShardplanError:
        return None


def model_problem(ad: ModelAdapter, facts: dict[str, Any] | None) -> str | None:
    """Why the plan document was made for another model, or None when it fits.

    The layer-graph hash decides; when it differs but the plan's model name resolves to the
    same architecture (e.g. a hash over another sequence length), the model fits.
    """
    from profiler.transformer import build_graph

    if facts is None:
        return None
    cfg = _model_config(ad)
    if cfg is None:
        return None
    if build_graph(cfg, facts["seq_len"]).content_hash() == facts["hash"]:
        return None
    try:
        from runtime.model import resolve_config

        other = resolve_config(facts["name"])
    except ShardplanError:
        return (f"the plan was made for model '{facts['name']}' (graph hash {facts['hash']}), "
                f"not this {cfg.name} model")
    diffs = [f"{k} {getattr(other, k)} vs {getattr(cfg, k)}" for k in ARCH_FIELDS if getattr(other, k) != getattr(cfg, k)]
    if not diffs:
        return None
    return f"the plan was made for model '{facts['name']}', not this one (plan vs model: {', '.join(diffs)})"


def check_plan(spec: dict[str, Any], plan: Any, world_size: int, dev: str, seq_len: int | None = None,
               global_batch: int | None = None, precision: Precision | None = None) -> None:
    """Validate ``plan`` against the model of ``spec`` without a process group (model on meta), at
    ``precision`` (fp32 when None: every plan runs at every precision :mod:`runtime.precision` knows),
    for sequences of ``seq_len`` tokens and steps of ``global_batch`` samples where given
    (:func:`runtime.validate.check`)."""
    from runtime.model import build

    if precision is not None and (why := precision_problems(precision.name, precision.grad_dtype)):
        raise ShardplanError("; ".join(why))
    strategy, facts = _strategy_of(plan)
    with torch.device("meta"):
        model, _ = build(spec, meta=True)
    ad = adapt(model)
    check(ad, strategy, world_size, dev, model_problem(ad, facts), seq_len or None, global_batch or None)
    cfg = _model_config(ad)
    if seq_len and cfg is not None and cfg.position == "learned" and seq_len > cfg.max_seq:
        raise ShardplanError(f"seq_len {seq_len} exceeds the model's {cfg.max_seq} learned positions")


def _groups(ad: ModelAdapter, stage: nn.Module, strategy: Strategy, splits: list[tuple[str, int]]) -> list[tuple[str, list[str]]]:
    """Candidate FSDP units of ``stage``, most specific first: slices, operators, units."""
    names = {n for n, _ in stage.named_modules()}
    out: list[tuple[str, list[str]]] = []
    for path, k in splits:
        if path in names:
            out += [(f"{path}.slices.{j}", [f"{path}.slices.{j}"]) for j in range(k)]
    ops = [ls.unit for ls in strategy.layers if ls.unit not in ad.units()]
    for op in sorted(ops, key=lambda u: -len(u.split("."))):
        paths = [p for p in ad.unit_paths(op) if p in names]
        if paths and any(True for p in paths for _ in stage.get_submodule(p).parameters()):
            out.append((op, paths))
    for u in ad.units():
        paths = [p for p in ad.unit_paths(u) if p in names]
        if paths:
            out.append((u, paths))
    return out


def _checkpoint(ad: ModelAdapter, stage: nn.Module, strategy: Strategy, dev: str) -> None:
    """Wrap units (and operator entries inside units that recompute nothing) per the plan."""
    names = {n for n, _ in stage.named_modules()}
    unit_mode = {u: resolve(strategy, u).recompute for u in ad.units()}
    for u, mode in unit_mode.items():
        for p in ad.unit_paths(u):
            if p in names:
                checkpointing.wrap(stage.get_submodule(p), mode, dev)
    for ls in strategy.layers:
        if ls.unit in unit_mode or ls.recompute == "none" or unit_mode.get(unit_of(ls.unit)) != "none":
            continue
        for p in ad.unit_paths(ls.unit):
            if p in names:
                checkpointing.wrap(stage.get_submodule(p), ls.recompute, dev)


def _modules(stages: list[nn.Module], kind: type | tuple[type, ...]) -> list[Any]:
    """The modules of ``kind`` in this rank's stages."""
    return [m for st in stages for m in st.modules() if isinstance(m, kind)]


def _context(stages: list[nn.Module], cs: ContextShard) -> None:
    """Every attention core and position table of the reference model learns this rank's tokens."""
    from runtime.model import AttentionCore, Embedding

    for m in _modules(stages, (AttentionCore, Embedding)):
        m.context = cs


def _experts(stages: list[nn.Module], ep: ExpertShard) -> None:
    """Every MoE block keeps the experts of its EP rank: ``[rank·E/ep, (rank+1)·E/ep)``."""
    from runtime.model import Experts

    for m in _modules(stages, Experts):
        n = m.up.shape[0] // ep.size
        mine = slice(ep.rank * n, (ep.rank + 1) * n)
        up, down = m.up, m.down
        m.up = nn.Parameter(up.detach()[mine].clone())
        m.down = nn.Parameter(down.detach()[mine].clone())
        origins.inherit(m.up, up, 0, mine)
        origins.inherit(m.down, down, 0, mine)
        m.ep = ep


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """This rank's mixture-of-experts blocks."""
    from runtime.model import MoE

    return _modules(applied(model).stages, MoE)


def _splits(ad: ModelAdapter, stage: nn.Module, strategy: Strategy) -> list[tuple[str, int]]:
    """Split the plan's operators of ``stage`` (OSDP); a tied head follows its table's split."""
    targets = split_targets(ad, strategy, stage)
    for path, k in targets:
        splitting.split_module(stage, path, k, slice_interleave(strategy, path))
    k = resolve(strategy, "embed.tok").split
    if ad.tied and k > 1 and getattr(stage, "head", None) is not None:
        splitting.split_tied_head(stage, k)
    return targets


def _apply_stage(ad: ModelAdapter, st: nn.Module, strategy: Strategy, rt: RuntimeMesh, mp: MixedPrecisionPolicy,
                 fp8_linears: bool, ready: Callable[[nn.Module], None] | None) -> ShardingResult:
    """Steps 4-7 on one stage: splits, fp8, TSP or TP (origins read off the DTensors), recomputation,
    data-parallel sharding (``ready`` materialises a meta stage once FSDP2 has sharded it)."""
    notes: list[str] = []
    splits = _splits(ad, st, strategy)
    tsp = rt.tsp
    if fp8_linears:
        notes += fp8.convert(st, rt.device_type)
        if tsp and fp8.converted(st):
            notes.append("fp8: TSP's ring layers compute in bf16 (only the layers TSP leaves alone are fp8)")
    if tsp:
        apply_tsp(st, TspGroup(rt.group("tp"), rt.coord("tp"), strategy.mesh.tp), ad.tied)
    elif strategy.mesh.tp > 1:
        before = origins.snapshot(st)
        tensor_parallel.parallelize(ad, st, rt.tp_mesh(), strategy.sequence_parallel)
        origins.after_sharding(st, before)
    _checkpoint(ad, st, strategy, rt.device_type)
    tied_here = ad.tied and getattr(st, "embed", True) is not None and getattr(st, "head", True) is not None
    res = shard(ad, st, strategy, rt, _groups(ad, st, strategy, splits), mp, tied_here, ready)
    res.notes = notes + res.notes
    return res


def apply_plan(model: nn.Module, plan: Any, mesh: DeviceMesh | RuntimeMesh | None = None, *,
               mixed_precision: MixedPrecisionPolicy | None = None, n_microbatches: int | None = None,
               fp8_linears: bool = False, init: Callable[[Origin], torch.Tensor] | None = None) -> nn.Module:
    """Apply ``plan`` (a :class:`vocab.plan.Plan` or a :class:`Strategy`) to ``model``.

    Runs on every rank of an initialised default process group whose size is the plan's world
    size; every rank must have built ``model`` identically (same seed). Returns the model changed
    in place, or, with pipeline parallelism, a :class:`PipelinedModel` of this rank's stages.
    With tensor parallelism the logits come out vocabulary-sharded (a DTensor): compute the loss
    and run its backward inside :func:`runtime.tensor_parallel.loss_context` (or use ``train_step``).
    Raises :class:`~runtime.validate.PlanMismatchError` (a ``ShardplanError``) listing every
    disagreement before anything is changed.

    Args:
        mesh: the plan's mesh, already built: a ``DeviceMesh`` named ``pp, dp_replicate, dp_shard,
            cp, tp`` (size-1 axes included) or a :class:`RuntimeMesh`; built when None.
        mixed_precision: FSDP2 policy for the ``zero3`` units (fp32 when None); a bf16 one makes
            the other units' parameters bf16 beside fp32 masters (:mod:`runtime.precision`).
        n_microbatches: pipeline micro-batches per step (default: the plan's global batch over
            ``dp * micro_batch`` when ``plan`` is a Plan, else ``2 * pp``).
        fp8_linears: the blocks' Linear layers train in fp8 (torchao; CUDA with compute capability
            8.9 or more, else a note; :mod:`runtime.fp8`). Pair it with a bf16 ``mixed_precision``.
        init: for a reference model built on the meta device (``runtime.model.build(spec,
            meta=True)``): the values of each parameter part, by origin (``runtime.init.seeded_values``,
            ``runtime.weights``); each rank allocates and fills only its shards, after FSDP2 has cut them.
    """
    strategy, facts = _strategy_of(plan)
    if getattr(model, "_shardplan", None) is not None:
        raise ShardplanError("this model already has a plan applied; build a fresh model to apply another")
    ad = adapt(model)
    dev = mesh.device_type if mesh is not None else device_type()
    world = dist.get_world_size() if dist.is_initialized() else 1
    check(ad, strategy, world, dev, model_problem(ad, facts))
    tsp = strategy.tp_mode == "tsp" and strategy.mesh.tp > 1
    rt = wrap_mesh(mesh, strategy.mesh, tsp) if mesh is not None else build_mesh(strategy.mesh, dev, tsp)
    device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    pp = strategy.mesh.pp
    notes: list[str] = []
    if pp > 1:
        if n_microbatches is None:
            n_microbatches = (plan.strategy.num_microbatches(plan.inputs.workload.global_batch)
                              if facts is not None else 2 * pp)
        stages, ids, has_first, has_last = build_pipeline(model, strategy, rt)  # frees the other stages
    else:
        stages = [model]
    on_meta = any(p.is_meta for st in stages for p in st.parameters())
    if on_meta and init is None:
        raise ShardplanError("the model is on the meta device: apply_plan needs init (what to fill its shards with)")
    for st in stages:
        if not on_meta:
            st.to(device)
    if rt.seq_size > 1:  # context parallelism or TSP: this rank holds some of each sequence's tokens
        _context(stages, ContextShard(rt.seq_group(), rt.seq_rank, rt.seq_size, strategy.cp_mode, strategy.cp_rotate))
    if strategy.mesh.ep > 1:
        em = rt.expert_mesh()
        _experts(stages, ExpertShard(em.get_group("ep"), em.get_local_rank("ep"), rt.ep))
    ready = (lambda st: materialize(st, device, init)) if on_meta else None  # type: ignore[arg-type]
    res = [_apply_stage(ad, st, strategy, rt, mixed_precision or MixedPrecisionPolicy(), fp8_linears, ready)
           for st in stages]
    replicated = [r for x in res for r in x.replicated]
    units = [u for x in res for u in x.fsdp_units]
    notes += [n for x in res for n in x.notes]
    info = AppliedPlan(strategy=strategy, mesh=rt, adapter=ad, stages=stages, replicated=replicated,
                       fsdp_units=units, notes=list(dict.fromkeys(notes)))
    out: nn.Module = model
    if pp > 1:
        info.pipeline = make_runner(stages, ids, strategy, rt, n_microbatches, device,
                                    of_policy(mixed_precision).compute)
        if ad.tied:
            info.tied = TiedPair(group=tied_pair_group(rt), params=tied_params(stages[0] if has_first else None,
                                                                                stages[-1] if has_last else None))
        out = PipelinedModel(stages)
    out._shardplan = info  # type: ignore[assignment]
    return out


# ---- optimizer -------------------------------------------------------------------------------

def optimizer_params(model: nn.Module) -> list[nn.Parameter]:
    """The tensors this rank's optimizer steps: FSDP shards, DDP parameters and ZeRO-1/2 slices."""
    info = applied(model)
    custom = {id(p) for r in info.replicated for p in r.params}
    out = [p for p in model.parameters() if id(p) not in custom]
    for r in info.replicated:
        out += r.optimizer_params()
    return out


def param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` as optimizer parameter groups, one per kind of tensor: plain tensors, then the
    DTensors of each device mesh. A fused or foreach optimizer steps a group's tensors in one
    kernel call, which cannot mix plain tensors with DTensors or DTensors of different meshes."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _tied_optim_params(info: AppliedPlan) -> list[nn.Parameter]:
    """What the optimizer steps for this rank's copy of the tied embedding (slice by slice)."""
    t = info.tied
    if t is None:
        return []
    stepped = {id(s.param): s.stepped() for r in info.replicated for s in r.slots}
    return [stepped.get(id(p), p) for p in t.params]


def build_optimizer(model: nn.Module, cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """A ``cls`` optimizer over :func:`optimizer_params` with the plan's step hooks.

    Before each ``step``: DDP/ZeRO gradient reduction, then the sum of tied pipeline copies'
    gradients. After: all-gather of ZeRO-1/2 slices, and the MoE blocks' balancing biases moved
    by the step's load over every rank (:func:`runtime.experts.rebalance`).
    """
    info = applied(model)
    opt = cls(param_groups(optimizer_params(model)), **kwargs)
    tied = _tied_optim_params(info)
    moe = moe_blocks(model)
    rt = info.mesh
    load_groups = list(rt.reduce_groups())

    def pre(_opt: Any, _args: Any, _kwargs: Any) -> None:
        for r in info.replicated:
            r.reduce_grads()
        if info.tied is not None and info.tied.group is not None:
            for p in tied:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = g
                dist.all_reduce(local(g), group=info.tied.group)

    def post(_opt: Any, _args: Any, _kwargs: Any) -> None:
        for r in info.replicated:
            r.gather_params()
        rebalance(moe, load_groups)

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return opt
