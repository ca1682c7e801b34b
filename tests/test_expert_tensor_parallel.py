"""Expert-tensor parallelism and MoE parallel folding, counted by hand on a DeepSeek-V3-shaped layer:
the tokens each rank's experts run, their width, the expert-TP all-gather and reduce-scatter of the
routed copies, the expert parameters per rank, the searches that offer folding and the trainers'
files that carry it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from costmodel.configs import AxisGroup, ConfigArrays
from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.experts import expert_times, expert_tp_time, gathered_input_bytes, tokens_per_sample
from costmodel.node_costs import local_params, node_times
from costmodel.units import _passes, _Traffic
from planner.trainers import ConfigError, export, import_plan
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import load_model
from profiler.transformer import build_graph
from solvers.space import SPACES, mesh_configs, restrict
from tests.test_explain import make_plan
from vocab.plan import Plan, PlanError, TargetRef, parse_plan
from vocab.strategy import LayerStrategy, Mesh, MeshConfig, Strategy, Workload
from vocab.targets import load_target

H, F_, E, K, SEQ = 7168, 2048, 256, 8, 4096  # DeepSeek-V3's routed experts, one 4,096-token sample


def _experts():
    cfg = TransformerConfig(name="moe", layers=1, hidden=H, heads=56, vocab=1000, activation="swiglu",
                            norm="rmsnorm", experts=E, top_k=K, moe_ffn_hidden=F_)
    return next(n for n in build_graph(cfg, SEQ).nodes if n.kind == "experts")


def _cfg(**mesh: int) -> ConfigArrays:
    return ConfigArrays.of([MeshConfig.of(Strategy(mesh=Mesh(**mesh), sequence_parallel=mesh.get("tp", 1) > 1))])


def _flat_dev() -> DeviceModel:
    dev = DeviceModel(parse_cluster("64xh100"))
    return DeviceModel(parse_cluster("64xh100"), constants=dev.c.with_overrides({"moe_imbalance": 1.0}))


def test_folded_experts_run_a_ranks_own_tokens_at_full_width() -> None:
    """tp=2 with sequence parallelism: a rank holds 2,048 of the sample's tokens. Split over tp
    (etp unset) the expert ranks gather both ranks' copies, 4,096 tokens, each expert at half its
    width; folded (etp=1) a rank runs its own 2,048 tokens through whole experts."""
    dev, n = _flat_dev(), _experts()
    w = Workload(seq_len=SEQ, global_batch=64, kernels="fused")
    assert tokens_per_sample(n) == SEQ
    split = node_times(n, dev, _cfg(tp=2, dp_shard=32, ep=8), w)
    folded = node_times(n, dev, _cfg(tp=2, dp_shard=32, ep=16, etp=1), w)
    kw = {"gemm_precision": "bf16", "fp8_casts": False, "kernels": "fused"}
    assert (split[0][0], split[1][0]) == pytest.approx(expert_times(n, dev, 4096, ep=8, tdiv=2, **kw), rel=1e-12)
    assert (folded[0][0], folded[1][0]) == pytest.approx(expert_times(n, dev, 2048, ep=16, tdiv=1, **kw), rel=1e-12)


def test_expert_parameters_per_rank_are_split_over_etp_times_ep() -> None:
    n = _experts()
    assert n.params == E * 3 * H * F_  # three matrices per expert (SwiGLU), no biases
    assert local_params(n, _cfg(tp=2, dp_shard=32, ep=8))[0] == n.params // 16
    assert local_params(n, _cfg(tp=2, dp_shard=32, ep=16, etp=1))[0] == n.params // 16
    assert local_params(n, _cfg(tp=2, dp_shard=32, ep=8, etp=1))[0] == n.params // 8


def _ep_comm(moe_tp: str = "dispatcher", **mesh: int) -> float:
    cfg, n = _cfg(**mesh), _experts()
    w = Workload(seq_len=SEQ, global_batch=64, kernels="fused", moe_tp=moe_tp)
    t = _Traffic([n], cfg, w, [1.0], 2.0)
    z = np.zeros(1)
    return float(t.comm(_flat_dev(), _passes(cfg, "none", w.selective), z, z + 1e-3, z, z)["comm_ep"][0])


def test_expert_tp_gathers_and_scatters_the_routed_copies() -> None:
    """ep=1, tp=2 (etp = tp): each rank routes its 2,048 tokens' 8 copies of 7,168 bf16 values; after
    the dispatch the pair gathers both ranks' copies (4,096 x 8 x 7,168 x 2 bytes) and reduce-scatters
    the experts' outputs of that size, forward and backward: nothing else is expert traffic."""
    dev = _flat_dev()
    gathered = 4096 * K * H * 2
    pair = AxisGroup(2, 1)
    want = 2 * (dev.collective_time("all_gather", gathered, pair) + dev.collective_time("reduce_scatter", gathered, pair))
    assert expert_tp_time(dev, gathered / 2, pair) == pytest.approx(want / 2, rel=1e-12)
    assert _ep_comm(tp=2, dp_shard=32) == pytest.approx(want, rel=1e-12)
    assert _ep_comm(tp=1, dp_shard=64) == 0.0


