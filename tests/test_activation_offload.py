"""Activations offloaded to host memory (``offload: activations``): Transformer Engine's CPU offload as
Megatron runs it (``--cpu-offloading-num-layers N``): the bytes that move, where they are held, what a
target can express, and the Megatron export and import."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import check, estimate
from costmodel.units import UnitOption, price_unit
from planner.reprice import load_named_model, price
from planner.trainers import ConfigError, export, import_plan, lacks
from profiler.hardware import parse_cluster
from profiler.models import load_model
from vocab.errors import ShardplanError
from vocab.plan import PlanError, TargetRef, parse_plan
from vocab.strategy import LayerStrategy, Strategy, Workload

W = Workload(seq_len=256, global_batch=8, grad_dtype="bf16", fp8_saved_inputs="quantized")


def _unit(offload: str, cluster: str = "8xh100") -> dict[str, float]:
    graph = load_model("llama3-8b", 256)
    nodes = dict(graph.blocks())["layers.1"]
    s = Strategy(micro_batch=2, mesh={"dp_shard": 8})
    cfg = ConfigArrays.of_strategy(s)
    opt = UnitOption.uniform(nodes, "zero1", "none", offload)
    cost = price_unit("layers.1", nodes, DeviceModel(parse_cluster(cluster)), cfg, W, [opt]).at(0, 0)
    return {k: getattr(cost, k) for k in ("activations", "remat", "host_bytes", "offload", "fwd", "bwd", "time")}


def test_offloaded_unit_holds_its_activations_only_while_it_runs() -> None:
    """What the unit keeps moves to the host: the device holds it as a transient (``remat``) around
    the unit's own forward and backward, the host one micro-batch's, and each copy not hidden under the
    unit's forward (down) or backward (up) compute is exposed, every micro-batch."""
    on, off = _unit("none"), _unit("activations")
    kept = on["activations"]
    assert kept > 0 and off["activations"] == 0.0
    assert off["remat"] == max(on["remat"], kept)
    assert off["host_bytes"] == on["host_bytes"] + int(np.ceil(kept))
    assert off["time"] == on["time"] and off["fwd"] == on["fwd"]
    move = kept / (parse_cluster("8xh100").accelerator.host_link_gbps * 1e9)
    n_mb = Strategy(micro_batch=2, mesh={"dp_shard": 8}).num_microbatches(W.global_batch)
    exposed = max(move - on["fwd"], 0.0) + max(move - on["bwd"], 0.0)
    assert off["offload"] == pytest.approx(on["offload"] + exposed * n_mb, rel=1e-12)


def test_a_slow_link_exposes_the_copies() -> None:
    """On the CPU 'accelerator' (10 GB/s to the host, a slow forward) nothing is hidden for free either:
    the exposed part is the copy less the unit's own compute, never negative."""
    on, off = _unit("none", "1xcpu"), _unit("activations", "1xcpu")
    assert off["offload"] >= on["offload"] and off["activations"] == 0.0


def _strategy(n: int, sharding: str = "zero1") -> Strategy:
    layers = [{"unit": f"layers.{i}", "sharding": sharding, "offload": "activations"} for i in range(n)]
    return Strategy.model_validate({"mesh": {"dp_shard": 8}, "micro_batch": 1, "default": {"sharding": sharding},
                                    "layers": layers})


def test_peak_memory_falls_and_the_host_holds_the_layers() -> None:
    """Llama 3 8B under ZeRO-3 at 8K tokens, a block keeping 139,392 bytes a token (1.06 GiB): offloading
    16 blocks takes at least 15 of them off the device (the 16th is back while it runs), and one node's
    host holds 8 GPUs' 16 blocks."""
    graph, cluster = load_model("llama3-8b", 8192), parse_cluster("8xh100")
    w = Workload(seq_len=8192, global_batch=8)
    base, half = (estimate(graph, cluster, _strategy(n, "zero3"), w) for n in (0, 16))
    block = 139_392 * 8192 / 1024**3
    assert base.memory_peak_gib - half.memory_peak_gib > 15 * block
    assert base.host_per_node_gib == 0 and half.host_per_node_gib >= 8 * 16 * block


