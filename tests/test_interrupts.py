"""``vocab.interrupts.held_interrupts``: a SIGINT inside the block reaches the handler only once the
block ends (where a C extension would have printed and swallowed the KeyboardInterrupt)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from vocab.interrupts import held_interrupts


def test_a_sigint_in_the_block_is_delivered_after_it() -> None:
    seen: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append("handler")
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with held_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                seen.append("block ran on")
        assert seen == ["block ran on", "handler"]  # once, after the block
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_without_a_sigint_nothing_changes() -> None:
    before = signal.getsignal(signal.SIGINT)
    with held_interrupts():
        x = 1
    assert x == 1 and signal.getsignal(signal.SIGINT) is before


def test_an_ignored_sigint_stays_ignored() -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
