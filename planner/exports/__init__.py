"""Export a plan to a training framework's configuration (``shardplan export``).

One module per target (``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron``, ``python``), each
with ``CAPS`` (what the target can express), ``SUFFIX``, ``adjust(n)`` (target-specific mapping to the
nearest expressible plan) and ``render(n, s, cost)``. Key names live in :mod:`planner.exports.keys`.
Where a target cannot express the plan, :func:`export` maps it to the nearest plan it can, re-prices
that plan with the cost model and reports what was lost with its predicted cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from planner.exports.base import Exported, change_lines, normalize
from planner.exports.keys import VERSIONS
from planner.reprice import reprice, units_of
from vocab.errors import UnknownNameError
from vocab.plan import Plan

if TYPE_CHECKING:
    from profiler.graph import LayerGraph

TARGETS = ("torchtitan", "megatron", "deepspeed", "nanotron", "python")


def check_target(target: str) -> str:
    key = target.strip().lower()
    if key not in TARGETS:
        raise UnknownNameError("export target", target, TARGETS)
    return key


def export(plan: Plan, target: str, graph: LayerGraph | None = None) -> Exported:
    """The plan as ``target``'s configuration text, or the nearest plan the target can express,
    re-priced with the plan's model (its preset, config file or recorded graph) or ``graph``."""
    key = check_target(target)
    mod = importlib.import_module(f"{__name__}.{key}")
    units = units_of(plan)
    n = normalize(plan, units, mod.CAPS)
    mod.adjust(n)
    s = n.strategy()
    rep = reprice(plan, s, n.workload_model(), graph) if n.losses else None
    e = Exported(target=key, tool_version=VERSIONS[key], text="", suffix=mod.SUFFIX, strategy=s,
                 losses=n.losses, notes=n.notes, repriced=rep, changes=change_lines(plan, s, units))
    if rep is not None:
        e.notes += rep.notes
    e.text = mod.render(n, s, e.cost_line())
    return e


__all__ = ["TARGETS", "Exported", "check_target", "export"]
