"""Checks of command-line values shared by the commands: counts are positive integers, sizes and
limits finite positive numbers. A bad value is a usage error (one line, exit code 2)."""

from __future__ import annotations

import math
from typing import Any

import typer


def finite(value: Any) -> Any:
    """Callback of a float option: refuses NaN and infinities (a range check lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def finite_positive(value: Any) -> Any:
    """Callback of a float option that must be finite and above 0."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a finite number above 0")
    return value


def count_option(default: Any, *names: str, help: str = "", maximum: int | None = None) -> Any:
    """A positive integer option (a degree, a batch, a count): 0 and negatives are refused."""
    return typer.Option(default, *names, help=help, min=1, max=maximum)


def positive_option(default: Any, *names: str, help: str = "") -> Any:
    """A finite positive float option (a memory or time limit)."""
    return typer.Option(default, *names, help=help, callback=finite_positive)
