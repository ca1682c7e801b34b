"""Terminal layout shared by the commands: whether a table fits the console as it is, and the
narrow layout it gives way to (80 columns, or a pipe). Only rich: the commands that list data
files load it without the cost model."""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table


def natural_width(console: Console, renderable: RenderableType) -> int:
    """The cells ``renderable`` takes with no wrapping at all (a table: every cell on its lines)."""
    return Measurement.get(console, console.options.update_width(10_000), renderable).maximum


def fits(console: Console, renderable: RenderableType) -> bool:
    """Whether ``renderable`` prints at ``console``'s width without wrapping a cell: a wide
    terminal keeps the wide table, an 80-column one (or a pipe, 80 unless COLUMNS says otherwise)
    takes the narrow layout."""
    return natural_width(console, renderable) <= console.width


def kv_table(title: str | None = None) -> Table:
    """The narrow layout: a name column (never wrapped) and a value column (wrapped at words, a word
    longer than the column folded, never cut short) over the console's width."""
    t = Table(title=title, show_header=False, expand=True)
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold", ratio=1)
    return t
