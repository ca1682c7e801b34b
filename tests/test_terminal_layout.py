"""Terminal output that degrades well: ``explain``, ``compare`` and ``hardware`` at 80 columns, piped
and on a wide terminal. No line is longer than the width, no name is cut short ("…"), every
accelerator name is whole, MFU is a percentage; the 80-column output is a stored snapshot.

The snapshots (tests/data/snapshots/*.txt) hold the output with trailing spaces stripped from each
line; ``SHARDPLAN_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_terminal_layout.py`` rewrites them
(after a deliberate change to the layout, the cost model or the search).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from planner.cli import app, err_console
from planner.compare import compare, render_compare
from planner.explain import explain_data, render_explain, solver_time_text
from vocab.plan import Plan, load_plan

SNAPSHOTS = Path(__file__).parent / "data" / "snapshots"
ROOT = Path(__file__).resolve().parents[1]
UPDATE = bool(os.environ.get("SHARDPLAN_UPDATE_SNAPSHOTS"))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
runner = CliRunner()


def _accelerators() -> list[str]:
    from profiler.hardware import accelerators

    return list(accelerators())


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two plans for Llama 3 8B on 8 H100s (about a second each): the full space's and the
    Megatron space's, written as a.json and b.json (compare names them ``a`` and ``b``)."""
    from planner.api import plan

    d = tmp_path_factory.mktemp("layout")
    plan("llama3-8b", "8xh100", seq_len=4096, global_batch=64).save(d / "a.json")
    plan("llama3-8b", "8xh100", seq_len=4096, global_batch=64, space="megatron").save(d / "b.json")
    return d / "a.json", d / "b.json"


def _cli(args: list[str], columns: int | None = None) -> str:
    env = {"COLUMNS": str(columns)} if columns else None
    r = runner.invoke(app, args, env=env)
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.stdout)


def _render(fn: Callable[[Console], None], width: int) -> str:
    buf = io.StringIO()
    fn(Console(file=buf, width=width, force_terminal=False, color_system=None, legacy_windows=False))
    return buf.getvalue()


def _stripped(text: str) -> str:
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def _snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_stripped(text), encoding="utf-8")
    assert path.exists(), f"no snapshot {path}: run with SHARDPLAN_UPDATE_SNAPSHOTS=1"
    assert _stripped(text) == path.read_text(encoding="utf-8"), f"{name} differs from {path}"


def _check(text: str, width: int, names: list[str], words: tuple[str, ...] = ()) -> None:
    """No line over ``width``, nothing cut short, every name and word whole."""
    lines = text.splitlines()
    assert lines
    too_long = [ln for ln in lines if len(ln) > width]
    assert not too_long, too_long[:3]
    assert "…" not in text
    for name in [*names, *words]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"'{name}' is not whole"


# ---- hardware ------------------------------------------------------------------------------------

HARDWARE_WORDS = ("bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB", "HBM TB/s", "scale-up GB/s", "scale-out GB/s", "GEMM eff")


def test_hardware_at_80_columns(columns_from_env: None) -> None:
    out = _cli(["hardware"], 80)
    _check(out, 80, _accelerators(), HARDWARE_WORDS)
    _snapshot("hardware_80", out)


def test_hardware_piped() -> None:
    """``shardplan hardware | cat``: no terminal anywhere, no COLUMNS, so rich's 80 columns."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    r = subprocess.run([sys.executable, "-m", "planner.cli", "hardware"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check(r.stdout, 80, _accelerators(), HARDWARE_WORDS)
    assert _stripped(r.stdout) == (SNAPSHOTS / "hardware_80.txt").read_text(encoding="utf-8")


def test_hardware_on_a_wide_terminal_keeps_one_table(wide: None) -> None:
    out = _cli(["hardware"])
    _check(out, 200, _accelerators(), HARDWARE_WORDS)
    header = next(ln for ln in out.splitlines() if "bf16 TFLOP/s" in ln)
    assert "scale-out GB/s" in header and "GEMM eff" in header  # one row of headers: today's table


def test_hardware_narrower_still_lists_each_accelerator() -> None:
    out = _render(lambda c: _with_console(c, ["hardware"]), 40)
    _check(out, 40, _accelerators(), ("TFLOP/s", "scale-out"))


def _with_console(c: Console, args: list[str]) -> None:
    """Run a command printing to ``c`` instead of the CLI's console."""
    import planner.cli as cli

    old = cli.console
    cli.console = c
    try:
        assert cli.main(args) == 0
    finally:
        cli.console = old


# ---- explain -------------------------------------------------------------------------------------

def _explain_words(p: Plan) -> tuple[str, ...]:
    return ("MFU", "per pipeline stage", "strategies", "inside one node", "time not recorded", p.inputs.model)