def test_folded_experts_send_only_the_dispatch() -> None:
    """etp=1: no expert-TP collectives; the all-to-all runs over 16 adjacent ranks (ep stride 1), the
    copies of a rank's own 2,048 tokens."""
    dev = _flat_dev()
    sent = 2048 * K * H * 2
    a2a = dev.collective_time("all_to_all", sent, AxisGroup(16, 1))
    assert _ep_comm(tp=2, dp_shard=32, ep=16, etp=1) == pytest.approx(2 * 2 * a2a * (1 - dev.c.ep_overlap), rel=1e-9)


def test_torchtitan_gathers_the_layer_input_over_tp_and_dispatches_every_token() -> None:
    """moe_tp gathered (torchtitan), ep=8 with tp=2: the layer all-gathers the sample's 4,096 tokens
    of 7,168 bf16 values over the tp pair and reduce-scatters its output, forward and backward; split
    over tp (etp = tp) each tp rank then dispatches all 4,096 tokens' copies, folded (etp=1, ep=16)
    its own 2,048 tokens'. No expert-TP collective after the dispatch."""
    dev = _flat_dev()
    layer, pair = 4096 * H * 2, AxisGroup(2, 1)
    around = 2 * (dev.collective_time("all_gather", layer, pair) + dev.collective_time("reduce_scatter", layer, pair))
    keep = 2 * 2 * (1 - dev.c.ep_overlap)  # forward and backward, dispatch and combine, the part not hidden
    split = keep * dev.collective_time("all_to_all", 4096 * K * H * 2, AxisGroup(8, 2))
    assert _ep_comm("gathered", tp=2, dp_shard=32, ep=8) == pytest.approx(around + split, rel=1e-9)
    folded = keep * dev.collective_time("all_to_all", 2048 * K * H * 2, AxisGroup(16, 1))
    assert _ep_comm("gathered", tp=2, dp_shard=32, ep=16, etp=1) == pytest.approx(around + folded, rel=1e-9)
    assert _ep_comm("gathered", tp=1, dp_shard=64, ep=8) == _ep_comm(tp=1, dp_shard=64, ep=8)


def test_torchtitan_plans_are_priced_with_its_gathered_moe_layer() -> None:
    assert load_target("torchtitan").behaviour.workload()["moe_tp"] == "gathered"
    assert load_target("megatron").behaviour.workload()["moe_tp"] == "dispatcher"
    doc = json.loads(_folded_plan(TargetRef(name="torchtitan", version="0.2.2")).model_dump_json())
    assert doc["inputs"]["workload"]["moe_tp"] == "gathered"
    doc["schema_version"] = "1.9"
    with pytest.raises(PlanError, match="workload.moe_tp 'gathered' needs schema_version 1.10"):
        parse_plan(json.dumps(doc))


