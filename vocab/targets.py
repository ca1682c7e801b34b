"""Training targets: what a trainer at a pinned version can run, one data file each.

A target file (``vocab/targets/<name>.yaml``) names the trainer, its pinned release and the places
in that release that say what it can express: the mesh axes, the sharding modes (overall, with a
pipeline, with HSDP, beside model parallelism), tensor and context parallelism, the pipeline
schedules with their stage-count rules and how layers may be split over stages, recomputation,
offload, per-layer choices, OSDP operator splitting, fp8 and mxfp8; and how it behaves where the cost model
has a choice (the cross-entropy kernel and the gradient dtype). Adding a target, or a newer release,
is adding or editing a file. Files are validated once, strictly (unknown keys, wrong types and
inconsistent rules are refused, naming the file).

The target ``any`` is no trainer: it allows the whole plan vocabulary and is what plans made before
targets were recorded were searched with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vocab.arguments import typed
from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import decode_json, decode_yaml, read_text, validate_document
from vocab.strategy import (
    CROSS_ENTROPY_CHOICES,
    GRAD_DTYPE_CHOICES,
    KERNEL_CHOICES,
    LOW_PRECISION_EXPERTS_CHOICES,
    MOE_DISPATCH_CHOICES,
    MOE_OVERLAP_CHOICES,
    OFFLOADS,
    RECOMPUTES,
    RECV_BUFFER_CHOICES,
    SCHEDULES,
    SELECTIVE_CHOICES,
    SHARDINGS,
    ZERO3_MASTER_CHOICES,
    MeshFacts,
    Offload,
    Recompute,
    Schedule,
    Sharding,
    even_split,
)

TARGETS_DIR = Path(__file__).parent / "targets"
ANY = "any"
DEFAULT_TARGET = "shardplan"
AXES = ("pp", "tp", "cp", "ep", "dp_replicate", "dp_shard")
NAME = re.compile(r"^[a-z][a-z0-9_.-]*$")

Axis = Literal["pp", "tp", "cp", "ep", "dp_replicate", "dp_shard"]
TpMode = Literal["megatron", "tsp"]
CpMode = Literal["ring", "ulysses"]


class TargetError(ShardplanError):
    """A target file that cannot be read or does not validate."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Source(_Strict):
    """Where in the trainer's release a fact is stated."""

    what: str = Field(..., min_length=1)
    where: str = Field(..., min_length=1, description="file:line or file (symbol) in the pinned release")


