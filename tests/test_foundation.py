"""Model ingestion, hardware and cluster specs, the plan schema and the listing commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
import yaml

from profiler import hardware
from profiler.hardware import parse_cluster
from profiler.models import config_from_hf, load_model, preset, presets, resolve_config
from profiler.transformer import build_graph
from vocab.errors import ShardplanError, UnknownNameError
from vocab.plan import (
    SCHEMA_PATH,
    ClusterRef,
    Plan,
    PlanError,
    PlanInputs,
    Predicted,
    json_schema_text,
    parse_plan,
)
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

DATA = Path(__file__).parent / "data"

# Published parameter counts the issue names (billions).
PUBLISHED = {"llama3-8b": 8.03, "llama3-70b": 70.55, "llama3.1-405b": 405.8, "gpt3-175b": 174.6,
             "mixtral-8x7b": 46.7}


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED.items()))
def test_named_presets_match_published_parameter_counts(name: str, billions: float) -> None:
    total = build_graph(preset(name)).total_params
    assert abs(total / (billions * 1e9) - 1) <= 0.005


def test_every_preset_matches_its_published_count() -> None:
    """Within 0.5%, or equal at the precision the source prints (Megatron's 1.7B is 1.65B rounded)."""
    for name, cfg in presets().items():
        assert cfg.params_published > 0, name
        total = build_graph(cfg).total_params / 1e9
        pub = cfg.params_published / 1e9
        decimals = max(0, len(f"{pub:g}".split(".")[1]) if "." in f"{pub:g}" else 0)
        assert abs(total / pub - 1) <= 0.005 or round(total, decimals) == pub, (name, total, pub)


def test_parameter_count_is_the_graphs() -> None:
    """``shardplan models`` counts from one block of each kind: every preset's count equals its
    whole graph's, at any sequence length."""
    from profiler.transformer import parameter_count

    for name, cfg in presets().items():
        for seq in (None, 128):
            assert parameter_count(cfg) == build_graph(cfg, seq).total_params, name


def test_preset_names_are_short_lowercase_and_cover_the_families() -> None:
    names = set(presets())
    for n in ("gpt2", "gpt2-xl", "gpt3-175b", "gpt3-1t", "llama2-70b", "llama3-8b", "llama3-70b",
              "llama3.1-405b", "mixtral-8x7b", "mixtral-8x22b", "qwen3-235b-a22b", "bert-large", "vit-l-16",
              "deepseek-v3", "kimi-k2", "gemma2-9b", "gpt-oss-120b", "mistral-7b"):
        assert n in names
    assert all(n == n.lower() and " " not in n for n in names)


@pytest.mark.parametrize("name", ["gpt3-1.7b", "gpt3-18.4b", "gpt3-175b", "gpt3-1t", "gpt2-xl"])
@pytest.mark.parametrize("seq", [1024, 2048, 8192])
def test_training_flops_equal_megatron_formula(name: str, seq: int) -> None:
    cfg = preset(name)
    g = build_graph(cfg, seq)
    n_layers, h, v = cfg.layers, cfg.hidden, cfg.vocab
    megatron = 72 * seq * n_layers * h**2 * (1 + seq / (6 * h) + v / (12 * n_layers * h))
    assert abs(g.train_flops / megatron - 1) < 0.01


def test_hf_config_files_are_read_offline() -> None:
    llama = resolve_config(str(DATA / "llama3-8b-config.json"))
    assert build_graph(llama).total_params == build_graph(preset("llama3-8b")).total_params
    gpt2 = resolve_config(str(DATA / "gpt2-config.json"))
    assert build_graph(gpt2).total_params == build_graph(preset("gpt2")).total_params
    mixtral = resolve_config(str(DATA / "mixtral-8x7b-config.json"))
    assert build_graph(mixtral).total_params == build_graph(preset("mixtral-8x7b")).total_params
    qwen2 = build_graph(resolve_config(str(DATA / "qwen2-7b-config.json"))).total_params
    assert abs(qwen2 / 7.62e9 - 1) < 0.005  # Qwen2-7B: 7.62B with q/k/v biases


def test_bad_configs_get_clear_errors() -> None:
    with pytest.raises(ShardplanError, match="not valid JSON"):
        resolve_config(str(DATA / "truncated-config.json"))
    with pytest.raises(ShardplanError, match="missing key 'num_hidden_layers'"):
        config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(ShardplanError, match="not a known key set"):
        config_from_hf({"model_type": "t5"})
    # a Gemma-2 config has Llama's keys, but not its layers: read as Gemma-2 (9.24 B), never as Llama (10.16 B)
    gemma2 = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000}
    assert abs(build_graph(config_from_hf(gemma2)).total_params / 9.24e9 - 1) < 0.001
    with pytest.raises(ShardplanError, match="heads 6 is not divisible by kv_heads 4"):
        resolve_config({"layers": 2, "hidden": 48, "heads": 6, "kv_heads": 4, "vocab": 10})
    with pytest.raises(UnknownNameError, match="Did you mean: llama3-8b"):
        load_model("llama3-8x")


