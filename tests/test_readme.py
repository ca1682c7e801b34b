"""README.md is a user's guide: short, no development history, the set-up commands CI runs, and a
CLI table whose every command and option exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from planner.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 250
HISTORY_WORDS = ("session", "what changed", "re-run", "2026-", "previously")
SETUP_COMMANDS = (
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && shardplan plan --model llama3-70b "
    "--cluster 1024xh100 --seq-len 8192 --global-batch 512 -o plan.json",
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[test]' && sh tests/install_trainers.sh "
    "&& python -m pytest -q",
)
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

runner = CliRunner()


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def cli_table() -> list[tuple[tuple[str, ...], list[str]]]:
    """(command words after ``shardplan``, ``--options`` named) of each row of the README's CLI
    table: the table whose header starts with ``| command |``."""
    rows: list[tuple[tuple[str, ...], list[str]]] = []
    inside = False
    for line in _lines():
        if line.startswith("| command |"):
            inside = True
            continue
        if not inside:
            continue
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):  # the separator row
            continue
        code = re.search(r"`shardplan ([^`]*)`", cells[0])
        assert code, f"CLI table row without a `shardplan ...` command: {line}"
        words: list[str] = []
        for word in code.group(1).split():
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break  # PLAN, [CSV...]: arguments, not subcommands
            words.append(word)
        rows.append((tuple(words), OPTION.findall(" ".join(cells[1:-1]))))
    return rows


ROWS = cli_table()


def test_readme_is_short() -> None:
    assert len(_lines()) <= MAX_LINES, f"README.md has {len(_lines())} lines, at most {MAX_LINES}"


def test_readme_tells_no_development_history() -> None:
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(_lines(), 1)
            for word in HISTORY_WORDS if word in line.lower()]
    assert not hits, "history in README.md:\n" + "\n".join(hits)


def test_readme_keeps_the_setup_commands_verbatim() -> None:
    text = README.read_text(encoding="utf-8")
    for cmd in SETUP_COMMANDS:
        assert cmd in text, f"README.md lacks the set-up command: {cmd}"


def test_cli_table_lists_the_commands() -> None:
    commands = {" ".join(words) for words, _ in ROWS}
    assert {"plan", "explain", "export", "train", "estimate"} <= commands, commands
    assert all(words for words, _ in ROWS)


def _help(words: tuple[str, ...]) -> str:
    r = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert r.exit_code == 0, f"shardplan {' '.join(words)} --help exited {r.exit_code}:\n{r.output}"
    return ANSI.sub("", r.output)


@pytest.mark.parametrize("words, options", ROWS, ids=[" ".join(w) for w, _ in ROWS])
def test_every_command_and_option_in_the_cli_table_exists(words: tuple[str, ...], options: list[str]) -> None:
    out = _help(words)
    missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", out)]
    assert not missing, f"shardplan {' '.join(words)} --help does not know {missing}"


def test_first_plan_output_is_what_the_command_prints(tmp_path: Path) -> None:
    """The output block after the first set-up command is the plan command's output, line for
    line (the solver's wall time aside)."""
    import subprocess
    import sys

    text = README.read_text(encoding="utf-8")
    closing = text.index("```", text.index(SETUP_COMMANDS[0]))  # of the command's own block
    start = text.index("```\n", closing + 3) + 4
    shown = text[start:text.index("```", start)].strip("\n").splitlines()
    args = SETUP_COMMANDS[0].split("shardplan ", 1)[1].split()
    out = subprocess.run([sys.executable, "-m", "planner.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "COLUMNS": "80"}, check=True).stdout
    wall = re.compile(r"\d+\.\d+ s(\s*│)$")
    got = [wall.sub(r"T s\1", line.rstrip()) for line in out.strip("\n").splitlines()]
    assert got == [wall.sub(r"T s\1", line.rstrip()) for line in shown]
