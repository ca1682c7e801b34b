"""Targets: the data files, the search space they bound, the plans searched for them (expressible by
the exporter's own check; the shardplan target's pass the runtime's check), the plan's record of its
target, and older plans read as the target ``any``."""

from __future__ import annotations

import json
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from costmodel.estimate import estimate
from planner.api import plan
from planner.cli import app
from planner.trainers import check_target, export, lacks, refusal
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.space import SPACES, mesh_configs, restrict, split_allowed, stages_allowed
from tests.test_explain import make_plan
from vocab.errors import ShardplanError, UnknownNameError
from vocab.plan import Plan, PlanError, parse_plan
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload
from vocab.targets import ANY, TargetError, load_target, read_target, target_names, targets

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ["shardplan", "torchtitan", "torchtitan-0.3", "megatron", "megatron-0.19", "deepspeed", "nanotron"]
# (model, cluster, seq_len, global_batch, memory limit): a dense model, one under memory pressure
# (recomputation, pipelines), a small one whose 12 heads limit tensor parallelism, and a MoE model
CASES = {
    "llama3-8b": ("llama3-8b", "8xh100", 4096, 32, None),
    "llama3-8b-tight": ("llama3-8b", "8xh100", 8192, 32, 24.0),
    "gpt2": ("gpt2", "8xh100", 1024, 64, None),
    "mixtral-8x7b": ("mixtral-8x7b", "16xh100", 4096, 64, None),
}


@cache
def searched(target: str, case: str) -> Plan:
    model, cluster, seq, batch, limit = CASES[case]
    return plan(model, cluster, seq, batch, memory_limit_gib=limit, target=target, top_k=1)


# ---- the files ----------------------------------------------------------------------------------

def test_every_trainer_has_a_file_with_its_pinned_release() -> None:
    pinned = {name: (t.package, t.version) for name, t in targets().items()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert pinned == {"torchtitan": ("torchtitan", "0.2.2"), "torchtitan-0.3": ("torchtitan", "0.3.0"), "megatron": ("megatron-core", "0.16.1"),
                      "megatron-0.19": ("megatron-core", "0.19.2"),
                      "deepspeed": ("deepspeed", "0.19.8"), "nanotron": ("nanotron", "0.4"),
                      "shardplan": ("shardplan", project), ANY: ("any", "")}
    assert target_names() == sorted(TRAINERS) + [ANY]
    for name in TRAINERS:
        t = load_target(name)
        assert t.sources and all(s.where for s in t.sources) and t.exporter is not None
        assert check_target(name) == t.exporter and load_target(f" {name.upper()} ") is t
    assert load_target("torchtitan").label == "torchtitan 0.2.2"


def test_an_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="unknown target 'titan'. Did you mean: torchtitan"):
        load_target("titan")


