"""shardplan export: each target parses (tomllib, json, yaml, shlex, ast) with the plan's values; what a
target cannot express is refused on the command line and by ``Plan.export``, or (``--nearest``,
``nearest=True``; ``planner.trainers.export`` always) mapped to the nearest plan and reported with its
re-priced cost; a nearest plan that does not fit is refused by both."""

from __future__ import annotations

import ast
import json
import os
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from planner.cli import app
from planner.trainers import TARGETS, export, refusal, target_of
from planner.trainers.deepspeed.keys import DEEPSPEED
from planner.trainers.megatron.keys import MEGATRON
from planner.trainers.nanotron.keys import NANOTRON
from planner.trainers.python.keys import PYTHON
from planner.trainers.torchtitan.keys import TORCHTITAN
from tests.test_explain import make_plan
from vocab.errors import ShardplanError
from vocab.plan import Plan, parse_plan
from vocab.strategy import Strategy

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
HYBRID = {"mesh": {"pp": 2, "dp_shard": 2, "tp": 4}, "micro_batch": 2, "sequence_parallel": True,
          "default": {"sharding": "zero1", "recompute": "selective"}}
MIXED = {"mesh": {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}, "schedule": "zb", "sequence_parallel": True,
         "default": {"sharding": "zero3", "recompute": "selective"},
         "layers": [{"unit": "layers.0", "sharding": "zero2", "recompute": "full"},
                    {"unit": "layers.1", "sharding": "zero3", "recompute": "full", "split": 4}]}
#: what the runtime runs: 1F1B (not zero bubble with selective recomputation: rule zb_selective)
RUNNABLE = {**MIXED, "schedule": "1f1b"}
UNSPLIT = {**RUNNABLE, "layers": [{**x, "split": 1} for x in MIXED["layers"]]}
FUSED = {"cross_entropy": "fused", "recv_buffers": "none", "kernels": "fused"}
TT = {"zero3_master": "parameter"}  # FSDP2 (torchtitan, the runtime): the fp32 shard is the master  # how Megatron-LM and nanotron run the loss, buffers, kernels


