"""What NVIDIA's recipes need of the megatron target: gradients reduced in bf16, and
``estimate --recompute full`` meaning full recomputation of the transformer blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.commands.estimate import price_args
from planner.reprice import load_named_model, price
from planner.trainers import export, import_plan, lacks
from profiler.hardware import parse_cluster
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload
from vocab.targets import load_target

JOB = {"model": "llama3-8b", "cluster": "8xh100", "seq_len": 4096, "global_batch": 32, "zero": 1}


def test_megatron_runs_bf16_gradients_and_searches_with_fp32() -> None:
    # megatron-core 0.16.1: DistributedDataParallelConfig.grad_reduce_in_fp32 = False (its default, bf16
    # buffers); Megatron-LM's --bf16 sets it True: the search keeps pricing fp32
    assert load_target("megatron").behaviour.grad_dtype == ["fp32", "bf16"]
    fp32 = price_args({**JOB, "target": "megatron"})
    bf16 = price_args({**JOB, "target": "megatron", "grad_dtype": "bf16"})
    assert bf16["memory_peak_gib"] < fp32["memory_peak_gib"]


def test_bf16_gradients_export_and_import_back(tmp_path: Path) -> None:
    graph, cluster = load_named_model("llama3-8b", 4096), parse_cluster("8xh100")
    t = load_target("megatron")
    w = Workload(seq_len=4096, global_batch=32, precision="bf16", **t.behaviour.workload(grad_dtype="bf16"))
    s = Strategy(mesh=Mesh(dp_shard=8), micro_batch=1, default=LayerStrategy(sharding="zero1"))
    plan = price(graph, cluster, s, w, model="llama3-8b")
    assert lacks(plan, "megatron") == []
    e = export(plan, "megatron")
    assert e.exact and "--grad-reduce-in-bf16" in e.text.split()
    path = tmp_path / "plan.args"
    path.write_text(e.text, encoding="utf-8")
    back = import_plan(path)
    assert back.inputs.workload.grad_dtype == "bf16"
    assert back.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    fp32 = price(graph, cluster, s, w.model_copy(update={"grad_dtype": "fp32"}), model="llama3-8b")
    assert "--grad-reduce-in-bf16" not in export(fp32, "megatron").text.split()


def test_estimate_full_recompute_on_megatron_is_of_the_blocks() -> None:
    rep = price_args({**JOB, "target": "megatron", "recompute": "full"})
    assert any("recomputes the transformer blocks; the embedding and head recompute nothing" in n
               for n in rep["notes"])
    graph, cluster = load_named_model("llama3-8b", 4096), parse_cluster("8xh100")
    blocks = Strategy(mesh=Mesh(dp_shard=8), micro_batch=1, default=LayerStrategy(sharding="zero1", recompute="full"),
                      layers=[LayerStrategy(unit=u, sharding="zero1", recompute="none") for u in ("embedding", "head")])
    w = Workload(seq_len=4096, global_batch=32, precision="bf16", **load_target("megatron").behaviour.workload())
    assert rep["step_time_s"] == pytest.approx(price(graph, cluster, blocks, w).predicted.step_time_s, rel=1e-12)
    # a target that recomputes any unit keeps the embedding and head in it, and says nothing
    mine = price_args({**JOB, "zero": 2, "target": "shardplan", "recompute": "full"})
    assert not any("transformer blocks" in n for n in mine["notes"])


def test_estimate_still_refuses_what_megatron_lacks() -> None:
    with pytest.raises(ShardplanError, match="cannot express: ZeRO-2"):
        price_args({**JOB, "zero": 2, "target": "megatron", "recompute": "full"})
    # Megatron-FSDP (ZeRO-3) runs on data-parallel meshes; beside tensor parallelism it is not offered
    assert price_args({**JOB, "zero": 3, "target": "megatron", "recompute": "full"})["fits"]
    with pytest.raises(ShardplanError, match="cannot express: ZeRO-3 with data parallelism beside model parallelism"):
        price_args({**JOB, "zero": 3, "tp": 2, "target": "megatron"})
