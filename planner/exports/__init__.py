"""Export a plan to a training framework's configuration (``shardplan export``).

One module per exporter (``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron``, ``python``), each
writing for the target whose file names it (``vocab/targets/<name>.yaml``, ``exporter:``; ``python``
writes for ``shardplan``), with ``SUFFIX``, ``adjust(n)`` (target-specific mapping to the nearest
expressible plan) and ``render(n, s, cost)``. Key names live in :mod:`planner.exports.keys`.

:func:`export` maps the plan to the nearest plan the target can express and, where that differs,
re-prices it with the cost model; :func:`refusal` says why such an export is not written: the plan
uses what the target lacks (unless the nearest plan is asked for), or the nearest plan does not fit.
"""

from __future__ import annotations

import importlib

from planner.exports.base import Exported, Loss, change_lines, normalize
from planner.reprice import recorded_graph, reprice, units_of
from profiler.graph import LayerGraph
from vocab.arguments import typed
from vocab.errors import UnknownNameError
from vocab.plan import Plan
from vocab.targets import Target, by_exporter, targets

TARGETS = ("torchtitan", "megatron", "deepspeed", "nanotron", "python")


@typed
def check_target(target: str) -> str:
    """The exporter for ``target``: an exporter name, or the name of a target that has one."""
    key = target.strip().lower()
    if key in TARGETS:
        return key
    t = targets().get(key)
    if t is not None and t.exporter in TARGETS:
        return t.exporter
    known = dict.fromkeys([*TARGETS, *(n for n, t in targets().items() if t.exporter)])
    raise UnknownNameError("export target", target, known)


def target_of(exporter: str) -> Target:
    """The target an exporter writes for."""
    return by_exporter(check_target(exporter))


@typed
def lacks(plan: Plan, target: str) -> list[Loss]:
    """What ``plan`` uses that ``target`` (an exporter or target name) cannot express, and how the
    target would run it differently (``behaviour`` losses): empty when it exports as it is."""
    key = check_target(target)
    mod = importlib.import_module(f"{__name__}.{key}")
    n = normalize(plan, units_of(plan), by_exporter(key))
    mod.adjust(n)
    return n.losses


@typed
def export(plan: Plan, target: str, graph: LayerGraph | None = None) -> Exported:
    """The plan as ``target``'s configuration text, or the nearest plan the target can express,
    re-priced with the plan's model (its preset, config file or recorded graph) or ``graph``."""
    key = check_target(target)
    t = by_exporter(key)
    mod = importlib.import_module(f"{__name__}.{key}")
    recorded_graph(plan)  # a plan whose recorded graph is broken is refused, not exported without it
    units = units_of(plan)
    n = normalize(plan, units, t)
    mod.adjust(n)
    s = n.strategy()
    rep = reprice(plan, s, n.workload_model(), graph) if n.losses else None
    e = Exported(target=key, tool_version=t.label, text="", suffix=mod.SUFFIX, strategy=s,
                 losses=n.losses, notes=n.notes, repriced=rep, changes=change_lines(plan, s, units))
    if rep is not None:
        e.notes += rep.notes
    e.text = mod.render(n, s, e.cost_line())
    return e


@typed
def refusal(e: Exported, nearest: bool = False) -> str | None:
    """Why ``e`` is not written, in one line, or None: the plan uses what the target lacks (unless
    ``nearest``), or the plan as the target can run it does not fit its memory limit."""
    lacking = list(dict.fromkeys(x.lacks for x in e.losses if not x.behaviour))
    if lacking and not nearest:
        return (f"{e.tool_version} cannot express: {'; '.join(lacking)} (--nearest exports the nearest plan it "
                "can, re-priced)")
    r = e.repriced
    if r is not None and r.variant is not None and not r.variant.get("fits", True):
        what = "the nearest plan it can express" if lacking else "the plan as it runs it"
        return (f"{e.tool_version}: {what} needs {r.variant['memory_peak_gib']:.1f} GiB per GPU, over the "
                f"{r.variant['memory_limit_gib']:.1f} GiB limit; nothing written")
    return None


__all__ = ["TARGETS", "Exported", "check_target", "export", "lacks", "refusal", "target_of"]
