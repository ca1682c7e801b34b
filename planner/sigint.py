"""Ctrl-C (SIGINT) at any moment of ``shardplan``: one line, ``interrupted``, and exit code 130.

Three stretches of a run, three ways:

- while the command line's modules load (``planner`` and ``planner.cli`` import this module before any other):
  SIGINT exits at once with the line and the code (nothing is open yet). At the end of its import
  ``planner.cli`` calls :func:`loaded`, which puts back the handler it found, so that a program
  that imports the command line keeps its own Ctrl-C;
- while the command runs: Python's ``KeyboardInterrupt``, which the commands turn into the line and
  the code after removing what they were writing (:func:`planner.cli.guard`), and which
  :func:`planner.cli.run` catches around the rest;
- once the command has its exit code: SIGINT is ignored, the process is ending.

A SIGINT before Python runs the first line of the package (interpreter start-up, ``site``) gets
Python's own handling.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

#: the exit code of an interrupted command (128 + SIGINT, as shells report it)
INTERRUPTED_EXIT = 130
#: the names ``sys.argv[0]`` has when shardplan is the program: its console script, ``-m planner.cli``
ENTRY_POINTS = ("shardplan", "cli.py")
#: the line an interrupted command prints on stderr
INTERRUPTED = "interrupted"


def _exit_now(signum: int, frame: Any) -> None:
    os.write(2, f"{INTERRUPTED}\n".encode())  # not through sys.stderr: its buffer may be mid-write
    os._exit(INTERRUPTED_EXIT)


def _install(handler: Any) -> Any:
    """Set the SIGINT handler; the one before it, or None off the main thread (where Python sets none)."""
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        return None


_found = _install(_exit_now) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else None


def is_entry() -> bool:
    """Whether shardplan is the program: its console script, or ``python -m planner.cli`` (read from
    the interpreter's own arguments too, since ``sys.argv[0]`` is ``-m`` while the package loads)."""
    argv0 = Path(sys.argv[0] if sys.argv else "").name
    orig = list(getattr(sys, "orig_argv", []))
    via_m = any(a == "-m" and b == "planner.cli" for a, b in zip(orig, orig[1:], strict=False))
    return argv0 in ENTRY_POINTS or via_m


def loaded() -> None:
    """The package or the command line has loaded: the SIGINT handler found before it is back, for a
    program that imports it; the ``shardplan`` script and ``python -m planner.cli`` keep exiting at
    once until :func:`running` (under ``-m`` the module is imported a second time before it runs)."""
    if _found is not None and not is_entry():
        _install(_found)


#: whether SIGINT arrived while a command ran (a library may turn the ``KeyboardInterrupt`` into
#: its own error: pydantic-core reports one raised while it builds a validator as a ``SchemaError``)
received = False


def _interrupt(signum: int, frame: Any) -> None:
    global received
    received = True
    signal.default_int_handler(signum, frame)


def running() -> None:
    """A command starts: SIGINT raises ``KeyboardInterrupt`` (and is recorded in :data:`received`)."""
    global received
    received = False  # a program that runs several commands: one interrupt is not the next's
    _install(_interrupt)


def finished() -> None:
    """The command has its exit code: SIGINT is ignored, and the process exits with that code.

    CPython (3.11, ``run_eval_code_obj`` in ``Python/pythonrun.c``) marks a ``KeyboardInterrupt``
    that leaves an ``eval`` of a string as unhandled even when a caller catches it (typer evaluates
    the commands' annotations that way), and ``Py_RunMain`` then ends the process by SIGINT (exit
    -2) instead of with its code. Each such evaluation clears the mark first: one harmless one does."""
    _install(signal.SIG_IGN)
    eval("None")  # noqa: S307  (a constant: clears the mark described above)
