"""torchtitan: the job config TOML (``[parallelism]``, ``[activation_checkpoint]``, ``[training]``), written by
the TOML emitter ``tomli_w`` (every string quoted by TOML's rules)."""

from __future__ import annotations

from typing import Any

import tomli_w

from costmodel.kernels import experts_low_precision
from planner.reprice import block_index, plan_graph
from planner.trainers.exporting import Nearest, collapse, header
from planner.trainers.torchtitan.keys import (
    TORCHTITAN,
    TORCHTITAN_CP_ROTATE,
    TORCHTITAN_EXPERTS_FQN,
    TORCHTITAN_FLOAT8,
    TORCHTITAN_FQN,
    TORCHTITAN_GROUPED,
    TORCHTITAN_MX,
    TORCHTITAN_PLACEHOLDERS,
    TORCHTITAN_RESHARD,
    TORCHTITAN_SCHEDULES,
)
from planner.trainers.torchtitan.read import flavor_of
from vocab.strategy import FP8_PRECISIONS, Strategy, Workload

SUFFIX = ".toml"


def _rank_positions(n: Nearest) -> list[int]:
    """Each block's 1-based position among the blocks its pipeline rank builds: torchtitan counts layers
    for ``selective_ac_option = "N"`` per process, over the rank's (virtual) stages in order."""
    p, sizes = n.mesh["pp"], n.stage_sizes()
    owner = [v % p for v, size in enumerate(sizes) for _ in range(size)]
    seen: dict[int, int] = {}
    out = []
    for r in owner:
        seen[r] = seen.get(r, 0) + 1
        out.append(seen[r])
    return out


def adjust(n: Nearest) -> None:
    """Activation checkpointing of the transformer blocks: all alike, or full on every N-th block that a
    pipeline rank builds (N at most the blocks of one rank)."""
    vals = n.values("recompute", n.blocks)
    if len(set(vals)) <= 1:
        return
    if set(vals) == {"none", "full"}:
        order = sorted(n.blocks, key=lambda u: block_index(u) or 0)
        pos = dict(zip(order, _rank_positions(n), strict=True))
        for every in range(2, max(pos.values()) + 1):
            if all((v == "full") == (pos[u] % every == 0) for u, v in zip(n.blocks, vals, strict=True)):
                n.extra["ac_every"] = every
                return
    collapse(n, "recompute", "torchtitan checkpoints all blocks alike, or fully every N-th block of a rank",
             n.blocks, "per-layer recompute other than full on every N-th block of a pipeline rank")


