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
        super().__init__(f"unknown {what} {shown(name)}.{hint} Known: {', '.join(known)}")
        self.name = name
        self.close = close


def shown(value: Any, limit: int = 40) -> str:
    """``value`` for an error message: an integer with thousands separators (its size in bits when
    huge), anything else as its ``repr`` (control characters escaped) cut to ``limit`` characters: what a
    message quotes of a value read from a file."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if abs(value) < 10**24 else f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_validation_error(err: Any, limit: int = 5) -> str:
    """A pydantic ``ValidationError`` as ``field.path: reason; ...`` (first ``limit`` errors); a key of
    the document in the path is cut to 40 characters, and no value of it is quoted."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(x) if len(str(x)) <= 40 else shown(str(x)) for x in e["loc"]) or "(document)"
        parts.append(f"{loc}: {e['msg']}")
    more = f" (and {err.error_count() - limit} more)" if err.error_count() > limit else ""
    return "; ".join(parts) + more


def first_line(err: BaseException) -> str:
    """An exception's message in one line: its first, or its type's name when it has none."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__
