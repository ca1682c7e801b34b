"""Search spaces: small generator functions that yield only valid choices.

Every degree a generator yields keeps the validity rules (:data:`vocab.rules.RULES`, whose
predicates the generators call) for the model, cluster and workload it was given: tensor
parallelism divides the attention heads and the KV heads (or the KV
heads divide it) and stays inside one node; expert parallelism divides the experts and
``dp_shard·cp``; ``pp·vpp`` stays within the layers; context parallelism keeps ``seq_len``
divisible by ``2·cp`` (``2·cp·tp`` under TSP); micro-batch sizes divide the per-replica batch; a pipeline gets at least
``pp`` micro-batches (``torch.distributed.pipelining`` refuses fewer), interleaved schedules a
multiple of ``pp`` and as many virtual stages as divide the layers evenly (or two,
split as evenly as possible, as Llama 3 405B and Megatron's weak-scaling runs do; where the target's
layer split lets the first and last stage hold the embedding or the loss alone, as Megatron's does,
the layers with those two counted as layers, as NVIDIA's recipes split Llama-3.1 405B's 126).

Named spaces (:data:`SPACES`):

* ``fsdp`` — FSDP/HSDP: data parallelism only (``dp_replicate × dp_shard``), uniform sharding
  ``zero2``/``zero3``/``zero3_keep``, uniform recomputation, optional parameter offload (under ZeRO-3
  only, as DeepSpeed and FSDP2 do it; :func:`offload_fits`).
* ``osdp`` — OSDP: data parallelism only; every unit chooses its sharding (replicate, ZeRO-1/2/3,
  ZeRO-3 kept gathered), recomputation and offload, and its large operators (at least a quarter
  of the unit's largest) may instead run under ZeRO-3 split into 2 or 4 slices, or under ZeRO-3
  while the rest of the unit is replicated / ZeRO-1 (:func:`unit_options`).
* ``megatron`` — TP/PP/DP/SP/CP (and EP) with uniform layers, DDP or the distributed optimizer
  (``zero1``), 1F1B or interleaved, an even stage split.
* ``hybrid`` — every mesh axis, TP/CP mode and schedule. Without a pipeline the units choose as in
  ``osdp``; with one, the mesh takes one sharding and offload for all units (both enumerated),
  every unit its own recomputation, and — with one virtual stage per rank — the stages their own
  boundaries (at least one block each); interleaved stages split evenly.
* ``full`` — all of the above at once (it is the union, so it searches like ``hybrid``).
* ``staged`` — ``hybrid`` where inside a pipeline every unit also takes its own sharding and
  offload (per layer, as OSDP does without a pipeline; the embedding and a head tied to it alike).
  Exact too (a MIP per pipeline mesh), but its searches of large models take longer.

GPipe is never yielded: it has 1F1B's step time and keeps more micro-batches alive. Sequence
parallelism is on with Megatron TP (it never costs more in the cost model) unless a target never
runs it.

A search is for a target (:mod:`vocab.targets`): :func:`restrict` narrows a space to what the
target runs. Most of it is the space's own fields; the rest the generators and the search check:
the virtual stages per rank a schedule takes and how layers may split over stages
(:func:`stages_allowed`), tp dividing the KV heads and the FFN width (``strict_tp``), tp only for
dense models (``tp_experts``), the shardings a
pipeline, HSDP or model parallelism leave (:func:`mesh_shardings`, :func:`grid_mask`), the
shardings an offload needs (:func:`offload_fits`) and recomputation of the blocks only
(:func:`blocks_recompute`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product

import numpy as np

from costmodel.vectorized import GridOption
from profiler.graph import LayerGraph
from profiler.hardware import Cluster
from vocab.errors import ShardplanError
from vocab.rules import divides, kv_heads_fit, pipeline_fed, stages_fit, ulysses_fits
from vocab.strategy import (
    DEGREES,
    RECOMPUTES,
    SHARDINGS,
    STATE_OFFLOADS,
    LayerStrategy,
    MeshConfig,
    Strategy,
    Workload,
    even_split,
    num_microbatches,
    parallel_axes,
    sequence_chunks,
)
from vocab.targets import ANY_SHARDING, BARE_END_STAGES, ShardingCaps, Target, sharding_facts, split_problem

#: offload modes and the shardings they need: parameters are offloaded only where ZeRO-3 shards
#: them (DeepSpeed's ``offload_param`` and FSDP2's CPU offload alike); optimizer offload goes with
#: any sharding (ZeRO-Offload)
OFFLOAD_NEEDS: tuple[tuple[str, tuple[str, ...]], ...] = (("params", ("zero3", "zero3_keep")),)


@dataclass(frozen=True)
class SpaceOptions:
    """What a search space lets vary."""

    name: str
    pp: bool = True
    tp: bool = True
    cp: bool = True
    ep: bool = True
    dp_replicate: bool = True
    shardings: tuple[str, ...] = SHARDINGS
    recomputes: tuple[str, ...] = RECOMPUTES
    offloads: tuple[str, ...] = ("none",)
    splits: tuple[int, ...] = (1,)  # OSDP operator splitting of a unit's large operators
    per_layer: bool = False  # units choose their own strategy
    stage_boundaries: bool = False  # non-uniform pipeline stages
    mix_stages: bool = False  # inside a pipeline every unit takes its own sharding and offload
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    max_vpp: int = 32
    max_micro_batch: int = 64
    max_micro_batch_sizes: int = 8  # keep the smallest few divisors
    tp_modes: tuple[str, ...] = ("megatron",)
    cp_modes: tuple[str, ...] = ("ring",)
    sequence_parallel: tuple[bool, ...] = (True,)  # for tp > 1 (SP never costs more here)
    # what a target adds (:func:`restrict`); the defaults restrict nothing
    sharding_rules: ShardingCaps = ANY_SHARDING  # the target's: shardings with pp, HSDP, beside model parallelism
    offload_needs: tuple[tuple[str, tuple[str, ...]], ...] = OFFLOAD_NEEDS
    stage_rules: tuple[tuple[str, int, int | None], ...] = ()  # (schedule, min, max) stages per rank
    stage_split: str = "any"  # any | first_last | even | layout (:func:`split_allowed`)
    recompute_blocks_only: bool = False  # the embedding and the head never recompute
    strict_tp: bool = False  # tp divides the KV heads and the FFN width (no KV-head replication)
    tp_experts: bool = True  # tp > 1 for mixture-of-experts models
    expert_folding: bool = False  # experts without TP beside tp > 1 (etp = 1, MoE parallel folding), where a target runs it
    split_experts_with_ep: bool = True  # experts split over tp > 1 beside ep > 1 (a target's expert_split "any")
    experts_need_sp: bool = False  # MoE blocks beside tp > 1 only with sequence parallelism
    tsp_cp_modes: tuple[str, ...] = ("ring", "ulysses")  # context-parallel modes beside TSP
    cp_rotate: str = "allgather"  # how the target's ring moves K/V (recorded in the plan, priced as it runs)
    max_axes: int | None = None  # meshes with at most this many degrees above 1 (the tie-break's searches)
    degrees: tuple[tuple[str, int], ...] = ()  # (axis, degree): meshes with exactly these (a sweep's heatmap cells)

    def with_(self, **kw: object) -> SpaceOptions:
        return replace(self, **kw)  # type: ignore[arg-type]


SPACES: dict[str, SpaceOptions] = {
    "fsdp": SpaceOptions(
        "fsdp",
        pp=False,
        tp=False,
        cp=False,
        ep=False,
        shardings=("zero2", "zero3", "zero3_keep"),
        offloads=("none", "params"),
    ),
    "osdp": SpaceOptions(
        "osdp", pp=False, tp=False, cp=False, ep=False, offloads=STATE_OFFLOADS, splits=(1, 2, 4), per_layer=True
    ),
    "megatron": SpaceOptions("megatron", dp_replicate=False, shardings=("replicate", "zero1")),
    "hybrid": SpaceOptions(
        "hybrid",
        offloads=STATE_OFFLOADS,
        splits=(1, 2, 4),
        per_layer=True,
        stage_boundaries=True,
        schedules=("1f1b", "zb", "interleaved"),
        tp_modes=("megatron", "tsp"),
        cp_modes=("ring", "ulysses"),
    ),
}
SPACES["full"] = replace(SPACES["hybrid"], name="full")
SPACES["staged"] = replace(SPACES["hybrid"], name="staged", mix_stages=True)


def space_options(name: str) -> SpaceOptions:
    if name not in SPACES:
        raise ShardplanError(f"unknown search space '{name}'; known: {', '.join(SPACES)}")
    return SPACES[name]


def for_device(opts: SpaceOptions, device_kind: str) -> SpaceOptions:
    """``opts`` as searched on a device of ``device_kind``: on a CPU the host memory is the device
    memory, so offloading frees nothing (the runtime treats it as a no-op) and is not searched."""
    return replace(opts, offloads=("none",)) if device_kind == "cpu" else opts


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in increasing order, found by trial division up to its square root."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def tp_degrees(graph: LayerGraph, cluster: Cluster, world: int, strict: bool = False) -> Iterator[int]:
    """Divide the heads, fit the KV heads (either divides the other; ``strict``: tp divides them and
    the FFN width) and stay inside one node."""
    heads = int(graph.config.get("heads", 0) or 0)
    kv = int(graph.config.get("kv_heads", 0) or 0)
    ffn = int(graph.config.get("ffn_hidden", 0) or 0) if strict else 0
    for t in divisors(world):
        if t > cluster.gpus_per_node or not divides(t, heads) or not kv_heads_fit(t, kv, strict):
            continue
        if not divides(t, ffn):
            continue
        yield t


def pp_degrees(graph: LayerGraph, world: int) -> Iterator[int]:
    yield from (p for p in divisors(world) if stages_fit(p, graph.num_blocks))


def cp_degrees(seq_len: int, world: int) -> Iterator[int]:
    yield from (c for c in divisors(world) if divides(sequence_chunks(c), seq_len))


def ep_degrees(graph: LayerGraph, shard: int) -> Iterator[int]:
    """Divide the experts and the shard group (``dp_shard·cp``) expert ranks are carved out of."""
    experts = int(graph.config.get("experts", 0) or 0)
    if not experts:
        yield 1
        return
    yield from (e for e in divisors(experts) if divides(e, shard))


def expert_layouts(graph: LayerGraph, tp: int, shard: int, folding: bool,
                   split_with_ep: bool = True) -> Iterator[tuple[int, int]]:
    """(ep, etp) of the expert ranks: ``ep`` of :func:`ep_degrees` with the experts split over tp
    (``etp`` 0; with ``ep > 1`` and ``tp > 1`` only where ``split_with_ep``), then, where ``folding`` and
    ``tp > 1``, every ``ep > 1`` dividing the experts and ``tp·dp_shard·cp`` with whole experts on each
    rank (``etp`` 1: MoE parallel folding)."""
    yield from ((e, 0) for e in ep_degrees(graph, shard) if e == 1 or tp == 1 or split_with_ep)
    experts = int(graph.config.get("experts", 0) or 0)
    if folding and experts and tp > 1:
        yield from ((e, 1) for e in divisors(experts) if e > 1 and divides(e, tp * shard))


def dp_splits(dp: int, replicate: bool = True) -> Iterator[tuple[int, int]]:
    """(dp_replicate, dp_shard) with the given product."""
    for r in divisors(dp) if replicate else [1]:
        yield r, dp // r


def micro_batches(global_batch: int, dp: int, opts: SpaceOptions) -> Iterator[int]:
    """Micro-batch sizes dividing the per-replica batch (the smallest few)."""
    if not divides(dp, global_batch):
        return
    sizes = [b for b in divisors(global_batch // dp) if b <= opts.max_micro_batch]
    yield from sizes[: opts.max_micro_batch_sizes]


def schedules(pp: int, n_mb: int, blocks: int, opts: SpaceOptions, tail: int = 0) -> Iterator[tuple[str, int]]:
    """(schedule, vpp); one entry when there is no pipeline. Interleaved: the virtual stages per rank
    over which the layers split evenly, counting the embedding and the loss as layers where the target's
    split lets a stage hold them alone (Megatron's ``account_for_*_in_pipeline_split``), and always 2;
    ``tail``: the model's last blocks that are MTP layers (:func:`vocab.targets.split_problem`)."""
    if pp == 1:
        yield "1f1b", 1
        return
    if not pipeline_fed(pp, n_mb):
        return
    bare = BARE_END_STAGES.get(opts.stage_split, 0)
    for s in opts.schedules:
        if s == "interleaved":
            if not divides(pp, n_mb):
                continue
            for v in range(2, opts.max_vpp + 1):
                even = any((blocks + a) % (pp * v) == 0 for a in range(bare + 1))
                if (stages_fit(pp * v, blocks, bare) and (even or v == 2)
                        and stages_allowed(s, pp, v, blocks, opts, tail)):
                    yield s, v
        elif s != "gpipe" and stages_allowed(s, pp, 1, blocks, opts, tail):
            yield s, 1


def stages_allowed(schedule: str, pp: int, vpp: int, blocks: int, opts: SpaceOptions, tail: int = 0) -> bool:
    """Whether a target runs ``schedule`` with ``vpp`` stages per rank and the even split of
    ``blocks`` layers (:meth:`Strategy.stage_layout` without ``stage_layers``), by its layer-split rule
    (:func:`vocab.targets.split_problem`)."""
    for name, lo, hi in opts.stage_rules:
        if name == schedule and (vpp < lo or (hi is not None and vpp > hi)):
            return False
    return split_allowed(even_split(blocks, pp * vpp), pp, opts.stage_split, tail)


def split_allowed(sizes: list[int], pp: int, rule: str, tail: int = 0) -> bool:
    """Whether a target with layer-split ``rule`` runs ``sizes`` (:func:`vocab.targets.split_problem`:
    the one rule the export's nearest-plan check asks too)."""
    return split_problem(rule, sizes, pp, tail) is None


def sequence_parallel_choices(tp: int, tp_mode: str, folded: bool, moe: bool, opts: SpaceOptions) -> tuple[bool, ...]:
    """Sequence parallelism off or on for a mesh: off without Megatron TP; on only where the experts
    fold over tp or the target needs it beside MoE experts (``experts_need_sp``)."""
    if tp == 1 or tp_mode == "tsp":
        return (False,)
    if folded or (moe and opts.experts_need_sp):
        return tuple(v for v in opts.sequence_parallel if v)
    return opts.sequence_parallel


def mesh_configs(
    graph: LayerGraph, cluster: Cluster, w: Workload, opts: SpaceOptions
) -> Iterator[MeshConfig]:
    """Every valid mesh configuration of the space, in a fixed order."""
    world = cluster.world_size
    blocks = graph.num_blocks
    heads = int(graph.config.get("heads", 0) or 0)
    kv_heads = int(graph.config.get("kv_heads", 0) or 0)
    moe = bool(graph.config.get("experts", 0))
    tail = int(graph.config.get("mtp_layers", 0) or 0)
    scheds: dict[tuple[int, int], list[tuple[str, int]]] = {}  # (pp, micro-batches) -> its schedules
    for tp in tp_degrees(graph, cluster, world, opts.strict_tp) if opts.tp and (opts.tp_experts or not moe) else [1]:
        for pp in pp_degrees(graph, world // tp) if opts.pp else [1]:
            for cp in cp_degrees(w.seq_len, world // (tp * pp)) if opts.cp else [1]:
                dp = world // (tp * pp * cp)
                for dpr, dps in dp_splits(dp, opts.dp_replicate):
                    for ep, etp in expert_layouts(graph, tp, dps * cp, opts.expert_folding,
                                                     opts.split_experts_with_ep) if opts.ep else [(1, 0)]:
                        if opts.max_axes is not None and axes_above_one(pp, dpr, dps, cp, tp, ep) > opts.max_axes:
                            continue
                        if opts.degrees and not _has_degrees(opts.degrees, pp=pp, dp_replicate=dpr, dp_shard=dps,
                                                             cp=cp, tp=tp, ep=ep):
                            continue
                        for b in micro_batches(w.global_batch, dp, opts):
                            n_mb = num_microbatches(w.global_batch, dp, b)
                            if (pp, n_mb) not in scheds:
                                scheds[pp, n_mb] = list(schedules(pp, n_mb, blocks, opts, tail))
                            for sched, vpp in scheds[pp, n_mb]:
                                for tpm in opts.tp_modes if tp > 1 else ("megatron",):
                                    if tpm == "tsp" and not divides(sequence_chunks(cp, tp, True), w.seq_len):
                                        continue
                                    if etp and tpm == "tsp":  # folding needs each tp rank's own tokens
                                        continue
                                    for sp in sequence_parallel_choices(tp, tpm, bool(etp), moe, opts):
                                        cpms = opts.cp_modes if tpm != "tsp" else opts.tsp_cp_modes
                                        for cpm in cpms if cp > 1 else ("ring",):
                                            if cpm == "ulysses" and not ulysses_fits(tp, cp, heads, kv_heads):
                                                continue
                                            rot = opts.cp_rotate if cp > 1 and cpm == "ring" else "allgather"
                                            yield MeshConfig(
                                                pp, dpr, dps, cp, tp, ep, b, sched, vpp, sp, tpm, cpm, rot, etp
                                            )


_MESHES: dict[tuple, tuple[list[MeshConfig], np.ndarray | None]] = {}


def mesh_list(graph: LayerGraph, cluster: Cluster, w: Workload, opts: SpaceOptions) -> list[MeshConfig]:
    """:func:`mesh_configs` as a list, enumerated once per model shape, cluster shape, sequence,
    global batch and space (a sweep's points and the tie-break's searches share it); a space
    narrowed by ``max_axes`` filters the whole list, in its order."""
    c = graph.config
    shape = tuple(int(c.get(k, 0) or 0) for k in ("heads", "kv_heads", "ffn_hidden", "experts", "mtp_layers"))
    key = (shape, graph.num_blocks, cluster.gpus_per_node, cluster.world_size, w.seq_len, w.global_batch,
           opts.with_(max_axes=None))
    if key not in _MESHES:
        if len(_MESHES) >= 32:
            _MESHES.clear()
        _MESHES[key] = (list(mesh_configs(graph, cluster, w, opts.with_(max_axes=None))), None)
    found, axes = _MESHES[key]
    if opts.max_axes is None:
        return list(found)
    if axes is None:  # counted once, on the first narrowed search
        axes = np.array([len(m.parallel_axes) for m in found], int)
        _MESHES[key] = (found, axes)
    return [found[i] for i in np.flatnonzero(axes <= opts.max_axes)]


def axes_above_one(*degrees: int) -> int:
    """How many of a mesh's degrees (``pp, dp_replicate, dp_shard, cp, tp, ep``) exceed 1: the
    parallel axes a person sets up (:func:`vocab.strategy.parallel_axes`)."""
    return len(parallel_axes(dict(zip(DEGREES, degrees, strict=True))))


def _has_degrees(want: tuple[tuple[str, int], ...], **mesh: int) -> bool:
    return all(mesh[axis] == d for axis, d in want)


def offload_fits(sharding: str, offload: str, needs: tuple[tuple[str, tuple[str, ...]], ...] = OFFLOAD_NEEDS
                 ) -> bool:
    """Whether ``offload`` goes with ``sharding`` (:data:`OFFLOAD_NEEDS`, or a target's rules)."""
    return all(sharding in allowed for mode, allowed in needs if mode == offload)


def sharding_offloads(opts: SpaceOptions, shard_group: int) -> list[tuple[str, str]]:
    """The (sharding, offload) pairs a mesh may take, sharding-major. Without a shard group every
    sharding prices as replication: per offload, the first sharding that allows it stands for all."""
    pairs = [(sh, off) for sh in opts.shardings for off in opts.offloads if offload_fits(sh, off, opts.offload_needs)]
    if shard_group > 1:
        return pairs
    first: dict[str, str] = {}
    for sh, off in pairs:
        first.setdefault(off, sh)
    return [(sh, off) for sh, off in pairs if first[off] == sh]


def grid_options(opts: SpaceOptions) -> tuple[list[GridOption], list[GridOption]]:
    """What :func:`costmodel.vectorized.price_grid` prices for a space: every uniform (sharding,
    recompute, offload), and — per-layer spaces with ZeRO-3 — the large-operator options (large
    operators under ZeRO-3, the rest replicated or ZeRO-1) that bound OSDP's per-operator choice."""
    uniform = [GridOption(sh, rc, off) for sh, rc, off in product(opts.shardings, opts.recomputes, opts.offloads)
               if offload_fits(sh, off, opts.offload_needs)]
    large: list[GridOption] = []
    if opts.per_layer and "zero3" in opts.shardings:
        large = [GridOption(sh, rc, off, large=True) for sh, rc, off in product(
            [x for x in opts.shardings if x in ("replicate", "zero1")], opts.recomputes, opts.offloads)
            if off != "params"]
    return uniform, large


def unit_options(opts: SpaceOptions, shard_group: int) -> Iterator[tuple[str, str, str, int, bool]]:
    """(sharding, recompute, offload, split, mixed) a unit may take.

    ``split > 1`` splits the unit's large operators into slices under ZeRO-3 (splitting changes
    nothing else); ``mixed`` shards the large operators with ZeRO-3 while the rest of the unit is
    replicated or ZeRO-1 (OSDP's per-operator choice; never with parameter offload, which needs the
    whole unit under ZeRO-3). Without a shard group (``dp_shard·cp == 1``) every sharding prices as
    ``replicate`` (named so, or ``zero3`` where parameters are offloaded) and neither applies.
    """
    group = shard_group > 1
    pairs = sharding_offloads(opts, shard_group) if group else [
        ("replicate" if off != "params" else sh, off) for sh, off in sharding_offloads(opts, shard_group)]
    z3 = group and opts.per_layer and "zero3" in opts.shardings
    for sh in dict.fromkeys(sh for sh, _ in pairs):
        for rc in opts.recomputes:
            for off in [o for s2, o in pairs if s2 == sh]:
                for k in opts.splits:
                    if k == 1 or (z3 and sh == "zero3"):
                        yield sh, rc, off, k, False
                    if z3 and sh in ("replicate", "zero1") and off != "params":
                        yield sh, rc, off, k, True


def operator_options(opts: SpaceOptions, shard_group: int) -> list[tuple[str, str, int, bool]]:
    """(sharding, offload, split, mixed) of :func:`unit_options` that split a unit's large operators
    or shard them apart from the rest (none without a shard group)."""
    keys = [(sh, off, k, mx) for sh, _, off, k, mx in unit_options(opts, shard_group) if k > 1 or mx]
    return list(dict.fromkeys(keys))


def pipeline_combos(graph: LayerGraph, cfg: MeshConfig, opts: SpaceOptions) -> Iterator[list[tuple[str, str]]]:
    """The (sharding, offload) pairs the units of a pipeline mesh choose from, one list per problem.

    With ``mix_stages`` every unit takes its own pair (an embedding and the head tied to it the
    same: the runtime sums the two copies' gradients, which needs them sharded alike); otherwise
    one pair serves the whole pipeline. Without a shard group every sharding prices as
    replication: one stands for all (:func:`sharding_offloads`)."""
    pairs = sharding_offloads(opts, cfg.shard)
    if not opts.mix_stages:
        yield from ([pair] for pair in pairs)
    else:
        yield pairs


def restrict(space: SpaceOptions, target: Target) -> SpaceOptions:
    """``space`` narrowed to what ``target`` runs: its axes, modes, schedules with their stage-count
    rules and layer splits, recomputation scope and sharding rules. Per-unit choices (and with them
    operator splitting and mixed stages) stay only where the target lets every unit choose its
    sharding, recomputation and offload freely; the target ``any`` restricts nothing."""
    t = target
    shardings = _keep(space.shardings, t.sharding.modes)
    if not shardings:
        raise ShardplanError(f"the '{space.name}' space and the {t.name} target ({t.label}) share no sharding: "
                             f"the space has {', '.join(space.shardings)}, the target {', '.join(t.sharding.modes)}")
    tp_modes, cp_modes = _keep(space.tp_modes, t.tensor_parallel.modes), _keep(space.cp_modes, t.context_parallel)
    schedules = _keep(space.schedules, tuple(t.pipeline.schedules))
    sp = {"always": (True,), "never": (False,)}.get(t.tensor_parallel.sequence_parallel, space.sequence_parallel)
    rules = tuple((s, r.min, r.max) for s, r in t.pipeline.schedules.items() if (r.min, r.max) != (1, None))
    free = (t.sharding.per_layer and t.offload.per_layer and t.recompute.per_layer == "any"
            and t.recompute.scope == "units" and t.pipeline.stage_split == "any"
            and not _narrowed(shardings, t.sharding))
    per_layer = space.per_layer and free
    return replace(
        space, pp=space.pp and t.has("pp") and bool(schedules), tp=space.tp and t.has("tp") and bool(tp_modes),
        cp=space.cp and t.has("cp") and bool(cp_modes), ep=space.ep and t.has("ep"),
        dp_replicate=space.dp_replicate and t.has("dp_replicate"), shardings=shardings,
        recomputes=_keep(space.recomputes, t.recompute.modes) or ("none",),
        offloads=_keep(space.offloads, t.offload.modes) or ("none",),
        splits=space.splits if t.osdp_split and per_layer else (1,), per_layer=per_layer,
        stage_boundaries=space.stage_boundaries and per_layer, mix_stages=space.mix_stages and per_layer,
        schedules=schedules, tp_modes=tp_modes or ("megatron",), cp_modes=cp_modes or ("ring",),
        sequence_parallel=sp, sharding_rules=t.sharding,
        offload_needs=tuple((m, tuple(v)) for m, v in t.offload.needs.items()),
        stage_rules=rules, stage_split=t.pipeline.stage_split,
        recompute_blocks_only=t.recompute.scope == "blocks",
        strict_tp=not t.tensor_parallel.kv_head_replication, tp_experts=t.tensor_parallel.experts,
        expert_folding=t.tensor_parallel.expert_folding,
        split_experts_with_ep=t.tensor_parallel.expert_split == "any", experts_need_sp=t.tensor_parallel.experts_need_sp,
        tsp_cp_modes=_keep(space.tsp_cp_modes, t.tensor_parallel.tsp_context), cp_rotate=t.behaviour.cp_rotate[0])


def _keep(values: tuple[str, ...], allowed: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(v for v in values if v in allowed)


def _narrowed(shardings: tuple[str, ...], rules: ShardingCaps) -> bool:
    """Whether a rule of the mesh (a pipeline, replicas, data beside model parallelism) can narrow
    ``shardings``."""
    return not all(set(shardings) <= set(x) for x in (rules.with_pp, rules.with_hsdp, rules.with_model_parallel))


def mesh_shardings(opts: SpaceOptions, cfg: MeshConfig) -> tuple[str, ...]:
    """The shardings of the space a mesh configuration may take under the target's rules
    (:meth:`vocab.targets.ShardingCaps.on_mesh`)."""
    return opts.sharding_rules.on_mesh(cfg, opts.shardings)[0]


def grid_mask(configs: list[MeshConfig], options: list[GridOption], opts: SpaceOptions) -> np.ndarray | None:
    """Which (configuration, uniform option) cells the space allows, shape (C, O); None: all."""
    if not _narrowed(opts.shardings, opts.sharding_rules):
        return None
    rows: dict[tuple[bool, bool, bool, bool], np.ndarray] = {}
    keys = [sharding_facts(cfg) for cfg in configs]
    for cfg, key in zip(configs, keys, strict=True):
        if key not in rows:
            allowed = mesh_shardings(opts, cfg)
            rows[key] = np.array([o.sharding in allowed for o in options], bool)
    return np.array([rows[k] for k in keys], bool).reshape(len(configs), len(options))


def blocks_recompute(s: Strategy, units: list[str]) -> Strategy:
    """``s`` with the units outside the transformer blocks (embedding, head) recomputing nothing,
    as a target that checkpoints blocks only runs it (``recompute_blocks_only``)."""
    outside = [u for u in units if not u.startswith("layers.")]
    if s.default.recompute == "none" or not outside:
        return s
    d = s.default
    extra = [LayerStrategy(unit=u, sharding=d.sharding, recompute="none", offload=d.offload) for u in outside]
    return s.model_copy(update={"layers": [*extra, *s.layers]})
