"""Files of versioned documents (plans, profiles, model and cluster files): read, decode, validate, write.

Each step raises the caller's :class:`~vocab.errors.ShardplanError` subclass with a message that
names the file (``origin``) and the reason, never a traceback.
"""

from __future__ import annotations

import functools
import glob
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from vocab.arguments import typed
from vocab.errors import ShardplanError, describe_validation_error

if TYPE_CHECKING:  # pydantic and PyYAML load where a document is read, not at every start-up
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")

#: the largest document read (bytes): plans, profiles, model, cluster and batch files are far smaller
MAX_DOCUMENT_BYTES = 64 * 2**20
#: the deepest nesting of lists and mappings a document may have (plans need 5)
MAX_DEPTH = 32
#: the most alias uses a YAML document may make (an "alias bomb" expands each into a copy)
MAX_YAML_ALIASES = 64
#: the most values (lists, mappings and scalars, shared ones once per use) a document may hold
MAX_NODES = 1_000_000
#: what names a temporary file of an output (``.plan.json.shardplan-tmp-XXXXXXXX``) for a person to recognise
TMP_MARK = "shardplan-tmp-"
#: a temporary file of an output untouched this long (s) is one a killed write left behind
STALE_TMP_S = 600.0


def check_writable(path: str | Path, what: str = "output", error: type[ShardplanError] = ShardplanError) -> Path:
    """``path`` as a file this process can create or replace, checked before any work: not an
    option's name (``-o --json`` writes no file ``--json``), not a directory, and its nearest
    existing folder writable (folders below it are made on write)."""
    p = Path(path)
    if str(path).startswith("-"):
        raise error(f"{what} '{path}' starts with '-', like an option; to write a file of that name, give ./{path}")
    try:
        if p.is_dir():
            raise error(f"{what} '{p}' is a directory; give a file name")
        parent = p.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise error(f"cannot write {what} '{p}': '{parent}' is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise error(f"cannot write {what} '{p}': permission denied")
        if len(p.name.encode()) > 255:
            raise error(f"cannot write {what}: the file name is {len(p.name.encode())} bytes; the limit is 255")
    except OSError as e:  # a name too long, a loop of links
        raise error(f"cannot write {what} '{p}': {e.strerror}") from None
    except ValueError as e:  # a NUL byte in the name
        raise error(f"cannot write {what} '{p}': {e}") from None
    return p


def write_atomic(path: Path, text: str, error: type[ShardplanError] = ShardplanError) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: never half a file; a
    path that cannot be written raises ``error``."""
    write_with(path, lambda tmp: Path(tmp).write_text(text), error)


def write_with(path: Path, write: Callable[[str], Any], error: type[ShardplanError] = ShardplanError) -> None:
    """``write(tmp)`` (a figure's ``savefig``, a table's ``to_csv``) to a temporary file beside
    ``path`` (``.NAME.shardplan-tmp-XXXXXXXX``), renamed over it: never half a file; a path that
    cannot be written raises ``error``. The file gets the mode a new file gets under the umask
    (``0666 & ~umask``), or the mode of the file it replaces. Temporary files of ``path`` older than
    :data:`STALE_TMP_S` (a process killed while writing) are removed first."""
    path = Path(path)
    check_writable(path, "output", error)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=tmp_prefix(path))
        os.close(fd)
    except OSError as e:
        raise error(f"cannot write '{path}': {e.strerror}") from None
    try:
        write(tmp)
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise error(f"cannot write '{path}': {e.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tmp_prefix(path: Path) -> str:
    """The start of the names of ``path``'s temporary files: ``.plan.json.shardplan-tmp-``."""
    return f".{path.name}.{TMP_MARK}"


def remove_stale_tmp(path: Path, older_than_s: float = STALE_TMP_S) -> list[Path]:
    """Remove the temporary files of ``path`` (:func:`tmp_prefix`) last written more than
    ``older_than_s`` ago: what a write killed midway left (one still being written is younger)."""
    removed = []
    now = time.time()
    for tmp in path.parent.glob(glob.escape(tmp_prefix(path)) + "*"):
        try:
            st = tmp.lstat()
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def _mode_for(path: Path) -> int:
    """The permission bits ``path`` is written with: an existing file's, else a new file's under
    the process's umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def canonical_json(data: Any) -> str:
    """``data`` as indented JSON with sorted keys and a final newline: same data, same bytes
    (NaN and infinities are not JSON: they raise ``ValueError``)."""
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


@typed
def read_text(path: str | Path, what: str, error: type[ShardplanError] = ShardplanError,
              limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of the ``what`` file at ``path``: a regular file, a pipe (``/dev/stdin``, a
    FIFO: one without a writer reads as empty, it does not wait for one) or a character device, of
    at most ``limit`` bytes; a directory, a socket or a block device is refused at once. A missing,
    unreadable, too large or non-UTF-8 file raises ``error``."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise error(f"cannot read {what} '{p}': {e.strerror}") from None
    except ValueError as e:  # a NUL byte in the name
        raise error(f"cannot read {what} '{p}': {e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"cannot read {what} '{p}': it is a directory")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        raise error(f"cannot read {what} '{p}': not a file, a pipe or a character device")
    if st.st_size > limit:
        raise error(f"{what} '{p}' is {st.st_size:,} bytes; the limit is {limit:,}")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer opens at once
        os.set_blocking(fd, True)  # ... and then reads as empty; a pipe with one reads to its end
    except OSError as e:
        raise error(f"cannot read {what} '{p}': {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        return read_stream(f, what, str(p), error, limit)


def read_stream(f: BinaryIO, what: str, name: str, error: type[ShardplanError] = ShardplanError,
                limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of the open binary stream ``f`` (a file, standard input), at most ``limit``
    bytes; ``name`` is what messages call it."""
    try:
        raw = f.read(limit + 1)
    except OSError as e:
        raise error(f"cannot read {what} '{name}': {e.strerror}") from None
    if len(raw) > limit:
        raise error(f"{what} '{name}' is over the limit of {limit:,} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} '{name}' is not UTF-8 text (byte {e.start})") from None


def as_json_data(data: Any, origin: str, error: type[ShardplanError] = ShardplanError,
                 allow_nan: bool = False) -> Any:
    """``data`` as reading its JSON text gives it back (tuples as lists), checked as a document read
    as text is: values JSON holds only (no sets, bytes or objects; no NaN or infinities unless
    ``allow_nan``, for a schema that names the field it refuses them in), string keys, at most
    :data:`MAX_DEPTH` levels and :data:`MAX_NODES` values; else ``error`` naming ``origin`` and
    where the value is."""
    check_depth(data, origin, error)
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, where = stack.pop()
        at = f"{origin}: {where[1:]}" if where else origin
        if isinstance(node, dict):
            bad = next((k for k in node if not isinstance(k, str)), None)
            if bad is not None:
                raise error(f"{at} has a key {bad!r} that is not a string")
            stack.extend((v, f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(node))
        elif isinstance(node, float) and not allow_nan and not math.isfinite(node):
            raise error(f"{at} is not a finite number")
        elif not (node is None or isinstance(node, str | int | float)):  # bool is an int
            raise error(f"{at} holds a {type(node).__name__}, which JSON cannot hold")
    return json.loads(json.dumps(data, allow_nan=allow_nan))


def check_depth(data: Any, origin: str, error: type[ShardplanError] = ShardplanError,
                limit: int = MAX_DEPTH) -> Any:
    """``data`` unchanged if its lists and mappings nest at most ``limit`` deep and it holds at
    most :data:`MAX_NODES` values, else ``error``."""
    stack, seen = [(data, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise error(f"{origin} holds more than {MAX_NODES:,} values")
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > limit:
            raise error(f"{origin} nests deeper than {limit} levels")
        stack.extend((c, depth + 1) for c in children)
    return data


@functools.cache
def _bounded_loader() -> type:
    """PyYAML's safe loader (plain data, no tags that build objects) that refuses documents using
    more than :data:`MAX_YAML_ALIASES` aliases (made on first use: PyYAML loads with it)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream: str):
            super().__init__(stream)
            self.aliases = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise yaml.YAMLError(f"more than {MAX_YAML_ALIASES} aliases")
            return super().compose_node(parent, index)

    return BoundedLoader


def decode_yaml(text: str, origin: str, error: type[ShardplanError] = ShardplanError) -> Any:
    """``text`` decoded as YAML (JSON is YAML too) with the safe loader, at most
    :data:`MAX_YAML_ALIASES` aliases and :data:`MAX_DEPTH` levels, or ``error`` naming ``origin``."""
    import yaml

    # without a '*' a document has no alias: libyaml's safe loader, where PyYAML has it (5-10x faster)
    fast = "*" not in text and getattr(yaml, "CSafeLoader", None)
    try:
        data = yaml.load(text, Loader=fast or _bounded_loader())  # noqa: S506 (safe loaders only)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where is not None else ""
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{origin} is not valid YAML: {reason}{at}") from None
    except RecursionError:
        raise error(f"{origin} nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError, OverflowError) as e:  # e.g. a timestamp out of range
        raise error(f"{origin} is not valid YAML: {e}") from None
    return check_depth(data, origin, error)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


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
        return check_depth(json.loads(text, parse_constant=_no_constant), origin, error)
    except ShardplanError:
        raise
    except RecursionError:
        raise error(f"{origin} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # malformed, NaN/Infinity, an integer of thousands of digits
        if not isinstance(e, json.JSONDecodeError):
            raise error(f"{origin} is not valid JSON: {e}") from None
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
    from pydantic import ValidationError

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
