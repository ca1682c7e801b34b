"""``shardplan import`` of a DeepSpeed config JSON (:mod:`planner.trainers.deepspeed.read`): export then import
gives back the predicted step time; what the JSON cannot say is refused with a message naming it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from planner.api import plan as search
from planner.cli import main
from planner.trainers import ConfigError, export, import_plan
from tests.test_explain import make_plan
from vocab.plan import Plan

FULL = {"default": {"sharding": "zero1", "recompute": "full"}}


@functools.cache
def plans() -> dict[str, Plan]:
    """Searched plans (small presets) and hand-made ones for what a search does not pick."""
    return {
        "zero2": search("llama3-8b", "16xh100", 2048, 64, target="deepspeed"),
        "tp-recompute-all-units": search("llama3-8b", "16xh100", 4096, 64, memory_limit_gib=18, target="deepspeed"),
        "gpt2-zero1": search("gpt2", "16xh100", 1024, 64, target="deepspeed"),
        "ulysses": search("llama3-8b", "16xh100", 8192, 32, memory_limit_gib=40, target="deepspeed"),
        "pipeline-tp-recompute": make_plan({"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "micro_batch": 1, **FULL}),
        "pipeline-blocks-recompute": make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "default": {"sharding": "zero1"},
                                                "layers": [{"unit": f"layers.{i}", "sharding": "zero1",
                                                            "recompute": "full"} for i in range(32)]}),
        "zero3-offload-params": make_plan({"mesh": {"dp_shard": 16},
                                           "default": {"sharding": "zero3", "offload": "params"}}),
        "zero2-offload-optimizer-ulysses": make_plan({"mesh": {"dp_shard": 8, "cp": 2}, "cp_mode": "ulysses",
                                                      "default": {"sharding": "zero2", "offload": "optimizer"}}),
        "gpipe-nearest": make_plan({"mesh": {"pp": 4, "dp_shard": 2, "tp": 2}, "schedule": "gpipe",
                                    "default": {"sharding": "replicate"}}),
    }


def write(tmp_path: Path, cfg: dict[str, Any] | str, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


def load(path: Path, **kw: Any) -> Plan:
    args: dict[str, Any] = {"model": "llama3-8b", "cluster": "16xh100", "seq_len": 2048, **kw}
    return import_plan(path, **args)


@pytest.mark.parametrize("name", list(plans()))
def test_round_trip_gives_back_the_step_time(name: str, tmp_path: Path) -> None:
    p = plans()[name]
    e = export(p, "deepspeed")
    want = p.predicted.step_time_s if e.exact else e.repriced.variant["step_time_s"]  # type: ignore[union-attr,index]
    path = write(tmp_path, e.text)
    back = import_plan(path, model=p.inputs.model, cluster=p.inputs.cluster.model_dump(),
                       seq_len=p.inputs.workload.seq_len)
    assert back.predicted.step_time_s == pytest.approx(want, rel=1e-9)
    assert back.strategy.mesh == e.strategy.mesh and back.strategy.micro_batch == e.strategy.micro_batch
    assert back.inputs.target.name == "deepspeed" and back.inputs.workload.global_batch == p.inputs.workload.global_batch


def test_expert_parallelism_comes_from_the_command_line(tmp_path: Path) -> None:
    """The JSON has no expert parallelism (the model code sets it): ``--ep`` gives it, and the round trip holds."""
    p = search("mixtral-8x7b", "16xh100", 2048, 64, target="deepspeed")
    assert p.strategy.mesh.ep > 1
    path = write(tmp_path, export(p, "deepspeed").text)
    back = import_plan(path, model="mixtral-8x7b", cluster="16xh100", seq_len=2048, ep=p.strategy.mesh.ep)
    assert back.strategy.mesh == p.strategy.mesh
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    without = import_plan(path, model="mixtral-8x7b", cluster="16xh100", seq_len=2048)
    assert without.strategy.mesh.ep == 1


def test_batch_is_completed_as_deepspeed_does(tmp_path: Path) -> None:
    only_global = load(write(tmp_path, {"train_batch_size": 64, "bf16": {"enabled": True}}))
    assert (only_global.strategy.micro_batch, only_global.inputs.workload.global_batch) == (4, 64)
    only_micro = load(write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))
    assert (only_micro.strategy.micro_batch, only_micro.inputs.workload.global_batch) == (2, 96)
    global_accum = load(write(tmp_path, {"train_batch_size": 64, "gradient_accumulation_steps": 2,
                                         "tensor_parallel": {"autotp_size": 2}}))
    assert (global_accum.strategy.micro_batch, global_accum.strategy.mesh.dp_shard) == (4, 8)


def test_deprecated_offload_switches(tmp_path: Path) -> None:
    zero = {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}
    s = load(write(tmp_path, {"train_batch_size": 64, "zero_optimization": zero})).strategy
    assert (s.default.sharding, s.default.offload) == ("zero3", "params")
    s = load(write(tmp_path, {"train_batch_size": 64, "zero_optimization": {"stage": 1, "cpu_offload": True}})).strategy
    assert (s.default.sharding, s.default.offload) == ("zero1", "optimizer")


def test_precision(tmp_path: Path) -> None:
    assert load(write(tmp_path, {"train_batch_size": 64, "bf16": {"enabled": False}})).inputs.workload.precision == "fp32"
    assert load(write(tmp_path, {"train_batch_size": 64})).inputs.workload.precision == "fp32"
    assert load(write(tmp_path, {"train_batch_size": 64, "bfloat16": {"enabled": True}})).inputs.workload.precision \
        == "bf16"


def test_recompute_read_from_the_count(tmp_path: Path) -> None:
    blocks = load(write(tmp_path, {"train_batch_size": 64, "activation_checkpointing": {"number_checkpoints": 32}}))
    s = blocks.strategy
    assert s.for_unit("layers.7").recompute == "full" and s.for_unit("embedding").recompute == "none"
    units = load(write(tmp_path, {"train_batch_size": 64, "activation_checkpointing": {"number_checkpoints": 34}}))
    assert {units.strategy.for_unit(u).recompute for u in ("embedding", "layers.0", "head")} == {"full"}
    interval = load(write(tmp_path, {"train_batch_size": 64, "zero_optimization": {"stage": 1},
                                     "pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}))
    assert interval.strategy.for_unit("layers.31").recompute == "full" and interval.strategy.mesh.pp == 2


@pytest.mark.parametrize(("cfg", "message"), [
    ({"train_batch_size": 64, "zero_optimisation": {"stage": 1}}, "has no key zero_optimisation"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin": 1}}},
     "has no key zero_optimization.offload_optimizer.pin"),
    ({"train_batch_size": 64, "pipeline": {"stages": 2, "schedule": "1f1b"}}, "has no key pipeline.schedule"),
    ("{\"train_batch_size\": 64,", "is not valid JSON"),
    ("[1, 2]", "is a JSON object, not list"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
     "train_batch_size 64 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x 16"),
    ({"train_batch_size": 70}, "does not add up"),
    ({"gradient_accumulation_steps": 4}, "needs train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 4}}, "zero_optimization.stage 4 is not one of 0, 1, 2, 3"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "offload_optimizer.device 'nvme' is not priced; accepted: none, cpu"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "offload_param without offload_optimizer"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                    "offload_param": {"device": "cpu"}}}, "under ZeRO stage 3 only"),
    ({"train_batch_size": 64, "zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}},
     "pipeline engine runs ZeRO stage 0 or 1, not 2"),
    ({"train_batch_size": 64, "pipeline": {"stages": 2, "partition": "parameters"}},
     "pipeline.partition 'parameters' is not priced; accepted: uniform"),
    ({"train_batch_size": 64, "pipeline": {"stages": "auto"}}, "pipeline.stages"),
    ({"train_batch_size": 64, "sequence_parallel_size": 3}, "does not divide 16 GPUs"),
    ({"train_batch_size": 64, "fp16": {"enabled": True}}, "fp16 training"),
    ({"train_batch_size": 64, "activation_checkpointing": {"number_checkpoints": 16}},
     "which units recompute cannot be told from the JSON"),
    ({"train_batch_size": 64, "pipeline": {"stages": 2, "activation_checkpoint_interval": 0},
      "activation_checkpointing": {"number_checkpoints": 32}}, "activation_checkpoint_interval 0 says not every block"),
    ({"train_batch_size": 64, "pipeline": {"stages": 2, "activation_checkpoint_interval": 4}},
     "activation_checkpoint_interval 4"),
])
def test_errors_name_the_problem(cfg: dict[str, Any] | str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, cfg))
    assert message in str(err.value)


def test_missing_seq_len_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, export(plans()["gpt2-zero1"], "deepspeed").text)
    with pytest.raises(ConfigError, match="does not say the sequence length: give --seq-len"):
        import_plan(path, model="gpt2", cluster="16xh100")


def test_cli_writes_nothing_for_a_bad_file(tmp_path: Path) -> None:
    out = tmp_path / "back.json"
    bad = write(tmp_path, {"train_batch_size": 64, "zero_optimization": {"stage": 9}})
    inputs = ["--model", "llama3-8b", "--cluster", "16xh100", "--seq-len", "2048"]
    assert main(["import", str(bad), *inputs, "-o", str(out)]) == 2
    assert main(["import", str(write(tmp_path, "{", "cut.json")), *inputs, "-o", str(out)]) == 2
    assert main(["import", str(write(tmp_path, {"train_batch_size": 64}, "bare.json")), "-o", str(out)]) == 2
    assert not out.exists()
    good = write(tmp_path, export(plans()["gpt2-zero1"], "deepspeed").text, "good.json")
    assert main(["import", str(good), "--model", "gpt2", "--cluster", "16xh100", "--seq-len", "1024",
                 "-o", str(out)]) == 0
    assert out.exists()


def test_ulysses_writes_the_mesh_deepspeed_initialize_builds(tmp_path: Path) -> None:
    """sequence_parallel_size with data_parallel_size (their product the world: deepspeed.initialize's
    (data_parallel, sequence_parallel) mesh) where nothing else splits the ranks; beside TP, a note that
    the model code's mpu must hold the groups; an import whose two sizes do not make the world is refused."""
    e = export(plans()["zero2-offload-optimizer-ulysses"], "deepspeed")
    cfg = json.loads(e.text[e.text.index("{"):])
    assert (cfg["sequence_parallel_size"], cfg["data_parallel_size"]) == (2, 8) and not e.notes
    tp = export(make_plan({"mesh": {"dp_shard": 4, "cp": 2, "tp": 2}, "cp_mode": "ulysses",
                           "default": {"sharding": "zero1"}}), "deepspeed")
    assert "data_parallel_size" not in json.loads(tp.text[tp.text.index("{"):])
    assert any(x.startswith("Ulysses beside tensor or pipeline parallelism: pass deepspeed.initialize an mpu")
               for x in tp.notes)
    bad = write(tmp_path, {**cfg, "data_parallel_size": 4})
    with pytest.raises(ConfigError, match="data_parallel_size 4 x sequence_parallel_size 2 is not the 16 GPUs"):
        load(bad)