def sharding_facts(mesh: Mapping[str, int] | MeshFacts) -> tuple[bool, bool, bool, bool]:
    """What of a mesh the sharding rules read: a pipeline, data-parallel replicas, data parallelism
    beside model parallelism (pp, tp, cp or ep), and data parallelism without a shard group
    (``dp_shard*cp == 1``: every sharding then runs as plain DDP)."""
    if isinstance(mesh, MeshFacts):  # attributes, not a dict: the search asks this of every configuration
        pp, dpr, dps, cp, tp, ep = mesh.pp, mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.tp, mesh.ep
    else:
        pp, dpr, dps, cp, tp, ep = (mesh[a] for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    dp = dpr * dps
    return pp > 1, dpr > 1, dp > 1 and max(pp, tp, cp, ep) > 1, dp > 1 and dps * cp == 1


class ShardingCaps(_Strict):
    """Sharding modes (``vocab.strategy.SHARDINGS``) overall and where other axes restrict them."""

    modes: list[Sharding] = Field(..., min_length=1)
    with_pp: list[Sharding] = Field(..., description="allowed with pp > 1")
    with_hsdp: list[Sharding] = Field(
        ..., description="allowed with data-parallel replicas (dp_replicate > 1): DDP across replicas, HSDP")
    with_model_parallel: list[Sharding] = Field(
        ..., description="allowed with data parallelism beside pp, tp, cp or ep > 1")
    per_layer: bool = False

    def __hash__(self) -> int:
        return hash((tuple(self.modes), tuple(self.with_pp), tuple(self.with_hsdp), tuple(self.with_model_parallel),
                     self.per_layer))

    def limits(self, mesh: Mapping[str, int] | MeshFacts, replicas: bool = True) -> list[tuple[list[str], str]]:
        """The sharding lists ``mesh``'s other axes hold a plan to, each with why: a pipeline
        (``with_pp``), data-parallel replicas (``with_hsdp``; not when ``replicas`` is false) and data
        parallelism beside model parallelism (``with_model_parallel``)."""
        piped, replicated, beside, _ = sharding_facts(mesh)
        rules = ((piped, self.with_pp, "with pipeline parallelism"),
                 (replicas and replicated, self.with_hsdp, "across data-parallel replicas"),
                 (beside, self.with_model_parallel, "with data parallelism beside model parallelism"))
        return [(list(allowed), why) for applies, allowed, why in rules if applies]

    def on_mesh(self, mesh: Mapping[str, int] | MeshFacts, within: Sequence[str] | None = None,
                replicas: bool = True, no_shard_group: bool = True) -> tuple[tuple[str, ...], str]:
        """The shardings of ``within`` (default: every mode) the target runs on ``mesh``, and why,
        when a rule of :meth:`limits` narrows them. Without a shard group (``dp_shard*cp == 1``) and
        with data parallelism every sharding runs as plain DDP: none, where a rule excludes DDP
        (``no_shard_group`` false: an export mends such a mesh itself)."""
        out, why = tuple(within if within is not None else self.modes), ""
        limits = self.limits(mesh, replicas)
        for allowed, because in limits:
            if not set(out) <= set(allowed):
                out, why = tuple(v for v in out if v in allowed), why or because
        if no_shard_group and sharding_facts(mesh)[3] and any("replicate" not in allowed for allowed, _ in limits):
            return (), why or "without a shard group, where DDP is ruled out"
        return out, why


class TensorParallelCaps(_Strict):
    modes: list[TpMode] = Field(default_factory=list, description="empty: no tensor parallelism")
    sequence_parallel: Literal["always", "optional", "never"] = "never"
    kv_head_replication: bool = Field(
        False, description="tp may exceed the KV heads (each copied to tp/kv ranks); else tp divides them "
        "and the FFN width")
    experts: bool = Field(True, description="tp splits mixture-of-experts blocks; false: no tp for MoE models")
    experts_need_sp: bool = Field(False, description="mixture-of-experts blocks beside tp > 1 train only with "
                                  "sequence parallelism")
    expert_folding: bool = Field(False, description="the experts may run without tensor parallelism beside tp > 1 "
                                 "(etp = 1), their ep ranks carved from tp x dp_shard x cp (MoE parallel folding)")
    expert_split: Literal["any", "without_ep"] = Field(
        "any", description="where the experts split over tp > 1 (etp = tp): on any mesh, or only without expert "
        "parallelism (with ep > 1 the expert ranks always fold over tp, etp = 1)")
    tsp_context: list[CpMode] = Field(default_factory=lambda: ["ring", "ulysses"],
                                      description="context-parallel modes TSP runs beside (cp > 1)")


class StageRule(_Strict):
    """Virtual stages per pipeline rank a schedule accepts (``max`` null: no upper bound)."""

    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)


StageSplit = Literal["any", "first_last", "even", "layout"]
#: virtual stages a layer split may have beyond the blocks: ``layout`` lets the first and the last hold
#: the embedding or the loss alone (no transformer block)
BARE_END_STAGES: dict[str, int] = {"layout": 2}


def split_problem(rule: str, sizes: Sequence[int], pp: int, tail: int = 0) -> str | None:
    """Why a trainer whose layer split is ``rule`` cannot run ``sizes`` (blocks per virtual stage, in
    order, over ``pp`` ranks: virtual stage ``k`` on rank ``k mod pp``), or None where it can. The
    embedding is on the first virtual stage and the loss on the last; ``tail``: the model's last blocks
    that are multi-token-prediction layers (they must sit in one virtual stage).

    - ``even``: the trainer's even split only (:func:`vocab.strategy.even_split`);
    - ``any``: every stage its own count, at least one block each;
    - ``first_last``: with one stage per rank the middle stages are equal (the first and last may
      differ), with more every virtual stage is;
    - ``layout``: any count per virtual stage, 0 included (a stage may hold only the embedding or the
      loss, or nothing), as Megatron's ``pipeline_model_parallel_layout`` places layers; the MTP
      layers together in the last virtual stage of a rank (megatron-core 0.16.1
      ``transformer/pipeline_parallel_layer_layout.py:85-150``). Its counting flags give subsets:
      ``account_for_embedding/loss_in_pipeline_split`` (the embedding and the loss count as layers, all
      virtual stages then equal: ``transformer/transformer_block.py:146-200``) and
      ``num_layers_in_first/last_pipeline_stage`` (``transformer_block.py:102-145``).
    """
    sizes, n = list(sizes), len(sizes)
    blocks = sum(sizes)
    if n <= 1 or rule == "layout" and not tail:
        return None
    if rule == "layout":
        starts = [sum(sizes[:k]) for k in range(n)]
        held = {k for k in range(n) for b in range(blocks - tail, blocks) if starts[k] <= b < starts[k] + sizes[k]}
        if len(held) > 1 or min(held) < n - pp:
            return (f"the {tail} MTP layer(s) not together in the last virtual stage of a pipeline rank "
                    f"({sizes})")
        return None
    if min(sizes) < 1:
        return f"a pipeline stage with no transformer layer ({sizes})"
    if rule == "even":
        return None if sizes == even_split(blocks, n) else f"uneven pipeline stages ({sizes})"
    if rule == "any" or len(set(sizes)) == 1:
        return None
    if rule == "first_last" and n > pp:
        return f"interleaved virtual stages of unequal layer counts ({blocks} layers over {n})"
    if rule == "first_last" and len(set(sizes[1:-1])) > 1:
        return "uneven middle pipeline stages"
    return None