def test_rules_refuse_a_pipeline_and_operator_entries() -> None:
    graph, cluster, w = load_model("llama3-8b", 4096), parse_cluster("8xh100"), Workload(seq_len=4096, global_batch=8)
    s = _strategy(2).model_copy(update={"mesh": _strategy(2).mesh.model_copy(update={"pp": 2, "dp_shard": 4})})
    with pytest.raises(ShardplanError, match="offload 'activations' is priced without pipeline parallelism only"):
        check(graph, cluster, s, w)
    op = _strategy(0).model_copy(update={"layers": [LayerStrategy(unit="layers.0.mlp.up", offload="activations")]})
    with pytest.raises(ShardplanError, match=r"not an operator's: \['layers.0.mlp.up'\] name operators"):
        check(graph, cluster, op, w)


def _megatron(s: Strategy) -> object:
    w = Workload(seq_len=2048, global_batch=16, cross_entropy="fused", grad_dtype="fp32", kernels="fused")
    p = price(load_named_model("llama3-8b", 2048), parse_cluster("8xh100"), s, w, model="llama3-8b")
    return p.model_copy(update={"inputs": p.inputs.model_copy(update={"target": TargetRef(name="megatron")})})


def test_megatron_exports_the_first_layers_and_imports_them_back(tmp_path: Path) -> None:
    p = _megatron(_strategy(3))
    e = export(p, "megatron")
    assert e.exact and "\n--cpu-offloading-num-layers 3\n" in e.text
    path = tmp_path / "off.args"
    path.write_text(e.text)
    back = import_plan(path)
    assert [ls.unit for ls in back.strategy.layers if ls.offload == "activations"] == ["layers.0", "layers.1", "layers.2"]
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    assert back.predicted.memory_peak_gib == pytest.approx(p.predicted.memory_peak_gib, rel=1e-9)
    path.write_text(e.text.replace("--cpu-offloading-num-layers 3", "--cpu-offloading-num-layers 32"))
    with pytest.raises(ConfigError, match="--cpu-offloading-num-layers 32 must be below the model's 32 layers"):
        import_plan(path)
    path.write_text(e.text + "--recompute-granularity selective\n")
    with pytest.raises(ConfigError, match="runs without pipeline parallelism and recomputation only"):
        import_plan(path)


def test_targets_name_what_they_cannot_offload() -> None:
    """Megatron offloads the first N blocks only; torchtitan offloads no activations."""
    gap = _strategy(0).model_copy(update={"layers": [LayerStrategy(unit="layers.1", sharding="zero1",
                                                                   offload="activations")]})
    assert [x.lacks for x in lacks(_megatron(gap), "megatron")] == ["activation offload"]
    assert "activation offload" in [x.lacks for x in lacks(_megatron(_strategy(2)), "torchtitan")]
    assert not lacks(_megatron(_strategy(2)), "megatron")


def test_an_older_plan_offloads_no_activations() -> None:
    doc = json.loads(_megatron(_strategy(2)).model_dump_json())
    doc["schema_version"] = "1.10"
    with pytest.raises(PlanError, match="offload 'activations' needs schema_version 1.11"):
        parse_plan(json.dumps(doc))


def test_estimate_offloads_the_first_layers(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    base = ["estimate", "-m", "llama3-8b", "-c", "8xh100", "--seq-len", "8192", "--global-batch", "8",
            "--dp-shard", "8", "--zero", "3", "--json"]
    peaks = []
    for extra in ([], ["--offload", "activations", "--offload-layers", "16"]):
        assert main([*base, *extra]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["memory_peak_gib"])
    block = 139_392 * 8192 / 1024**3  # a block's saved bytes (test_peak_memory_falls_and_the_host_holds_the_layers)
    assert peaks[0] - peaks[1] > 15 * block
    assert main([*base, "--offload-layers", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --offload-layers needs --offload activations"
    assert main([*base, "--offload", "activations", "--offload-layers", "33"]) == 2
    assert "--offload-layers must be between 1 and the model's 32 blocks, got 33" in capsys.readouterr().err
