"""Judging what a trainer's file holds after a plan string carried an injection payload, and
watching which files a command opens.

An export is judged against the export of the same plan with a harmless string in the same place
(the *reference*): read the way its trainer reads it, it must have the same shape, string values
aside: a Python script the same syntax tree (string constants aside) and, run at top level with
its imports stubbed, no marker file made; Megatron flags the same ``--flag`` words at the same
places (:func:`shlex.split` with comments); TOML, YAML and JSON the same tables and keys and the
same non-string values. Every header comment line stays one line: the leading block of comment
lines has as many lines as the reference's, lines counted as the trainer's reader counts them.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

#: what ends a line for each exporter's reader: Python and Megatron's flags read with universal
#: newlines, TOML at LF (a lone CR is an error there), YAML also at NEL, U+2028 and U+2029
LINE_BREAKS = {
    "python": re.compile(r"\r\n|[\r\n]"),
    "megatron": re.compile(r"\r\n|[\r\n]"),
    "torchtitan-0.3": re.compile(r"\n"),  # sh ends a line at LF only
    "torchtitan": re.compile(r"\r?\n"),
    "nanotron": re.compile(r"\r\n|[\r\n\x85\u2028\u2029]"),
    "deepspeed": re.compile(r"\r?\n"),
}

#: a Python script's top level run with every import of these packages stubbed (no torch, no
#: project code); calls are recorded, nothing is run for real
STUBBED_PACKAGES = ("torch", "vocab", "runtime", "planner", "profiler", "costmodel", "solvers", "numpy")
_RUNNER = r'''
import sys, types
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec

STUBBED = set(sys.argv[2].split(","))

class Rec:
    def __init__(self, name):
        self._name = name
    def __call__(self, *args, **kwargs):
        return Rec(self._name + "()")
    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        return Rec(self._name + "." + key)

class Stubs(MetaPathFinder, Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda key, n=spec.name: Rec(n + "." + key)
        return m
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Stubs())
path = sys.argv[1]
with open(path, "rb") as f:
    code = compile(f.read(), path, "exec")
exec(code, {"__name__": "shardplan_export", "__file__": path})
'''


def header_lines(text: str, target: str) -> int:
    """Lines of the leading block of comment lines (``#``, after blanks), counted with the target's
    line breaks."""
    n = 0
    for line in LINE_BREAKS[target].split(text):
        if not line.lstrip(" \t\x0c").startswith("#"):
            break
        n += 1
    return n


def skeleton(value: Any) -> Any:
    """The shape of loaded data: tables and keys, list lengths, and every non-string value as it is
    (strings count as the same)."""
    if isinstance(value, dict):
        return {str(k): skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(v) for v in value]
    if isinstance(value, str):
        return "<str>"
    return repr(value)


def python_shape(text: str) -> str:
    """The syntax tree of a script with every string constant blanked (raises SyntaxError)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree, include_attributes=False)


def run_script_stubbed(path: Path, cwd: Path, timeout: float = 20.0) -> str | None:
    """Run the script's top level in a fresh isolated interpreter with its imports stubbed; what went
    wrong, or None."""
    try:
        p = subprocess.run([sys.executable, "-I", "-S", "-c", _RUNNER, str(path), ",".join(STUBBED_PACKAGES)],
                           capture_output=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"the script's top level ran over {timeout:g} s"
    if p.returncode != 0:
        tail = p.stderr.decode("utf-8", "backslashreplace").strip().splitlines()
        return f"the script's top level failed (exit {p.returncode}): {tail[-1] if tail else ''}"[:300]
    return None


def _loaded(target: str, text: str) -> Any:
    """The file as its trainer reads it (raises ValueError-like errors when it cannot)."""
    if target == "megatron":
        return shlex.split(text, comments=True)
    if target == "torchtitan-0.3":  # the launch script's words, lines joined as sh joins them
        return shlex.split(text.replace("\\\n", " "), comments=True)
    if target == "torchtitan":
        return tomllib.loads(text)
    if target == "nanotron":
        return yaml.safe_load(text)
    if target == "deepspeed":
        return json.loads(text)
    return python_shape(text)


def _same_flags(got: list[str], ref: list[str]) -> str | None:
    if len(got) != len(ref):
        extra = [t for t in got if t.startswith("--") and t not in ref]
        return f"{len(got)} shell words where the reference has {len(ref)}" + (f"; new flags {extra[:3]}" if extra else "")
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if r.startswith("--") and g != r:
            return f"word {i} is {g[:60]!r} where the reference has the flag {r}"
    return None


def judge_export(target: str, text: str, reference: str | None, marker: Path, folder: Path) -> str | None:
    """What is wrong with an export ``text`` for ``target`` beside the ``reference`` export (None:
    judge the file alone), or None. A Python script is also run at top level (stubbed); it must
    not make ``marker``."""
    try:
        got = _loaded(target, text)
    except (ValueError, SyntaxError, yaml.YAMLError) as e:
        return f"the {target} export does not read back: {type(e).__name__}: {str(e)[:200]}"
    if target == "python":
        script = folder / "export_run.py"
        script.write_text(text, encoding="utf-8", newline="")
        problem = run_script_stubbed(script, folder)
        if marker.exists():
            return f"running the exported script made the marker file {marker.name}"
        if problem:
            return problem
    if marker.exists():
        return f"the marker file {marker.name} exists after the export"
    if reference is None:
        return None
    ref = _loaded(target, reference)
    if target != "deepspeed" and header_lines(text, target) != header_lines(reference, target):
        return (f"the header has {header_lines(text, target)} comment line(s) where the reference has "
                f"{header_lines(reference, target)}: a string broke out of its comment line")
    if target in ("megatron", "torchtitan-0.3"):
        return _same_flags(got, ref)
    if target == "python":
        return None if got == ref else "the script's syntax tree differs from the reference's (a string became code)"
    if skeleton(got) != skeleton(ref):
        return f"the {target} export's tables/keys/values differ from the reference's: {_first_difference(skeleton(got), skeleton(ref))}"
    return None


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a:
                return f"{path}{k} missing"
            if k not in b:
                return f"{path}{k} added"
            if a[k] != b[k]:
                return _first_difference(a[k], b[k], f"{path}{k}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}].")
    return f"{path.rstrip('.') or '(root)'}: {str(a)[:80]} vs {str(b)[:80]}"


# ---------------------------------------------------------------------------------------------
# Which files a command opens
# ---------------------------------------------------------------------------------------------

_WATCHED: set[str] = set()
_OPENED: list[str] = []
_HOOKED = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _WATCHED or not args:
        return
    path = args[0]
    if isinstance(path, int):
        return
    try:
        name = os.fsdecode(path)
    except (TypeError, ValueError):
        return
    for token in _WATCHED:
        if token in name:
            _OPENED.append(name)


@contextlib.contextmanager
def watch_opens(tokens: list[str]) -> Iterator[list[str]]:
    """Within the block, record every file opened (``open``, ``os.open``) whose path holds one of
    ``tokens`` (unique file names); yields the list of such paths."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)  # (a hook cannot be removed: it does nothing outside this block)
        _HOOKED = True
    _WATCHED.clear()
    _WATCHED.update(tokens)
    _OPENED.clear()
    found: list[str] = []
    try:
        yield found
    finally:
        found.extend(_OPENED)
        _WATCHED.clear()
        _OPENED.clear()
