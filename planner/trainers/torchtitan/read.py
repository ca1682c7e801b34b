"""torchtitan: a job config TOML read back into a plan.

``[parallelism]`` gives the mesh (``data_parallel_shard_degree = -1``: the GPUs left), the schedule,
its micro-batch size and the stages (``module_fqns_per_model_part``, or ``pipeline_parallel_layers_per_stage``
with the embedding and the head counted as one layer each, as torchtitan splits; neither: one stage per
rank, two for multi-stage schedules). FSDP shards over ``dp_shard × cp`` whenever that is above one:
``fsdp_reshard_after_forward`` ``always`` is ZeRO-3, ``never`` keeps parameters gathered
(``zero3_keep``), ``default`` reshards unless there is a pipeline. DDP otherwise. Sequence parallelism
is on with TP; context parallelism is ring attention. ``[activation_checkpoint]`` covers the
transformer blocks: ``full``, ``selective`` with ``selective_ac_option = "op"``, or full on every N-th
block a pipeline rank builds (``"N"``). ``training.enable_cpu_offload`` offloads parameters.
``expert_parallel_comm_backend`` ``deepep`` is the de-duplicated MoE dispatch (``standard``: an
all-to-all). With ``ep > 1`` and ``tp > 1``, ``expert_tensor_parallel_degree`` ``1`` (torchtitan's
default) folds the expert ranks over the tensor-parallel ones (``etp`` 1); ``tp`` splits the experts
over tp. ``[model]`` ``name`` and ``flavor`` are the model the file trains: where they are a preset
(``TORCHTITAN_FLAVORS``) whose layers differ from the model being priced (``--model`` or the header's),
the file is refused; a flavor that is no preset, or a file without one, is not checked. ``[model]``
``converters`` (names torchtitan registers: ``TORCHTITAN_CONVERTERS``; others are refused) holding ``quantize.linear.float8`` is fp8, ``quantize.linear.mx`` (torchao's MXLinear) mxfp8.
"""

from __future__ import annotations

import math
import tomllib
from typing import Any

from planner.trainers.reading import ConfigError, Context, count, refuse_unknown, unit_choices, unknown_keys
from planner.trainers.torchtitan.keys import TORCHTITAN as K
from planner.trainers.torchtitan.keys import (
    TORCHTITAN_CONVERTERS,
    TORCHTITAN_CP_ROTATE,
    TORCHTITAN_FLAVORS,
    TORCHTITAN_FLOAT8,
    TORCHTITAN_FQN,
    TORCHTITAN_GROUPED,
    TORCHTITAN_MODEL_DEFAULT,
    TORCHTITAN_MX,
    TORCHTITAN_SCHEDULES,
)
from vocab.digits import is_digits
from vocab.strategy import rank_blocks
from vocab.targets import Target, key_snapshot

SUFFIXES = (".toml",)
SCHEDULES = {v: k for k, v in TORCHTITAN_SCHEDULES.items()}
SINGLE_STAGE = ("gpipe", "1f1b")
PRECISIONS = {"bfloat16": "bf16", "float32": "fp32"}


def parse(text: str, origin: str, t: Target) -> dict[str, Any]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin} is not TOML: {e}") from None
    sections = key_snapshot(t)["sections"]
    refuse_unknown(unknown_keys(doc, {k: dict.fromkeys(v) for k, v in sections.items()}), t, origin)
    return doc


def _get(doc: dict[str, Any], section: str, key: str, default: Any) -> Any:
    return doc.get(str(K[section]), {}).get(str(K[key]), default)


