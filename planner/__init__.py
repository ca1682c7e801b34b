"""Wires the pipeline (model → profile → cost model → solvers → plan) and owns the CLI.

Importing ``planner`` is light: the plan schema and the CLI import heavy packages lazily. It makes
:class:`planner.notebook.PlanView` the notebook view of every :class:`vocab.plan.Plan`.
"""

from __future__ import annotations

from planner import sigint  # isort: skip  (first of all: Ctrl-C while shardplan loads)
from typing import TYPE_CHECKING, Any

from vocab.viewers import register_viewer

if TYPE_CHECKING:
    from vocab.plan import Plan


def _plan_view(plan: Plan) -> Any:
    """The notebook view of ``plan`` (pandas and matplotlib load on its first use)."""
    from planner.notebook import PlanView

    return PlanView(plan)


register_viewer(_plan_view)
sigint.loaded()