def _write(tmp: Path, name: str, change: dict[str, Any]) -> Path:
    import yaml

    data = yaml.safe_load((ROOT / "vocab" / "targets" / "torchtitan.yaml").read_text())
    data.update(change)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("name", "change", "message"), [
    ("torchtitan", {"headroom": 1}, "headroom: Extra inputs are not permitted"),
    ("torchtitan", {"fp8": "yes"}, "fp8: Input should be a valid boolean"),
    ("torchtitan", {"axes": ["pp", "tp", "dp_shard"]}, "axis cp and its modes disagree"),
    ("torchtitan", {"offload": {"modes": ["params"]}}, "offload.modes must hold none"),
    ("torchtitan", {"version": ""}, "needs its pinned version"),
    ("titan", {}, "names target 'torchtitan'; a target file is named after its target"),
])
def test_a_target_file_is_validated_strictly(tmp_path: Path, name: str, change: dict[str, Any], message: str) -> None:
    path = _write(tmp_path, name, change)
    with pytest.raises(TargetError, match=message) as e:
        read_target(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# ---- the space ----------------------------------------------------------------------------------

@pytest.mark.parametrize("space", list(SPACES))
def test_the_target_any_restricts_nothing(space: str) -> None:
    assert restrict(SPACES[space], load_target(ANY)) == SPACES[space]


def test_restrict_keeps_what_the_target_runs() -> None:
    full = SPACES["full"]
    tt = restrict(full, load_target("torchtitan"))
    assert tt.shardings == ("replicate", "zero3", "zero3_keep") and tt.cp_modes == ("ring",) and not tt.per_layer
    assert tt.tp_modes == ("megatron",) and tt.recompute_blocks_only
    beside_tp = dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=1)
    assert tt.sharding_rules.on_mesh(beside_tp, tt.shardings) == (
        ("zero3", "zero3_keep"), "with data parallelism beside model parallelism")
    # no shard group: every sharding is DDP, which torchtitan does not run beside tp
    assert tt.sharding_rules.on_mesh({**beside_tp, "dp_replicate": 4, "dp_shard": 1}, tt.shardings)[0] == ()
    mg = restrict(full, load_target("megatron"))
    assert mg.shardings == ("replicate", "zero1", "zero3") and mg.offloads == ("none", "optimizer") and mg.splits == (1,)
    # Megatron-FSDP on data-parallel meshes only; its HSDP (distributed-optimizer instances) included
    assert mg.sharding_rules.on_mesh(beside_tp, mg.shardings) == (("replicate", "zero1"),
                                                                  "with data parallelism beside model parallelism")
    assert mg.sharding_rules.on_mesh({**beside_tp, "tp": 1, "dp_replicate": 2}, mg.shardings)[0] == ("zero1", "zero3")
    assert mg.offload_needs == (("optimizer", ("zero1",)),) and mg.stage_split == "layout"
    nt = restrict(full, load_target("nanotron"))
    assert not nt.cp and nt.recomputes == ("none",) and nt.schedules == ("1f1b",)
    ds = restrict(full, load_target("deepspeed"))
    assert ds.sequence_parallel == (False,) and ds.cp_modes == ("ulysses",)
    piped = dict(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1)
    assert ds.sharding_rules.on_mesh(piped, ds.shardings) == (("replicate", "zero1"), "with pipeline parallelism")
    assert ds.sharding_rules.on_mesh({**piped, "pp": 1}, ds.shardings) == (ds.shardings, "")
    sp = restrict(full, load_target("shardplan"))
    assert sp.cp and sp.cp_modes == ("ring", "ulysses") and sp.ep and sp.per_layer and sp.splits == (1, 2, 4)
    assert sp.tp_modes == ("megatron", "tsp") and sp.tsp_cp_modes == ("ring",) and full.tsp_cp_modes == ("ring", "ulysses")
    assert sp.strict_tp and not sp.tp_experts and tt.tp_experts
    assert restrict(SPACES["fsdp"], load_target("megatron")).shardings == ("zero3",)  # Megatron-FSDP
    with pytest.raises(ShardplanError, match="the 'fsdp' space and the nanotron target .* share no sharding"):
        restrict(SPACES["fsdp"], load_target("nanotron"))


def test_stage_count_rules_and_layer_splits() -> None:
    tt = restrict(SPACES["full"], load_target("torchtitan"))
    assert not stages_allowed("zb", 4, 1, 32, tt)  # InterleavedZeroBubble needs >= 2 stages per rank
    assert stages_allowed("interleaved", 4, 2, 32, tt) and stages_allowed("1f1b", 4, 1, 30, tt)
    g, cl = load_model("llama3-8b", 4096), parse_cluster("16xh100")
    scheds = {(c.schedule, c.vpp) for c in mesh_configs(g, cl, Workload(seq_len=4096, global_batch=64), tt)}
    assert ("zb", 1) not in scheds and ("interleaved", 2) in scheds
    assert split_allowed([7, 8, 8, 7], 4, "first_last") and split_allowed([8, 8, 8, 6], 4, "first_last")
    assert not split_allowed([5, 5, 6, 6, 5, 5], 6, "first_last")
    assert not split_allowed([3, 3, 2, 2], 2, "first_last")  # interleaved: every virtual stage equal
    mg = restrict(SPACES["full"], load_target("megatron"))
    # Megatron's pipeline layout places any count per stage (tests/test_megatron_layouts.py)
    assert stages_allowed("1f1b", 6, 1, 32, mg) and stages_allowed("interleaved", 16, 4, 126, mg)