def flags(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tok in shlex.split(text, comments=True):
        if tok.startswith("--"):
            key = tok
            out[key] = True
        else:
            out[key] = tok
    return out


def test_every_exporter_has_a_pinned_target_and_keys() -> None:
    for key in TARGETS:
        t = target_of(key)
        assert t.exporter == key and t.version and t.sources
    for table in (TORCHTITAN, MEGATRON, DEEPSPEED, NANOTRON, PYTHON):
        assert all(v is None or isinstance(v, str) and v for v in table.values())


def test_torchtitan_toml() -> None:
    plan = make_plan({**HYBRID, "schedule": "interleaved", "vpp": 2, "default": {"sharding": "zero3"}},
                     global_batch=32, **TT)
    e = export(plan, "torchtitan")
    doc = tomllib.loads(e.text)
    par = doc["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 2)
    assert par["tensor_parallel_degree"] == 4 and "enable_sequence_parallel" not in par
    assert par["pipeline_parallel_degree"] == 2 and par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert par["fsdp_reshard_after_forward"] == "always" and par["pipeline_parallel_microbatch_size"] == 2
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 4 and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert sum(f.startswith("layers.") for part in parts for f in part) == 32
    assert par["context_parallel_degree"] == 1 and par["expert_parallel_degree"] == 1
    assert doc["activation_checkpoint"]["mode"] == "none"
    assert doc["training"] == {"local_batch_size": 16, "global_batch_size": 32, "seq_len": 2048,
                               "mixed_precision_param": "bfloat16", "enable_cpu_offload": False,
                               "dataset_path": "SET-ME/dataset"}  # a placeholder torchtitan stops on until set
    assert e.exact and not e.warnings()


def test_torchtitan_every_nth_layer_checkpoint_is_exact() -> None:
    layers = [{"unit": f"layers.{i}", "sharding": "zero3", "recompute": "full"} for i in range(1, 32, 2)]
    e = export(make_plan({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}, "layers": layers}, **TT),
               "torchtitan")
    ac = tomllib.loads(e.text)["activation_checkpoint"]
    assert ac == {"mode": "selective", "selective_ac_option": "2"} and e.exact


def test_megatron_flags() -> None:
    e = export(make_plan({**HYBRID, "schedule": "interleaved", "vpp": 2}, global_batch=32, **FUSED), "megatron")
    f = flags(e.text)
    assert f["--tensor-model-parallel-size"] == "4" and f["--pipeline-model-parallel-size"] == "2"
    assert f["--num-layers-per-virtual-pipeline-stage"] == "8" and f["--num-layers"] == "32"
    assert f["--sequence-parallel"] is True and f["--use-distributed-optimizer"] is True
    assert f["--recompute-granularity"] == "selective" and "--recompute-method" not in f
    assert (f["--micro-batch-size"], f["--global-batch-size"], f["--seq-length"]) == ("2", "32", "2048")
    assert f["--bf16"] is True and f["--context-parallel-size"] == "1"
    assert e.exact and e.text.startswith("# shardplan export for megatron-core 0.16.1")


def test_megatron_block_recompute_and_uneven_stages_are_exact() -> None:
    full = [{"unit": f"layers.{i}", "sharding": "zero1", "recompute": "full"} for i in (0, 1, 12, 13)]
    s = {"mesh": {"pp": 2, "dp_shard": 8}, "stage_layers": [12, 20], "default": {"sharding": "zero1"},
         "layers": full}
    e = export(make_plan(s, **FUSED), "megatron")
    f = flags(e.text)
    assert e.exact, e.warnings()
    assert (f["--recompute-granularity"], f["--recompute-method"], f["--recompute-num-layers"]) == ("full", "block", "2")
    assert f["--decoder-first-pipeline-num-layers"] == "12"


def test_megatron_lossy_mapping_is_priced() -> None:
    plan = make_plan(MIXED)
    e = export(plan, "megatron")
    what = {x.what for x in e.losses}
    assert {"OSDP operator splitting", "per-layer sharding", "sharding", "schedule"} <= what
    f = flags(e.text)
    assert "--use-distributed-optimizer" in f and f["--num-distributed-optimizer-instances"] == "2"
    r = e.repriced
    assert r is not None and r.original is not None and r.variant is not None and r.error is None
    assert r.original["step_time_s"] == pytest.approx(plan.predicted.step_time_s)
    d = e.to_dict()
    assert d["step_time_delta_s"] == pytest.approx(d["nearest_step_time_s"] - d["step_time_s"]) != 0
    assert "predicted cost: step time" in "\n".join(e.warnings()) and "# NOT exactly the plan" in e.text
    assert any(c.startswith("schedule: zb → 1f1b") for c in d["changes"])


def test_deepspeed_json() -> None:
    plan = make_plan({"mesh": {"dp_shard": 8, "tp": 2}, "micro_batch": 2,
                      "default": {"sharding": "zero3", "offload": "params"}})
    e = export(plan, "deepspeed")
    cfg = json.loads(e.text)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (32, 2, 2)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
    assert cfg["bf16"]["enabled"] is True and cfg["tensor_parallel"]["autotp_size"] == 2
    assert e.exact and "zero_hpz_partition_size" not in z


def test_deepspeed_hsdp_maps_to_hpz_with_its_cost() -> None:
    plan = make_plan({"mesh": {"dp_replicate": 2, "dp_shard": 8}, "default": {"sharding": "zero3"}})
    e = export(plan, "deepspeed")
    z = json.loads(e.text)["zero_optimization"]
    assert z["stage"] == 3 and z["zero_hpz_partition_size"] == 8
    assert [x.what for x in e.losses] == ["HSDP"] and e.strategy.mesh.dp_shard == 16
    assert e.repriced is not None and e.repriced.delta_s is not None


def test_nanotron_yaml() -> None:
    e = export(make_plan({"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "schedule": "gpipe", "sequence_parallel": True,
                          "default": {"sharding": "zero1"}}, **FUSED), "nanotron")
    doc = yaml.safe_load(e.text)
    par = doc["parallelism"]
    assert (par["dp"], par["pp"], par["tp"], par["expert_parallel_size"]) == (4, 2, 2, 1)
    assert par["pp_engine"] == "afab" and par["tp_mode"] == "REDUCE_SCATTER"
    assert par["tp_linear_async_communication"] is True
    assert doc["tokens"] == {"micro_batch_size": 1, "batch_accumulation_per_replica": 8, "sequence_length": 2048}
    assert doc["optimizer"]["zero_stage"] == 1 and e.exact


def test_nanotron_folds_context_parallelism() -> None:
    e = export(make_plan({"mesh": {"dp_shard": 8, "cp": 2}, "default": {"sharding": "zero1"}}), "nanotron")
    assert [x.what for x in e.losses if not x.behaviour] == ["context parallelism"]
    assert [x.what for x in e.losses if x.behaviour] == ["cross-entropy", "memory-bound kernels"]  # both fused
    assert yaml.safe_load(e.text)["parallelism"]["dp"] == 16 and e.strategy.mesh.cp == 1


def test_python_script_embeds_the_plan_exactly() -> None:
    plan = make_plan(UNSPLIT, selective="gemms", **TT)  # what the runtime's selective recomputation keeps
    e = export(plan, "python")
    tree = ast.parse(e.text)
    assert e.exact and not e.warnings()
    src = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PLAN_DOCUMENT")
    embedded = parse_plan(ast.literal_eval(src.value))
    assert embedded.strategy == plan.strategy and embedded.alternatives == []
    assert "from runtime.apply import apply_plan" in e.text


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [{}, {"mesh": {"cp": 2}, "micro_batch": 4},
                                      {"mesh": {"tp": 2}, "tp_mode": "tsp", "micro_batch": 4}],
                         ids=["one-process", "cp2", "tsp2"])