def workload(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seq = _get(doc, "training", "seq_len", None)
    if seq is not None:
        out["seq_len"] = count(seq, "training.seq_len", origin)
    gb = _get(doc, "training", "global_batch", -1)
    if gb != -1:
        out["global_batch"] = count(gb, "training.global_batch_size", origin)
    precision = _get(doc, "training", "mp_param", "bfloat16")
    if precision not in PRECISIONS:
        raise ConfigError(f"{origin}: training.mixed_precision_param {precision!r} is not one of "
                          f"{', '.join(PRECISIONS)}")
    out["precision"] = PRECISIONS[precision]
    converters = _get(doc, "model", "converters", [])
    unknown = [c for c in converters if c not in TORCHTITAN_CONVERTERS] if isinstance(converters, list) else [converters]
    if unknown:
        raise ConfigError(f"{origin}: model.converters {unknown!r}: torchtitan registers only "
                          f"{', '.join(TORCHTITAN_CONVERTERS)}")
    if TORCHTITAN_FLOAT8 in converters:
        out["precision"] = "fp8"
    elif TORCHTITAN_MX in converters:
        out["precision"] = "mxfp8"
    if out["precision"] in TORCHTITAN_GROUPED:
        out["low_precision_experts"] = _grouped_experts(doc, converters, out["precision"], origin)
    backend = _get(doc, "parallelism", "ep_backend", "standard")
    if backend not in ("standard", "deepep"):
        raise ConfigError(f"{origin}: parallelism.{K['ep_backend']} {backend!r} is not standard or deepep")
    out["moe_dispatch"] = "dedup" if backend == "deepep" else "alltoall"
    return out


def _grouped_experts(doc: dict[str, Any], converters: list[str], precision: str, origin: str) -> str:
    """How an fp8/mxfp8 file runs the experts' grouped GEMMs: in that precision (``float8_unpiped``) where
    its grouped-GEMM converter is listed with modules to convert, else in bf16 (``never``); the float8 one
    with a pipeline or context parallelism, or another precision's, is refused as torchtitan refuses it."""
    table, name = TORCHTITAN_GROUPED[precision]
    other = [c for p, (_, c) in TORCHTITAN_GROUPED.items() if p != precision and c in converters]
    if other:
        raise ConfigError(f"{origin}: model.converters {other[0]!r} beside {precision}'s Linear converter is not priced")
    if name not in converters:
        return "never"
    fqns: Any = doc
    for key in (str(K["quantize"]), str(K["grouped_mm"]), table, str(K["grouped_fqns"])):
        fqns = fqns.get(key) if isinstance(fqns, dict) else None
    names = fqns.split(",") if isinstance(fqns, str) else fqns if isinstance(fqns, list) else []
    if not [x for x in names if isinstance(x, str) and x.strip()]:
        return "never"  # the converter converts the modules its fqns name: none
    pp, cp = (_get(doc, "parallelism", key, 1) for key in ("pp", "cp"))
    if precision == "fp8" and (pp != 1 or cp != 1):
        raise ConfigError(f"{origin}: {name} with pipeline_parallel_degree {pp} and context_parallel_degree {cp}: "
                          "torchtitan 0.2.2 asserts both are 1 (components/quantization/float8.py:193-198)")
    return "float8_unpiped"


#: the layer shape a flavor and the priced model must share
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "experts", "moe_ffn_hidden")


