"""The launch watchdog (which rank is stale; a frozen rank ends ``shardplan train`` with one line and
no processes left) and ``train -o`` refused before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers ``train``)
import runtime.launch
from planner.cli import app
from planner.commands import train as train_cmd
from runtime.launch import FAIL_ENV, WATCHDOG_S, Stale, _Watch, stale_rank
from runtime.plans import hand_plan
from tests.processes import rank_processes
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

runner = CliRunner()


@pytest.fixture()
def plan2(tmp_path: Path) -> Path:
    p = tmp_path / "plan.json"
    hand_plan("tiny-llama", Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero2"),
                                     micro_batch=4)).save(p)
    return p


def test_no_rank_is_stale_while_pulses_and_progress_are_recent() -> None:
    assert stale_rank({0: 9.5, 1: 9.8}, {0: 9.0, 1: 8.0}, now=10.0, started=0.0, limit_s=5.0) is None
    assert stale_rank({}, {}, now=10.0, started=0.0, limit_s=5.0) is None


def test_a_rank_whose_pulse_is_silent_for_the_limit_is_blamed() -> None:
    assert stale_rank({0: 9.5, 1: 4.0}, {0: 3.0, 1: 3.5}, now=10.0, started=0.0, limit_s=5.0) == Stale(1, 6.0, True)
    assert stale_rank({0: 9.5, 1: 5.0}, {0: 9.0, 1: 5.0}, now=10.0, started=0.0, limit_s=5.0) == Stale(1, 5.0, True)
    assert stale_rank({0: 9.5, 1: 5.5}, {0: 9.0, 1: 5.5}, now=10.0, started=0.0, limit_s=5.0) is None
    # the one silent longest, the lowest of equals
    assert stale_rank({0: 2.0, 1: 1.0, 2: 9.0}, {0: 1.0, 1: 1.0, 2: 1.0}, now=10.0, started=0.0,
                      limit_s=5.0) == Stale(1, 9.0, True)
    assert stale_rank({0: 9.0, 1: 2.0, 2: 2.0}, {0: 9.0, 1: 2.0, 2: 2.0}, now=10.0, started=0.0,
                      limit_s=5.0) == Stale(1, 8.0, True)


def test_a_rank_that_has_not_pulsed_yet_has_the_startup_time() -> None:
    pulse, progress = {0: 99.0, 1: None}, {0: 99.0, 1: None}
    assert stale_rank(pulse, progress, now=100.0, started=0.0, limit_s=5.0, startup_s=120.0) is None
    assert stale_rank(pulse, progress, now=120.0, started=0.0, limit_s=5.0, startup_s=120.0) == Stale(1, 120.0, True)
    assert stale_rank(pulse, progress, now=300.0, started=0.0, limit_s=300.0, startup_s=120.0) == Stale(1, 300.0, True)
    assert stale_rank(pulse, progress, now=299.0, started=0.0, limit_s=300.0, startup_s=120.0) is None


def test_when_no_rank_makes_progress_the_one_behind_is_blamed() -> None:
    pulse = {0: 9.9, 1: 9.9}
    assert stale_rank(pulse, {0: 3.0, 1: 4.0}, now=10.0, started=0.0, limit_s=5.0) == Stale(0, 7.0, False)
    assert stale_rank(pulse, {0: 4.0, 1: 4.0}, now=10.0, started=0.0, limit_s=5.0) == Stale(0, 6.0, False)
    assert stale_rank(pulse, {0: 3.0, 1: 6.0}, now=10.0, started=0.0, limit_s=5.0) is None  # rank 1 moved
    assert stale_rank(pulse, {0: 1.0, 1: None}, now=10.0, started=0.0, limit_s=5.0) is None  # still setting up


def test_the_message_names_the_rank_and_its_silence() -> None:
    msg = Stale(1, 6.04, True).message(5.0)
    assert msg.startswith("rank 1 was silent for 6.0 s") and "stopped responding" in msg and "5 s" in msg
    assert "no rank made progress" in Stale(0, 7.0, False).message(300.0) and "\n" not in msg


def test_the_watch_times_counter_changes_on_its_own_clock() -> None:
    counters = [0, 0, 0, 0]  # pulse 0, pulse 1, progress 0, progress 1
    w = _Watch(counters, 2, started=0.0)
    assert w.check(1.0, [0, 1], 5.0) is None
    counters[:] = [1, 1, 1, 1]
    assert w.check(2.0, [0, 1], 5.0) is None
    counters[:] = [5, 1, 4, 1]  # rank 1 froze after its first report
    assert w.check(6.0, [0, 1], 5.0) is None
    assert w.check(7.0, [0, 1], 5.0) == Stale(1, 5.0, True)
    assert w.check(7.0, [0], 5.0) is None  # a rank that has exited is not watched


def test_the_cli_default_is_the_launch_default() -> None:
    assert train_cmd.WATCHDOG_S == WATCHDOG_S


@pytest.mark.slow
def test_a_stopped_rank_ends_train_with_one_line_and_no_processes_left(plan2: Path, tmp_path: Path) -> None:
    watchdog = 5.0
    out_file = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from planner.cli import run; run()", "train", "--model", "tiny-llama",
         "--plan", str(plan2), "--steps", "100000", "--watchdog-s", f"{watchdog:g}", "--output", str(out_file)],
        env={**os.environ, FAIL_ENV: "1:stop"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parent = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline, stopped_at = time.monotonic() + 180, None
        while stopped_at is None and proc.poll() is None and time.monotonic() < deadline:
            for c in rank_processes(parent):
                seen.setdefault(c.pid, c)
                try:
                    if c.status() == psutil.STATUS_STOPPED:
                        stopped_at = time.monotonic()
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
        assert stopped_at is not None, "rank 1 never stopped"
        out, _ = proc.communicate(timeout=watchdog + 60)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in seen.values():
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
    assert proc.returncode == 2, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 was silent for "), out
    assert "stopped responding" in lines[0]
    assert took >= watchdog, took  # it waited out the silence (the communicate timeout bounds a hang)
    assert len(seen) >= 2
    _, alive = psutil.wait_procs(list(seen.values()), timeout=5)
    assert alive == []  # every rank ended, the stopped one too
    assert not out_file.exists()


def _train(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["train", *args])
    return r.exit_code, r.output


@pytest.fixture()
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(runtime.launch, "launch", refuse)


def test_output_onto_a_directory_or_under_a_file_is_refused_before_any_rank_starts(
        plan2: Path, tmp_path: Path, no_launch: None) -> None:
    (tmp_path / "a-file").write_text("x")
    for target, reason in [(tmp_path, "is a directory"), (tmp_path / "a-file" / "report.json", "is not a directory")]:
        code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--steps", "1", "-o", str(target))
        assert code == 2 and reason in out, out
        assert len(out.strip().splitlines()) == 1 and out.startswith("error: ")
    assert (tmp_path / "a-file").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_output_into_a_read_only_directory_is_refused(plan2: Path, tmp_path: Path, no_launch: None) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "-o", str(ro / "report.json"))
    finally:
        ro.chmod(0o700)
    assert code == 2 and "permission denied" in out


def test_a_negative_watchdog_is_refused(plan2: Path, no_launch: None) -> None:
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--watchdog-s", "-1")
    assert code == 2 and "--watchdog-s must be at least 0" in out