def test_python_script_runs(tmp_path: Path, strategy: dict[str, Any]) -> None:
    cfg = tmp_path / "tiny_gpt2.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
                               "n_positions": 64}))
    from planner.reprice import plan_from_strategy

    world = Strategy.model_validate(strategy).mesh.world_size
    script = tmp_path / "train.py"
    script.write_text(export(plan_from_strategy(str(cfg), f"{world}xcpu", strategy, 32, 4), "python").text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(script), "1"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, [e[-2000:] for _, e in outs]
    assert sum("step 0: loss" in out for out, _ in outs) == world  # every rank its own tokens' loss


def test_a_renamed_key_follows_from_keys_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TORCHTITAN, "tp", "tensor_parallel_degree_v2")
    monkeypatch.setitem(TORCHTITAN, "sequence_parallel", None)
    par = tomllib.loads(export(make_plan(HYBRID), "torchtitan").text)["parallelism"]
    assert par["tensor_parallel_degree_v2"] == 4 and "enable_sequence_parallel" not in par


def test_unloadable_model_still_exports_with_unknown_cost(tmp_path: Path) -> None:
    plan = make_plan(MIXED)
    lost = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"model": "no-such-model"})})
    e = export(lost, "nanotron")
    assert e.losses and "predicted cost unknown" in e.cost_line()
    yaml.safe_load(e.text)


def _plan_file(tmp_path: Path, plan: Plan) -> Path:
    plan.save(tmp_path / "p.json")
    return tmp_path / "p.json"


def test_the_runtime_runs_operator_splits() -> None:
    e = export(make_plan(RUNNABLE), "shardplan")
    assert e.target == "python" and "OSDP operator splitting" not in [x.what for x in e.losses]
    assert any(ls.split > 1 for ls in e.strategy.layers) and refusal(e) is None


def test_cli_export_refuses_what_the_target_lacks(tmp_path: Path) -> None:
    src = _plan_file(tmp_path, make_plan(MIXED))
    out = tmp_path / "plan.args"
    r = runner.invoke(app, ["export", str(src), "--to", "megatron", "-o", str(out)])
    assert r.exit_code == 2 and r.stdout == "" and not out.exists()
    line = r.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("error: megatron-core 0.16.1 cannot express: ")
    for what in ("OSDP operator splitting", "per-layer sharding", "ZeRO-3", "schedule zb"):
        assert what in line, what
    assert "cross-entropy" not in line  # how Megatron computes the loss is re-priced, not refused


def test_cli_export_refuses_a_nearest_plan_that_does_not_fit(tmp_path: Path) -> None:
    plan = make_plan({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}, seq_len=8192, global_batch=64)
    src = _plan_file(tmp_path, plan)
    r = runner.invoke(app, ["export", str(src), "--to", "nanotron", "--nearest", "-o", str(tmp_path / "n.yaml")])
    assert r.exit_code == 2 and not (tmp_path / "n.yaml").exists()
    assert "nanotron 0.4: the nearest plan it can express needs" in r.stderr and "GiB limit; nothing written" in r.stderr


@pytest.mark.parametrize("nearest", [False, True])
def test_api_export_refuses_what_the_cli_refuses(tmp_path: Path, nearest: bool) -> None:
    """``Plan.export`` / ``PlanView.export`` refuse the plan ``shardplan export`` refuses, with its line:
    one nanotron cannot express (ZeRO-3), and, with ``nearest``, whose nearest plan does not fit."""
    from planner.notebook import PlanView

    plan = make_plan({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}, seq_len=8192, global_batch=64)
    src = _plan_file(tmp_path, plan)
    r = runner.invoke(app, ["export", str(src), "--to", "nanotron", *(["--nearest"] if nearest else [])])
    assert r.exit_code == 2 and r.stdout == ""
    line = r.stderr.strip().removeprefix("error: ")
    assert line.count("\n") == 0
    assert ("GiB limit; nothing written" in line) == nearest and ("cannot express" in line) != nearest
    for api in (plan.export, PlanView(plan).export):
        with pytest.raises(ShardplanError) as refused:
            api("nanotron", nearest=nearest)
        assert str(refused.value) == line


