"""Files of versioned documents (plans, profiles, model and cluster files): read, decode, validate, write.

Each step raises the caller's :class:`~vocab.errors.ShardplanError` subclass with a message that
names the file (``origin``) and the reason, never a traceback.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from vocab.errors import ShardplanError, describe_validation_error

M = TypeVar("M", bound=BaseModel)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def canonical_json(data: Any) -> str:
    """``data`` as indented JSON with sorted keys and a final newline: same data, same bytes."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def read_text(path: str | Path, what: str, error: type[ShardplanError] = ShardplanError) -> str:
    """The text of the ``what`` file at ``path``; a missing, unreadable or binary file raises ``error``."""
    p = Path(path)
    try:
        return p.read_text()
    except OSError as e:
        raise error(f"cannot read {what} '{p}': {e.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{what} '{p}' is not a text (JSON) file") from None


def _unclosed(text: str) -> bool:
    """Whether JSON text ends inside a string, an object or an array (a cut-off file)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_str or depth > 0


def decode_json(text: str, origin: str, error: type[ShardplanError] = ShardplanError,
                truncated_advice: str | None = None) -> Any:
    """``text`` decoded as JSON, or ``error`` naming ``origin``, the line and the column.

    With ``truncated_advice``, an empty text and one cut off mid-document get messages of their
    own, the latter ending in the advice (e.g. ``measure again``).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{e.msg} at line {e.lineno} column {e.colno}"
        if truncated_advice is not None:
            if not text.strip():
                raise error(f"{origin} is empty") from None
            if e.pos >= len(text.rstrip()) or _unclosed(text):
                raise error(f"{origin} is truncated: the JSON ends early ({where}); {truncated_advice}") from None
        raise error(f"{origin} is not valid JSON: {where}") from None


def validate_document(model: type[M], data: Any, origin: str, what: str,
                      error: type[ShardplanError] = ShardplanError) -> M:
    """``data`` validated as ``model``; errors name the first fields and their reasons."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(f"{origin} is not a valid {what}: {describe_validation_error(e)}") from None


def document_schema(model: type[BaseModel], name: str, version: str, title: str) -> dict[str, Any]:
    """The JSON schema of ``model`` with the ``$id`` and title of a shardplan document kind."""
    schema = model.model_json_schema()
    schema["$id"] = f"https://shardplan.dev/schema/{name}-{version}.json"
    schema["title"] = title
    return schema