def same_shape(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two model configs have the same layer shape (:data:`SHAPE`)."""
    return all(a.get(k) == b.get(k) for k in SHAPE)


def flavor_of(config: dict[str, Any]) -> tuple[str, str] | None:
    """torchtitan's ``([model] name, flavor)`` of a model config's layer shape (:data:`TORCHTITAN_FLAVORS`,
    the first listed), or None where it has none."""
    from profiler.models import preset

    return next((k for k, known in TORCHTITAN_FLAVORS.items() if same_shape(preset(known).to_dict(), config)), None)


def check_flavor(doc: dict[str, Any], ctx: Context) -> None:
    """Refuse a ``[model]`` flavor that is a known preset of another shape than the model being priced."""
    from profiler.models import preset

    name = _get(doc, "model", "model_name", TORCHTITAN_MODEL_DEFAULT)
    flavor = _get(doc, "model", "flavor", None)
    known = TORCHTITAN_FLAVORS.get((name, flavor)) if isinstance(name, str) and isinstance(flavor, str) else None
    if known is None or not all(k in ctx.config for k in SHAPE):  # a traced module has no such keys: unchecked
        return
    trained = preset(known).to_dict()
    if same_shape(trained, ctx.config):
        return

    def shape(c: dict[str, Any]) -> str:
        return f"{c.get('layers')} layers, hidden {c.get('hidden')}"

    priced = ctx.config.get("name") or "the model given"
    raise ConfigError(f"{ctx.origin}: [model] {K['model_name']} {name!r} flavor {flavor!r} trains {known} "
                      f"({shape(trained)}), but the model being priced is {priced} ({shape(ctx.config)}); give "
                      "--model for the model the file trains")


def strategy(doc: dict[str, Any], ctx: Context, fqn: dict[str, Any] = TORCHTITAN_FQN) -> dict[str, Any]:
    """The plan fields of a job config (``fqn``: the module names its stage lists hold)."""
    o = ctx.origin
    check_flavor(doc, ctx)
    par = doc.get(str(K["parallelism"]), {})

    def degree(key: str, default: int = 1) -> int:
        return count(par.get(str(K[key]), default), f"parallelism.{K[key]}", o)

    tp, pp, cp, ep, dpr = degree("tp"), degree("pp"), degree("cp"), degree("ep"), degree("dp_replicate")
    shard = par.get(str(K["dp_shard"]), -1)
    if shard == -1:
        rest = ctx.world // (tp * pp * cp * dpr)
        if rest * tp * pp * cp * dpr != ctx.world:
            raise ConfigError(f"{o}: tp {tp} x pp {pp} x cp {cp} x replicas {dpr} does not divide {ctx.world} GPUs")
        shard = rest
    dps = count(shard, f"parallelism.{K['dp_shard']}", o)
    fields: dict[str, Any] = {"mesh": {"pp": pp, "dp_replicate": dpr, "dp_shard": dps, "cp": cp, "tp": tp, "ep": ep},
                              "sequence_parallel": tp > 1}
    etp = degree("etp")  # torchtitan's default 1: with ep > 1 and tp > 1 the expert ranks fold over tp
    if ep > 1 and etp not in (1, tp):
        raise ConfigError(f"{o}: parallelism.{K['etp']} {etp} is neither 1 nor tp {tp} (torchtitan runs no other)")
    if ep > 1 and etp != tp:
        fields["mesh"]["etp"] = etp
    if cp > 1:
        rotate = par.get(str(K["cp_rotate"]), "allgather")
        methods = {v: k for k, v in TORCHTITAN_CP_ROTATE.items()}
        if rotate not in methods:
            raise ConfigError(f"{o}: context_parallel_rotate_method {rotate!r} is not one of {', '.join(methods)}")
        fields["cp_rotate"] = methods[rotate]
    local = count(_get(doc, "training", "local_batch", 8), "training.local_batch_size", o)
    if _get(doc, "training", "global_batch", -1) == -1:
        fields["global_batch"] = local * dpr * dps
    fields["micro_batch"] = local
    if pp > 1:
        _pipeline(par, fields, ctx, fqn)
    sharding = _sharding(par, dps * cp, dpr, pp, o)
    offload = "params" if _get(doc, "training", "cpu_offload", False) is True else "none"
    return _units(doc, fields, ctx, sharding, offload)


def _sharding(par: dict[str, Any], shard_group: int, replicas: int, pp: int, origin: str) -> str:
    if shard_group == 1:
        return "replicate"
    policy = par.get(str(K["reshard"]), "default")
    by_policy = {"always": "zero3", "never": "zero3_keep", "default": "zero3" if pp == 1 else "zero3_keep"}
    if policy not in by_policy:
        raise ConfigError(f"{origin}: fsdp_reshard_after_forward {policy!r} is not always, never or default")
    return by_policy[policy]


def _pipeline(par: dict[str, Any], fields: dict[str, Any], ctx: Context, fqn: dict[str, Any]) -> None:
    o, pp = ctx.origin, fields["mesh"]["pp"]
    name = par.get(str(K["schedule"]), "1F1B")
    if name not in SCHEDULES:
        raise ConfigError(f"{o}: pipeline_parallel_schedule {name!r} is not priced; known: {', '.join(SCHEDULES)}")
    sched = SCHEDULES[name]
    mb = count(par.get(str(K["pp_microbatch"]), 1), f"parallelism.{K['pp_microbatch']}", o)
    fields["local_batch"], fields["micro_batch"], fields["schedule"] = fields["micro_batch"], mb, sched
    parts = par.get(str(K["fqns_per_part"]))
    if parts is not None:
        sizes = _part_sizes(parts, ctx, fqn)
    else:
        per = par.get(str(K["layers_per_stage"]))
        first = count(par.get(str(K["first_less"]), 1), f"parallelism.{K['first_less']}", o, 0)
        last = count(par.get(str(K["last_less"]), 1), f"parallelism.{K['last_less']}", o, 0)
        stages = pp * (1 if sched in SINGLE_STAGE else 2)
        if per is not None:
            stages = math.ceil((ctx.blocks + first + last) / count(per, f"parallelism.{K['layers_per_stage']}", o))
        sizes = generated_sizes(stages, ctx.blocks, first, last, o)
    if len(sizes) % pp:
        raise ConfigError(f"{o}: {len(sizes)} pipeline stages do not divide over pp = {pp} ranks")
    v = len(sizes) // pp
    if sched == "zb" and v == 1:
        raise ConfigError(f"{o}: torchtitan's InterleavedZeroBubble needs at least 2 stages per rank")
    fields["vpp"] = v if sched == "interleaved" or v > 1 else 1
    if sched != "interleaved" and v > 1:
        raise ConfigError(f"{o}: schedule {name} runs one stage per rank, the config has {v}")
    fields["stage_layers"] = sizes
    local = fields.pop("local_batch")  # the local batch, split into micro-batches of mb
    if local % mb or local // mb < pp:
        raise ConfigError(f"{o}: local_batch_size {local} must split into at least pp = {pp} micro-batches of "
                          f"pipeline_parallel_microbatch_size {mb} (torch's pipeline schedules need as many)")


def generated_sizes(stages: int, blocks: int, first: int, last: int, origin: str) -> list[int]:
    """Blocks per stage as torchtitan's ``generate_llm_fqn_per_model_part`` cuts them: ``blocks + first +
    last`` effective layers as even as possible, the extra ones on the first stages, the embedding
    worth ``first`` layers of stage 0 and the norm and head ``last`` of the last stage."""
    if stages == 1:
        return [blocks]
    effective = blocks + first + last
    per, extra = divmod(effective, stages)
    if per == 0 or first > per or last > per:
        raise ConfigError(f"{origin}: torchtitan cannot cut {blocks} layers (+{first} +{last} for the embedding "
                          f"and the head) into {stages} stages")
    sizes, left = [], blocks
    for k in range(stages):
        room = per + (k < extra) - (first if k == 0 else last if k == stages - 1 else 0)
        take = min(room, left)
        sizes.append(take)
        left -= take
    if left:
        raise ConfigError(f"{origin}: torchtitan leaves {left} layers out of {stages} stages")
    return sizes


def _part_sizes(parts: Any, ctx: Context, fqn: dict[str, Any]) -> list[int]:
    """Blocks per stage of ``module_fqns_per_model_part``: every block once, in order, the embedding first
    and the head last."""
    o = ctx.origin
    if not isinstance(parts, list) or not all(isinstance(p, list) and all(isinstance(x, str) for x in p) for p in parts):
        raise ConfigError(f"{o}: module_fqns_per_model_part must be a list of lists of module names")
    prefix = str(fqn["block"]).split("{")[0]
    order: list[int] = []
    sizes = []
    for part in parts:
        blocks = []
        for name in part:
            if name.startswith(prefix) and is_digits(name[len(prefix):]):
                blocks.append(int(name[len(prefix):]))
            elif name not in (*fqn["embedding"], *fqn["head"]):
                raise ConfigError(f"{o}: module_fqns_per_model_part names {name!r}, not a module of the model")
        order += blocks
        sizes.append(len(blocks))
    if order != list(range(ctx.blocks)):
        raise ConfigError(f"{o}: module_fqns_per_model_part must hold the model's {ctx.blocks} layers once each, in order")
    return sizes


def _units(doc: dict[str, Any], fields: dict[str, Any], ctx: Context, sharding: str, offload: str) -> dict[str, Any]:
    o = ctx.origin
    ac = doc.get(str(K["ac"]), {})
    mode = ac.get(str(K["ac_mode"]), "selective")
    option = ac.get(str(K["ac_option"]), "2")
    if mode not in ("none", "full", "selective"):
        raise ConfigError(f"{o}: activation_checkpoint.mode {mode!r} is not none, full or selective")
    blocks = [u for u in ctx.units if u.startswith("layers.")]
    if mode == "selective" and option != "op":
        if not (isinstance(option, str) and is_digits(option) and int(option) >= 1):
            raise ConfigError(f"{o}: selective_ac_option must be 'op' or a positive integer string, got {option!r}")
        every = int(option)
        per_block = ["full" if _position(fields, ctx.blocks, b) % every == 0 else "none" for b in range(ctx.blocks)]
    else:
        per_block = [{"none": "none", "full": "full", "selective": "selective"}[mode]] * ctx.blocks
    fields.update(unit_choices(ctx.units, dict(zip(blocks, per_block, strict=True)), sharding, offload))
    return fields


def _position(fields: dict[str, Any], blocks: int, b: int) -> int:
    """Block ``b``'s 1-based position among the blocks its pipeline rank builds."""
    pp, v = fields["mesh"]["pp"], fields.get("vpp", 1)
    for held in rank_blocks(blocks, pp, v, fields.get("stage_layers")):
        if b in held:
            return held.index(b) + 1
    raise AssertionError(b)
