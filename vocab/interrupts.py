"""Ctrl-C held back over code that would swallow it.

A C extension that calls back into Python prints an exception raised in the callback and carries on
(protobuf's descriptor pool does, as OR-Tools' MathOpt loads): a ``KeyboardInterrupt`` that lands
there becomes a traceback on stderr and the run goes on as if nothing happened. :func:`held_interrupts`
records a SIGINT that arrives inside its block and hands it to the handler that was installed once
the block ends, so the program's own Ctrl-C handling (``planner.sigint``) sees it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Run the block with SIGINT recorded, not delivered; afterwards the handler before it gets the
    first one that arrived. Off the main thread, or where no Python handler is set, nothing changes."""
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(before):
        yield
        return
    caught: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if caught:
            before(*caught[0])
