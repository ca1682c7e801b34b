"""Every key an export emits is one its trainer's loader accepts at the pinned version.

The key snapshots in ``vocab/targets/keys/`` are generated from the installed releases by
``benchmarks/trainer_key_snapshots.py``; these tests always run. Where a trainer is importable, its own
loader reads the exported file too (skipped otherwise).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import tomllib
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from planner.api import plan as search
from planner.exports import export
from tests.test_explain import make_plan
from tests.test_exports import flags as megatron_flags
from vocab.plan import Plan
from vocab.targets import by_exporter

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "vocab" / "targets" / "keys"
SNAPSHOT_NAME = {"torchtitan": "torchtitan", "megatron": "megatron_core", "deepspeed": "deepspeed",
                 "nanotron": "nanotron"}
TARGETS = tuple(SNAPSHOT_NAME)


def snapshot(target: str) -> dict[str, Any]:
    t = by_exporter(target)
    return json.loads((SNAPSHOTS / f"{SNAPSHOT_NAME[target]}-{t.version}.json").read_text())


@functools.cache
def plans(target: str) -> tuple[Plan, ...]:
    """Plans searched for ``target`` (small presets; a tight memory limit for pipelines and recompute),
    and hand-made ones for what a search does not pick."""
    out = [search("llama3-8b", "16xh100", 2048, 64, target=target),
           search("llama3-8b", "16xh100", 4096, 64, memory_limit_gib=18, target=target),
           search("gpt2", "16xh100", 1024, 64, target=target)]
    if "ep" in by_exporter(target).axes:
        out.append(search("mixtral-8x7b", "16xh100", 2048, 64, target=target))
    full = {"default": {"sharding": "zero1", "recompute": "full"}}
    out += [make_plan({"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "micro_batch": 1, **full}),
            make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "default": {"sharding": "zero1"},
                       "layers": [{"unit": f"layers.{i}", "sharding": "zero1", "recompute": "full"}
                                  for i in range(1, 32, 2)]})]
    return tuple(out)


def texts(target: str) -> list[str]:
    return [export(p, target).text for p in plans(target)]


def _unknown(doc: Any, tree: Any, path: str = "") -> list[str]:
    """Keys of ``doc`` missing from a snapshot tree ({key: subtree}, None for a leaf)."""
    if not isinstance(doc, dict) or tree is None:
        return []
    bad = []
    for k, v in doc.items():
        if k not in tree:
            bad.append(f"{path}{k}")
        else:
            bad += _unknown(v, tree[k], f"{path}{k}.")
    return bad


def test_snapshots_name_the_pinned_versions() -> None:
    for target in TARGETS:
        t = by_exporter(target)
        path = SNAPSHOTS / f"{SNAPSHOT_NAME[target]}-{t.version}.json"
        assert path.is_file(), f"{t.package} {t.version} is pinned but {path.name} is missing: run " \
                               "benchmarks/trainer_key_snapshots.py with that release installed"
        assert json.loads(path.read_text())["version"] == t.version


def test_torchtitan_keys_are_in_the_snapshot() -> None:
    sections = snapshot("torchtitan")["sections"]
    for text in texts("torchtitan"):
        doc = tomllib.loads(text)
        assert _unknown(doc, {k: dict.fromkeys(v) for k, v in sections.items()}) == []
        assert "enable_sequence_parallel" not in doc["parallelism"]
        ac = doc["activation_checkpoint"]
        assert ac["mode"] in ("none", "selective", "full")
        opt = ac.get("selective_ac_option", "op")
        assert opt == "op" or (opt.isdigit() and int(opt) >= 1)


def test_megatron_flags_are_in_the_snapshot() -> None:
    snap = snapshot("megatron")
    fields = {f for names in snap["classes"].values() for f in names}
    for text in texts("megatron"):
        f = megatron_flags(text)
        bad = [x for x in f if x not in snap["lm_flags"] and x[2:].replace("-", "_") not in fields]
        assert bad == []
        for need in ("--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--normalization",
                     "--position-embedding-type", "--overlap-grad-reduce"):
            assert need in f


def test_megatron_model_shape_flags() -> None:
    f = megatron_flags(export(plans("megatron")[0], "megatron").text)
    assert (f["--hidden-size"], f["--ffn-hidden-size"], f["--num-attention-heads"]) == ("4096", "14336", "32")
    assert f["--group-query-attention"] is True and f["--num-query-groups"] == "8" and f["--swiglu"] is True
    assert (f["--normalization"], f["--position-embedding-type"]) == ("RMSNorm", "rope")
    assert f["--untie-embeddings-and-output-weights"] is True and f["--disable-bias-linear"] is True
    moe = megatron_flags(export(search("mixtral-8x7b", "16xh100", 2048, 64, target="megatron"), "megatron").text)
    assert (moe["--num-experts"], moe["--moe-router-topk"], moe["--moe-ffn-hidden-size"]) == ("8", "2", "14336")
    gpt2 = megatron_flags(export(search("gpt2", "16xh100", 1024, 64, target="megatron"), "megatron").text)
    assert "--swiglu" not in gpt2 and "--untie-embeddings-and-output-weights" not in gpt2
    assert gpt2["--normalization"] == "LayerNorm" and gpt2["--position-embedding-type"] == "learned_absolute"


def test_deepspeed_keys_are_in_the_snapshot() -> None:
    snap = snapshot("deepspeed")
    sec = snap["sections"]
    seen = set()
    for text in texts("deepspeed"):
        cfg = json.loads(text)
        assert [k for k in cfg if k not in snap["top_level"]] == []
        z = cfg["zero_optimization"]
        assert [k for k in z if k not in sec["zero_optimization"]] == []
        for sub in ("offload_optimizer", "offload_param"):
            assert [k for k in z.get(sub, {}) if k not in sec[f"zero_optimization.{sub}"]] == []
        for name in ("bf16", "tensor_parallel", "activation_checkpointing", "pipeline"):
            assert [k for k in cfg.get(name, {}) if k not in sec[name]] == []
        seen |= set(cfg)
    assert {"pipeline", "activation_checkpointing"} <= seen


def test_nanotron_keys_are_in_the_snapshot() -> None:
    tree = snapshot("nanotron")["tree"]
    for text in texts("nanotron"):
        doc = yaml.safe_load(text)
        assert _unknown(doc, tree) == [] and "recompute_layer" not in doc["parallelism"]
        assert doc["parallelism"]["pp_engine"] in ("afab", "1f1b")
        assert doc["parallelism"]["tp_mode"] in ("ALL_REDUCE", "REDUCE_SCATTER")


# ---- the trainers' own loaders, where installed ------------------------------------------------------

def test_torchtitan_loader_accepts_the_exports(tmp_path: Path) -> None:
    manager = pytest.importorskip("torchtitan.config.manager")
    for i, text in enumerate(texts("torchtitan")):
        path = tmp_path / f"{i}.toml"
        path.write_text(text)
        manager.ConfigManager().parse_args(["--job.config_file", str(path)])


def test_megatron_configs_accept_the_flags() -> None:
    pytest.importorskip("megatron.core")
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    snap = snapshot("megatron")
    tc_fields = set(snap["classes"]["TransformerConfig"])
    ddp_fields = set(snap["classes"]["DistributedDataParallelConfig"])
    for p in plans("megatron"):
        f = megatron_flags(export(p, "megatron").text)

        def val(v: str | bool) -> Any:
            if v is True:
                return True
            for cast in (int, float):
                try:
                    return cast(v)
                except ValueError:
                    pass
            return v

        kw = {k[2:].replace("-", "_"): val(v) for k, v in f.items() if k not in snap["lm_flags"]}
        tc = {k: v for k, v in kw.items() if k in tc_fields}
        if "--swiglu" in f:
            tc.update(gated_linear_unit=True, activation_func=F.silu)
        if "--num-experts" in f:
            tc["num_moe_experts"] = int(f["--num-experts"])  # type: ignore[arg-type]
        if "--disable-bias-linear" in f:
            tc["add_bias_linear"] = False
        pp = tc.get("pipeline_model_parallel_size", 1)
        if "--num-layers-per-virtual-pipeline-stage" in f:
            tc["virtual_pipeline_model_parallel_size"] = tc["num_layers"] // pp // int(
                f["--num-layers-per-virtual-pipeline-stage"])  # type: ignore[arg-type]
        if "--decoder-first-pipeline-num-layers" in f:
            tc["num_layers_in_first_pipeline_stage"] = int(f["--decoder-first-pipeline-num-layers"])  # type: ignore[arg-type]
        if "--decoder-last-pipeline-num-layers" in f:
            tc["num_layers_in_last_pipeline_stage"] = int(f["--decoder-last-pipeline-num-layers"])  # type: ignore[arg-type]
        if pp > 1:
            tc["pipeline_dtype"] = torch.bfloat16
        tc.pop("fp8", None)
        TransformerConfig(**tc)
        DistributedDataParallelConfig(**{k: v for k, v in kw.items() if k in ddp_fields})


def test_deepspeed_config_accepts_the_exports() -> None:
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc

    for p in plans("deepspeed"):
        e = export(p, "deepspeed")
        m = e.strategy.mesh
        world = m.dp_replicate * m.dp_shard
        with mock.patch.object(dsc.dist, "get_rank", return_value=0), \
                mock.patch.object(dsc.dist, "get_world_size", return_value=world * m.cp):
            dsc.DeepSpeedConfig(json.loads(e.text))


NANOTRON_BASE = """
general: {project: shardplan, run: check, seed: 42}
model:
  init_method: {std: 0.025}
  dtype: bfloat16
  model_config: {is_llama_config: true, hidden_size: 256, intermediate_size: 688, num_attention_heads: 8,
                 num_hidden_layers: 4, num_key_value_heads: 2, vocab_size: 32000}
tokenizer: {tokenizer_name_or_path: gpt2}
tokens: {train_steps: 10}
optimizer:
  weight_decay: 0.01
  clip_grad: 1.0
  accumulate_grad_in_fp32: true
  adam_eps: 1.0e-08
  adam_beta1: 0.9
  adam_beta2: 0.95
  torch_adam_is_fused: true
  learning_rate_scheduler: {learning_rate: 0.0003, lr_warmup_steps: 2, lr_warmup_style: linear,
                            lr_decay_style: cosine, min_decay_lr: 1.0e-05}
"""


def test_nanotron_loader_accepts_the_exports(tmp_path: Path) -> None:
    pytest.importorskip("nanotron")
    spec = importlib.util.spec_from_file_location("snapshots", ROOT / "benchmarks" / "trainer_key_snapshots.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod._nanotron_config()
    for i, text in enumerate(texts("nanotron")):
        doc = yaml.safe_load(NANOTRON_BASE)
        for k, v in yaml.safe_load(text).items():
            doc[k] = {**doc.get(k, {}), **v}
        path = tmp_path / f"{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg.get_config_from_file(str(path))
