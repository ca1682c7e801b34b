"""shardplan explain / compare: data, terminal view, and bad input (exit 2, no traceback)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from planner.cli import app
from planner.compare import compare, diff_strategies, label_units, runs
from planner.explain import explain_data, mesh_placement
from vocab.plan import Alternative, ClusterRef, Plan, PlanInputs, Predicted, SolverInfo, TargetRef
from vocab.strategy import Strategy, Workload

runner = CliRunner()
MODEL = "llama3-8b"
PP2_TP2 = {"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "sequence_parallel": True,
           "default": {"sharding": "zero3", "recompute": "selective"}}
FSDP = {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3", "recompute": "full"}}


@cache
def _graph(model: str, seq_len: int) -> Any:
    from profiler.models import load_model

    return load_model(model, seq_len)


def make_plan(strategy: dict[str, Any], cluster: str = "16xh100", seq_len: int = 2048, global_batch: int = 32,
              alternatives: tuple[dict[str, Any], ...] = (), memory_limit_gib: float | None = None,
              target: TargetRef | None = None, model: str = MODEL, **workload: Any) -> Plan:
    """The test fixture: estimate() given strategies and wrap them into a plan (solver 'user'), with
    the workload's other fields (``cross_entropy``, ...) and the target it records."""
    from costmodel.estimate import estimate
    from profiler.hardware import parse_cluster

    graph, cl = _graph(model, seq_len), parse_cluster(cluster)
    w = Workload(seq_len=seq_len, global_batch=global_batch, **workload)

    def priced(s: dict[str, Any]) -> tuple[Strategy, Predicted]:
        st = Strategy.model_validate(s)
        return st, Predicted(**estimate(graph, cl, st, w, memory_limit_gib=memory_limit_gib).to_dict())

    s, pred = priced(strategy)
    alts = [Alternative(strategy=a, predicted=p) for a, p in map(priced, alternatives)]
    inputs = PlanInputs(model=model, model_hash=graph.content_hash(), cluster=ClusterRef(**cl.to_dict()),
                        workload=w, memory_limit_gib=memory_limit_gib, target=target or TargetRef(name="any"))
    return Plan(inputs=inputs, strategy=s, predicted=pred, solver=SolverInfo(name="user"), alternatives=alts)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("plans") / "a.json"
    make_plan(PP2_TP2, alternatives=(FSDP,)).save(p)
    return p


def test_mesh_placement_inside_and_across_nodes() -> None:
    mesh = {a["axis"]: a for a in mesh_placement(make_plan(PP2_TP2))["axes"]}
    assert mesh["tp"]["placement"] == "inside one node" and mesh["tp"]["stride"] == 1
    assert mesh["dp_shard"]["placement"] == "inside one node" and mesh["dp_shard"]["stride"] == 2
    assert mesh["pp"]["placement"].startswith("across 2 nodes") and mesh["pp"]["stride"] == 8
    hier = {a["axis"]: a for a in mesh_placement(make_plan(FSDP))["axes"]}
    assert hier["dp_shard"]["per_domain"] == 8 and hier["dp_shard"]["domains"] == 2
    assert "hierarchical" in hier["dp_shard"]["placement"]


def test_explain_data_stages_time_and_runner_up() -> None:
    d = explain_data(make_plan(PP2_TP2, alternatives=(FSDP,)))
    assert d["schedule"]["num_microbatches"] == 8 and d["schedule"]["schedule"] == "1f1b"
    assert [s["layers"] for s in d["stages"]] == ["embedding + layers.0-15", "layers.16-31 + head"]
    for s in d["stages"]:
        parts = sum(s[f"{k}_gib"] for k in ("params", "grads", "optimizer", "activations", "buffers", "overhead"))
        assert parts == pytest.approx(s["total_gib"]) and s["headroom_gib"] == pytest.approx(s["limit_gib"] - parts)
    total = sum(c["seconds"] for c in d["time"]["components"])
    assert total == pytest.approx(d["time"]["step_time_s"], rel=1e-6)
    ru = d["runner_up"]
    fields = {c["field"] for c in ru["changes"]}
    assert {"mesh.pp", "mesh.tp", "mesh.dp_shard", "sequence_parallel", "recompute"} <= fields
    assert ru["step_time_delta_s"] == pytest.approx(ru["runner_up_step_time_s"] - d["predicted"]["step_time_s"])
    assert ru["time_deltas"] and ru["verdict"]


def test_runner_up_over_the_limit_is_named() -> None:
    d = explain_data(make_plan(FSDP, alternatives=({"mesh": {"dp_shard": 16}},), memory_limit_gib=40))
    assert not d["runner_up"]["runner_up_fits"]
    assert "over the 40.0 GiB limit" in d["runner_up"]["verdict"]


