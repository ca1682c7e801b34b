"""The training ranks a test started: the descendants of a process that are not multiprocessing's
resource tracker (and, with ``live``, not zombies)."""

from __future__ import annotations

import psutil


def rank_processes(parent: psutil.Process | None = None, live: bool = False) -> list[psutil.Process]:
    """Rank processes under ``parent`` (this process by default); a process that ends meanwhile is left out."""
    out = []
    for c in (parent or psutil.Process()).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(c.cmdline()) and not (live and c.status() == psutil.STATUS_ZOMBIE):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out
