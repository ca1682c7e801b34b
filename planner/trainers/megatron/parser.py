"""Megatron-LM's command-line parser, rebuilt from its recorded definitions.

``vocab/targets/keys/megatron_lm-<version>.json`` (``benchmarks/megatron_lm_parser.py``) holds every
action of Megatron-LM's ``add_megatron_arguments``: option strings, kind, ``nargs``, value type and
choices. :func:`lm_parser` builds an argparse parser of the same definitions, whose errors are one
:class:`ConfigError` line, so that a file of flags is checked as Megatron-LM parses it: no flag it does
not define, every value of its type and among its choices, a bare flag where it takes no value.
Megatron-LM's ``validate_args`` (the checks across flags, which need its runtime) is not run.
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from pathlib import Path
from typing import Any

from planner.trainers.reading import ConfigError

#: the recorded parser: Megatron-LM's as shipped in the megatron-core 0.19.2 wheel (the pinned 0.16.1
#: wheel has no megatron/training); a flag of 0.16.1 it lacks is checked against the key snapshot only
PARSER_FILE = Path(__file__).resolve().parents[3] / "vocab" / "targets" / "keys" / "megatron_lm-0.19.2.json"
TYPES = {"int": int, "float": float, "str": str}


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits; a parse here is a check
        raise ConfigError(message)


@cache
def recorded() -> dict[str, Any]:
    """The recorded definitions (the JSON file)."""
    return json.loads(PARSER_FILE.read_text(encoding="utf-8"))


def lm_parser() -> argparse.ArgumentParser:
    """An argparse parser with Megatron-LM's definitions (a new one each call: argparse keeps state)."""
    p = _Refusing(prog="pretrain_gpt.py", add_help=False, allow_abbrev=False, exit_on_error=False)
    for a in recorded()["actions"]:
        kw: dict[str, Any] = {"dest": a["dest"]}
        if _takes_no_value(a):  # argparse.BooleanOptionalAction (nargs 0): --x and --no-x, both bare
            kw["action"] = a["kind"] if a["kind"] in ("store_true", "store_false", "count") else "store_true"
        else:
            typ = TYPES[a["type"]]
            kw.update(type=typ, nargs=a["nargs"], action="append" if a["kind"] == "append" else "store")
            if a["choices"] is not None:
                kw["choices"] = [typ(c) for c in a["choices"]]
        p.add_argument(*a["flags"], **kw)
    return p


@cache
def lm_flags() -> frozenset[str]:
    """Every option string Megatron-LM's parser defines."""
    return frozenset(f for a in recorded()["actions"] for f in a["flags"])


def _takes_no_value(a: dict[str, Any]) -> bool:
    """Whether a recorded action is a bare flag (store_true, store_false, count, BooleanOptionalAction)."""
    return a["kind"] in ("store_true", "store_false", "count") or a["nargs"] == 0


@cache
def _bare() -> frozenset[str]:
    """The option strings that take no value."""
    return frozenset(f for a in recorded()["actions"] if _takes_no_value(a) for f in a["flags"])


def check_flags(doc: dict[str, list[str]], origin: str) -> None:
    """Parse the flags of ``doc`` (flag -> the values after it) that Megatron-LM's parser defines, as it
    would: one ConfigError line naming what it refuses (a value after a bare flag by the flag's name)."""
    for flag, values in doc.items():
        if flag in _bare() and values:
            raise ConfigError(f"{origin}: {flag} takes no value, got {values[0]!r}")
    tokens = [x for flag, values in doc.items() if flag in lm_flags() for x in (flag, *values)]
    try:
        lm_parser().parse_args(tokens)
    except (ConfigError, argparse.ArgumentError) as e:
        raise ConfigError(f"{origin}: Megatron-LM {recorded()['version']}'s parser refuses it: {e}") from None
