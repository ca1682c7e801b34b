"""Read a trainer's configuration back into a plan (``shardplan import``).

One module per trainer (``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron``, ``python``), each
with ``SUFFIXES`` (how its files are recognised), ``parse(text, origin)`` (the decoded document, every
key checked against the keys the target's pinned release accepts: :func:`vocab.targets.key_snapshot`),
``workload(doc)`` (what the file says of the sequence length, the global batch and the precision) and
``strategy(doc, ctx)`` (the plan's strategy fields, given the model's units and the cluster's size).

The model and the cluster come from ``--model`` and ``--cluster``, or from the ``shardplan-inputs``
line that every export except DeepSpeed's JSON carries in its header (:func:`inputs_line`). The header
names them for the record: it may give a preset and a cluster like ``8xh100`` (or a mapping), but a
file it names is not opened; that takes ``--model`` / ``--cluster`` on the command line. The result
is a plan for the trainer's target, priced with that target's behaviour: ``export`` then ``import``
gives back the plan's strategy and its predicted step time.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vocab.arguments import typed
from vocab.errors import ShardplanError, UnknownNameError, shown
from vocab.io import read_text, validate_document
from vocab.plan import Plan, TargetRef
from vocab.strategy import RECOMPUTES, Strategy, Workload, even_split
from vocab.targets import WORKLOAD_BEHAVIOUR, Target, by_exporter

#: the importers, by the exporter (and target) they read
IMPORTERS = ("torchtitan", "megatron", "deepspeed", "nanotron", "python")
INPUTS_TAG = "shardplan-inputs:"
_INPUTS = re.compile(r"^\s*(?:#|//)\s*" + re.escape(INPUTS_TAG) + r"\s*(\{.*\})\s*$", re.MULTILINE)


class ConfigError(ShardplanError):
    """A trainer's configuration that cannot be read into a plan."""


@dataclass(frozen=True)
class Context:
    """What a configuration is read against: the model's units in order, its transformer block
    count and config keys (``hidden``, ``heads``, ...), the cluster's GPUs, the file's name for
    messages, and the expert parallelism given on the command line (for a trainer whose file does
    not hold it; None when not given)."""

    origin: str
    units: list[str]
    blocks: int
    world: int
    config: dict[str, Any] = field(default_factory=dict)
    ep: int | None = None


def inputs_line(model: str, cluster: dict[str, Any], memory_limit_gib: float | None = None) -> str:
    """The header line an export carries so that ``import`` finds the model, the cluster and the
    plan's memory limit."""
    data: dict[str, Any] = {"model": model, "cluster": cluster}
    if memory_limit_gib is not None:
        data["memory_limit_gib"] = memory_limit_gib
    return f"{INPUTS_TAG} " + json.dumps(data, sort_keys=True)


