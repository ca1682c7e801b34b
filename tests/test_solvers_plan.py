"""plan(): reproducible documents, CPU clusters, time limits, infeasible requests, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from costmodel.estimate import estimate
from planner.api import plan, search_plan
from planner.cli import app
from planner.request import Request
from profiler.hardware import parse_cluster
from profiler.models import load_model
from vocab.errors import ShardplanError
from vocab.plan import parse_plan

runner = CliRunner()


def test_cpu_plan_is_reproducible_and_fits() -> None:
    a = plan("gpt2", "4xcpu", seq_len=128, global_batch=8)
    b = plan("gpt2", "4xcpu", seq_len=128, global_batch=8)
    assert a.to_json() == b.to_json()
    assert parse_plan(a.to_json()).to_json() == a.to_json()
    s = a.solver
    assert s.status == "optimal" and s.gap == 0.0 and s.objective == s.bound == a.predicted.step_time_s
    g, cl = load_model("gpt2", 128), parse_cluster("4xcpu")
    rep = estimate(g, cl, a.strategy, a.inputs.workload)
    assert rep.fits and rep.step_time_s == pytest.approx(a.predicted.step_time_s, rel=1e-12)
    d = a.predicted.model_dump()
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "hfu", "memory_peak_gib", "stages", "time"):
        assert key in d
    assert a.alternatives and all(
        x.predicted.step_time_s >= a.predicted.step_time_s * (1 - 1e-12) for x in a.alternatives[:3]
    )


def test_staged_plan_mixes_inside_stages_reproducibly() -> None:
    """Under a tight limit the staged space's fastest plan (units of a pipeline stage sharded apart)
    beats hybrid's, is byte-identical when planned twice, and records the stage MIP as its solver."""
    kw = dict(seq_len=8192, global_batch=32, memory_limit_gib=20.0, top_k=1, tie_break=False)
    a = plan("llama3-8b", "16xh100", space="staged", **kw)
    assert a.to_json() == plan("llama3-8b", "16xh100", space="staged", **kw).to_json()
    h = plan("llama3-8b", "16xh100", space="hybrid", **kw)
    assert a.predicted.step_time_s < h.predicted.step_time_s * (1 - 1e-3)
    s = a.strategy
    assert s.mesh.pp > 1 and a.solver.status == "optimal" and "stage_ilp" in a.to_json()
    assert len({e.sharding for e in s.layers} | {s.default.sharding}) > 1
    rep = estimate(load_model("llama3-8b", 8192), parse_cluster("16xh100"), s, a.inputs.workload,
                   memory_limit_gib=20.0)
    assert rep.fits and rep.step_time_s == pytest.approx(a.predicted.step_time_s, rel=1e-12)


def test_osdp_plan_records_both_solvers() -> None:
    p = plan(
        "gpt2-medium", "8xh100", seq_len=512, global_batch=32, memory_limit_gib=6.0, space="osdp", top_k=2
    )
    o = p.solver.options
    assert p.solver.name == "ilp" and o["dp_ilp_agree"] is True
    obj = p.solver.objective
    assert o["dp_bound"] <= obj * (1 + 1e-9) and obj <= o["dp_objective"] * (1 + 1e-9)
    assert p.predicted.memory_peak_gib <= 6.0
    assert p.strategy.mesh.tp == p.strategy.mesh.pp == 1


def test_throughput_picks_the_global_batch() -> None:
    r = search_plan(Request("gpt2", "4xcpu", seq_len=128, global_batch=[4, 8, 16], top_k=1))
    best = max(r.by_batch, key=lambda b: r.by_batch[b])
    assert r.plan.inputs.workload.global_batch == best and len(r.by_batch) == 3


def test_time_limit_gives_a_plan_and_gap() -> None:
    p = plan("llama3-8b", "64xh100", seq_len=4096, global_batch=256, time_limit=0.3, top_k=1)
    s = p.solver
    assert s.status in ("optimal", "time_limit") and s.bound <= s.objective and s.gap is not None


def test_infeasible_raises_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ShardplanError, match="smallest per-GPU memory any plan needs"):
        plan("llama3-70b", "8xh100", seq_len=4096, global_batch=8, memory_limit_gib=8.0, space="fsdp")
    out = tmp_path / "p.json"
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "llama3-70b",
            "--cluster",
            "8xh100",
            "--seq-len",
            "4096",
            "--global-batch",
            "8",
            "--memory-limit",
            "8",
            "--space",
            "fsdp",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 2 and "dominated by" in r.output and not out.exists()


def test_cli_plan_json_and_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "gpt2",
            "--cluster",
            "4xcpu",
            "--seq-len",
            "128",
            "--global-batch",
            "8",
            "--json",
            "-o",
            str(out),
            "--top-k",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["solver"]["status"] == "optimal" and out.exists()
    assert parse_plan(out.read_text()).strategy.model_dump() == doc["strategy"]
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "gpt2",
            "--cluster",
            "4xcpu",
            "--seq-len",
            "128",
            "--global-batch",
            "8",
            "--space",
            "nope",
        ],
    )
    assert r.exit_code == 2 and "unknown search space" in r.output


def test_cli_summary_subprocess() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "planner.cli",
            "plan",
            "--model",
            "gpt2",
            "--cluster",
            "4xcpu",
            "--seq-len",
            "128",
            "--global-batch",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for word in (
        "mesh",
        "schedule",
        "micro-batching",
        "step time",
        "tokens/s/GPU",
        "MFU",
        "peak memory",
        "solver",
    ):
        assert word in r.stdout