class PipelineCaps(_Strict):
    schedules: dict[Schedule, StageRule] = Field(default_factory=dict, description="empty: no pipeline")
    stage_split: StageSplit = Field(
        "even", description="any: every stage its own layer count; first_last: the middle stages equal, "
        "virtual stages all equal; even: the trainer's even split only; layout: any count per virtual "
        "stage, 0 included (the first and last may hold only the embedding or the loss: "
        ":func:`split_problem`)")

    def split_problem(self, sizes: Sequence[int], pp: int, tail: int = 0) -> str | None:
        """:func:`split_problem` under this trainer's rule."""
        return split_problem(self.stage_split, sizes, pp, tail)


class RecomputeCaps(_Strict):
    modes: list[Recompute] = Field(..., min_length=1)
    scope: Literal["units", "blocks"] = Field(
        "blocks", description="units: any unit (embedding and head too); blocks: transformer blocks only")
    per_layer: Literal["none", "every_nth", "first_per_stage", "any"] = "none"


class OffloadCaps(_Strict):
    modes: list[Offload] = Field(..., min_length=1)
    needs: dict[Offload, list[Sharding]] = Field(
        default_factory=dict, description="the shardings an offload mode works with")
    per_layer: bool = False
    activations: Literal["any", "first_blocks"] = Field(
        "any", description="which units may offload their activations (mode 'activations'): any, or "
        "first_blocks (the first N transformer blocks, N below their count, with no recomputation: Megatron's "
        "cpu_offloading_num_layers)")


#: the workload fields a target's behaviour sets (``Behaviour``: the values it runs)
WORKLOAD_BEHAVIOUR = ("cross_entropy", "grad_dtype", "recv_buffers", "kernels", "zero3_master", "moe_dispatch",
                      "moe_overlap", "selective", "low_precision_experts", "moe_tp", "fp8_saved_inputs",
                      "adam_states")


def _runs(default: str, what: str) -> Any:
    """A :class:`Behaviour` field: the values the trainer runs (at least one), ``[default]`` where
    its file names none; ``what`` describes it."""
    return Field(default_factory=lambda: [default], min_length=1, description=what)


class Behaviour(_Strict):
    """How the trainer behaves where the cost model has a knob (``vocab.strategy.Workload``): the
    values it runs, the first being what a search for it assumes."""

    cross_entropy: list[Literal["eager", "fused", "chunked"]] = Field(..., min_length=1)
    grad_dtype: list[Literal["fp32", "bf16"]] = Field(..., min_length=1)
    recv_buffers: list[Literal["per_micro_batch", "one", "none"]] = _runs(
        "per_micro_batch", "pipeline receive buffers kept beyond the activations (vocab.strategy.Workload)")
    kernels: list[Literal["eager", "fused"]] = _runs(
        "eager", "how it runs memory-bound kernels (vocab.strategy.Workload.kernels)")
    zero3_master: list[Literal["optimizer", "parameter"]] = _runs(
        "optimizer", "where ZeRO-3 keeps the fp32 master weights (vocab.strategy.Workload.zero3_master)")
    cp_rotate: list[Literal["allgather", "alltoall"]] = _runs(
        "allgather", "how its ring attention moves K/V (vocab.strategy.Strategy.cp_rotate)")
    moe_dispatch: list[Literal["alltoall", "dedup"]] = _runs(
        "alltoall", "how expert parallelism sends tokens to experts (vocab.strategy.Workload.moe_dispatch)")
    moe_overlap: list[Literal["none", "1f1b"]] = _runs(
        "none", "whether its expert-parallel all-to-alls hide under compute (vocab.strategy.Workload.moe_overlap)")
    selective: list[Literal["attention", "op", "gemms"]] = _runs(
        "attention", "what its selective recomputation keeps (vocab.strategy.Workload.selective)")
    low_precision_experts: list[Literal["always", "float8_unpiped", "never"]] = _runs(
        "always", "where an fp8/mxfp8 run's expert GEMMs run in it (vocab.strategy.Workload.low_precision_experts)")
    moe_tp: list[Literal["dispatcher", "gathered", "gathered_without_ep"]] = _runs(
        "dispatcher", "how a MoE layer meets tensor parallelism (vocab.strategy.Workload.moe_tp)")

    fp8_saved_inputs: list[Literal["original", "quantized"]] = _runs(
        "original", "what an fp8 linear keeps of its input for backward (vocab.strategy.Workload.fp8_saved_inputs)")

    adam_states: list[Literal["fp32", "bf16"]] = _runs(
        "fp32", "the dtypes of Adam's master and moments (vocab.strategy.Workload.adam_states)")

    def workload(self, **asked: str | None) -> dict[str, str]:
        """The workload fields a plan for the target is priced with: the value asked for of each
        field of :data:`WORKLOAD_BEHAVIOUR` (``None``: not asked), else the target's first."""
        return {f: asked.get(f) or getattr(self, f)[0] for f in WORKLOAD_BEHAVIOUR}