# ---- plans searched for a target ----------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target", TRAINERS)
def test_a_plan_searched_for_a_target_is_one_it_runs(target: str, case: str) -> None:
    if (target, case) == ("nanotron", "llama3-8b-tight"):  # nanotron 0.4 has no recomputation
        with pytest.raises(ShardplanError, match=r"smallest per-GPU memory .* recompute none.* \(target nanotron: "
                                                 r"nanotron 0.4\)$"):
            searched(target, case)
        return
    p = searched(target, case)
    t = load_target(target)
    assert (p.inputs.target.name, p.inputs.target.version) == (target, t.version)
    w = p.inputs.workload
    assert (w.cross_entropy, w.grad_dtype) == (t.behaviour.cross_entropy[0], t.behaviour.grad_dtype[0])
    assert lacks(p, target) == []  # the exporter's own check: nothing lacking, no other behaviour
    e = export(p, target)
    assert e.exact and refusal(e) is None
    model, cluster, seq, _, limit = CASES[case]
    rep = estimate(load_model(model, seq), parse_cluster(cluster), p.strategy, w, memory_limit_gib=limit)
    assert rep.fits and rep.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-12)


def test_expert_parallelism_where_the_target_has_it() -> None:
    meshes = {t: searched(t, "mixtral-8x7b").strategy.mesh for t in TRAINERS}
    assert meshes["nanotron"].ep == 1 and meshes["shardplan"].ep > 1
    assert meshes["shardplan"].tp == 1  # the runtime does not split experts over tp ranks


def test_targets_that_checkpoint_blocks_only_never_recompute_the_head() -> None:
    for target in ("torchtitan", "megatron"):
        s = searched(target, "llama3-8b-tight").strategy
        assert s.default.recompute != "none", target  # the memory limit needs recomputation
        assert s.for_unit("head").recompute == s.for_unit("embedding").recompute == "none"
    s = searched("shardplan", "llama3-8b-tight").strategy
    assert s.mesh.ep == 1 and s.tp_mode in load_target("shardplan").tensor_parallel.modes


@pytest.mark.parametrize("case", [("gpt2", "8xh100", 1024, 64, None, "full"),
                                  ("gpt2", "8xh100", 1024, 64, 3.0, "full"),
                                  ("gpt2", "8xh100", 1024, 64, 3.0, "staged"),
                                  ("gpt2", "4xcpu", 128, 8, None, "full")])
def test_shardplan_plans_pass_the_runtime_check(case: tuple[Any, ...]) -> None:
    from runtime.apply import check_plan
    from runtime.model import spec_for

    model, cluster, seq, batch, limit, space = case
    p = plan(model, cluster, seq, batch, memory_limit_gib=limit, space=space, top_k=1)
    assert p.inputs.target.name == "shardplan"
    dev = "cpu" if cluster.endswith("cpu") else "cuda"
    for s in [p.strategy, *(a.strategy for a in p.alternatives)]:
        check_plan(spec_for(model), p.model_copy(update={"strategy": s}), p.inputs.cluster.world_size, dev,
                   seq_len=seq, global_batch=batch)


def test_a_search_refuses_what_its_target_does_not_run() -> None:
    with pytest.raises(ShardplanError, match=r"the shardplan target \(shardplan .*\) has no fp8 training"):
        plan("gpt2", "8xh100", 1024, 64, precision="fp8")
    with pytest.raises(ShardplanError, match=r"the megatron target \(megatron-core 0.16.1\) runs cross-entropy "
                                             r"fused, not 'eager'"):
        plan("gpt2", "8xh100", 1024, 64, target="megatron", cross_entropy="eager")
    with pytest.raises(ShardplanError, match="unknown cross-entropy 'bogus'"):
        plan("gpt2", "8xh100", 1024, 64, cross_entropy="bogus")


