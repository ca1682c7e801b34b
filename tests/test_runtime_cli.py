"""``shardplan train``: bad input and faults give one message and a non-zero exit; a good plan trains."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers ``train``)
from planner.cli import app
from runtime.launch import FAIL_ENV, free_port
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


def _train(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, ["train", *args])
    return r.exit_code, r.output


def _workers() -> list[psutil.Process]:
    """Live child processes of this test that are training ranks."""
    return rank_processes(live=True)


def test_corrupt_plan_file(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema_version": "1.0", "strategy": ')
    code, out = _train("--model", "tiny-llama", "--plan", str(bad), "--nproc", "2")
    assert code == 2 and "not valid JSON" in out
    bad.write_text('{"schema_version": "1.0", "strategy": {}}')
    code, out = _train("--model", "tiny-llama", "--plan", str(bad))
    assert code == 2 and "not a valid plan" in out
    code, out = _train("--model", "tiny-llama", "--plan", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read plan" in out


def test_plan_for_another_world_size_or_model(plan2: Path, tmp_path: Path) -> None:
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--nproc", "4")
    assert code == 2 and "needs 2 processes" in out and "--nproc is 4" in out
    code, out = _train("--model", "tiny-gpt", "--plan", str(plan2), "--nproc", "2")
    assert code == 2 and "made for model 'tiny-llama'" in out and "activation swiglu vs gelu" in out
    ep = tmp_path / "ep.json"
    hand_plan("tiny-llama", Strategy(mesh=Mesh(dp_shard=2, ep=2))).save(ep)
    code, out = _train("--model", "tiny-llama", "--plan", str(ep))
    assert code == 2 and "expert parallelism (ep=2)" in out
    code, out = _train("--model", "llama2-70b", "--plan", str(plan2))  # any size builds (on meta); not this plan's
    assert code == 2 and "made for model 'tiny-llama'" in out and "layers 4 vs 80" in out
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--global-batch", "7")
    assert code == 2 and "not divisible" in out


@pytest.mark.slow
def test_train_reports_losses_memory_and_parity(plan2: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "report.json"
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--steps", "2", "--check-parity",
                       "--json", "--output", str(out_file))
    assert code == 0, out
    rep = json.loads(out)
    assert rep == json.loads(out_file.read_text())
    assert rep["parity"] is True and rep["max_loss_diff"] < 1e-4
    assert len(rep["steps"]) == 2 and rep["steps"][0]["loss"] == pytest.approx(rep["reference_losses"][0], rel=1e-4)
    n = 180800  # tiny-llama parameters; ZeRO-2 over 2 ranks
    for st in rep["steps"]:
        assert st["step_time_s"] > 0
        assert [r["rank"] for r in st["ranks"]] == [0, 1]
        assert st["step_time_s"] == max(r["step_time_s"] for r in st["ranks"])  # the slowest rank's
        for r in st["ranks"]:
            assert r["cpu_time_s"] > 0
            assert (r["param_bytes"], r["grad_bytes"], r["optim_bytes"]) == (4 * n, 2 * n, 4 * n)
            assert r["peak_bytes"] > 0
    first, second = rep["steps"]
    assert not first["memory_tracked"] and all(r["tensor_peak_bytes"] is None for r in first["ranks"])
    assert second["memory_tracked"]
    for r in second["ranks"]:  # live tensors peak above the states they hold, below the process's RSS
        assert 10 * n < r["tensor_peak_bytes"] < r["peak_bytes"]
    assert _workers() == []


FORCED = {  # plans the search may pick, forced: context parallelism both ways, expert parallelism, TSP, splits with TP
    "cp-ring": ("tiny-llama", Strategy(mesh=Mesh(cp=2), micro_batch=4)),
    "cp-ulysses": ("tiny-llama", Strategy(mesh=Mesh(cp=2), cp_mode="ulysses", micro_batch=4)),
    "ep": ("tiny-mixtral", Strategy(mesh=Mesh(dp_shard=2, ep=2), micro_batch=4, default=L(sharding="zero3"))),
    "tsp": ("tiny-llama", Strategy(mesh=Mesh(tp=2), tp_mode="tsp", micro_batch=8)),
    "split-tp": ("tiny-gpt", Strategy(mesh=Mesh(tp=2), sequence_parallel=True, micro_batch=8,
                                      default=L(split=2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORCED))
def test_forced_plans_train_like_one_process(name: str, tmp_path: Path) -> None:
    model, strategy = FORCED[name]
    plan = tmp_path / f"{name}.json"
    hand_plan(model, strategy).save(plan)
    code, out = _train("--model", model, "--plan", str(plan), "--steps", "2", "--check-parity", "--json")
    assert code == 0, out
    rep = json.loads(out)
    assert rep["parity"] is True and rep["max_loss_diff"] < 1e-5 * rep["reference_losses"][0]
    assert _workers() == []


@pytest.mark.slow
def test_a_dying_rank_ends_all_ranks_with_one_message(plan2: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAIL_ENV, "1")
    out_file = tmp_path / "report.json"
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--steps", "2", "--output", str(out_file))
    assert code != 0
    assert "rank 1 failed" in out and "injected failure" in out
    assert "Traceback" not in out
    assert not out_file.exists() and list(tmp_path.iterdir()) == [plan2]  # no partial outputs
    assert _workers() == []  # no orphans
    monkeypatch.setenv(FAIL_ENV, "0:exit")  # dies without a word
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--steps", "2", "--output", str(out_file))
    assert code != 0 and "rank 0 died (exit code 3)" in out
    assert not out_file.exists() and _workers() == []


def test_a_rank_aborting_in_teardown_after_all_finished_is_forgiven(plan2: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's C++ teardown once aborted a rank after the job had finished (CI, 1 run in many): the
    launch reports the results every rank completed, not a failure."""
    monkeypatch.setenv(FAIL_ENV, "1:teardown")
    out_file = tmp_path / "report.json"
    code, out = _train("--model", "tiny-llama", "--plan", str(plan2), "--steps", "1", "--output", str(out_file))
    assert code == 0, out
    assert len(json.loads(out_file.read_text())["steps"]) == 1
    assert _workers() == []