def test_graph_structure_and_blocks() -> None:
    g = load_model("llama3-8b", 4096)
    dg = g.to_networkx()
    assert nx.is_directed_acyclic_graph(dg)
    assert dg.number_of_nodes() == len(g.nodes) and dg.number_of_edges() == len(g.nodes) - 1
    units = [u for u, _ in g.blocks()]
    assert units[0] == "embedding" and units[-1] == "head" and len(units) == 34
    assert g.num_blocks == 32
    assert {n.block_type for n in g.nodes} == {"embedding", "decoder", "head"}
    assert g.content_hash() == load_model("llama3-8b", 4096).content_hash()
    assert g.content_hash() != load_model("llama3-8b", 2048).content_hash()


def test_moe_graph_counts_active_flops_and_all_parameters() -> None:
    g = load_model("mixtral-8x7b", 4096)
    experts = [n for n in g.nodes if n.kind == "experts"]
    assert len(experts) == 32
    e = experts[0]
    assert e.params == 8 * 3 * 4096 * 14336
    assert e.fwd_flops == 2 * 4096 * 2 * 3 * 4096 * 14336  # top-2 of 8 experts per token


def test_accelerators_have_sources_and_sane_numbers() -> None:
    accs = hardware.accelerators()
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h800", "h200", "b200", "b300", "gb200", "gb300",
                 "mi300x", "cpu"):
        a = accs[name]
        assert a.peak_tflops["bf16"] > 0 and a.hbm_gb > 0
        assert {"peak_tflops", "hbm", "scale_up", "scale_out"} <= set(a.sources)
    assert accs["gb200"].scale_up.domain == 72
    assert hardware.accelerator("H100").name == "h100-sxm"
    # the H800 is the H100's compute with a narrower NVLink
    h800, h100 = accs["h800"], accs["h100-sxm"]
    assert h800.peak_tflops == h100.peak_tflops and h800.scale_up.gbps < h100.scale_up.gbps


def test_a_new_accelerator_file_is_picked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = yaml.safe_load((hardware.ACCELERATOR_DIR / "h100-sxm.yaml").read_text())
    base.update(name="x1000", aliases=["xk"], hbm_gb=512)
    (tmp_path / "x1000.yaml").write_text(yaml.safe_dump(base))
    monkeypatch.setenv("SHARDPLAN_ACCELERATOR_PATH", str(tmp_path))
    c = parse_cluster("16xxk")
    assert c.accelerator.name == "x1000" and c.accelerator.hbm_gb == 512 and c.nodes == 2
    out = subprocess.run([sys.executable, "-m", "planner.cli", "hardware", "--json"], capture_output=True,
                         text=True, check=True, env={**__import__("os").environ})
    assert "x1000" in [a["name"] for a in json.loads(out.stdout)]


def test_cluster_shorthand_and_files(tmp_path: Path) -> None:
    c = parse_cluster("64xh100")
    assert (c.nodes, c.gpus_per_node, c.world_size) == (8, 8, 64)
    assert parse_cluster("64xh100", gpus_per_node=4).nodes == 16
    assert parse_cluster("4xcpu").world_size == 4
    f = tmp_path / "c.yaml"
    f.write_text("accelerator: h200\nnodes: 4\nscale_out: {gbps: 100}\n")
    c2 = parse_cluster(str(f))
    assert c2.world_size == 32 and c2.accelerator.scale_out.gbps == 100
    with pytest.raises(ShardplanError, match="not a multiple"):
        parse_cluster("12xh100")
    with pytest.raises(ShardplanError, match="must be positive"):
        parse_cluster("0xh100")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ShardplanError, match="not valid JSON"):
        parse_cluster(str(bad))


