"""What every trainer's importer shares (``shardplan import``): the ``shardplan-inputs`` header line an
export carries, the error a configuration that cannot be read raises, what a file is read against
(:class:`Context`), and the checks of its keys and counts.

Each trainer's ``read`` module (``planner/trainers/<name>/read.py``) has ``SUFFIXES`` (how its files
are recognised), ``parse(text, origin)`` (the decoded document, every key checked against the keys the
target's pinned release accepts: :func:`vocab.targets.key_snapshot`), ``workload(doc)`` (what the file
says of the sequence length, the global batch and the precision) and ``strategy(doc, ctx)`` (the plan's
strategy fields, given the model's units and the cluster's size); :func:`planner.trainers.import_plan`
reads a file with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from vocab.errors import ShardplanError
from vocab.strategy import RECOMPUTES
from vocab.targets import Target

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


__all__ = ["INPUTS_TAG", "ConfigError", "Context", "count", "inputs_line", "read_inputs", "refuse_unknown",
           "unit_choices", "unknown_keys"]