def test_megatron_search_offers_folded_meshes_with_sequence_parallelism_only() -> None:
    """Qwen3-235B on 256 H100: the megatron space holds NVIDIA's tp2 pp8 ep32 (ep32 does not divide
    dp 16: only folded), and with MoE beside tp every mesh has sequence parallelism (Megatron raises
    otherwise); the shardplan runtime's space folds nothing."""
    graph, cluster = load_model("qwen3-235b-a22b", 4096), parse_cluster("256xh100")
    w = Workload(seq_len=4096, global_batch=2048)
    opts = restrict(SPACES["megatron"], load_target("megatron"))
    found = list(mesh_configs(graph, cluster, w, opts))
    folded = [c for c in found if c.etp]
    assert any((c.tp, c.pp, c.ep, c.etp) == (2, 8, 32, 1) for c in folded)
    assert all(c.etp == 1 and c.sequence_parallel and c.tp > 1 for c in folded)
    assert all(c.sequence_parallel for c in found if c.tp > 1)
    assert any(c.tp == 1 and c.ep == 32 and not c.sequence_parallel for c in found)  # and meshes without tp
    runtime = restrict(SPACES["hybrid"], load_target("shardplan"))
    assert not any(c.etp for c in mesh_configs(graph, cluster, w, runtime))


MEGATRON = TargetRef(name="megatron", version="0.16.1")
FOLDED = {"mesh": {"dp_shard": 8, "tp": 2, "ep": 16, "etp": 1}, "sequence_parallel": True,
          "default": {"sharding": "zero1"}}


def _folded_plan(target: TargetRef = MEGATRON) -> Plan:
    """GPT-OSS-20B (32 experts) on 16 H100, tp2 with ep16: only folded (ep 16 does not divide dp 8)."""
    return make_plan(FOLDED, model="gpt-oss-20b", cluster="16xh100", seq_len=4096, global_batch=64,
                     target=target, **load_target(target.name).behaviour.workload())


def test_a_folded_plan_exports_and_imports_on_megatron_and_torchtitan(tmp_path: Path) -> None:
    plan = _folded_plan()
    assert plan.schema_version == "1.12" and plan.strategy.mesh.etp == 1
    assert json.loads(plan.model_dump_json())["strategy"]["mesh"]["etp"] == 1
    meg = export(plan, "megatron")
    assert not meg.losses and "--expert-tensor-parallel-size 1" in meg.text
    path = tmp_path / "run.sh"
    path.write_text(meg.text)
    assert import_plan(path, "megatron", "gpt-oss-20b", "16xh100").strategy.mesh == plan.strategy.mesh
    tt = export(_folded_plan(TargetRef(name="torchtitan", version="0.2.2")), "torchtitan")
    par = tomllib.loads(tt.text)["parallelism"]
    assert (par["expert_tensor_parallel_degree"], par["expert_parallel_degree"]) == (1, 16)
    path = tmp_path / "a.toml"
    path.write_text(tt.text)
    assert import_plan(path, "torchtitan", "gpt-oss-20b", "16xh100").strategy.mesh == plan.strategy.mesh