class Target(_Strict):
    """What one trainer at one release can run, and how it behaves."""

    name: str = Field(..., pattern=NAME.pattern)
    trainer: str = Field(..., min_length=1, description="the trainer's name")
    package: str = Field(..., min_length=1, description="the distribution the version pins")
    version: str = Field(..., description="the pinned release")
    exporter: str | None = Field(None, description="the trainer folder under planner/trainers that writes and reads its configuration")
    sources: list[Source] = Field(default_factory=list)
    axes: list[Axis] = Field(..., min_length=1)
    sharding: ShardingCaps
    tensor_parallel: TensorParallelCaps = TensorParallelCaps()
    context_parallel: list[CpMode] = Field(default_factory=list, description="modes; empty: none")
    pipeline: PipelineCaps = PipelineCaps()
    recompute: RecomputeCaps
    offload: OffloadCaps
    osdp_split: bool = False
    fp8: bool = False
    mxfp8: bool = Field(False, description="it trains with MXFP8 GEMMs (fp8 with an 8-bit exponent scale per "
                        "32-element block, OCP MX) on accelerators that run them")
    moe_capacity: bool = Field(False, description="it can cap the tokens each expert takes (a capacity factor, "
                               "dropping the rest); false: dropless MoE only")
    behaviour: Behaviour
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Target:
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def label(self) -> str:
        """``package version``, e.g. ``torchtitan 0.2.2`` (``any`` for the target without a trainer)."""
        return f"{self.package} {self.version}".strip()

    def has(self, axis: str) -> bool:
        return axis in self.axes


def _problems(t: Target) -> list[str]:
    out = []
    if "dp_shard" not in t.axes:
        out.append("axes must hold dp_shard (data parallelism)")
    sh = t.sharding
    for what, values in (("with_pp", sh.with_pp), ("with_hsdp", sh.with_hsdp),
                         ("with_model_parallel", sh.with_model_parallel)):
        extra = sorted(set(values) - set(sh.modes))
        if extra:
            out.append(f"sharding.{what} holds {extra}, which sharding.modes lacks")
    for axis, present in (("tp", bool(t.tensor_parallel.modes)), ("cp", bool(t.context_parallel)),
                          ("pp", bool(t.pipeline.schedules))):
        if t.has(axis) != present:
            out.append(f"axis {axis} and its modes disagree: list both or neither")
    if "replicate" not in sh.modes:
        out.append("sharding.modes must hold replicate (plain data parallelism)")
    if "none" not in t.recompute.modes:
        out.append("recompute.modes must hold none")
    if "none" not in t.offload.modes:
        out.append("offload.modes must hold none")
    for mode, shardings in t.offload.needs.items():
        if mode not in t.offload.modes or not set(shardings) <= set(sh.modes):
            out.append(f"offload.needs.{mode} must name an offload mode and shardings of sharding.modes")
    for sched, rule in t.pipeline.schedules.items():
        if rule.max is not None and rule.max < rule.min:
            out.append(f"pipeline.schedules.{sched}: max {rule.max} is below min {rule.min}")
    if t.name != ANY and (not t.version or not t.sources):
        out.append("a trainer's target needs its pinned version and sources")
    return out


#: the sharding rules of no trainer: every sharding on every mesh
ANY_SHARDING = ShardingCaps(modes=list(SHARDINGS), with_pp=list(SHARDINGS), with_hsdp=list(SHARDINGS),  # type: ignore[arg-type]
                            with_model_parallel=list(SHARDINGS), per_layer=True)  # type: ignore[arg-type]


