"""shardplan: the script ``export --to python`` writes, read back through the plan it embeds."""

from __future__ import annotations

import re
from typing import Any

from planner.imports import ConfigError, Context
from vocab.errors import ShardplanError
from vocab.plan import Plan, parse_plan

SUFFIXES = (".py",)
_EMBEDDED = re.compile(r'parse_plan\(r"""\n(.*?)"""\)', re.DOTALL)


def parse(text: str, origin: str) -> Plan:
    m = _EMBEDDED.search(text)
    if m is None:
        raise ConfigError(f"{origin} is not a script written by 'shardplan export --to python' (no embedded plan)")
    try:
        return parse_plan(m.group(1))
    except ShardplanError as e:
        raise ConfigError(f"{origin}: the embedded plan: {e}") from None


def workload(doc: Plan, origin: str) -> dict[str, Any]:
    w = doc.inputs.workload
    return {"seq_len": w.seq_len, "global_batch": w.global_batch, "precision": w.precision}


def strategy(doc: Plan, ctx: Context) -> dict[str, Any]:
    return doc.strategy.model_dump()
