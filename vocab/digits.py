"""Numbers read from text a person wrote (command-line values, cluster specs, trainer flags): ASCII
digits only.

Python's ``int()`` and ``float()`` read any Unicode decimal digit (``٤``, ``８``) and underscores
(``1_000``); :func:`read_int` and :func:`read_float` refuse them, so that a count that looks like
another number, or like none, is never taken. Both raise ``ValueError`` where ``int()`` and
``float()`` do (and keep their limits: an integer of thousands of digits is refused too).
"""

from __future__ import annotations

import re
import string

#: an integer: an optional sign and ASCII digits
INTEGER = re.compile(r"[+-]?[0-9]+")
#: a decimal number (an optional sign, ASCII digits with a point and an exponent), or a word that
#: ``float`` reads (``inf``, ``nan``: callers refuse them with their ranges)
NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


def is_digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits only (``str.isdigit`` takes ``٣`` and ``²`` too)."""
    return text.isascii() and text.isdigit()


def read_int(text: str) -> int:
    """``text`` (ASCII blanks around it allowed) as an integer of ASCII digits, else ``ValueError``."""
    core = text.strip(string.whitespace)
    if INTEGER.fullmatch(core) is None:
        raise ValueError(f"not an integer in ASCII digits: {text!r}")
    return int(core)


def read_float(text: str) -> float:
    """``text`` (ASCII blanks around it allowed) as a number of ASCII digits, else ``ValueError``."""
    core = text.strip(string.whitespace)
    if NUMBER.fullmatch(core) is None:
        raise ValueError(f"not a number in ASCII digits: {text!r}")
    return float(core)
