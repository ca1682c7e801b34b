"""Terminal layout shared by the commands: text from users and documents shown literally, whether a
table fits the console as it is, and the narrow layout it gives way to (80 columns, or a pipe).
Only rich: the commands that list data files load it without the cost model."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from vocab.names import escape_unprintable


def printable(text: object) -> str:
    """``text`` on one line as a terminal should show it: every character that is not printable
    (newline, carriage return, escape, BEL, NUL, a bidirectional override) written as its Python
    escape (``\\x1b``), never sent to the terminal (:func:`vocab.names.escape_unprintable`)."""
    return escape_unprintable(str(text))


def literal(text: object) -> Text:
    """User or document text as printed: on one line (:func:`printable`), never read as rich markup
    (``[bold]``) or an emoji code (``:smile:``)."""
    return Text(printable(text))


def literal_lines(lines: Iterable[object]) -> Text:
    """Lines of user or document text, each shown literally (:func:`literal`), one under another."""
    return Text("\n").join(literal(x) for x in lines)


def styled(*parts: str | tuple[str, str] | Text) -> Text:
    """A line of shardplan's own words (a string, or ``(words, style)``) and :func:`literal` pieces;
    no part is read as markup."""
    return Text.assemble(*parts)


def natural_width(console: Console, renderable: RenderableType) -> int:
    """The cells ``renderable`` takes with no wrapping at all (a table: every cell on its lines)."""
    return Measurement.get(console, console.options.update_width(10_000), renderable).maximum


def fits(console: Console, renderable: RenderableType) -> bool:
    """Whether ``renderable`` prints at ``console``'s width without wrapping a cell: a wide
    terminal keeps the wide table, an 80-column one (or a pipe, 80 unless COLUMNS says otherwise)
    takes the narrow layout."""
    return natural_width(console, renderable) <= console.width


def kv_table(title: str | Text | None = None) -> Table:
    """The narrow layout: a name column (never wrapped) and a value column (wrapped at words, a word
    longer than the column folded, never cut short) over the console's width."""
    t = Table(title=title, show_header=False, expand=True)
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold", ratio=1)
    return t
