"""Checks of command-line values shared by the commands: counts are positive integers, sizes and
limits finite positive numbers. A bad value is a usage error (one line, exit code 2) that names the
option, the form it takes and a valid example: ``--seq-len takes an integer number of tokens, e.g.
8192, got '8k'``. :func:`usage_line` words every usage error of the parser that way.

A command with many options is built from a table of them (:func:`command`, :class:`Opt`): the
command's function takes their values as one object, and a request's options come from its fields
(:func:`planner.request.option`), so their flags, defaults and help are written once.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import typer

from vocab.digits import read_float, read_int

#: what a numeric option takes and a valid value, for the messages of a bad or missing one
FORMS: dict[str, tuple[str, str]] = {
    "--seq-len": ("an integer number of tokens", "8192"),
    "--global-batch": ("an integer number of samples", "1024"),
    "--micro-batch": ("an integer number of samples", "1"),
    "--tp": ("an integer degree", "8"),
    "--pp": ("an integer number of stages", "4"),
    "--cp": ("an integer degree", "2"),
    "--ep": ("an integer degree", "8"),
    "--dp": ("an integer degree", "16"),
    "--dp-shard": ("an integer number of ranks", "8"),
    "--dp-replicate": ("an integer number of replicas", "2"),
    "--vpp": ("an integer number of virtual stages", "2"),
    "--nproc": ("an integer number of processes", "8"),
    "--steps": ("an integer number of steps", "100"),
    "--layers": ("an integer number of blocks", "2"),
    "--repeats": ("an integer number of steps", "5"),
    "--top-k": ("an integer number of runners-up", "5"),
    "--workers": ("an integer number of processes", "4"),
    "--seed": ("an integer", "0"),
    "--zero": ("a ZeRO stage", "1"),
    "--memory-limit": ("a number of GiB", "80"),
    "--reserve": ("a percentage", "5"),
    "--time-limit": ("a number of seconds", "60"),
    "--timeout": ("a number of seconds", "120"),
    "--watchdog-s": ("a number of seconds", "600"),
    "--moe-capacity-factor": ("a multiple of the mean load", "1.25"),
}
#: a valid value of the options whose form the help text gives, for the message of a missing one
EXAMPLES: dict[str, str] = {
    **{name: example for name, (_, example) in FORMS.items()},
    "--model": "llama3-8b",
    "--cluster": "8xh100",
}
#: what the got value of a message shows of a long one
SHOWN = 40


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def option_name(param: Any) -> str:
    """The name a message calls ``param`` by: its first long option (``--seq-len``), else its first
    name, else its metavar (an argument: ``PLAN``)."""
    opts = list(getattr(param, "opts", None) or [])
    if getattr(param, "param_type_name", "option") == "argument":
        return str(getattr(param, "human_readable_name", None) or (opts[0] if opts else "the argument")).upper()
    return next((o for o in opts if o.startswith("--")), opts[0] if opts else "the option")


def _range(kind: str, lo: float | None, hi: float | None, above: bool = False) -> str:
    """``, at least 1`` / ``, above 0`` / ``, 0 to 90``: the range part of a message."""
    if lo is not None and hi is not None:
        return f", {lo:g} to {hi:g}"
    if lo is not None:
        return f", above {lo:g}" if above else f", at least {lo:g}"
    if hi is not None:
        return f", at most {hi:g}"
    return ""


def value_message(name: str, kind: str, got: Any, lo: float | None = None, hi: float | None = None,
                  above: bool = False, out_of_range: bool = False) -> str:
    """``--seq-len takes an integer number of tokens, e.g. 8192, got '8k'``; the range too where
    ``got`` is a number outside it. ``kind`` is ``integer`` or ``number`` (for options without a form)."""
    form, example = FORMS.get(name, ("an integer" if kind == "integer" else "a number", ""))
    span = _range(kind, lo, hi, above) if out_of_range else ""
    eg = f", e.g. {example}" if example else ""
    return f"{name} takes {form}{span}{eg}, got '{_shown(got)}'"


class OptionValueError(typer.BadParameter):
    """A bad option value; the parser attaches the option, and the message names it, the form it
    takes and an example (not click's ``Invalid value for '--x': ...``)."""

    def __init__(self, kind: str, got: Any, lo: float | None = None, hi: float | None = None,
                 above: bool = False, out_of_range: bool = False) -> None:
        super().__init__(f"takes {kind}, got {_shown(got)!r}")
        self.kind, self.got, self.lo, self.hi, self.above, self.out_of_range = kind, got, lo, hi, above, out_of_range

    def format_message(self) -> str:
        return value_message(option_name(self.param), self.kind, self.got, self.lo, self.hi, self.above,
                             self.out_of_range)


def _integer(lo: int | None, hi: int | None) -> Any:
    """The parser of an integer option (ASCII digits) in ``lo..hi``."""

    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise OptionValueError("integer", value)
        if isinstance(value, int):
            n = value
        else:
            try:
                n = read_int(str(value))
            except ValueError:  # not an integer, or over the digits int() reads
                raise OptionValueError("integer", value) from None
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise OptionValueError("integer", value, lo, hi, out_of_range=True)
        return n

    return parse


def _real(value: Any) -> float:
    """A number option's value (ASCII digits), or the option's usage error."""
    if isinstance(value, bool):
        raise OptionValueError("number", value)
    try:
        return float(value) if isinstance(value, int | float) else read_float(str(value))
    except (ValueError, OverflowError):
        raise OptionValueError("number", value) from None


def _positive(value: Any) -> float:
    """The parser of a finite number above 0."""
    x = _real(value)
    if not (math.isfinite(x) and x > 0):
        raise OptionValueError("number", value, 0, None, above=True, out_of_range=True)
    return x


def _finite(lo: float | None, hi: float | None) -> Any:
    """The parser of a finite number option in ``lo..hi``."""

    def parse(value: Any) -> float:
        x = _real(value)
        if not math.isfinite(x):
            raise OptionValueError("number", value)
        if (lo is not None and x < lo) or (hi is not None and x > hi):
            raise OptionValueError("number", value, lo, hi, out_of_range=True)
        return x

    return parse


def count_option(default: Any, *names: str, help: str = "", maximum: int | None = None) -> Any:
    """A positive integer option (a degree, a batch, a count): 0, negatives, fractions and words
    are refused with the option's form and an example."""
    return typer.Option(default, *names, help=help, min=1, max=maximum, parser=_integer(1, maximum))


def positive_option(default: Any, *names: str, help: str = "") -> Any:
    """A finite positive float option (a memory or time limit)."""
    return typer.Option(default, *names, help=help, parser=_positive)


def int_option(default: Any, *names: str, help: str = "", minimum: int | None = None,
               maximum: int | None = None) -> Any:
    """An integer option (ASCII digits) in ``minimum..maximum``: fractions, words and other digits
    are refused with the option's form and an example."""
    return typer.Option(default, *names, help=help, min=minimum, max=maximum, parser=_integer(minimum, maximum))


def number_option(default: Any, *names: str, help: str = "", minimum: float | None = None,
                  maximum: float | None = None) -> Any:
    """A finite float option (ASCII digits) in ``minimum..maximum``."""
    return typer.Option(default, *names, help=help, min=minimum, max=maximum, parser=_finite(minimum, maximum))


# ---- the parser's usage errors, one line each -------------------------------------------------

def _what(param: Any) -> str:
    """The first clause of ``param``'s help: what its value is (``samples per step``)."""
    text = " ".join(str(getattr(param, "help", None) or "").split())
    for stop in ("; ", " (default", " (the "):
        text = text.split(stop, 1)[0]
    return text.strip().rstrip(".")


def missing_message(command: str, param: Any) -> str:
    """``shardplan plan needs --global-batch (samples per step, e.g. 1024)``."""
    name = option_name(param)
    what, example = _what(param), EXAMPLES.get(name, "")
    detail = ", e.g. ".join(p for p in (what, example) if p)
    return f"{command} needs {name}" + (f" ({detail})" if detail else "")


def _param_kind(param: Any) -> str | None:
    """``integer``, ``number``, ``path`` or None: the type of ``param``'s values (typer's)."""
    desc = getattr(param, "type_descriptor", None)
    annotation = getattr(desc, "annotation", None)
    if annotation is bool:
        return None
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if getattr(desc, "is_path", False):
        return "path"
    return None


def needs_value_message(name: str, param: Any) -> str:
    """``-o needs a file path``: an option given without its value."""
    kind = _param_kind(param) if param is not None else None
    if kind == "path":
        return f"{name} needs a file path"
    long_name = option_name(param) if param is not None else name
    if long_name in FORMS:
        form, example = FORMS[long_name]
        return f"{name} needs {form}, e.g. {example}"
    if kind is not None:
        return f"{name} needs {'an integer' if kind == 'integer' else 'a number'}"
    what = _what(param) if param is not None else ""
    example = EXAMPLES.get(long_name)
    return f"{name} needs a value" + (f": {what}" if what else "") + (f", e.g. {example}" if example else "")


def bad_value_message(e: Any) -> str:
    """A value typer's own parsing refused (pydantic's error in ``e.__cause__``), as
    ``--top-k takes an integer number of runners-up, 0 to 1000, e.g. 5, got 'x'``."""
    param = getattr(e, "param", None)
    name = option_name(param)
    errors = []
    cause = e.__cause__
    if cause is not None and hasattr(cause, "errors"):
        try:
            errors = cause.errors()
        except Exception:  # an error without the list: the generic form below
            errors = []
    kind = _param_kind(param)
    if not errors or kind not in ("integer", "number"):
        message = str(getattr(e, "message", "") or e)
        return f"{name}: {message[:1].lower()}{message[1:]}".rstrip(".")
    err = errors[0]
    info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
    lo, hi = getattr(info, "min", None), getattr(info, "max", None)
    out_of_range = err.get("type") in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
    return value_message(name, kind, err.get("input", ""), lo, hi, out_of_range=out_of_range)


def usage_line(e: Any, command: str, params: Any = None) -> str:
    """The one line (without ``error: ``) of a usage error ``e`` of the command ``command``
    (``shardplan plan``, whose click parameters are ``params``): the option, the form its value
    takes and an example; where the error is not about one value, click's message and a pointer to
    the command's help."""
    kind = type(e).__name__
    see = f" (see {command} --help)"
    if kind == "MissingParameter" and getattr(e, "param", None) is not None:
        return missing_message(command, e.param)
    if isinstance(e, OptionValueError):
        return e.format_message() + see
    if kind == "BadParameter" and getattr(e, "param", None) is not None:
        return bad_value_message(e) + see
    if kind == "BadOptionUsage" and "requires" in str(getattr(e, "message", "")):
        name = str(getattr(e, "option_name", "") or "the option")
        param = _find_param(params, name)
        return needs_value_message(name, param) + see
    if kind == "NoSuchOption":
        name = str(getattr(e, "option_name", ""))
        close = sorted(getattr(e, "possibilities", None) or [])
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"{command} has no option {name}{hint}" + see
    message = str(e.format_message()).strip()
    return message.rstrip(".") + see


def _find_param(params: Any, name: str) -> Any:
    """The parameter among ``params`` that ``name`` (``-o``) names, or None."""
    for p in params or []:
        if name in (getattr(p, "opts", None) or []) or name in (getattr(p, "secondary_opts", None) or []):
            return p
    return None


# ---- commands built from a table of options ---------------------------------------------------

@dataclass(frozen=True)
class Opt:
    """One option of a command built by :func:`command`: the parameter ``name`` its value fills,
    the Python ``type`` typer reads the value as, and the typer option (flags, default, help, check)."""

    name: str
    type: Any
    option: Any


class Values(dict[str, Any]):
    """The values of a command's options by parameter name, also as attributes (``values.seq_len``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def command(table: Sequence[Opt]) -> Callable[[Callable[[Values], Any]], Callable[..., Any]]:
    """A typer command whose parameters are ``table``'s options, in order (typer reads a command's
    options from its signature); the decorated body takes their values as one :class:`Values`."""

    def wrap(body: Callable[[Values], Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def run(**values: Any) -> Any:
            return body(Values(values))

        keyword = inspect.Parameter.KEYWORD_ONLY
        run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(o.name, keyword, default=o.option, annotation=o.type) for o in table])
        run.__annotations__ = {o.name: o.type for o in table}
        return run

    return wrap