def test_diff_groups_units_into_ranges() -> None:
    a = Strategy.model_validate({"default": {"sharding": "zero3"}})
    b = Strategy.model_validate({"default": {"sharding": "zero3"}, "layers": [
        {"unit": f"layers.{i}", "sharding": "zero2"} for i in range(4, 8)]})
    units = ["embedding", *(f"layers.{i}" for i in range(10)), "head"]
    assert diff_strategies(a, b, units) == [{"field": "sharding", "units": "layers.4-7", "a": "zero3", "b": "zero2"}]
    assert [r["units"] for r in runs(b, units)] == ["embedding + layers.0-3", "layers.4-7", "layers.8-9 + head"]
    assert label_units(["layers.0", "layers.1", "layers.8", "head"]) == "layers.0-1,8 + head"


def test_compare_lists_differences_first() -> None:
    data = compare([make_plan(PP2_TP2), make_plan(FSDP)], ["a", "b"])
    diff = {r["field"] for r in data["differences"]}
    same = {r["field"] for r in data["same"]}
    assert {"mesh.pp", "mesh.tp", "step time (s)"} <= diff and {"model", "seq_len"} <= same
    assert data["best"] in ("a", "b") and len(data["summary"]) == 2


def test_compare_shows_the_targets_apart() -> None:
    """Plans searched for different trainers differ in their target and in how the trainer runs them."""
    a = make_plan(FSDP, target=TargetRef(name="torchtitan", version="0.2.2"))
    b = make_plan(FSDP, target=TargetRef(name="megatron", version="0.16.1"), cross_entropy="fused")
    diff = {r["field"]: r["values"] for r in compare([a, b], ["a", "b"])["differences"]}
    assert diff["target"] == ["torchtitan 0.2.2", "megatron 0.16.1"]
    assert diff["cross-entropy"] == ["eager", "fused"]


def test_cli_explain_text_and_json(plan_file: Path, wide: None) -> None:
    r = runner.invoke(app, ["explain", str(plan_file)])
    assert r.exit_code == 0, r.output
    for words in ("mesh: 16 GPUs", "inside one node", "across 2 nodes", "schedule", "1f1b", "per pipeline stage",
                  "step time", "exposed tp comm", "bubble", "solver", "vs runner-up", "mesh.tp: 2 → 1",
                  "target any: searched over the whole plan vocabulary"):
        assert words in r.output, words
    r = runner.invoke(app, ["explain", str(plan_file), "--json"])
    d = json.loads(r.stdout)
    assert d["mesh"]["world_size"] == 16 and d["runner_up"]["changes"] and len(d["stages"]) == 2
    assert d["target"] == {"name": "any", "version": None, "trainer": "any", "pinned_now": None}


def test_explain_names_the_target(tmp_path: Path, wide: None) -> None:
    make_plan(FSDP, target=TargetRef(name="torchtitan", version="0.2.1")).save(tmp_path / "t.json")
    r = runner.invoke(app, ["explain", str(tmp_path / "t.json")])
    assert r.exit_code == 0 and "target torchtitan 0.2.1 (torchtitan); this shardplan pins 0.2.2" in r.output
    d = json.loads(runner.invoke(app, ["explain", str(tmp_path / "t.json"), "--json"]).stdout)
    assert d["target"] == {"name": "torchtitan", "version": "0.2.1", "trainer": "torchtitan", "pinned_now": "0.2.2"}


def test_cli_explain_without_alternatives(tmp_path: Path, wide: None) -> None:
    make_plan(FSDP).save(tmp_path / "p.json")
    r = runner.invoke(app, ["explain", str(tmp_path / "p.json")])
    assert r.exit_code == 0 and "no runner-up recorded" in r.output