def test_api_export_gives_the_nearest_plan_only_when_asked() -> None:
    plan = make_plan(MIXED)
    with pytest.raises(ShardplanError, match="^megatron-core 0.16.1 cannot express: .*--nearest exports"):
        plan.export("megatron")
    e = plan.export("megatron", nearest=True)
    assert not e.exact and e.repriced is not None and flags(e.text)["--tensor-model-parallel-size"] == "2"


def test_cli_export_nearest_warns_on_stderr_and_writes_atomically(tmp_path: Path) -> None:
    src = _plan_file(tmp_path, make_plan(MIXED))
    out = tmp_path / "plan.args"
    r = runner.invoke(app, ["export", str(src), "--to", "megatron", "--nearest", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "warning: megatron" in r.stderr and "predicted cost: step time" in r.stderr
    assert "--tensor-model-parallel-size" not in r.stdout
    assert flags(out.read_text())["--tensor-model-parallel-size"] == "2"
    r = runner.invoke(app, ["export", str(src), "--to", "deepspeed", "--nearest"])
    assert r.exit_code == 0 and json.loads(r.stdout)["zero_optimization"]["stage"] == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.json", "plan.args"]


@pytest.mark.parametrize(("args", "message"), [
    (["--to", "jax"], "unknown export target 'jax'"),
    (["--to", "megatron", "-o", "{tmp}"], "is a directory"),
])
def test_cli_export_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    src = _plan_file(tmp_path, make_plan(HYBRID))
    r = runner.invoke(app, ["export", str(src), *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output
    assert [x.name for x in tmp_path.iterdir()] == ["p.json"]


def test_cli_export_missing_plan(tmp_path: Path) -> None:
    r = runner.invoke(app, ["export", str(tmp_path / "x.json"), "--to", "python", "-o", str(tmp_path / "x.py")])
    assert r.exit_code == 2 and "cannot read plan" in r.output and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("strategy", "target", "lost"), [
    ({"mesh": {"dp_shard": 8, "tp": 2}, "tp_mode": "tsp"}, "megatron", "TSP"),
    ({"mesh": {"dp_shard": 8, "cp": 2}, "cp_mode": "ulysses", "default": {"sharding": "zero3"}}, "torchtitan",
     "context-parallel mode"),
    ({"mesh": {"pp": 2, "dp_shard": 8}, "schedule": "interleaved", "vpp": 2}, "nanotron", "schedule"),
    ({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero2"}}, "torchtitan", "sharding"),
    ({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3", "offload": "optimizer"}}, "nanotron", "offload"),
])
def test_what_a_target_lacks_is_lost_with_a_price(strategy: dict[str, Any], target: str, lost: str) -> None:
    e = export(make_plan(strategy), target)
    assert lost in [x.what for x in e.losses]
    assert e.repriced is not None and e.repriced.error is None and e.repriced.delta_s is not None
    assert e.cost_line().startswith("predicted cost: step time")


def test_torchtitan_runs_no_ddp_beside_tensor_parallelism() -> None:
    """Replicas with no shard group run any sharding as DDP, which torchtitan refuses beside TP: the export
    says so, and the nearest plan makes the replicas its FSDP group."""
    e = export(make_plan({"mesh": {"dp_replicate": 4, "tp": 4}, "sequence_parallel": True,
                          "default": {"sharding": "zero3"}}, **TT), "torchtitan")
    assert [x.lacks for x in e.losses] == ["DDP beside model parallelism"]
    assert (e.strategy.mesh.dp_replicate, e.strategy.mesh.dp_shard) == (1, 4)
    assert export(make_plan({"mesh": {"dp_replicate": 16}}), "torchtitan").exact  # plain DDP alone runs


def test_selective_recomputation_is_exported_as_the_trainer_runs_it() -> None:
    """The runtime keeps every GEMM's output; torchtitan keeps every other one and Megatron-LM all but
    the attention core: the export says so and prices the trainer's policy. Without selective
    recomputation the policy changes nothing and nothing is said."""
    sel = {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3", "recompute": "selective"}}
    p = make_plan(sel, selective="gemms", **TT)
    for target, policy in (("torchtitan", "op"), ("megatron", "attention")):
        e = export(p, target)
        notes = [x.detail for x in e.losses if x.what == "selective recomputation"]
        assert notes == [f"gemms → {policy} (how {target} runs it)"], e.losses
        assert e.repriced is not None and e.repriced.variant is not None
    none = make_plan({**sel, "default": {"sharding": "zero3"}}, selective="gemms", **TT)
    assert not [x for x in export(none, "torchtitan").losses if x.what == "selective recomputation"]
