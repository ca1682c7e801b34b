"""The notebook view a :class:`vocab.plan.Plan` delegates to, registered by ``planner``.

Apart from the plan schema so that registering it (every ``import planner``, every command's
start-up) does not build the schema's pydantic models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_VIEWER: list[Callable[[Any], Any]] = []


def register_viewer(factory: Callable[[Any], Any]) -> None:
    """Make ``factory(plan)`` the view :class:`vocab.plan.Plan`'s notebook conveniences delegate to."""
    _VIEWER.append(factory)


def registered() -> Callable[[Any], Any] | None:
    """The view last registered, if any."""
    return _VIEWER[-1] if _VIEWER else None