@pytest.mark.slow
def test_sigterm_to_train_ends_every_rank_and_leaves_nothing(plan2: Path, tmp_path: Path) -> None:
    """A scheduler's SIGTERM to ``shardplan train``: one message, a non-zero exit, every rank
    ended, no scratch directory and no output left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    scratch, out_file = tmp_path / "scratch", tmp_path / "report.json"
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from planner.cli import run; run()", "train", "--model", "tiny-llama",
         "--plan", str(plan2), "--nproc", "2", "--steps", "100000", "--output", str(out_file)],
        env={**os.environ, "TMPDIR": str(scratch)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parent = psutil.Process(proc.pid)

    try:
        deadline = time.monotonic() + 120
        while len(rank_processes(parent)) < 2 and time.monotonic() < deadline:  # both ranks started
            time.sleep(0.2)
        started = rank_processes(parent)
        assert len(started) >= 2
        while not list(scratch.glob("shardplan-train-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # training under way
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:  # whatever failed, no training is left running for the next test
        if proc.poll() is None:
            for c in parent.children(recursive=True):
                c.kill()
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2 and "stopped by SIGTERM" in out and "Traceback" not in out
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert alive == []
    assert list(scratch.glob("shardplan-train-*")) == [] and not out_file.exists()  # (torch caches aside)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_plan_made_for_this_machine_trains(tmp_path: Path) -> None:
    """The issue's round trip: ``shardplan plan --model gpt2 --cluster 4xcpu ...`` then ``train --nproc 4``."""
    p = tmp_path / "gpt2.json"
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128",
                            "--global-batch", "8", "-o", str(p)])
    assert r.exit_code == 0, r.output
    plan = json.loads(p.read_text())
    code, out = _train("--model", "gpt2", "--plan", str(p), "--nproc", "4", "--steps", "1", "--json")
    assert code == 0, out
    rep = json.loads(out)
    assert len(rep["steps"]) == 1 and [x["rank"] for x in rep["steps"][0]["ranks"]] == [0, 1, 2, 3]
    assert rep["steps"][0]["loss"] == pytest.approx(11.0, abs=0.5)  # ln(50257) = 10.8 at initialisation
    mesh = plan["strategy"]["mesh"]
    assert mesh["pp"] * mesh["dp_replicate"] * mesh["dp_shard"] * mesh["cp"] * mesh["tp"] == 4
    # the host is the device: offloading frees nothing on a CPU, so the plan never asks for it
    assert all(e["offload"] == "none" for e in [plan["strategy"]["default"], *plan["strategy"]["layers"]])
    assert _workers() == []


def _report(ranks: int, steps: int) -> dict[str, object]:
    """A train report of ``steps`` steps on ``ranks`` ranks, the first step memory-tracked."""
    per_rank = [{"rank": r, "cpu_time_s": 1.25 + r, "param_bytes": 12_345_678, "grad_bytes": 12_345_678,
                 "optim_bytes": 24_691_356, "peak_bytes": 987_654_321, "tensor_peak_bytes": 55_500_000}
                for r in range(ranks)]
    return {"model": "gpt2\x1b[31m", "nproc": ranks, "device": "cpu", "reference_losses": [10.5 - s for s in range(steps)],
            "steps": [{"step": s, "loss": 10.5 - s, "step_time_s": 2.5, "memory_tracked": s == 0, "ranks": per_rank}
                      for s in range(steps)]}


@pytest.mark.parametrize("width", [80, 200])
def test_the_train_table_fits_the_terminal(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns the steps and the ranks print one table under the other, every cell whole; a
    wide terminal keeps one table; the model's name is printed literally."""
    import io

    from rich.console import Console

    from planner.commands import train

    out = io.StringIO()
    monkeypatch.setattr(train, "console", Console(file=out, width=width, color_system=None))
    train._table(_report(4, 3))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= width and not any("…" in x for x in lines)
    assert "gpt2\\x1b[31m" in out.getvalue() and "\x1b" not in out.getvalue()
    rank_rows = [x for x in lines if " 988 " in x]  # each rank of each step, with its whole peak
    assert len(rank_rows) == 12 and all("12.35" in x and "24.69" in x and "55.5" in x for x in rank_rows)
    assert ("per rank" in [x.strip() for x in lines]) == (width == 80)  # the second table's title