def test_a_plan_of_the_target_any_is_refused_where_a_trainer_lacks_it() -> None:
    p = make_plan({"mesh": {"dp_shard": 8, "cp": 2}, "cp_mode": "ulysses", "default": {"sharding": "zero1"}})
    e = export(p, "torchtitan")
    assert refusal(e) == ("torchtitan 0.2.2 cannot express: ZeRO-1; context parallelism mode ulysses "
                          "(--nearest exports the nearest plan it can, re-priced)")
    tp = export(make_plan({"mesh": {"dp_shard": 8, "tp": 2}, "default": {"sharding": "zero3"}},
                          zero3_master="parameter"), "torchtitan")
    assert [x.lacks for x in tp.losses] == ["tensor parallelism without sequence parallelism"]
    # torchtitan 0.2.2 runs sequence parallelism whenever tp > 1 and has no key for it
    assert tp.strategy.sequence_parallel and "enable_sequence_parallel" not in tomllib.loads(tp.text)["parallelism"]
    zb = export(make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "schedule": "zb", "default": {"sharding": "zero3"}},
                          zero3_master="parameter"), "torchtitan")
    assert [x.lacks for x in zb.losses] == ["schedule zb with 1 stage(s) per rank"] and zb.strategy.schedule == "1f1b"


# ---- the command line and the document ----------------------------------------------------------

def test_cli_plan_records_its_target_and_exports_to_it(tmp_path: Path) -> None:
    out = tmp_path / "tt.json"
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "8xh100", "--seq-len", "1024", "--global-batch",
                            "64", "--target", "torchtitan", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "torchtitan 0.2.2" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == "1.12" and doc["inputs"]["target"] == {"name": "torchtitan", "version": "0.2.2"}
    r = runner.invoke(app, ["export", str(out), "--to", "torchtitan", "-o", str(tmp_path / "tt.toml")])
    assert r.exit_code == 0 and "warning" not in r.stderr and (tmp_path / "tt.toml").exists()
    d = json.loads(runner.invoke(app, ["explain", str(out), "--json"]).stdout)
    assert d["target"]["name"] == "torchtitan" and d["target"]["version"] == "0.2.2"
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "8xh100", "--seq-len", "1024", "--global-batch",
                            "64", "--target", "jax"])
    assert r.exit_code == 2 and "unknown target 'jax'" in r.output and "Traceback" not in r.output