def test_explain_at_80_columns(plans: tuple[Path, Path], columns_from_env: None) -> None:
    p = load_plan(plans[0])
    out = _cli(["explain", str(plans[0])], 80)
    _check(out, 80, [p.inputs.cluster.accelerator], _explain_words(p))
    assert re.search(r"MFU \d+\.\d%", out)
    assert "0.00 s" not in out and "candidates (time not recorded)" in " ".join(out.split())
    assert out == _render(lambda c: render_explain(explain_data(p), c), 80)  # the CLI's console: 80 columns
    _snapshot("explain_80", out)


def test_explain_piped_and_wide(plans: tuple[Path, Path]) -> None:
    p = load_plan(plans[0])
    for width in (80, 120, 200):
        out = _render(lambda c: render_explain(explain_data(p), c), width)
        _check(out, width, [p.inputs.cluster.accelerator], _explain_words(p))
    wide = _render(lambda c: render_explain(explain_data(p), c), 200)
    assert re.search(r"┃ stage ┃ layers +┃ strategies", wide)  # the wide per-stage table, one row of headers
    assert "rank stride" in wide and "placement" in wide


def test_solver_time_is_never_made_up() -> None:
    assert solver_time_text(0.0) == " (time not recorded)" and solver_time_text(None) == " (time not recorded)"
    assert solver_time_text(1.234) == " in 1.23 s"


# ---- compare -------------------------------------------------------------------------------------

def test_compare_at_80_columns(plans: tuple[Path, Path], columns_from_env: None) -> None:
    a, b = (load_plan(p) for p in plans)
    out = _cli(["compare", *map(str, plans)], 80)
    _check(out, 80, [a.inputs.cluster.accelerator], ("MFU", "layer strategies"))
    mfu = [ln for ln in out.splitlines() if "MFU" in ln]
    assert mfu and all(re.search(r"\d+\.\d%", ln) for ln in mfu), mfu
    assert not re.search(r"0\.\d{4}\b", " ".join(mfu))
    assert out == _render(lambda c: render_compare(compare([a, b], ["a", "b"]), c), 80)
    _snapshot("compare_80", out)


def test_compare_wide_keeps_the_plans_side_by_side(plans: tuple[Path, Path], wide: None) -> None:
    a, b = (load_plan(p) for p in plans)
    out = _cli(["compare", *map(str, plans)])
    _check(out, 200, [a.inputs.cluster.accelerator], ("MFU", "layer strategies"))
    row = next(ln for ln in out.splitlines() if "≠ MFU" in ln)
    assert len(re.findall(r"\d+\.\d%", row)) == 2  # both plans' MFU on one row
    three = _render(lambda c: render_compare(compare([a, b, a], ["a", "b", "c"]), c), 80)
    _check(three, 80, [a.inputs.cluster.accelerator], ("MFU", "c"))


# ---- plan: the summary and the progress ----------------------------------------------------------

def test_summary_lists_the_per_unit_exceptions() -> None:
    from planner.commands.plan import MAX_EXCEPTION_LINES, _layers_text
    from vocab.strategy import Strategy

    full = {"sharding": "zero3", "recompute": "full"}
    s = Strategy.model_validate({"default": {"sharding": "zero3"}, "layers": [
        {"unit": "layers.0", **full}, {"unit": "layers.79", **full},
        *({"unit": f"layers.{i}", "sharding": "zero1"} for i in range(3, 8)), {"unit": "head", "sharding": "zero1"},
        *({"unit": f"layers.{i}.mlp.up", "sharding": "zero3", "split": 4} for i in range(10, 14))]})
    assert _layers_text(s).splitlines() == ["zero3, recompute none", "layers.0,79: recompute full",
                                            "layers.3-7 + head: zero1", "layers.10-13.mlp.up: split 4"]
    many = Strategy.model_validate({"default": {"sharding": "zero3"}, "layers": [
        {"unit": f"layers.{i}", "sharding": "zero3", "split": i + 2} for i in range(10)]})
    lines = _layers_text(many).splitlines()
    assert len(lines) == 1 + MAX_EXCEPTION_LINES and lines[-1].startswith("and 7 more groups")


def test_plan_progress_never_shows_an_unknown_total(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The bar (drawn on a terminal only) shows no count before the search has one, never ``0/None``."""
    import planner.api

    real = planner.api.search_plan
    seen: list[Any] = []

    def search(*args: Any, **kwargs: Any) -> Any:
        progress = next(a for a in args if callable(a))
        progress("enumerating meshes", 0, None)
        seen.append(progress)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner.api, "search_plan", search)
    monkeypatch.setattr(err_console, "_force_terminal", True)  # a person's terminal: the bar is drawn
    monkeypatch.setattr(err_console, "is_interactive", True)
    monkeypatch.setenv("TERM", "xterm")
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch",
                            "8"])
    assert r.exit_code == 0, r.output
    assert seen and "enumerating meshes" in r.stderr
    assert "None" not in ANSI.sub("", r.stderr)
