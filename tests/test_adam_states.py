"""Adam's state in bf16 (``workload.adam_states``): Megatron's precision-aware optimizer as NVIDIA's
recipes run it (both moments bf16, the fp32 master kept as 16-bit remainders): the bytes held and
moved, and the Megatron export and import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.state_groups import adam_step_bytes, state_bytes
from planner.reprice import load_named_model, price
from planner.trainers import ConfigError, export, import_plan
from profiler.hardware import parse_cluster
from vocab.plan import PlanError, TargetRef, parse_plan
from vocab.strategy import Strategy, Workload


def _w(**kw: object) -> Workload:
    return Workload(seq_len=2048, global_batch=16, **kw)  # type: ignore[arg-type]


def test_state_and_step_bytes() -> None:
    """16-bit training: master 4 + moments 4 + 4 = 12 bytes, bf16 states 2 + 2 + 2 = 6; fp32 training has
    no master: 8 and 4. The step reads and writes each: 36 - 3 x 2 x 2 = 24 bytes, fp32 36 - 2 x 2 x 2."""
    assert state_bytes(_w()) == (2, 4, 12) and state_bytes(_w(adam_states="bf16")) == (2, 4, 6)  # fp32 gradients
    assert state_bytes(_w(precision="fp32"))[2] == 8 and state_bytes(_w(precision="fp32", adam_states="bf16"))[2] == 4
    assert (adam_step_bytes(_w()), adam_step_bytes(_w(adam_states="bf16")),
            adam_step_bytes(_w(precision="fp32", adam_states="bf16"))) == (36, 24, 28)


def test_the_optimizer_holds_half() -> None:
    graph, cluster = load_named_model("llama3-8b", 2048), parse_cluster("8xh100")
    s = Strategy.model_validate({"mesh": {"dp_shard": 8}, "default": {"sharding": "zero1"}})
    full, half = (estimate(graph, cluster, s, _w(adam_states=a)).stages[0] for a in ("fp32", "bf16"))
    assert half.optim_bytes * 2 == full.optim_bytes and half.param_bytes == full.param_bytes


def _megatron(sharding: str = "zero1", adam: str = "bf16") -> object:
    w = Workload(seq_len=2048, global_batch=16, cross_entropy="fused", grad_dtype="fp32", kernels="fused",
                 adam_states=adam)  # type: ignore[arg-type]
    s = Strategy.model_validate({"mesh": {"dp_shard": 8}, "default": {"sharding": sharding}})
    p = price(load_named_model("llama3-8b", 2048), parse_cluster("8xh100"), s, w, model="llama3-8b")
    return p.model_copy(update={"inputs": p.inputs.model_copy(update={"target": TargetRef(name="megatron")})})


def test_megatron_exports_the_precision_aware_optimizer_and_reads_it_back(tmp_path: Path) -> None:
    p = _megatron()
    e = export(p, "megatron")
    assert e.exact
    assert "\n--use-precision-aware-optimizer\n--exp-avg-dtype bf16\n--exp-avg-sq-dtype bf16\n" in e.text
    path = tmp_path / "pa.args"
    path.write_text(e.text)
    back = import_plan(path)
    assert back.inputs.workload.adam_states == "bf16"
    assert back.predicted.memory_peak_gib == pytest.approx(p.predicted.memory_peak_gib, rel=1e-9)
    path.write_text(e.text.replace("--exp-avg-dtype bf16", "--exp-avg-dtype fp16"))
    with pytest.raises(ConfigError, match="Adam's moments fp16/bf16 with a fp32 master are not priced"):
        import_plan(path)
    path.write_text(e.text.replace("--use-precision-aware-optimizer\n", ""))
    with pytest.raises(ConfigError, match="--exp-avg-dtype, --exp-avg-sq-dtype needs --use-precision-aware-optimizer"):
        import_plan(path)


def test_ddp_keeps_fp32_states_on_megatron() -> None:
    """Megatron runs the precision-aware optimizer with the distributed optimizer only."""
    e = export(_megatron("replicate"), "megatron")
    assert [(x.what, x.detail) for x in e.losses] == [
        ("Adam's state", "bf16 → fp32 (Megatron's precision-aware optimizer needs the distributed optimizer)")]
    assert "--use-precision-aware-optimizer" not in e.text


def test_other_targets_keep_fp32_states() -> None:
    e = export(_megatron(), "torchtitan")
    assert ("Adam's state", "bf16 → fp32 (how torchtitan runs it)") in [(x.what, x.detail) for x in e.losses]


def test_an_older_plan_keeps_fp32_states() -> None:
    doc = json.loads(_megatron().model_dump_json())
    doc["schema_version"] = "1.10"
    doc["inputs"]["workload"].pop("fp8_saved_inputs", None)
    with pytest.raises(PlanError, match="workload.adam_states 'bf16' needs schema_version 1.11"):
        parse_plan(json.dumps(doc))