def test_older_plans_read_as_the_target_any_and_price_the_same(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    doc = json.loads(searched("shardplan", "gpt2").to_json())
    old = {**doc, "schema_version": "1.1", "inputs": {k: v for k, v in doc["inputs"].items() if k != "target"}}
    old["inputs"]["workload"] = pre_1_4(doc["inputs"]["workload"])
    p = parse_plan(old)
    assert p.schema_version == "1.1" and p.inputs.target.name == ANY and p.inputs.target.version is None
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    assert main(["estimate", "--plan", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == doc["predicted"]["step_time_s"]
    with pytest.raises(PlanError, match="inputs: target 'shardplan' needs schema_version 1.2"):
        parse_plan({**doc, "schema_version": "1.1"})
    assert parse_plan({**doc, "inputs": {k: v for k, v in doc["inputs"].items() if k != "target"}}).inputs.target.name \
        == ANY


def test_plans_record_the_targets_receive_buffers() -> None:
    """A plan for Megatron-LM is priced with its receive buffers (none beyond the activations) and records
    them (schema 1.3); a 1.2 document was priced with torch's and may name no other; a 1.2 document
    without the field reads as torch's."""
    p = searched("megatron", "gpt2")
    assert p.schema_version == "1.12" and p.inputs.workload.recv_buffers == "none"
    doc = json.loads(p.to_json())
    with pytest.raises(PlanError, match="workload.recv_buffers 'none' needs schema_version 1.3"):
        parse_plan({**doc, "schema_version": "1.2"})
    older = older_doc("1.2")
    del older["inputs"]["workload"]["recv_buffers"]
    assert parse_plan(older).inputs.workload.recv_buffers == "per_micro_batch"


def pre_1_4(workload: dict[str, Any]) -> dict[str, Any]:
    """A workload as documents before schema 1.4 wrote it (no kernels, no ZeRO-3 master, no selective
    policy)."""
    return {k: v for k, v in workload.items() if k not in ("kernels", "zero3_master", "selective")}


def older_doc(version: str) -> dict[str, Any]:
    """The shardplan target's GPT-2 plan as a document of an older ``version`` writes it."""
    doc = json.loads(searched("shardplan", "gpt2").to_json())
    return {**doc, "schema_version": version,
            "inputs": {**doc["inputs"], "workload": pre_1_4(doc["inputs"]["workload"])}}


def test_plans_record_the_targets_kernels() -> None:
    """A plan for Megatron-LM is priced with its fused memory-bound kernels and records them (schema
    1.4), and its norms cost less than the same plan's with eager kernels; a 1.3 document was priced
    with eager kernels and may name no other; a 1.3 document without the field reads as eager."""
    p = searched("megatron", "gpt2")
    assert p.schema_version == "1.12" and p.inputs.workload.kernels == "fused"
    assert searched("shardplan", "gpt2").inputs.workload.kernels == "eager"
    doc = json.loads(p.to_json())
    with pytest.raises(PlanError, match="workload.kernels 'fused' needs schema_version 1.4"):
        parse_plan({**doc, "schema_version": "1.3"})
    parsed = parse_plan(older_doc("1.3")).inputs.workload
    assert (parsed.kernels, parsed.zero3_master) == ("eager", "optimizer")
    graph, cluster = load_model("llama3-8b", 2048), parse_cluster("8xh100-sxm")  # RMSNorm, SwiGLU
    w = Workload(seq_len=2048, global_batch=8, kernels="fused")
    fsdp = Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding="zero3"))
    fused = estimate(graph, cluster, fsdp, w).time.compute
    eager = estimate(graph, cluster, fsdp, w.model_copy(update={"kernels": "eager"})).time.compute
    assert eager > 1.05 * fused


def test_plans_record_the_targets_moe_dispatch_and_overlap() -> None:
    """A plan for Megatron-LM is priced without its all-to-all overlap unless asked (Megatron's
    overlap_moe_expert_parallel_comm is off by default) and records what it was priced with (schema
    1.5); a 1.4 document was priced with a plain all-to-all and may name no other; one without the
    fields reads as that."""
    p = searched("megatron", "gpt2")
    assert (p.inputs.workload.moe_dispatch, p.inputs.workload.moe_overlap) == ("alltoall", "none")
    model, cluster, seq, batch, limit = CASES["gpt2"]
    p = plan(model, cluster, seq, batch, memory_limit_gib=limit, target="megatron", top_k=1, moe_overlap="1f1b")
    assert p.inputs.workload.moe_overlap == "1f1b"
    doc = json.loads(p.to_json())
    with pytest.raises(PlanError, match="moe_overlap '1f1b' need schema_version 1.5"):
        parse_plan({**doc, "schema_version": "1.4"})
    old = older_doc("1.4")
    for f in ("moe_dispatch", "moe_overlap"):
        del old["inputs"]["workload"][f]
    parsed = parse_plan(old).inputs.workload
    assert (parsed.moe_dispatch, parsed.moe_overlap) == ("alltoall", "none")


@pytest.mark.parametrize(("target", "policy"), [("torchtitan", "op"), ("megatron", "attention"),
                                                 ("shardplan", "gemms"), (ANY, "attention")])
def test_plans_record_what_the_targets_selective_recomputation_keeps(target: str, policy: str) -> None:
    """Each target's selective recomputation is priced as it runs (costmodel.recompute) and recorded
    (schema 1.6); a 1.5 document was priced with the attention core recomputed and may name no other;
    one without the field reads as that."""
    p = searched(target, "gpt2")
    assert p.schema_version == "1.12" and p.inputs.workload.selective == policy
    if policy != "attention":
        doc = json.loads(p.to_json())
        with pytest.raises(PlanError, match=f"workload.selective '{policy}' needs schema_version 1.6"):
            parse_plan({**doc, "schema_version": "1.5"})
    old = older_doc("1.5")
    assert "selective" not in old["inputs"]["workload"]
    assert parse_plan(old).inputs.workload.selective == "attention"