def read_inputs(text: str, origin: str) -> dict[str, Any]:
    """The model and cluster the file's ``shardplan-inputs`` line names ({} when it has none)."""
    m = _INPUTS.search(text)
    if m is None:
        return {}
    try:
        data = json.loads(m.group(1))
    except ValueError:
        raise ConfigError(f"{origin}: the {INPUTS_TAG} line is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        raise ConfigError(f"{origin}: the {INPUTS_TAG} line must name a model and a cluster")
    return data


@typed
def importer_for(path: Path, trainer: str | None) -> str:
    """The importer named by ``trainer`` (an importer or target name), or the one whose suffix ``path`` has."""
    if trainer is not None:
        key = trainer.strip().lower()
        if key == "shardplan":
            key = "python"
        if key not in IMPORTERS:
            raise UnknownNameError("trainer", trainer, [*IMPORTERS[:-1], "shardplan"])
        return key
    for name in IMPORTERS:
        if path.suffix.lower() in _module(name).SUFFIXES:
            return name
    raise ConfigError(f"cannot tell the trainer of '{path.name}' from its suffix: give --from "
                      f"{'|'.join([*IMPORTERS[:-1], 'shardplan'])}")


def _module(name: str) -> Any:
    return importlib.import_module(f"{__name__}.{name}")


def unknown_keys(doc: Any, tree: Any, path: str = "") -> list[str]:
    """Dotted keys of ``doc`` that a key tree ({key: subtree}, None for a leaf) does not hold."""
    if not isinstance(doc, dict) or tree is None:
        return []
    bad = []
    for k, v in doc.items():
        if k not in tree:
            bad.append(f"{path}{k}")
        else:
            bad += unknown_keys(v, tree[k], f"{path}{k}.")
    return bad


def refuse_unknown(bad: list[str], t: Target, origin: str) -> None:
    """One error naming the keys ``t``'s pinned release does not know."""
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ConfigError(f"{origin}: {t.label} has no key {shown}")


def count(value: Any, what: str, origin: str, minimum: int = 1) -> int:
    """An integer setting of at least ``minimum`` (a bool or a float is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{origin}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def unit_choices(units: list[str], recompute: dict[str, str], sharding: str, offload: str) -> dict[str, Any]:
    """The strategy's ``default`` and ``layers`` for a trainer that sets sharding and offload for the whole
    model: every unit ``sharding`` and ``offload``, its recomputation from ``recompute`` (none for a
    unit it does not name); the most frequent recomputation is the default (a tie goes to none)."""
    per_unit = [recompute.get(u, "none") for u in units]
    common = max(RECOMPUTES, key=per_unit.count)
    unit = {"sharding": sharding, "offload": offload}
    return {"default": {**unit, "recompute": common},
            "layers": [{"unit": u, **unit, "recompute": r} for u, r in zip(units, per_unit, strict=True) if r != common]}


@typed
def import_plan(path: str | Path, trainer: str | None = None, model: str | None = None,
                cluster: str | dict[str, Any] | None = None, seq_len: int | None = None,
                memory_limit_gib: float | None = None, ep: int | None = None) -> Plan:
    """The plan a trainer's configuration file runs, priced for that trainer's target; ``ep`` is the
    expert parallelism of a trainer whose file does not hold it (DeepSpeed sets it in the model code)."""
    from planner.reprice import load_named_model, price
    from profiler.hardware import parse_cluster

    path = Path(path)
    origin = f"'{path.name}'"
    key = importer_for(path, trainer)
    mod, t = _module(key), by_exporter(key)
    text = read_text(path, f"{t.trainer} configuration", ConfigError)
    head = read_inputs(text, origin)
    model = model or _header_model(head.get("model"), origin)
    if not model:
        raise ConfigError(f"{origin} does not name its model: give --model")
    spec = cluster or _header_cluster(head.get("cluster"), origin)
    if not spec:
        raise ConfigError(f"{origin} does not name its cluster: give --cluster")
    cl = parse_cluster(spec)
    limit = memory_limit_gib if memory_limit_gib is not None else head.get("memory_limit_gib")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 < limit < 1e9):
        raise ConfigError(f"{origin}: the memory limit must be a positive number of GiB, got {limit!r}")
    doc = mod.parse(text, origin)
    found = mod.workload(doc, origin)
    seq = seq_len or found.get("seq_len")
    if not seq:
        raise ConfigError(f"{origin} does not say the sequence length: give --seq-len")
    if seq_len and found.get("seq_len") and seq_len != found["seq_len"]:
        raise ConfigError(f"{origin} trains {found['seq_len']} tokens per sample, not --seq-len {seq_len}")
    graph = load_named_model(model, seq)
    units = [u for u, _ in graph.blocks()]
    ctx = Context(origin, units, graph.num_blocks, cl.world_size, dict(graph.config), ep)
    fields = mod.strategy(doc, ctx)
    if ep is not None and not getattr(mod, "EP_FROM_COMMAND_LINE", False):
        raise ConfigError(f"{origin} says its own expert parallelism; --ep is for a DeepSpeed JSON")
    implied_batch = fields.pop("global_batch", None)  # what the trainer derives when the file leaves it out
    strategy = _validated(Strategy, fields, origin)
    if strategy.stage_layers is not None and strategy.stage_layers == even_split(ctx.blocks, strategy.num_stages):
        strategy = strategy.model_copy(update={"stage_layers": None})  # the even split, said as the plan says it
    if strategy.mesh.world_size != cl.world_size:
        raise ConfigError(f"{origin} lays out {strategy.mesh.world_size} GPUs ({_mesh_text(strategy)}), the cluster "
                          f"has {cl.world_size}")
    gb = found.get("global_batch", implied_batch)
    if gb is None:
        raise ConfigError(f"{origin} does not say the global batch")
    if gb % (strategy.mesh.dp * strategy.micro_batch):
        raise ConfigError(f"{origin}: global batch {gb} is not a multiple of micro-batch {strategy.micro_batch} x "
                          f"{strategy.mesh.dp} data-parallel ranks")
    said = {f: found[f] for f in WORKLOAD_BEHAVIOUR if f in found}  # what the file says; else how the target runs
    w = _validated(Workload, {"seq_len": seq, "global_batch": gb, "precision": found.get("precision", "bf16"),
                              "moe_capacity_factor": found.get("moe_capacity_factor"),
                              **t.behaviour.workload(**said)}, origin)
    plan = price(graph, cl, strategy, w, limit, model=model)
    return plan.model_copy(update={"inputs": plan.inputs.model_copy(
        update={"target": TargetRef(name=t.name, version=t.version or None)})})


def _header_model(model: str | None, origin: str) -> str | None:
    """The header's model where it loads without a file (a preset, or a Hugging Face id a preset lists)."""
    from planner.reprice import loadable_by_name

    if model and not loadable_by_name(model):
        raise ConfigError(f"{origin}: its {INPUTS_TAG} line names model {shown(model)}, a file path, not a preset; "
                          "pass --model PATH to load it")
    return model


def _header_cluster(spec: Any, origin: str) -> Any:
    """The header's cluster where it needs no file (``8xh100``, or a mapping of fields)."""
    from profiler.hardware import names_cluster_file

    if isinstance(spec, str) and names_cluster_file(spec):
        raise ConfigError(f"{origin}: its {INPUTS_TAG} line names cluster file {shown(spec)}; pass --cluster PATH "
                          "to load it")
    return spec


def _validated(cls: Any, data: dict[str, Any], origin: str) -> Any:
    return validate_document(cls, data, f"the plan {origin} describes", cls.__name__.lower(), ConfigError)


def _mesh_text(s: Strategy) -> str:
    return " ".join(f"{k}={v}" for k, v in s.mesh.axes().items() if v > 1) or "one GPU"


__all__ = ["IMPORTERS", "ConfigError", "Context", "import_plan", "importer_for", "inputs_line", "read_inputs"]
