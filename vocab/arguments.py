"""Arguments of a public function checked against its annotations (:func:`typed`): a wrong type is
one :class:`~vocab.errors.ShardplanError` line naming the function, the parameter and the type it
takes, not a ``TypeError`` or ``AttributeError`` from deep inside. ``True`` is not an ``int`` and
``8.0`` is not an ``int``; an ``int`` is a ``float``; ``Any`` takes anything.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import numbers
import os
import types
import typing
from collections.abc import Callable
from pathlib import PurePath
from typing import Any, TypeVar

from vocab.errors import ShardplanError

F = TypeVar("F", bound=Callable[..., Any])
#: how a message names the types of annotations
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "None"}
_SEQUENCES = (list, tuple, collections.abc.Sequence)
_MAPPINGS = (dict, collections.abc.Mapping)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotation ``hint`` (unions, optionals, lists and tuples, dicts,
    callables, literals and classes; element types of lists and dicts too)."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in _SEQUENCES:
        if not isinstance(value, collections.abc.Sequence) or isinstance(value, str | bytes):
            return False
        item = args[0] if args and origin is not tuple else Any
        return all(matches(v, item) for v in value)
    if origin in _MAPPINGS:
        key, item = args if len(args) == 2 else (Any, Any)
        return isinstance(value, dict) and all(matches(k, key) and matches(v, item) for k, v in value.items())
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return isinstance(value, os.PathLike)
    return isinstance(value, origin or hint)


def describe(hint: Any) -> str:
    """``an integer or a list of integers``: the annotation ``hint`` in words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in _SEQUENCES:
        return "a list" + (f" of {describe(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "")
    if origin in _MAPPINGS:
        return "a dict"
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "a function"
    if hint in _NAMES:
        return _NAMES[hint]
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a path"
    name = getattr(hint, "__name__", str(hint))
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def typed(fn: F) -> F:
    """``fn`` checking its arguments against its annotations before it runs (see :func:`matches`)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:  # a missing or unknown argument
            raise ShardplanError(f"{fn.__name__}: {e}") from None
        hints = _hints(fn)
        for name, value in bound.arguments.items():
            hint = hints.get(name, Any)
            many = sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
            for key, v in (value.items() if many else [(name, value)]):
                if not matches(v, hint):
                    raise ShardplanError(f"{fn.__name__}: {key} must be {describe(hint)}, got {_shown(v)}")
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@functools.cache
def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of ``fn`` (on first call: its module has then imported every name)."""
    return typing.get_type_hints(fn)