def _any() -> Target:
    return Target(
        name=ANY, trainer="any", package="any", version="",
        sources=[Source(what="the whole plan vocabulary", where="vocab/strategy.py")],
        axes=list(AXES),  # type: ignore[arg-type]
        sharding=ANY_SHARDING,
        tensor_parallel=TensorParallelCaps(modes=["megatron", "tsp"], sequence_parallel="optional",
                                           kv_head_replication=True),
        context_parallel=["ring", "ulysses"],
        pipeline=PipelineCaps(schedules={s: StageRule() for s in SCHEDULES}, stage_split="any"),  # type: ignore[misc]
        recompute=RecomputeCaps(modes=list(RECOMPUTES), scope="units", per_layer="any"),  # type: ignore[arg-type]
        offload=OffloadCaps(modes=list(OFFLOADS), needs={"params": ["zero3", "zero3_keep"]},  # type: ignore[arg-type]
                            per_layer=True),
        osdp_split=True, fp8=True, mxfp8=True, moe_capacity=True,
        behaviour=Behaviour(cross_entropy=list(CROSS_ENTROPY_CHOICES),  # type: ignore[arg-type]
                            grad_dtype=list(GRAD_DTYPE_CHOICES),  # type: ignore[arg-type]
                            recv_buffers=list(RECV_BUFFER_CHOICES),  # type: ignore[arg-type]
                            kernels=list(KERNEL_CHOICES),  # type: ignore[arg-type]
                            zero3_master=list(ZERO3_MASTER_CHOICES),  # type: ignore[arg-type]
                            moe_dispatch=list(MOE_DISPATCH_CHOICES),  # type: ignore[arg-type]
                            moe_overlap=list(MOE_OVERLAP_CHOICES),  # type: ignore[arg-type]
                            selective=list(SELECTIVE_CHOICES),  # type: ignore[arg-type]
                            low_precision_experts=list(LOW_PRECISION_EXPERTS_CHOICES)),  # type: ignore[arg-type]
        notes=["no trainer: every choice of the plan vocabulary; plans of schema 1.0 and 1.1 read as this target"],
    )


def read_target(path: Path) -> Target:
    """The target in the YAML file at ``path``; its name must be the file's stem."""
    origin = f"target file '{path}'"
    data = decode_yaml(read_text(path, "target file", TargetError), origin, TargetError)
    if not isinstance(data, dict):
        raise TargetError(f"{origin} must hold a mapping of fields")
    t = validate_document(Target, data, origin, "target", TargetError)
    if t.name != path.stem:
        raise TargetError(f"{origin} names target '{t.name}'; a target file is named after its target")
    if t.name == ANY:
        raise TargetError(f"{origin}: '{ANY}' is the built-in target without a trainer")
    return t


@cache
def targets() -> dict[str, Target]:
    """Every target by name: the files of :data:`TARGETS_DIR`, and ``any``."""
    out = {p.stem: read_target(p) for p in sorted(TARGETS_DIR.glob("*.yaml"), key=lambda p: p.stem)}
    out[ANY] = _any()
    return out


def target_names() -> list[str]:
    """The targets a plan may be searched for: the trainers, then ``any``."""
    return [n for n in targets() if n != ANY] + [ANY]


@typed
def load_target(name: str) -> Target:
    """The target called ``name`` (case and surrounding spaces ignored); an unknown name raises
    :class:`~vocab.errors.UnknownNameError` listing the known ones."""
    table = targets()
    key = name.strip().lower()
    if key not in table:
        raise UnknownNameError("target", name, table)
    return table[key]


KEYS_DIR = TARGETS_DIR / "keys"


def key_snapshot(t: Target) -> dict:
    """The configuration keys the target's pinned release accepts (``keys/<package>-<version>.json``,
    written from the installed release by ``benchmarks/trainer_key_snapshots.py``)."""
    path = KEYS_DIR / f"{t.package.replace('-', '_')}-{t.version}.json"
    data = decode_json(read_text(path, "key snapshot", TargetError), f"key snapshot '{path.name}'", TargetError)
    if not isinstance(data, dict) or data.get("version") != t.version:
        raise TargetError(f"key snapshot '{path.name}' is not the keys of {t.label}")
    return data


def by_exporter(exporter: str) -> Target:
    """The target an exporter module writes for."""
    for t in targets().values():
        if t.exporter == exporter:
            return t
    raise UnknownNameError("exporter", exporter, [t.exporter for t in targets().values() if t.exporter])


if __name__ == "__main__":  # check every target file
    for t in targets().values():
        print(f"{t.name}: {t.label}")