def test_torchtitan_splits_experts_over_tp_only_where_the_file_says_so(tmp_path: Path) -> None:
    """torchtitan 0.2.2's expert_tensor_parallel_degree defaults to 1: a file with tp 2 and ep 4 that
    does not set it folds the expert ranks over tp; set to tp, the experts split over tp; no other value."""
    plan = make_plan({"mesh": {"dp_shard": 8, "tp": 2, "ep": 4}, "sequence_parallel": True}, model="gpt-oss-20b",
                     cluster="16xh100", seq_len=4096, global_batch=64, target=TargetRef(name="torchtitan", version="0.2.2"),
                     **load_target("torchtitan").behaviour.workload())
    text = export(plan, "torchtitan").text
    assert tomllib.loads(text)["parallelism"]["expert_tensor_parallel_degree"] == 2
    path = tmp_path / "a.toml"
    path.write_text(text)
    assert import_plan(path, "torchtitan", "gpt-oss-20b", "16xh100").strategy.mesh.etp == 0
    path.write_text(text.replace("expert_tensor_parallel_degree = 2\n", ""))
    assert import_plan(path, "torchtitan", "gpt-oss-20b", "16xh100").strategy.mesh.etp == 1
    path.write_text(text.replace("expert_tensor_parallel_degree = 2", "expert_tensor_parallel_degree = 4"))
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree 4 is neither 1 nor tp 2"):
        import_plan(path, "torchtitan", "gpt-oss-20b", "16xh100")


def test_a_target_without_folding_exports_the_nearest_plan() -> None:
    e = export(_folded_plan(), "deepspeed")
    lost = [x for x in e.losses if x.what == "MoE parallel folding"]
    assert lost and lost[0].detail.startswith("etp=1 ep=16 → ep=8, the experts split over tp=2")
    assert (e.strategy.mesh.etp, e.strategy.mesh.ep) == (0, 8)


def test_an_older_plan_names_no_expert_tp() -> None:
    doc = json.loads(_folded_plan().model_dump_json())
    doc["schema_version"] = "1.9"
    with pytest.raises(PlanError, match="strategy.mesh.etp needs schema_version 1.10"):
        parse_plan(json.dumps(doc))
    doc["schema_version"] = "1.10"  # the version that added it reads it
    doc["inputs"]["workload"].pop("fp8_saved_inputs", None)  # a 1.11 field
    assert parse_plan(json.dumps(doc)).strategy.mesh.etp == 1


def test_a_rank_keeps_the_whole_input_of_every_routed_copy_its_experts_run() -> None:
    """A routed copy saves its input (7,168 bf16 values) and its FFN part (3 x 2,048) for the backward.
    tp=2 with sequence parallelism, the experts split over tp: a rank runs both ranks' 4,096 tokens' 8
    copies, inputs whole, the FFN part at half width; the unit's share of its saved bytes counts the
    inputs at half, so 4,096 x 8 x 7,168 bytes come on top. Folded, or under TSP, a rank runs its own
    2,048 tokens' copies at full width: nothing on top. Without sequence parallelism (or with
    torchtitan's gathered layer) every rank holds all 4,096 tokens: the same on top."""
    n = _experts()
    saved = n.act_saved_bytes  # one sample: 4,096 tokens x 8 copies x (7,168 + 3 x 2,048) x 2 bytes
    assert saved == 2 * (H + 3 * F_) * SEQ * K
    tp = np.array([2.0, 2.0, 2.0, 2.0, 1.0])
    etp = np.array([2.0, 1.0, 2.0, 2.0, 1.0])
    gathered = np.array([False, False, True, False, False])
    got = gathered_input_bytes(n, saved, tp, np.where([False, False, False, True, False], 1.0, etp), gathered)
    assert list(got) == [SEQ * K * H, 0.0, SEQ * K * H, 0.0, 0.0]
    graph, cluster = load_model("mixtral-8x7b", 4096), parse_cluster("16xh100")
    w = Workload(seq_len=4096, global_batch=64)

    def acts(**mesh: int) -> float:
        s = Strategy(mesh=Mesh(**mesh), sequence_parallel=True, default=LayerStrategy(sharding="zero1"))
        return estimate(graph, cluster, s, w).stages[0].activations

    layers, h, k = 32, 4096, 2  # Mixtral 8x7B: every block a MoE layer of top-2 routing
    assert acts(tp=2, dp_shard=8, ep=8) - acts(tp=2, dp_shard=8, ep=8, etp=1) == pytest.approx(layers * 4096 * k * h)
