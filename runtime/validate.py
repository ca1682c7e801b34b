"""Check that a plan and a model agree before anything is changed, and say what differs."""

from __future__ import annotations

from torch import nn

from runtime.adapters import ModelAdapter
from runtime.units import resolve, slice_interleave, split_targets
from vocab.errors import ShardplanError
from vocab.rules import ModelShape, Subject
from vocab.rules import problems as rule_problems
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


def model_shape(ad: ModelAdapter) -> ModelShape:
    """What the validity rules read of a model the runtime adapted."""
    known = ", ".join(ad.units()[:3] + ["...", ad.units()[-1]])
    return ModelShape(f"this {ad.kind} model", ad.heads, ad.kv_heads, ad.ffn_hidden, ad.experts, ad.num_layers,
                      ad.has, f"the model has {known} and their operators")


def check(ad: ModelAdapter, strategy: Strategy, world_size: int, device: str, model_problem: str | None = None,
          seq_len: int | None = None, global_batch: int | None = None) -> None:
    """Raise :class:`PlanMismatchError` listing every disagreement between plan and model: the rules
    every validator applies (:data:`vocab.rules.RULES`, with the runtime's: tensor parallelism divides
    the heads, KV heads and FFN width and leaves experts whole, a pipeline gets a micro-batch per
    rank, sequence parallelism gets whole tokens) and what the runtime implements for its reference
    model only.

    Args:
        ad: the model.
        strategy: the plan's strategy.
        world_size: processes in the default group.
        device: ``cpu`` or ``cuda``.
        model_problem: why the plan document names another model, if it does.
        seq_len, global_batch: the workload, where known.
    """
    problems = [model_problem] if model_problem else []
    problems += rule_problems(Subject(strategy, model_shape(ad), seq_len, global_batch, world_size,
                                      "the process group's {} ranks", strict_tp=True, tp_experts=False, folding=False,
                                      pipelining=True, sp_tokens=True))
    problems += _runtime_problems(ad, strategy)
    if all(ad.has(ls.unit) for ls in strategy.layers):
        problems += _split_problems(ad, strategy)
    for ls in [strategy.default, *strategy.layers]:
        if ls.offload == "activations":
            problems.append(f"unit '{ls.unit}': offload 'activations' is not run by this runtime (it offloads states "
                            "with FSDP2)")
        elif ls.offload != "none" and device == "cuda" and ls.sharding not in ("zero3", "zero3_keep"):
            problems.append(f"unit '{ls.unit}': offload '{ls.offload}' needs zero3 sharding in the runtime (FSDP2)")
    if problems:
        uniq = list(dict.fromkeys(problems))
        raise PlanMismatchError("plan and model disagree: " + "; ".join(uniq))


def _runtime_problems(ad: ModelAdapter, strategy: Strategy) -> list[str]:
    """What the runtime runs for its reference model only, or not at all."""
    m, out = strategy.mesh, []
    ref = ad.kind == "reference"
    if m.cp > 1 and not ref:
        out.append(f"context parallelism (cp={m.cp}) is implemented for the reference model only, not {ad.kind}")
    if m.tp > 1 and strategy.tp_mode == "tsp":
        if not ref:
            out.append(f"tp_mode tsp is implemented for the reference model only, not {ad.kind}")
        if m.cp > 1 and strategy.cp_mode == "ulysses":
            out.append("tp_mode tsp with Ulysses context parallelism: the runtime runs TSP with ring attention")
    if m.pp > 1:
        if not ref:
            out.append(f"pipeline parallelism (pp={m.pp}) is implemented for the reference model only, not {ad.kind}")
        emb, head = resolve(strategy, "embed.tok").sharding, resolve(strategy, "head").sharding
        if ad.tied and emb != head:
            out.append(f"tied embeddings over pipeline stages need the same sharding for 'embedding' and "
                       f"'head' (their gradients are summed shard by shard); the plan has {emb} and {head}")
    return out