def test_cli_compare(plan_file: Path, tmp_path: Path, wide: None) -> None:
    make_plan(FSDP).save(tmp_path / "b.json")
    r = runner.invoke(app, ["compare", str(plan_file), str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert r.output.index("≠ mesh.pp") < r.output.index("  model")
    data = json.loads(runner.invoke(app, ["compare", str(plan_file), str(tmp_path / "b.json"), "--json"]).stdout)
    assert data["plans"] == ["a", "b"] and data["differences"] and data["strategy_changes"][0]["changes"]
    same_name = tmp_path / "x" / "a.json"
    same_name.parent.mkdir()
    make_plan(FSDP).save(same_name)
    data = json.loads(runner.invoke(app, ["compare", str(plan_file), str(same_name), "--json"]).stdout)
    assert data["plans"] == [str(plan_file), str(same_name)]


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    (tmp / "malformed.json").write_text("{not json")
    (tmp / "invalid.json").write_text(json.dumps({"schema_version": "1.0", "inputs": {}}))
    (tmp / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp / "adir.json").mkdir()
    return {"missing": tmp / "missing.json", "malformed": tmp / "malformed.json",
            "invalid": tmp / "invalid.json", "binary": tmp / "binary.json", "directory": tmp / "adir.json"}


@pytest.mark.parametrize("case", ["missing", "malformed", "invalid", "binary", "directory"])
def test_bad_plan_is_one_clear_error(case: str, tmp_path: Path, plan_file: Path) -> None:
    bad = _bad_inputs(tmp_path)[case]
    for args in (["explain", str(bad)], ["compare", str(plan_file), str(bad)]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (case, r.output)
        assert "error:" in r.output and "Traceback" not in r.output and str(bad) in r.output.replace("\n", "")
        assert r.exception is None or isinstance(r.exception, SystemExit)


def test_compare_needs_two_plans(plan_file: Path) -> None:
    r = runner.invoke(app, ["compare", str(plan_file)])
    assert r.exit_code == 2 and "at least two plans" in r.output


def test_explain_flags_context_parallelism_below_the_validated_length(tmp_path: Path, wide: None) -> None:
    """cp=8 over 8,192 tokens leaves 1,024 per rank, below the 4,096 the published runs validate; cp=2 does not."""
    from costmodel.published.runs import load_published
    from costmodel.published.validate import VALIDATED_CP_TOKENS

    rows, _ = load_published()
    assert VALIDATED_CP_TOKENS == min(r.workload.seq_len // r.strategy.mesh.cp for r in rows if r.strategy.mesh.cp > 1)
    short = {"mesh": {"cp": 8, "dp_shard": 2}, "default": {"sharding": "zero3"}}
    make_plan(short, seq_len=8192, global_batch=2).save(tmp_path / "cp8.json")
    r = runner.invoke(app, ["explain", str(tmp_path / "cp8.json")])
    assert r.exit_code == 0 and "caveat context parallelism at 1,024 tokens per rank" in r.output
    long = {"mesh": {"cp": 2, "dp_shard": 8}, "default": {"sharding": "zero3"}}
    assert explain_data(make_plan(long, seq_len=8192, global_batch=8))["caveats"] == []


@pytest.mark.parametrize("mesh,overlap", [({"dp_shard": 16, "ep": 8}, "1f1b"), ({"pp": 2, "dp_shard": 8, "ep": 8}, "none")])
def test_explain_says_how_the_experts_all_to_alls_run(mesh: dict[str, int], overlap: str) -> None:
    """With expert parallelism, explain names the dispatch and whether the all-to-alls hide under
    the paired micro-batch's compute, as priced (not with a pipeline of one virtual stage per rank)."""
    s = {"mesh": mesh, "micro_batch": 1, "default": {"sharding": "zero1"}}
    p = make_plan(s, cluster="16xh100", seq_len=2048, global_batch=32, model="mixtral-8x7b", moe_overlap="1f1b",
                  moe_dispatch="dedup")
    assert explain_data(p)["schedule"]["moe"] == {"dispatch": "dedup", "overlap": overlap, "expert_tp": 1,
                                                  "folded": False}
    assert "moe" not in explain_data(make_plan({"mesh": {"dp_shard": 16}}))["schedule"]


def test_explain_says_where_the_experts_fold_over_tp(tmp_path: Path) -> None:
    """A folded plan (etp=1 beside tp=2) says so, and places the ep groups on adjacent ranks."""
    s = {"mesh": {"dp_shard": 8, "tp": 2, "ep": 8, "etp": 1}, "sequence_parallel": True}
    p = make_plan(s, cluster="16xh100", seq_len=2048, global_batch=32, model="mixtral-8x7b")
    assert explain_data(p)["schedule"]["moe"] == {"dispatch": "alltoall", "overlap": "none", "expert_tp": 1,
                                                  "folded": True}
    ep = next(a for a in mesh_placement(p)["axes"] if a["axis"] == "ep")
    assert (ep["stride"], ep["example_group"]) == (1, "0, 1, 2, 3, ...")
    p.save(tmp_path / "f.json")
    r = runner.invoke(app, ["explain", str(tmp_path / "f.json")])
    assert r.exit_code == 0 and "experts folded over tp (etp=1)" in " ".join(r.output.split())


def test_explain_says_what_selective_recomputation_keeps(tmp_path: Path) -> None:
    """A plan that recomputes selectively names its target's policy and what it keeps; one that
    does not says nothing of it."""
    s = {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3", "recompute": "selective"}}
    make_plan(s, selective="op").save(tmp_path / "op.json")
    r = runner.invoke(app, ["explain", str(tmp_path / "op.json")])
    assert r.exit_code == 0 and "selective recomputation 'op': every other GEMM's output and attention's" in " ".join(
        r.output.split())
    assert explain_data(make_plan({"mesh": {"dp_shard": 16}}, selective="op"))["schedule"].get("selective") is None


def test_compare_counts_2_and_2_0_as_one_number() -> None:
    from planner.compare import _same

    assert _same([2, 2.0]) and _same([1.0, 1.0 + 1e-12]) and not _same([2, 2.5])


def test_schedule_line_names_a_mode_only_where_its_axis_runs() -> None:
    from planner.explain import _schedule_text

    base = {"schedule": "1f1b", "pp": 2, "vpp": 1, "num_microbatches": 4, "micro_batch": 1,
            "tokens_per_microbatch": 128, "dp": 2, "sequence_parallel": False, "tp_mode": "megatron",
            "cp_mode": "ring"}
    assert "tp_mode" not in _schedule_text({**base, "tp": 1, "cp": 1})
    assert "cp_mode" not in _schedule_text({**base, "tp": 1, "cp": 1})
    both = _schedule_text({**base, "tp": 2, "cp": 2})
    assert "tp_mode megatron" in both and "cp_mode ring" in both
