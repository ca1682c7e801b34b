"""Turn whatever names a model into a layer graph.

Three ways in, chosen by the shape of the name:

* a preset (``llama3-8b``): a YAML file in ``profiler/data/models``;
* a Hugging Face ``config.json`` path: read offline; the GPT-2, Llama/Mistral/Qwen2/Qwen3 and
  Mixtral key sets are understood without ``transformers``;
* ``package.module:factory``: a callable returning an ``nn.Module``, built on the meta device and
  traced (see :mod:`profiler.trace`).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from profiler.graph import LayerGraph
from profiler.model_config import TransformerConfig
from profiler.transformer import build_graph
from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import decode_json, read_text

PRESET_DIR = Path(__file__).parent / "data" / "models"


@cache
def presets() -> dict[str, TransformerConfig]:
    """All preset models by name (one YAML file each; adding a model is adding a file)."""
    out: dict[str, TransformerConfig] = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        with path.open() as f:
            data = yaml.safe_load(f)
        cfg = TransformerConfig.from_dict(data)
        out[cfg.name] = cfg
    return out


def preset(name: str) -> TransformerConfig:
    table = presets()
    key = name.strip().lower()
    if key not in table:
        raise UnknownNameError("model", name, table)
    return table[key]


# ---- Hugging Face config.json --------------------------------------------------------------

class KnownKeysError(ShardplanError):
    """A config.json whose key set shardplan does not read by itself (transformers may)."""

    def __init__(self, name: str, config: dict[str, Any]):
        mtype = config.get("model_type") or "?"
        super().__init__(
            f"config '{name}': model_type '{mtype}' is not a known key set (gpt2, llama, mistral, "
            "mixtral, qwen2, qwen3, qwen3_moe); with transformers installed any architecture it knows is traced"
        )
        self.name, self.config = name, config


def _get(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def config_from_hf(d: dict[str, Any], name: str = "hf-model") -> TransformerConfig:
    """A :class:`TransformerConfig` from the keys of a Hugging Face ``config.json``."""
    mtype = str(d.get("model_type", "")).lower()
    try:
        if mtype == "gpt2" or "n_embd" in d:
            h = int(d["n_embd"])
            return TransformerConfig(
                name=name, layers=int(d["n_layer"]), hidden=h, heads=int(d["n_head"]),
                vocab=int(d["vocab_size"]), ffn_hidden=int(_get(d, "n_inner", default=4 * h)),
                max_seq=int(_get(d, "n_positions", "n_ctx", default=1024)), activation="gelu",
                norm="layernorm", position="learned", bias=True,
                tied_embeddings=bool(d.get("tie_word_embeddings", True)),
                dropout=float(_get(d, "resid_pdrop", default=0.0)), attention_impl="eager",
            )
        if mtype in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or "num_key_value_heads" in d:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            experts = int(_get(d, "num_local_experts", "num_experts", "n_routed_experts", default=0))
            return TransformerConfig(
                name=name, layers=int(d["num_hidden_layers"]), hidden=hidden, heads=heads,
                kv_heads=int(_get(d, "num_key_value_heads", default=heads)),
                head_dim=int(_get(d, "head_dim", default=hidden // heads)),
                ffn_hidden=int(d["intermediate_size"]), vocab=int(d["vocab_size"]),
                max_seq=int(_get(d, "max_position_embeddings", default=4096)), activation="swiglu",
                norm="rmsnorm", position="rope", bias=bool(d.get("mlp_bias", False)),
                qkv_bias=mtype.startswith("qwen2") or bool(d.get("attention_bias", False)),
                qk_norm=mtype.startswith("qwen3"),
                tied_embeddings=bool(d.get("tie_word_embeddings", False)), experts=experts,
                top_k=int(_get(d, "num_experts_per_tok", default=0)) if experts else 0,
                moe_ffn_hidden=int(_get(d, "moe_intermediate_size", default=0)) if experts else 0,
                shared_experts=1 if experts and d.get("shared_expert_intermediate_size") else 0,
                dropout=float(_get(d, "attention_dropout", default=0.0)),
            )
    except KeyError as e:
        raise ShardplanError(f"config '{name}': missing key {e.args[0]!r} for model_type '{mtype}'") from None
    raise KnownKeysError(name, d)


def load_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    data = decode_json(read_text(p, "model config"), f"model config '{p}'")
    if not isinstance(data, dict):
        raise ShardplanError(f"model config '{p}' must hold a JSON object")
    return data


# ---- one entry point -------------------------------------------------------------------------

def resolve_config(spec: str | dict[str, Any] | TransformerConfig) -> TransformerConfig:
    """Preset name, config.json path, or a dict of HF keys / TransformerConfig fields."""
    if isinstance(spec, TransformerConfig):
        return spec
    if isinstance(spec, dict):
        if "layers" in spec and "hidden" in spec:
            return TransformerConfig.from_dict({"name": "inline", **spec})
        return config_from_hf(spec, name=str(spec.get("name", spec.get("_name_or_path", "inline"))))
    if spec.endswith(".json") or Path(spec).is_file():
        return config_from_hf(load_hf_config(spec), name=Path(spec).stem if Path(spec).stem != "config" else Path(spec).parent.name or "config")
    return preset(spec)


def load_model(spec: str | dict[str, Any] | TransformerConfig, seq_len: int | None = None) -> LayerGraph:
    """The layer graph of a preset, a config file or dict, or a ``pkg.mod:factory`` module.

    A config whose key set is not one of the common ones is built with ``transformers`` (when
    installed) on the meta device and traced.
    """
    if isinstance(spec, str) and ":" in spec and not Path(spec).exists():
        from profiler.trace_factories import trace_factory  # imports torch only when needed

        return trace_factory(spec, seq_len=seq_len or 128)
    try:
        return build_graph(resolve_config(spec), seq_len)
    except KnownKeysError as e:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise e from None
        from profiler.trace_factories import trace_hf_config

        return trace_hf_config(e.config, seq_len or 512, model_id=e.name)
