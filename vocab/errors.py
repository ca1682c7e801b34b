"""The one error type that user-facing commands turn into a clear message and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ShardplanError(ValueError):
    """Bad input or an impossible request, with a message meant for the user (no traceback)."""


class UnknownNameError(ShardplanError):
    """A name (model, accelerator, schedule, ...) that is not in a registry."""

    def __init__(self, what: str, name: str, known: Iterable[str]):
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.4)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        super().__init__(f"unknown {what} '{name}'.{hint} Known: {', '.join(known)}")
        self.name = name
        self.close = close


def describe_validation_error(err: Any, limit: int = 5) -> str:
    """A pydantic ``ValidationError`` as ``field.path: reason; ...`` (first ``limit`` errors)."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(x) for x in e["loc"]) or "(document)"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (and {err.error_count() - limit} more)" if err.error_count() > limit else ""
    return "; ".join(parts) + more


def first_line(err: BaseException) -> str:
    """An exception's message in one line: its first, or its type's name when it has none."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__
