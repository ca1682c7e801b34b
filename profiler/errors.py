"""The one error type that user-facing commands turn into a clear message and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
