"""Model and hardware inputs are checked once where they enter: every bad one is a ShardplanError of
one line naming the input and the field; valid presets, config files and accelerators load as before."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from profiler import hardware
from profiler.hardware import Accelerator, NetworkTier, parse_cluster
from profiler.model_config import MAX_LAYERS, TransformerConfig
from profiler.models import PRESET_DIR, config_from_hf, load_model, presets, resolve_config
from profiler.transformer import build_graph
from vocab.errors import ShardplanError

H100 = yaml.safe_load((hardware.ACCELERATOR_DIR / "h100-sxm.yaml").read_text())
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100}


def _error(fn: Any, *args: Any) -> str:
    with pytest.raises(ShardplanError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---- clusters ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body,reason", [
    ("accelerator: h200\nnodes: x\n", "nodes: Input should be a valid integer (got 'x')"),
    ("accelerator: h200\nnodes: 4.5\n", "nodes: Input should be a valid integer (got 4.5)"),
    ("accelerator: h200\nnodes: 2\ngpus_per_node: 8.5\n", "gpus_per_node: Input should be a valid integer (got 8.5)"),
    ("accelerator: h200\nnodes: true\n", "nodes: Input should be a valid integer (got True)"),
    ("accelerator: h200\nnodes: 100000000\n", "nodes: Input should be less than or equal to 1048576"),
    ("accelerator: h200\nnodes: 200000\n", "1,600,000 GPUs (200,000 nodes x 8) is over the supported 1,048,576"),
    ("accelerator: h200\ngpus: 12\n", "12 GPUs is not a multiple of 8 GPUs per node"),
    ("nodes: 4\n", "missing field 'accelerator'"),
    ("accelerator: h200\n", "give 'nodes' or 'gpus'"),
    ("accelerator: h200\nnodes: 1\nnodez: 4\n", "nodez: Extra inputs are not permitted"),
    ("accelerator: h200\nnodes: 1\nmemory_gb: .nan\n", "memory_gb: Input should be a finite number"),
    ("accelerator: h200\nnodes: 1\nscale_out: {gbps: 0}\n", "scale_out.gbps: Input should be greater than 0"),
    ("accelerator: [h200]\nnodes: 1\n", "accelerator must be a name or a mapping of fields, got list"),
    ("- 1\n", "must hold a mapping, got list"),
    ("", "must hold a mapping, got NoneType"),
])
def test_bad_cluster_files_name_the_file_and_field(tmp_path: Path, body: str, reason: str) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(body)
    msg = _error(parse_cluster, str(f))
    assert msg.startswith(f"cluster file '{f}'") and reason in msg, msg


def test_cluster_specs_are_bounded_and_valid_ones_unchanged() -> None:
    assert "2,000,000 GPUs is over the supported 1,048,576" in _error(parse_cluster, "2000000xh100")
    assert "digits) GPUs is over" in _error(parse_cluster, "9" * 5000 + "xh100")
    assert "GPUs per node must be in" in _error(parse_cluster, "64xh100", 0)
    assert "world_size 9 is not" in _error(parse_cluster, {"accelerator": "h200", "nodes": 1, "world_size": 9})
    assert "expected 'N x accelerator'" in _error(parse_cluster, "a\0b")
    c = parse_cluster({"accelerator": "h200", "nodes": 2, "gpus_per_node": 8, "world_size": 16, "memory_gb": 100.0})
    assert c.to_dict() == {"accelerator": "h200", "nodes": 2, "gpus_per_node": 8, "world_size": 16, "memory_gb": 100.0}
    assert parse_cluster(c.to_dict()) == c and parse_cluster("1048576xh100").world_size == 2**20


# ---- accelerators ------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,reason", [
    ("hbm_gb", "80", "hbm_gb: Input should be a valid number"),
    ("hbm_gb", -1, "hbm_gb: Input should be greater than 0"),
    ("hbm_gb", 0, "hbm_gb: Input should be greater than 0"),
    ("hbm_gb", math.nan, "hbm_gb: Input should be a finite number"),
    ("hbm_gb", math.inf, "hbm_gb: Input should be a finite number"),
    ("hbm_gb", 1e12, "hbm_gb: Input should be less than or equal to 1000000"),
    ("hbm_tbps", True, "hbm_tbps: Input should be a valid number"),
    ("peak_tflops", {**H100["peak_tflops"], "bf16": 0}, "peak_tflops.bf16 must be > 0"),
    ("peak_tflops", {**H100["peak_tflops"], "fp8": -1}, "peak_tflops.fp8: Input should be greater than or equal to 0"),
    ("peak_tflops", {"bf16": 989}, "peak_tflops lacks ['fp32', 'tf32', 'fp8']"),
    ("gemm_efficiency", 1.5, "gemm_efficiency: Input should be less than or equal to 1"),
    ("busbw_efficiency", 0, "busbw_efficiency: Input should be greater than 0"),
    ("attention_efficiency", {"flash9": 0.5}, "attention_efficiency.flash9.[key]: Input should be 'flash2' or 'flash3'"),
    ("scale_up", {**H100["scale_up"], "gbps": "fast"}, "scale_up.gbps: Input should be a valid number"),
    ("scale_out", {**H100["scale_out"], "latency_us": -1}, "scale_out.latency_us: Input should be greater than or equal to 0"),
    ("gpus_per_node", 8.5, "gpus_per_node: Input should be a valid integer"),
    ("host_link_gbps", 0, "host_link_gbps: Input should be greater than 0"),
    ("cost_constants", {"dp_overlap": math.inf}, "cost_constants.dp_overlap: Input should be a finite number"),
    ("kind", "tpu", "kind: Input should be 'gpu' or 'cpu'"),
    ("watts", 700, "watts: Extra inputs are not permitted"),
])
def test_bad_accelerator_fields_are_refused(field: str, value: Any, reason: str) -> None:
    msg = _error(Accelerator.from_dict, {**H100, field: value}, "accelerator file 'x.yaml'")
    assert msg.startswith("accelerator file 'x.yaml': ") and reason in msg, msg
    assert "name: Field required" in _error(Accelerator.from_dict, {k: v for k, v in H100.items() if k != "name"})


def test_every_shipped_accelerator_loads_as_written() -> None:
    accs = hardware.accelerators()
    for path in sorted(hardware.ACCELERATOR_DIR.glob("*.yaml")):
        d = yaml.safe_load(path.read_text())
        d.update(scale_up=NetworkTier(**d["scale_up"]), scale_out=NetworkTier(**d["scale_out"]),
                 aliases=tuple(d.get("aliases", ())), peak_tflops={k: float(v) for k, v in d["peak_tflops"].items()},
                 attention_efficiency={k: float(v) for k, v in (d.get("attention_efficiency") or {}).items()},
                 cost_constants={k: float(v) for k, v in (d.get("cost_constants") or {}).items()})
        assert accs[d["name"]] == Accelerator(**d)


def test_a_broken_file_on_the_accelerator_path_is_skipped_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "x1000.yaml").write_text(yaml.safe_dump({**H100, "name": "x1000", "aliases": ["xk"]}))
    (tmp_path / "y2000.yaml").write_text(yaml.safe_dump({**H100, "name": "y2000", "aliases": ["yk"], "hbm_gb": -1}))
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    (tmp_path / "folder.yaml").mkdir()
    monkeypatch.setenv("SHARDPLAN_ACCELERATOR_PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="profiler.hardware"):
        accs = hardware.accelerators()
    assert "x1000" in accs and "h100-sxm" in accs and "y2000" not in accs
    warned = sorted(r.getMessage() for r in caplog.records)
    assert len(warned) == 4 and all("\n" not in w and w.endswith("; skipped") for w in warned)
    for name, reason in (("bad", "is not valid YAML"), ("empty", "expected a mapping of fields, got NoneType"),
                         ("folder", "it is a directory"), ("y2000", "hbm_gb: Input should be greater than 0")):
        assert any(f"{tmp_path / name}.yaml" in w and reason in w for w in warned), (name, warned)
    assert parse_cluster("16xxk").nodes == 2
    assert "hbm_gb: Input should be greater than 0" in _error(hardware.accelerator, "yk")
    assert "it is a directory" in _error(parse_cluster, "8xfolder")


# ---- models ------------------------------------------------------------------------------------

@pytest.mark.parametrize("base,key,value,reason", [
    (LLAMA, "num_hidden_layers", "32", "num_hidden_layers: Input should be a valid integer (got '32')"),
    (LLAMA, "num_hidden_layers", True, "num_hidden_layers: Input should be a valid integer (got True)"),
    (LLAMA, "num_hidden_layers", 10**9, f"num_hidden_layers: Input should be less than or equal to {MAX_LAYERS}"),
    (LLAMA, "hidden_size", -64, "hidden_size: Input should be greater than 0"),
    (LLAMA, "hidden_size", 0, "hidden_size: Input should be greater than 0"),
    (LLAMA, "hidden_size", 2**30, "hidden_size: Input should be less than or equal to 1048576"),
    (LLAMA, "intermediate_size", [128], "intermediate_size: Input should be a valid integer"),
    (LLAMA, "vocab_size", 10**12, "vocab_size: Input should be less than or equal to 10000000"),
    (LLAMA, "head_dim", 128.5, "head_dim: Input should be a valid integer (got 128.5)"),
    (LLAMA, "max_position_embeddings", 10**9, "max_position_embeddings: Input should be less than or equal to 16777216"),
    (LLAMA, "mlp_bias", "yes", "mlp_bias: Input should be a valid boolean"),
    (LLAMA, "attention_dropout", math.nan, "attention_dropout: Input should be a finite number"),
    (LLAMA, "num_attention_heads", 6, "num_attention_heads 6 does not divide hidden_size 64; give head_dim"),
    (LLAMA, "num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (LLAMA, "num_local_experts", 8, "num_experts_per_tok must be in 1..8"),
    (LLAMA, "model_type", ["llama"], "model_type must be a string"),
    (GPT2, "n_layer", "12", "n_layer: Input should be a valid integer (got '12')"),
    (GPT2, "n_embd", 64.0, "n_embd: Input should be a valid integer (got 64.0)"),
    (GPT2, "n_head", 5, "n_head 5 does not divide n_embd 64"),
    (GPT2, "n_positions", -1, "n_positions: Input should be greater than 0"),
])
def test_bad_hf_configs_name_the_key(tmp_path: Path, base: dict[str, Any], key: str, value: Any, reason: str) -> None:
    msg = _error(config_from_hf, {**base, key: value}, "tiny")
    assert msg.startswith("config 'tiny': ") and reason in msg, msg
    if not (isinstance(value, float) and math.isnan(value)):
        f = tmp_path / "tiny.json"
        f.write_text(json.dumps({**base, key: value}))
        assert reason in _error(resolve_config, str(f))


@pytest.mark.parametrize("field,value,reason", [
    ("layers", "2", "layers: Input should be a valid integer (got '2')"),
    ("layers", MAX_LAYERS + 1, f"layers: Input should be less than or equal to {MAX_LAYERS}"),
    ("ffn_hidden", -1, "ffn_hidden: Input should be greater than or equal to 0"),
    ("dropout", math.nan, "dropout: Input should be a finite number"),
    ("bias", 1, "bias: Input should be a valid boolean"),
    ("experts", 10**6, "experts: Input should be less than or equal to 100000"),
    ("heads", 7, "hidden 64 is not divisible by heads 7; give head_dim"),
    ("hiddn", 64, "unknown field(s) ['hiddn']"),
])
def test_bad_preset_fields_are_refused(field: str, value: Any, reason: str) -> None:
    msg = _error(TransformerConfig.from_dict, {"name": "m", "layers": 2, "hidden": 64, "heads": 4, "vocab": 10,
                                               field: value})
    assert msg.startswith("model 'm': ") and reason in msg, msg
    assert "expected a mapping of fields, got list" in _error(TransformerConfig.from_dict, [1])


def test_sizes_and_seq_len_are_bounded_at_the_boundary() -> None:
    for seq, reason in ((0, "in 1..10,000,000 tokens, got 0"), (-5, "in 1..10,000,000 tokens, got -5"),
                        (10**8, "in 1..10,000,000 tokens, got 100,000,000"), (2.5, "an integer, got 2.5"),
                        (True, "an integer, got True")):
        assert _error(load_model, "gpt2", seq) == f"seq_len must be {reason}"
    assert "seq_len must be in" in _error(build_graph, presets()["gpt2"], -1)
    huge = TransformerConfig(name="huge", layers=1000, hidden=2**20, heads=8, vocab=10**7)
    assert _error(build_graph, huge, 8) == ("model 'huge' has 13,215,117,397,196,800 parameters; the supported "
                                           "range is up to 1,000,000,000,000,000")
    long = TransformerConfig(name="long", layers=1, hidden=64, heads=4, vocab=10, max_seq=2**24, position="rope")
    assert "its max_seq 16,777,216 is longer than the supported 10,000,000" in _error(build_graph, long)
    assert build_graph(long, 10).seq_len == 10


def test_presets_and_config_files_load_as_written() -> None:
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        d = yaml.safe_load(path.read_text())
        assert presets()[d["name"]] == TransformerConfig(**d)
    data = Path(__file__).parent / "data"
    assert load_model("mixtral-8x7b", 4096).content_hash() == "39bff551ea3bcae2"
    assert load_model("llama3-8b", 2048).content_hash() == "58b12ea628dc4250"
    assert load_model(str(data / "gpt2-config.json"), 1024).content_hash() == "f7dcc719be3e18d1"


# ---- traced models -----------------------------------------------------------------------------

def test_traced_configs_are_bounded() -> None:
    from profiler.trace_factories import check_traced_sizes

    check_traced_sizes({"model_type": "t5", "num_layers": 24, "d_model": 1024, "vocab_size": 32128}, "t5")
    for config, reason in (({"num_layers": 10**6}, "num_layers 1,000,000 is over the supported 128 blocks"),
                           ({"text_config": {"vocab_size": 10**9}}, "vocab_size 1,000,000,000 is over"),
                           ({"d_model": 2**40}, "d_model 1,099,511,627,776 is over the supported 4,194,304 wide")):
        assert reason in _error(check_traced_sizes, {"model_type": "t5", **config}, "cfg")


def test_user_factory_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "userfactories.py").write_text(
        "import torch\n"
        "def boom():\n    raise RuntimeError('boom\\nsecond line')\n"
        "class Bad(torch.nn.Linear):\n"
        "    def example_inputs(self, batch, seq_len):\n        return torch.zeros(batch, 4)\n"
        "    def forward(self, x):\n        raise ValueError('bad forward')\n"
        "def bad():\n    return Bad(4, 4)\n")
    (tmp_path / "brokenmodule.py").write_text("raise KeyError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "userfactories", raising=False)
    assert _error(load_model, "userfactories:boom") == \
        "model factory 'userfactories:boom' failed on the meta device: RuntimeError: boom second line"
    assert _error(load_model, "userfactories:bad") == \
        "model factory 'userfactories:bad': tracing failed: ValueError: bad forward"
    assert _error(load_model, "brokenmodule:f") == \
        "model factory 'brokenmodule:f': cannot import 'brokenmodule': KeyError: 'at import'"
