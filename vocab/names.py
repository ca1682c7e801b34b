"""What a string in a document may hold, and how such a string is shown.

A plan is a file people pass around; its strings end up in files other programs run or load (a
Python script, Megatron flags, TOML, YAML, JSON) and on terminals. Two rules, owned here:

* **Names are closed.** Strings that name something (a model, a file, an accelerator, a unit, a
  target release, a solver) match a pattern of a closed ASCII character set and a bounded length,
  checked when the document is read (:data:`MODEL_REF`, :data:`ACCELERATOR`, :data:`UNIT`, ...).
* **Text is printable.** Every other string of a document (notes, descriptions) holds no control,
  format or separator character: no newline, carriage return, form feed, escape, NEL (U+0085), line
  or paragraph separator (U+2028/9), bidirectional override (:func:`first_unprintable`).

Whatever is printed or written into a comment still goes through :func:`escape_unprintable`, and a
value written into another language goes through that language's own quoting (the exporters).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

#: a preset name, a Hugging Face id, a config file's path or ``package.module:factory``: letters,
#: digits and ``_ . / ~ @ + : = , -``, inner spaces; at most 256 characters
MODEL_REF = r"^[A-Za-z0-9_./~](?:[A-Za-z0-9_./~@+:=, -]{0,254}[A-Za-z0-9_./~@+:=,-])?$"
#: an accelerator's name (``h100``, ``a100-80gb``, ``cpu``): at most 64 characters
ACCELERATOR = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$"
#: a content hash (hex digits, or any letters and digits of a hand-made document)
HASH = r"^[A-Za-z0-9]{1,64}$"
#: a unit or operator path (``embedding``, ``layers.3``, ``layers.3.attn.qkv``) or ``*`` (all units)
UNIT = r"^(?:\*|[A-Za-z0-9_][A-Za-z0-9_.-]{0,255})$"
#: a trainer's release (``0.2.2``, ``0.19.1rc0``): at most 64 characters
RELEASE = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$"
#: a solver's name (``dp``, ``ilp``, ``hybrid``, ``user``)
SOLVER = r"^[A-Za-z][A-Za-z0-9_+-]{0,63}$"
#: the longest free text a document string may hold
MAX_TEXT = 4096

_COMPILED = {p: re.compile(p) for p in (MODEL_REF, ACCELERATOR, HASH, UNIT, RELEASE, SOLVER)}


def matches(pattern: str, value: str) -> bool:
    """Whether ``value`` is a whole match of one of this module's patterns."""
    return _COMPILED[pattern].fullmatch(value) is not None  # fullmatch: '$' alone passes a final newline


def is_printable(ch: str) -> bool:
    """A character that shows as itself on one line: Python's printable (no Unicode 'Other' or
    'Separator' but the ASCII space), so no control, format, line or paragraph separator."""
    return ch.isprintable()


def first_unprintable(text: str) -> str | None:
    """The first character of ``text`` that is not printable on one line, or None."""
    if text.isprintable():
        return None
    return next(ch for ch in text if not is_printable(ch))


def escape_unprintable(text: str) -> str:
    """``text`` with every character that is not printable on one line written as its Python escape
    (``\\n``, ``\\x1b``, ``\\u2028``): what terminals and comment lines show."""
    if text.isprintable():
        return text
    return "".join(ch if is_printable(ch) else ascii(ch)[1:-1] for ch in text)


def codepoint(ch: str) -> str:
    """``U+000A`` for a character: how a message names it without printing it."""
    return f"U+{ord(ch):04X}"


def strings_in(data: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string inside ``data`` (mapping keys included) with its dotted path."""
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            yield where, node
        elif isinstance(node, dict):
            for k, v in node.items():
                sub = f"{where}.{k}" if where else str(k)
                if isinstance(k, str):
                    yield f"{sub} (key)", k
                stack.append((v, sub))
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(node))


def unprintable_string(data: Any) -> str | None:
    """Why a document's strings are not all printable text, or None: the first string holding a
    control, format or separator character, or longer than :data:`MAX_TEXT`, by path."""
    for where, s in strings_in(data):
        bad = first_unprintable(s)
        if bad is not None:
            return f"{where or 'the document'}: holds the character {codepoint(bad)}, which no document string may hold"
        if len(s) > MAX_TEXT:
            return f"{where or 'the document'}: a string of {len(s):,} characters (at most {MAX_TEXT:,})"
    return None
