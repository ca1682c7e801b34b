"""``explain PLAN --compare-with CONFIG``: a trainer's configuration priced beside the plan, for the
plan's model, cluster, sequence length and limit, on the configuration's own trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from planner.api import plan
from planner.cli import app
from planner.trainers import import_plan

runner = CliRunner()
ARGS = ["--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2", "--micro-batch-size 1",
        "--global-batch-size 32", "--seq-length 2048", "--bf16", "--use-distributed-optimizer", "--sequence-parallel"]


def _files(tmp_path: Path, target: str) -> tuple[Path, Path]:
    p = plan("llama3-8b", "16xh100", seq_len=2048, global_batch=32, target=target, top_k=1)
    p.save(tmp_path / "plan.json")
    (tmp_path / "recipe.args").write_text("\n".join(ARGS) + "\n")
    return tmp_path / "plan.json", tmp_path / "recipe.args"


def test_the_configuration_is_priced_beside_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, recipe = _files(tmp_path, "megatron")
    r = runner.invoke(app, ["explain", str(doc), "--compare-with", str(recipe), "--json"])
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)["compared_with"]
    alone = import_plan(recipe, model="llama3-8b", cluster="16xh100", seq_len=2048)
    assert c["target"] == "megatron" and c["mesh"] == "pp=2 dp_shard=4 tp=2 (SP)"
    assert c["step_time_s"] == alone.predicted.step_time_s and c["fits"]
    mine = json.loads(doc.read_text())["predicted"]["tokens_per_s_per_gpu"]
    assert c["throughput_ratio"] == mine / alone.predicted.tokens_per_s_per_gpu >= 1.0  # the search's optimum
    assert c["verdict"].startswith(f"this plan trains {c['throughput_ratio']:.2f}x the configuration's")
    # where the steps differ: the named parts are those of at least 2% of the plan's step, and all the
    # parts (none left out) add up to the whole difference of the two steps
    from planner import compare_config

    pred = json.loads(doc.read_text())["predicted"]
    parts = {d["part"]: d["seconds"] for d in c["time_differences"]}
    assert parts and all(abs(v) >= 0.02 * pred["step_time_s"] for v in parts.values())
    monkeypatch.setattr(compare_config, "NAMED_SHARE", 0.0)
    every = compare_config.time_differences(pred, alone.predicted.model_dump())
    assert set(parts) <= {k for k, _ in every}
    assert sum(d for _, d in every) == pytest.approx(alone.predicted.step_time_s - pred["step_time_s"], abs=1e-9)
    assert c["where"].startswith("the plan, per 32 samples: ") and c["where"].count(" s ") == len(parts)


def test_time_differences_name_what_the_plan_saves_and_spends() -> None:
    from planner.compare_config import differences_text, time_differences

    mine = {"step_time_s": 10.0, "time": {"compute_s": 8.0, "comm_s": {"ep": 1.0, "tp": 0.1}, "bubble_s": 0.9}}
    theirs = {"step_time_s": 6.05, "time": {"compute_s": 3.0, "comm_s": {"ep": 3.0, "tp": 0.05}, "bubble_s": 0.0}}
    diffs = time_differences(mine, theirs, scale=2.0)  # theirs trains half the plan's samples a step
    assert diffs == [("exposed ep comm", 5.0), ("compute", -2.0), ("bubble", -0.9)]  # tp: 0.0 s, under 2%
    assert differences_text(diffs) == "exposed ep comm 5 s less, compute 2 s more, bubble 0.9 s more"


def test_a_plan_for_another_target_says_so(tmp_path: Path) -> None:
    doc, recipe = _files(tmp_path, "shardplan")
    r = runner.invoke(app, ["explain", str(doc), "--compare-with", str(recipe)])
    assert r.exit_code == 0, r.output
    assert "priced as megatron runs it, the plan as shardplan does" in " ".join(r.stdout.split())


def test_a_configuration_that_does_not_parse_is_one_line(tmp_path: Path) -> None:
    doc, recipe = _files(tmp_path, "megatron")
    recipe.write_text("--no-such-flag 3\n")
    r = runner.invoke(app, ["explain", str(doc), "--compare-with", str(recipe)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")


def test_a_configuration_of_no_known_suffix_names_the_suffixes(tmp_path: Path) -> None:
    doc, recipe = _files(tmp_path, "megatron")
    other = recipe.with_suffix(".cfg")
    other.write_text(recipe.read_text())
    r = runner.invoke(app, ["explain", str(doc), "--compare-with", str(other)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "from its suffix: .toml (torchtitan), .sh (torchtitan-0.3), .args (megatron)" in r.stderr