def _plan() -> Plan:
    s = Strategy(mesh=Mesh(pp=2, dp_shard=4, tp=2), micro_batch=2, default=LayerStrategy(sharding="zero3"),
                 layers=[LayerStrategy(unit="layers.3", recompute="full", split=2)])
    return Plan(
        inputs=PlanInputs(model="llama3-8b", model_hash="abc", workload=Workload(seq_len=4096, global_batch=64),
                          cluster=ClusterRef(accelerator="h100-sxm", nodes=2, gpus_per_node=8, world_size=16,
                                             memory_gb=80)),
        strategy=s,
        predicted=Predicted(step_time_s=1.5, tokens_per_s_per_gpu=1000, mfu=0.4, hfu=0.5, memory_peak_gib=60,
                            time={"compute_s": 1.0}),
    )


def test_plan_round_trips_byte_identically(tmp_path: Path) -> None:
    p = _plan()
    path = tmp_path / "plan.json"
    p.save(path)
    again = parse_plan(path.read_text())
    assert again == p and again.to_json() == p.to_json()
    assert again.strategy.for_unit("layers.3.mlp.up").split == 2
    assert again.strategy.for_unit("layers.30").sharding == "zero3"
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_invalid_plans_name_the_field_and_reason() -> None:
    d = json.loads(_plan().to_json())
    d["strategy"]["mesh"]["tp"] = 0
    with pytest.raises(PlanError, match=r"strategy\.mesh\.tp: Input should be greater than or equal to 1"):
        parse_plan(d)
    d = json.loads(_plan().to_json())
    d["strategy"]["default"]["sharding"] = "zero9"
    with pytest.raises(PlanError, match=r"strategy\.default\.sharding"):
        parse_plan(d)
    d = json.loads(_plan().to_json())
    d["schema_version"] = "0.1"
    with pytest.raises(PlanError, match="schema_version '0.1' is not supported"):
        parse_plan(d)
    with pytest.raises(PlanError, match="not valid JSON"):
        parse_plan('{"inputs": ')
    d = json.loads(_plan().to_json())
    d["strategy"]["vpp"] = 2
    with pytest.raises(PlanError, match="vpp=2 needs schedule 'interleaved'"):
        parse_plan(d)


def test_a_plan_delegates_its_notebook_view_to_the_planner() -> None:
    import planner  # noqa: F401  (importing it registers PlanView)
    from planner.notebook import PlanView

    p = _plan()
    assert isinstance(p.view(), PlanView) and p.view().plan is p
    assert p.report == p.predicted.model_dump()


def test_exported_json_schema_is_in_sync() -> None:
    assert SCHEMA_PATH.read_text() == json_schema_text(), "run: python -m vocab.plan"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True)


def test_listing_commands_give_stable_json() -> None:
    models = json.loads(_cli("models", "--json").stdout)
    assert "llama3.1-405b" in [m["name"] for m in models]
    hw = json.loads(_cli("hardware", "--json").stdout)
    assert all("name" in a for a in hw) and "h100-sxm" in [a["name"] for a in hw]
    ins = json.loads(_cli("inspect", "--model", "gpt2", "--seq-len", "128", "--json").stdout)
    assert ins["total_params"] == build_graph(preset("gpt2")).total_params
    assert ins["layers"][0]["name"] == "embed" and ins["seq_len"] == 128
    cfg = json.loads(_cli("inspect", "--model", str(DATA / "llama3-8b-config.json"), "--json").stdout)
    assert cfg["total_params"] == 8030261248


def test_unknown_names_exit_2_with_close_matches_and_no_traceback() -> None:
    r = _cli("inspect", "--model", "lama3-8b")
    assert r.returncode == 2
    assert "unknown model 'lama3-8b'" in r.stderr and "llama3-8b" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    r = _cli("inspect", "--model", str(DATA / "truncated-config.json"))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "Traceback" not in r.stderr


def test_other_architectures_are_traced_through_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = {"model_type": "gpt_neox", "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 320, "max_position_embeddings": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    g = load_model(str(path), 64)
    assert g.source == "traced" and g.total_params == 478720  # sum(p.numel()) of GPTNeoXForCausalLM