def _table(items: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """A TOML table's keys in order, without the keys this release has not (``None``) or unset values."""
    return {k: v for k, v in items if k is not None and v is not None}


def fqns_per_part(s: Strategy, n_blocks: int, fqn: dict[str, Any] = TORCHTITAN_FQN) -> list[list[str]]:
    """torchtitan's module FQNs of each virtual stage (:meth:`Strategy.stage_blocks`); ``fqn``: the
    release's module names (the embedding's, a block's, the head's)."""
    parts = [[str(fqn["block"]).format(i=j) for j in held] for held in s.stage_blocks(n_blocks)]
    parts[0] = list(fqn["embedding"]) + parts[0]
    parts[-1] = parts[-1] + list(fqn["head"])
    return parts


def data_parallel(n: Nearest, s: Strategy) -> tuple[int, int, str]:
    """(replicate degree, shard degree, the sharding) as torchtitan takes them: a plan that shards nothing
    replicates over every data-parallel rank."""
    m, units = s.mesh, n.units
    shard = s.for_unit(units[0]).sharding if units else s.default.sharding
    if all(s.for_unit(u).sharding == "replicate" for u in units):
        return m.dp_replicate * m.dp_shard, 1, shard
    return m.dp_replicate, m.dp_shard, shard


def render(n: Nearest, s: Strategy, cost: str) -> str:
    K, m, w = TORCHTITAN, s.mesh, n.workload_model()
    units = n.units
    rep, shd, shard = data_parallel(n, s)
    n_mb = s.num_microbatches(w.global_batch)
    par: list[tuple[str | None, Any]] = [
        (K["dp_replicate"], rep), (K["dp_shard"], shd), (K["reshard"], TORCHTITAN_RESHARD.get(shard, "default")),
        (K["tp"], m.tp), (K["sequence_parallel"], s.sequence_parallel), (K["pp"], m.pp),
    ]
    if m.pp > 1:
        par += [(K["schedule"], TORCHTITAN_SCHEDULES[s.schedule]), (K["pp_microbatch"], s.micro_batch),
                (K["fqns_per_part"], fqns_per_part(s, len(n.blocks)))]
    par += [(K["cp"], m.cp)]
    if m.cp > 1:
        par.append((K["cp_rotate"], TORCHTITAN_CP_ROTATE[s.cp_rotate]))
    par.append((K["ep"], m.ep))
    if m.ep > 1:  # written always: torchtitan's default (1) folds the expert ranks over tp
        par += [(K["etp"], m.expert_tp), (K["ep_backend"], "deepep" if w.moe_dispatch == "dedup" else "standard")]
    rec = {s.for_unit(u).recompute for u in n.blocks} - {"none"}
    if "ac_every" in n.extra:
        ac = [(K["ac_mode"], "selective"), (K["ac_option"], str(n.extra["ac_every"]))]
    elif rec == {"full"}:
        ac = [(K["ac_mode"], "full")]
    elif rec == {"selective"}:
        ac = [(K["ac_mode"], "selective"), (K["ac_option"], "op")]
    else:
        ac = [(K["ac_mode"], "none")]
    offload = any(s.for_unit(u).offload != "none" for u in units)
    train: list[tuple[str | None, Any]] = [
        (K["local_batch"], s.micro_batch * (n_mb if m.pp > 1 else 1)), (K["global_batch"], w.global_batch),
        (K["seq_len"], w.seq_len), (K["mp_param"], "bfloat16"), (K["cpu_offload"], offload),
    ]
    model = model_keys(n)
    grouped = _grouped_converter(n, w, m.pp, m.cp)
    if w.precision in ("fp8", "mxfp8"):
        model.append((K["converters"], [TORCHTITAN_FLOAT8 if w.precision == "fp8" else TORCHTITAN_MX,
                                        *([TORCHTITAN_GROUPED[w.precision][1]] if grouped else [])]))
    placeholders = {section: [(K[key], value) for sec, key, value in TORCHTITAN_PLACEHOLDERS if sec == section]
                    for section in ("training", "model")}
    doc = {str(K["parallelism"]): _table(par), str(K["ac"]): _table(ac),
           str(K["training"]): _table(train + placeholders["training"]),
           str(K["model"]): _table(model + placeholders["model"])}
    if grouped:
        doc[str(K["quantize"])] = {str(K["grouped_mm"]): {TORCHTITAN_GROUPED[w.precision][0]: {
            str(K["grouped_fqns"]): [TORCHTITAN_EXPERTS_FQN]}}}
    unset = ("# placeholders: set dataset_path and hf_assets_path to the run's data and tokenizer (torchtitan stops "
             "at start-up while they name nothing); add the optimizer, learning-rate and checkpoint sections\n")
    return header(n.plan, n.label, n.losses, cost) + unset + "\n" + tomli_w.dumps(doc)


def _grouped_converter(n: Nearest, w: Workload, pp: int, cp: int) -> bool:
    """Whether the experts' grouped-GEMM converter is written: an fp8/mxfp8 plan of a model with experts
    whose price runs them in that precision on this mesh (:func:`costmodel.kernels.experts_low_precision`)."""
    if w.precision not in FP8_PRECISIONS or not plan_graph(n.plan).has_experts:
        return False
    if not bool(experts_low_precision(w.precision, w.low_precision_experts, pp, cp)):
        return False
    n.notes.append(f"{TORCHTITAN_GROUPED[w.precision][1]} needs torchao's prototype MoE training "
                   "(torchao.prototype.moe_training) and, for its speed, torch.compile")
    return True


def model_keys(n: Nearest) -> list[tuple[str | None, Any]]:
    """``[model]`` ``name`` and ``flavor`` of torchtitan's model of the plan's layer shape
    (:data:`TORCHTITAN_FLAVORS`, the same shape the import checks); none, with a note, where the plan's
    model is no preset or torchtitan has no flavor of its shape (torchtitan would train its default
    ``debugmodel``)."""
    from profiler.models import preset
    from vocab.errors import ShardplanError

    name = n.plan.inputs.model
    try:
        found = flavor_of(preset(name).to_dict())
    except ShardplanError:
        found = None
    if found is not None:
        return [(TORCHTITAN["model_name"], found[0]), (TORCHTITAN["flavor"], found[1])]
    n.notes.append(f"[model] names no flavor: {n.label} has none of {name}'s shape; set "
                   "[model] name and flavor (and hf_assets_path) to your model before training")
    return []
