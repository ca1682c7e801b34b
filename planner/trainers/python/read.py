"""shardplan: the script ``export --to python`` writes, read back through the plan it embeds: the literal
assigned to ``PLAN_DOCUMENT`` (read by ``ast.literal_eval``, never run), or the JSON text that older
scripts pass to ``parse_plan(r\"\"\"...\"\"\")``."""

from __future__ import annotations

import ast
import re
from typing import Any

from planner.trainers.reading import ConfigError, Context
from vocab.errors import ShardplanError
from vocab.plan import Plan, parse_plan
from vocab.targets import Target

SUFFIXES = (".py",)
_EMBEDDED = re.compile(r'parse_plan\(r"""\n(.*?)"""\)', re.DOTALL)


#: the name the script gives the plan document
DOCUMENT = "PLAN_DOCUMENT"


def _literal(text: str) -> Any:
    """The value of the script's ``PLAN_DOCUMENT = <literal>``, or None when it has none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == DOCUMENT):
            try:
                return ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
    return None


def parse(text: str, origin: str, t: Target | None = None) -> Plan:
    """The plan the script embeds (``t``, the target, is the one the script names: not consulted)."""
    doc: Any = _literal(text)
    if doc is None:
        m = _EMBEDDED.search(text)
        doc = m.group(1) if m else None
    if doc is None:
        raise ConfigError(f"{origin} is not a script written by 'shardplan export --to python' (no embedded plan)")
    try:
        return parse_plan(doc)
    except ShardplanError as e:
        raise ConfigError(f"{origin}: the embedded plan: {e}") from None


def workload(doc: Plan, origin: str) -> dict[str, Any]:
    w = doc.inputs.workload
    return {"seq_len": w.seq_len, "global_batch": w.global_batch, "precision": w.precision}


def strategy(doc: Plan, ctx: Context) -> dict[str, Any]:
    return doc.strategy.model_dump()
