"""Check that a plan and a model agree before anything is changed, and say what differs."""

from __future__ import annotations

from torch import nn

from runtime.adapters import ModelAdapter
from runtime.units import resolve, slice_interleave, split_targets
from vocab.errors import ShardplanError
from vocab.strategy import Strategy


class PlanMismatchError(ShardplanError):
    """The plan does not fit the model, the process group or the device; the message lists why."""


def _split_problems(ad: ModelAdapter, strategy: Strategy) -> list[str]:
    targets = split_targets(ad, strategy)
    if not targets:
        return []
    if ad.kind != "reference":
        return [f"operator splitting ({targets[0][0]}, split={targets[0][1]}) is implemented for the reference model only"]
    out = []
    for path, k in targets:
        mod = ad.get(path)
        if isinstance(mod, nn.Embedding):
            width, ways = mod.embedding_dim, k
        elif isinstance(mod, nn.Linear):
            width, ways = mod.out_features, k * slice_interleave(strategy, path)
        else:
            out.append(f"operator '{path}' is a {type(mod).__name__}, which cannot be split (only Linear, Embedding)")
            continue
        if width % ways:
            out.append(f"operator '{path}': width {width} is not divisible by split={k}"
                       + (f" x tp={ways // k} (column-parallel slices hold a part of every rank's rows)"
                          if ways != k else ""))
    return out


def check(ad: ModelAdapter, strategy: Strategy, world_size: int, device: str, model_problem: str | None = None) -> None:
    """Raise :class:`PlanMismatchError` listing every disagreement between plan and model.

    Args:
        ad: the model.
        strategy: the plan's strategy.
        world_size: processes in the default group.
        device: ``cpu`` or ``cuda``.
        model_problem: why the plan document names another model, if it does.
    """
    m = strategy.mesh
    problems: list[str] = []
    if model_problem:
        problems.append(model_problem)
    if m.world_size != world_size:
        problems.append(f"world size: the plan's mesh {m.axes()} has {m.world_size} ranks, the process group {world_size}")
    experts = ad.experts
    if m.ep > 1:
        if not experts:
            problems.append(f"expert parallelism (ep={m.ep}) needs a mixture-of-experts model of the runtime's own")
        elif experts % m.ep:
            problems.append(f"ep={m.ep} does not divide the {experts} experts")
        if (m.dp_shard * m.cp) % m.ep:
            problems.append(f"ep={m.ep} must divide dp_shard x cp = {m.dp_shard * m.cp} (expert ranks are data-parallel ranks)")
    if experts and m.tp > 1:
        problems.append(f"tp={m.tp} with mixture-of-experts blocks: the runtime does not split experts over tensor-parallel ranks")
    if m.cp > 1:
        if ad.kind != "reference":
            problems.append(f"context parallelism (cp={m.cp}) is implemented for the reference model only, not {ad.kind}")
        local_heads = ad.heads // m.tp if ad.heads % m.tp == 0 else 0
        if strategy.cp_mode == "ulysses" and local_heads and local_heads % m.cp:
            problems.append(f"Ulysses splits the {local_heads} heads of a tp rank over cp={m.cp}: not divisible")
    if m.tp > 1 and strategy.tp_mode == "tsp":
        if ad.kind != "reference":
            problems.append(f"tp_mode tsp is implemented for the reference model only, not {ad.kind}")
        if m.cp > 1 and strategy.cp_mode == "ulysses":
            problems.append("tp_mode tsp with Ulysses context parallelism: the runtime runs TSP with ring attention")
    elif m.tp > 1:
        for what, n in (("heads", ad.heads), ("kv_heads", ad.kv_heads), ("ffn_hidden", ad.ffn_hidden)):
            if n % m.tp:
                problems.append(f"tp={m.tp} does not divide {what}={n}")
    if m.pp > 1:
        if ad.kind != "reference":
            problems.append(f"pipeline parallelism (pp={m.pp}) is implemented for the reference model only, not {ad.kind}")
        n_stages = strategy.num_stages
        if strategy.stage_layers is not None and sum(strategy.stage_layers) != ad.num_layers:
            problems.append(f"stage_layers {strategy.stage_layers} sum to {sum(strategy.stage_layers)}, "
                            f"the model has {ad.num_layers} layers")
        elif strategy.stage_layers is None and n_stages > ad.num_layers:
            problems.append(f"{n_stages} pipeline stages for {ad.num_layers} layers")
        emb, head = resolve(strategy, "embed.tok").sharding, resolve(strategy, "head").sharding
        if ad.tied and emb != head:
            problems.append(f"tied embeddings over pipeline stages need the same sharding for 'embedding' and "
                            f"'head' (their gradients are summed shard by shard); the plan has {emb} and {head}")
    unknown = [ls.unit for ls in strategy.layers if not ad.has(ls.unit)]
    if unknown:
        known = ", ".join(ad.units()[:3] + ["...", ad.units()[-1]])
        problems.append(f"units/operators not in the model: {unknown} (the model has {known} and their operators)")
    if not unknown:
        problems += _split_problems(ad, strategy)
    for ls in [strategy.default, *strategy.layers]:
        if ls.offload != "none" and device == "cuda" and ls.sharding not in ("zero3", "zero3_keep"):
            problems.append(f"unit '{ls.unit}': offload '{ls.offload}' needs zero3 sharding in the runtime (FSDP2)")
    if problems:
        uniq = list(dict.fromkeys(problems))
        raise PlanMismatchError("plan and model disagree: " + "; ".join(uniq))
