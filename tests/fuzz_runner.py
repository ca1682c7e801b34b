"""Running one fuzz input, in-process or as a ``python -m planner.cli`` subprocess, under a time
limit and judging it: success, a rejection (a ``ShardplanError``; exit code 2 with one line
``error: ...`` on stderr) or a failure; the extra rules of ``-o`` files and ``--batch`` output,
:class:`Case`, :class:`FuzzEnv`, and the time limits and failure report of the tests and benchmark."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz_inputs import REPO, accelerator_seed, cluster_seeds, hf_configs, make_plans, valid_profile
from vocab.errors import ShardplanError

#: a call that runs longer than this is a hang
HANG_S = 30.0
#: the outcome kinds, in the order of the benchmark's table
KINDS = ("accepted", "rejected", "exception", "exit70", "hang", "multiline", "other")
BAD_KINDS = ("exception", "exit70", "hang", "multiline", "other")


# ---------------------------------------------------------------------------------------------
# Running one input and judging the outcome
# ---------------------------------------------------------------------------------------------

class FuzzTimeout(BaseException):
    """Raised in the main thread when a call runs over its limit (a BaseException: no handler
    of the code under test catches it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`FuzzTimeout` after ``seconds`` (main thread only)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise FuzzTimeout(f"still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def environment(env: dict[str, str | None] | None) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the block."""
    env = {"SHARDPLAN_DEBUG": None, **(env or {})}
    old = {k: os.environ.get(k) for k in env}
    try:
        _set_environment(env)
        yield
    finally:
        _set_environment(old)


def _set_environment(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def log_to(stream: io.StringIO) -> Iterator[None]:
    """Log records of level WARNING and above to ``stream`` as bare messages for the block: what
    Python's last-resort handler writes to stderr in a ``shardplan`` process (in-process, pytest's
    log capture would otherwise swallow them)."""
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


@dataclass
class Outcome:
    """What one input did: ``kind`` is one of :data:`KINDS`."""

    kind: str
    detail: str = ""
    where: str = ""
    seconds: float = 0.0
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.kind in ("accepted", "rejected")

    def summary(self) -> str:
        at = f" at {self.where}" if self.where else ""
        rc = f" (exit {self.rc})" if self.rc is not None else ""
        return f"{self.kind}{rc}{at}: {self.detail}"[:600]


def where(exc: BaseException) -> str:
    """The innermost frame of the product code in ``exc``'s traceback (``file:line in function``)."""
    found = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        try:
            rel = Path(fr.filename).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts and (rel.parts[0] in ("tests", "benchmarks") or rel.parts[0].startswith(".")
                          or "site-packages" in rel.parts):
            continue
        found = f"{rel}:{fr.lineno} in {fr.name}"
    return found


def call(fn: Callable[..., Any], *args: Any, limit: float | None = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``fn(*args)`` in-process (what it prints is dropped): ``accepted`` if it returns, ``rejected``
    on a ShardplanError, ``hang`` past ``limit``, ``exception`` on anything else."""
    t0 = time.perf_counter()
    try:
        with environment(env), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                time_limit(limit):
            fn(*args)
    except FuzzTimeout as e:
        return Outcome("hang", str(e), seconds=time.perf_counter() - t0)
    except ShardplanError as e:
        out = Outcome("rejected", str(e)[:300], seconds=time.perf_counter() - t0)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (anything else is what the fuzzer looks for)
        return Outcome("exception", f"{type(e).__name__}: {str(e)[:300]}", where(e), time.perf_counter() - t0)
    else:
        out = Outcome("accepted", seconds=time.perf_counter() - t0)
    if limit and out.seconds > limit:
        return Outcome("hang", f"took {out.seconds:.1f} s (limit {limit:g} s)", seconds=out.seconds)
    return out


def _judge_cli(rc: Any, stdout: str, stderr: str, seconds: float, limit: float | None) -> Outcome:
    out = Outcome("accepted", rc=rc if isinstance(rc, int) else None, stdout=stdout, stderr=stderr, seconds=seconds)
    lines = [line for line in stderr.splitlines() if line.strip()]
    if limit and seconds > limit:
        out.kind, out.detail = "hang", f"took {seconds:.1f} s (limit {limit:g} s)"
    elif "Traceback (most recent call last)" in stderr:
        out.kind, out.detail = "exception", "a traceback on stderr: " + (lines[-1] if lines else "")
    elif rc == 70:
        out.kind, out.detail = "exit70", lines[-1] if lines else "(no message)"
    elif rc == 2:
        out.kind, out.detail = "rejected", lines[0] if lines else ""
        if len(lines) != 1:
            out.kind = "multiline"
            out.detail = f"{len(lines)} non-empty stderr lines: " + " | ".join(lines[:4])
        elif not lines[0].startswith("error: "):
            out.kind, out.detail = "other", f"rejection line does not start with 'error: ': {lines[0]}"
    elif rc != 0:
        out.kind, out.detail = "other", f"exit code {rc}: " + " | ".join(lines[-3:])
    if out.ok:
        bad = sorted({f"{ord(c):#04x}" for c in stderr if ord(c) < 32 and c not in "\n\t"} |
                     ({"a lone surrogate"} if any(0xD800 <= ord(c) <= 0xDFFF for c in stderr) else set()))
        if bad:
            out.kind, out.detail = "other", f"control characters printed raw on stderr ({', '.join(bad)}): {stderr[:200]!r}"
    return out


def run_cli(argv: list[str], limit: float | None = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``planner.cli.main(argv)`` in-process with stdout and stderr captured, judged."""
    from planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    rc: Any = None
    try:
        with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), log_to(err), \
                time_limit(limit):
            rc = main(list(argv))
    except FuzzTimeout as e:
        return Outcome("hang", str(e), seconds=time.perf_counter() - t0, stdout=out.getvalue(), stderr=err.getvalue())
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        return Outcome("exception", f"main() raised {type(e).__name__}: {str(e)[:300]}", where(e),
                       time.perf_counter() - t0, None, out.getvalue(), err.getvalue())
    return _judge_cli(rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0, limit)


def locate_cli(argv: list[str], env: dict[str, str | None] | None = None, limit: float | None = HANG_S) -> str:
    """Where an exit-70 command fails: run it again with ``SHARDPLAN_DEBUG=1`` (the exception
    then leaves ``main``) and name the innermost product frame."""
    from planner.cli import main

    try:
        with environment({**(env or {}), "SHARDPLAN_DEBUG": "1"}), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), time_limit(limit):
            main(list(argv))
    except (FuzzTimeout, SystemExit):
        return ""
    except BaseException as e:  # noqa: BLE001
        return where(e)
    return ""


def run_cli_subprocess(argv: list[str], limit: float = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``python -m planner.cli *argv`` as a process (``timeout=limit``), judged."""
    full = {k: v for k, v in os.environ.items() if k != "SHARDPLAN_DEBUG"}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full.get("PYTHONPATH", "")) if p)
    full.setdefault("COLUMNS", "100")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "planner.cli", *argv], capture_output=True, timeout=limit,
                           cwd=REPO, env=full, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome("hang", f"killed after {limit:g} s", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    stderr = p.stderr.decode("utf-8", "backslashreplace")
    return _judge_cli(p.returncode, p.stdout.decode("utf-8", "backslashreplace"), stderr, seconds + 0.0,
                      limit + 1.0)


# ---------------------------------------------------------------------------------------------
# Extra rules of some commands
# ---------------------------------------------------------------------------------------------

def snapshot(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def check_output_file(path: Path, before: bytes | None, outcome: Outcome, kind: str) -> str | None:
    """The ``-o`` rule: a failed command leaves ``path`` as it was; a successful one leaves a whole
    file (``kind``: ``plan``, ``svg``, ``png`` or ``text``); no temporary file stays behind."""
    try:
        parent = path.parent
        leftovers = [p.name for p in parent.glob(f".{path.name}.*.tmp")] if parent.is_dir() else []
    except (OSError, ValueError):
        leftovers = []
    if leftovers:
        return f"temporary files left next to -o: {leftovers[:3]}"
    now = snapshot(path)
    if outcome.rc != 0:
        if now != before:
            return ("a failed command created -o" if before is None else "a failed command changed -o") + f" ({path})"
        return None
    if outcome.rc == 0:
        if now is None:
            return f"exit 0 but -o '{path}' is not a file"
        if kind == "plan":
            from vocab.plan import parse_plan

            try:
                parse_plan(now.decode("utf-8"))
            except (ShardplanError, UnicodeDecodeError) as e:
                return f"-o holds no valid plan: {str(e)[:200]}"
        elif kind == "svg" and b"</svg>" not in now:
            return "-o is not a whole SVG"
        elif kind == "png" and not (now.startswith(b"\x89PNG") and now.rstrip().endswith(b"\xaeB`\x82")):
            return "-o is not a whole PNG"
        elif kind == "text" and not now:
            return "-o is empty"
    return None


def jsonl_lines(data: bytes) -> int | None:
    """Lines of a JSON-lines file (None: not UTF-8): each ended by ``\\n`` (a ``\\r`` before it, or
    anywhere, is JSON whitespace), a final one ending the last line. Other characters Unicode
    counts as line breaks (``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028, U+2029) end no
    line: JSON allows U+2028 and U+2029 unescaped inside strings."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text:
        return 0
    parts = text.split("\n")
    return len(parts) - 1 if parts[-1] == "" else len(parts)


def check_batch(data: bytes, outcome: Outcome) -> str | None:
    """``estimate --batch``: one JSON object out per line in, in order, ``{"error": ...}`` for a bad
    line (an internal error reported for a line counts as a bug); exit 2 after one output line per
    input line when some line failed (``N of M lines failed``); refusing the whole file (exit 2)
    is for a file that is empty, blank or not UTF-8 only."""
    n = jsonl_lines(data)
    some_failed = outcome.rc == 2 and " lines failed" in outcome.detail
    if outcome.rc == 2 and not some_failed:
        if n is None or not data.decode("utf-8").strip():
            return None
        return f"a readable batch file of {n} line(s) refused as a whole: {outcome.detail}"
    if outcome.rc not in (0, 2):
        return None
    got = outcome.stdout.split("\n")
    if got and got[-1] == "":
        got.pop()
    if n is None:
        return None if len(got) >= 1 else "no output for a non-UTF-8 file"
    if len(got) != n:
        return f"{n} input line(s) but {len(got)} output line(s)"
    for i, line in enumerate(got, 1):
        try:
            obj = json.loads(line)
        except ValueError:
            return f"output line {i} is not JSON: {line[:120]!r}"
        if not isinstance(obj, dict):
            return f"output line {i} is not a JSON object"
        err = obj.get("error")
        if isinstance(err, str) and err.startswith("line ") and not err.startswith(f"line {i}:"):
            return f"output line {i} reports another line: {err[:80]!r}"
        if isinstance(err, str) and ("internal error" in err or "this is a bug" in err):
            return f"output line {i} reports a bug instead of a bad input: {err[:300]}"
    return None


# ---------------------------------------------------------------------------------------------
# Cases: one generated input with the call that runs it
# ---------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One fuzzed input: ``run(limit)`` runs it in-process; ``argv``/``env`` (CLI cases) can also run as
    a subprocess; ``checks`` are the extra rules its outcome must meet."""

    family: str
    target: str
    notes: list[str]
    run: Callable[[float | None], Outcome]
    argv: list[str] | None = None
    env: dict[str, str | None] | None = None
    payload: bytes | None = None
    checks: list[Callable[[Outcome], str | None]] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)

    def describe(self, limit: int = 1500) -> str:
        parts = [f"[{self.family}] {self.target}", "mutations: " + "; ".join(self.notes)]
        if self.argv is not None:
            parts.append("argv: " + " ".join(_quote(a) for a in self.argv))
        if self.env:
            parts.append("env: " + ", ".join(f"{k}={v}" for k, v in self.env.items()))
        if self.payload is not None:
            more = " ..." if len(self.payload) > limit else ""
            parts.append(f"input ({len(self.payload)} bytes): {self.payload[:limit]!r}{more}")
        return "\n  ".join(parts)

    def execute(self, limit: float | None = HANG_S, subprocess_mode: bool = False) -> Outcome:
        """Run and judge (the extra rules included); removes the case's files afterwards."""
        try:
            if subprocess_mode:
                assert self.argv is not None
                out = run_cli_subprocess(self.argv, limit or HANG_S, self.env)
            else:
                out = self.run(limit)
            if out.ok:
                for check in self.checks:
                    problem = check(out)
                    if problem:
                        out.kind, out.detail = "other", problem
                        break
            if out.kind == "exit70" and self.argv is not None and not subprocess_mode:
                out.where = locate_cli(self.argv, self.env, limit)
            return out
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the case's files."""
        for p in self.cleanup:
            with contextlib.suppress(OSError, ValueError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()

    @property
    def subprocess_ok(self) -> bool:
        return self.argv is not None and not any("\x00" in a for a in self.argv)


def _quote(arg: str) -> str:
    if arg and all(c.isalnum() or c in "-_./=:,+@%" for c in arg):
        return arg
    return repr(arg) if any(not c.isprintable() for c in arg) else "'" + arg.replace("'", "'\\''") + "'"


class FuzzEnv:
    """Where the generators write files, and the seeds they start from (plans are made once)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self._plans: list[tuple[str, dict[str, Any], Path]] | None = None
        self.profile = valid_profile()
        self.profile_path = self.root / "seed-profile.json"
        self.profile_path.write_text(json.dumps(self.profile))
        self.configs = hf_configs()
        self.accelerator = accelerator_seed()
        self.clusters = cluster_seeds()

    @property
    def plans(self) -> list[tuple[str, dict[str, Any], Path]]:
        if self._plans is None:
            self._plans = make_plans(self.root)
        return self._plans

    def name(self, suffix: str = "", stem: str = "f") -> Path:
        self._n += 1
        return self.root / f"{stem}{self._n}{suffix}"

    def file(self, data: bytes, suffix: str = ".json", stem: str = "f") -> Path:
        p = self.name(suffix, stem)
        p.write_bytes(data)
        return p


# ---------------------------------------------------------------------------------------------
# Time limits and reports shared by the tests and the benchmark
# ---------------------------------------------------------------------------------------------

class HangBudget:
    """The time limit of each call of one family: :data:`HANG_S` until ``allowed`` calls ran over
    it, then ``after`` seconds (a family with a hang does not spend the run waiting on more of
    them; a call over ``after`` then counts as a hang too)."""

    def __init__(self, allowed: int = 3, after: float = 5.0, limit: float = HANG_S):
        self.allowed, self.after, self.full, self.hangs = allowed, after, limit, 0

    def limit(self) -> float:
        return self.full if self.hangs < self.allowed else self.after

    def record(self, outcome: Outcome) -> None:
        if outcome.kind == "hang":
            self.hangs += 1


def signature(case: Case, out: Outcome) -> tuple[str, str, str]:
    """What makes two failures the same bug: family, kind, and the place and exception type (or the
    message with names and numbers blanked)."""
    import re

    if out.kind == "exit70":
        m = re.search(r"internal error in '[^']*': (\w+)", out.detail)
        what = m.group(1) if m else ""
    elif out.kind == "exception":
        what = out.detail.removeprefix("main() raised ").split(":")[0]
    else:
        what = re.sub(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?", "_", out.detail)[:70]
    return case.family, out.kind, f"{out.where} {what}".strip()


def report(failures: list[tuple[Case, Outcome]], groups: int = 12, width: int = 700) -> str:
    """Failures grouped by :func:`signature`: count, outcome and the first input of each group."""
    by: dict[tuple[str, str, str], list[tuple[Case, Outcome]]] = {}
    for case, out in failures:
        by.setdefault(signature(case, out), []).append((case, out))
    lines = [f"{len(failures)} failing input(s), {len(by)} distinct:"]
    for (_, _kind, _), items in sorted(by.items(), key=lambda kv: -len(kv[1]))[:groups]:
        case, out = items[0]
        lines.append(f"- {len(items)}x {out.summary()[:300]}")
        lines.append("    " + case.describe(width).replace("\n", "\n    "))
    if len(by) > groups:
        lines.append(f"... and {len(by) - groups} more distinct failure(s)")
    return "\n".join(lines)
