"""A script of ``benchmarks/`` loaded as a module (the folder is not a package), for tests that share
its data or helpers."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, loaded once."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the script runs
    spec.loader.exec_module(mod)
    return mod
