"""Turn whatever names a model into a layer graph.

Four ways in, chosen by the shape of the name:

* a preset (``llama3-8b``): a YAML file in ``profiler/data/models``;
* a Hugging Face id (``meta-llama/Meta-Llama-3-70B``): the preset that lists it in its ``hf_ids``
  (ignoring case), else the ``config.json`` of the local Hugging Face cache (read offline; never
  downloaded);
* a Hugging Face ``config.json`` path (or a folder holding one): read offline; the GPT-2,
  Llama/Mistral/Qwen2/Qwen3, Mixtral, DeepSeek-V2/V3, Gemma-2/3 and gpt-oss key sets are understood
  without ``transformers``;
* ``package.module:factory``: a callable returning an ``nn.Module``, built on the meta device and
  traced (see :mod:`profiler.trace`).
"""

from __future__ import annotations

import difflib
import os
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from profiler.graph import LayerGraph
from profiler.hf_cache import cached_hf_config, hf_hub_cache, is_hf_id, repo_folder
from profiler.model_config import (
    MAX_FFN,
    MAX_LAYERS,
    Experts,
    FfnWidth,
    Layers,
    Positions,
    Probability,
    TransformerConfig,
    Vocab,
    Width,
    check_seq_len,
    describe_fields,
)
from profiler.transformer import build_graph
from vocab.errors import ShardplanError, UnknownNameError, shown
from vocab.io import decode_json, decode_yaml, read_text

PRESET_DIR = Path(__file__).parent / "data" / "models"


@cache
def presets() -> dict[str, TransformerConfig]:
    """All preset models by name (one YAML file each; adding a model is adding a file)."""
    out: dict[str, TransformerConfig] = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        origin = f"model preset '{path}'"
        data = decode_yaml(read_text(path, "model preset"), origin)
        if not isinstance(data, dict):
            raise ShardplanError(f"{origin} must hold a mapping of fields")
        cfg = TransformerConfig.from_dict(data)
        out[cfg.name] = cfg
    return out


@cache
def hf_ids() -> dict[str, str]:
    """The Hugging Face ids the presets list (``hf_ids``), lowercased, each to its preset's name;
    an id two presets claim is refused."""
    out: dict[str, str] = {}
    for name, cfg in presets().items():
        for hf_id in cfg.hf_ids:
            key = hf_id.lower()
            if out.get(key, name) != name:
                raise ShardplanError(f"model presets '{out[key]}' and '{name}' both list the Hugging Face id '{hf_id}'")
            out[key] = name
    return out


def preset(name: str) -> TransformerConfig:
    """The preset called ``name``, or listing the Hugging Face id ``name`` (case ignored)."""
    table = presets()
    key = name.strip().lower()
    if key in table:
        return table[key]
    if key in hf_ids():
        return table[hf_ids()[key]]
    raise UnknownNameError("model", name, table)


# ---- Hugging Face config.json --------------------------------------------------------------

class KnownKeysError(ShardplanError):
    """A config.json whose key set shardplan does not read by itself (transformers may)."""

    def __init__(self, name: str, config: dict[str, Any]):
        mtype = config.get("model_type") or "?"
        super().__init__(
            f"config '{name}': model_type {shown(mtype)} is not a known key set "
            f"(gpt2, {', '.join(_LLAMA_TYPES + _DEEPSEEK_TYPES + tuple(_WINDOWED_TYPES))}); "
            "with transformers installed any architecture it knows is traced"
        )
        self.name, self.config = name, config


_ExpertWidth = Annotated[int, Field(ge=0, le=MAX_FFN)]


class _HFKeys(BaseModel):
    """The keys of a ``config.json`` that shardplan reads, with their types and supported ranges
    (strict: ``"12"``, ``12.5`` or ``true`` is no layer count); other keys are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    tie_word_embeddings: StrictBool | None = None


class _GPT2Keys(_HFKeys):
    n_embd: Width
    n_layer: Layers
    n_head: Width
    vocab_size: Vocab
    n_inner: FfnWidth | None = None
    n_positions: Positions | None = None
    n_ctx: Positions | None = None
    resid_pdrop: Probability | None = None
    layer_norm_epsilon: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None


class _DecoderKeys(_HFKeys):
    """The keys every decoder family below shares."""

    num_hidden_layers: Layers
    hidden_size: Width
    num_attention_heads: Width
    intermediate_size: FfnWidth
    vocab_size: Vocab
    num_key_value_heads: Width | None = None
    head_dim: Width | None = None
    max_position_embeddings: Positions | None = None
    num_experts_per_tok: Experts | None = None
    rope_theta: Annotated[float, Field(gt=0.0, le=1e12)] | None = None
    rms_norm_eps: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None


class _LlamaKeys(_DecoderKeys):
    mlp_bias: StrictBool | None = None
    attention_bias: StrictBool | None = None
    num_local_experts: Experts | None = None
    num_experts: Experts | None = None
    n_routed_experts: Experts | None = None
    moe_intermediate_size: _ExpertWidth | None = None
    shared_expert_intermediate_size: _ExpertWidth | None = None
    attention_dropout: Probability | None = None
    sliding_window: Positions | None = None
    use_sliding_window: StrictBool | None = None


class _DeepSeekKeys(_DecoderKeys):
    """DeepSeek-V2/V3: multi-head latent attention, shared experts, leading dense layers, MTP."""

    moe_intermediate_size: _ExpertWidth
    n_routed_experts: Experts
    num_experts_per_tok: Experts
    kv_lora_rank: Width
    qk_nope_head_dim: Width
    qk_rope_head_dim: Width
    v_head_dim: Width
    q_lora_rank: Width | None = None
    n_shared_experts: Experts | None = None
    first_k_dense_replace: Annotated[int, Field(ge=0, le=MAX_LAYERS)] | None = None
    num_nextn_predict_layers: Annotated[int, Field(ge=0, le=MAX_LAYERS)] | None = None
    n_group: Experts | None = None
    topk_group: Experts | None = None
    topk_method: str | None = None


class _WindowedKeys(_DecoderKeys):
    """Gemma-2, Gemma-3 (text) and gpt-oss: local layers with a sliding window between global ones."""

    sliding_window: Positions | None = None
    sliding_window_pattern: Layers | None = None
    layer_types: list[str] | None = None
    num_local_experts: Experts | None = None
    attention_bias: StrictBool | None = None


_LLAMA_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")
#: model_type: (every k-th layer global unless the config lists layer_types, tied embeddings by default)
_WINDOWED_TYPES = {"gemma2": (2, True), "gemma3_text": (6, True), "gpt_oss": (2, False)}


def _get(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _check_keys(d: dict[str, Any], keys: type[_HFKeys], name: str, mtype: str) -> None:
    """``d``'s keys that ``keys`` lists: present where required, of the right type and range."""
    for k, f in keys.model_fields.items():
        if f.is_required() and k not in d:
            raise ShardplanError(f"config '{name}': missing key {k!r} for model_type '{mtype}'")
    try:
        keys.model_validate(d)
    except ValidationError as e:
        raise ShardplanError(f"config '{name}': {describe_fields(e)}") from None


def _divides(d: dict[str, Any], name: str, part: str, whole: str, advice: str = "") -> None:
    if d[whole] % d[part]:
        raise ShardplanError(f"config '{name}': {part} {d[part]} does not divide {whole} {d[whole]}{advice}")


def config_from_hf(d: dict[str, Any], name: str = "hf-model") -> TransformerConfig:
    """A :class:`TransformerConfig` from the keys of a Hugging Face ``config.json`` (each key read
    checked for its type and the supported range)."""
    if not isinstance(d, dict):
        raise ShardplanError(f"config '{name}' must be a mapping of keys, got {type(d).__name__}")
    raw_type = d.get("model_type", "")
    if raw_type is not None and not isinstance(raw_type, str):
        raise ShardplanError(f"config '{name}': model_type must be a string, got {raw_type!r}"[:200])
    mtype = str(raw_type).lower()
    # a key set alone decides only where model_type is missing: a type read by the wrong key set
    # (Gemma-2 read as Llama) would price another model
    if mtype == "gpt2" or (not mtype and "n_embd" in d):
        _check_keys(d, _GPT2Keys, name, mtype)
        _divides(d, name, "n_head", "n_embd")
        h = int(d["n_embd"])
        return TransformerConfig(
            name=name, layers=int(d["n_layer"]), hidden=h, heads=int(d["n_head"]),
            vocab=int(d["vocab_size"]), ffn_hidden=int(_get(d, "n_inner", default=4 * h)),
            max_seq=int(_get(d, "n_positions", "n_ctx", default=1024)), activation="gelu",
            norm="layernorm", position="learned", bias=True,
            tied_embeddings=bool(d.get("tie_word_embeddings", True)),
            dropout=float(_get(d, "resid_pdrop", default=0.0)), attention_impl="eager",
            norm_eps=float(_get(d, "layer_norm_epsilon", default=0.0)),
        )
    if mtype in _LLAMA_TYPES or (not mtype and "num_key_value_heads" in d):
        _check_keys(d, _LlamaKeys, name, mtype)
        _check_heads(d, name)
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        experts = int(_get(d, "num_local_experts", "num_experts", "n_routed_experts", default=0))
        top_k = _top_k(d, name, experts)
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
            top_k=top_k,
            moe_ffn_hidden=int(_get(d, "moe_intermediate_size", default=0)) if experts else 0,
            shared_experts=1 if experts and d.get("shared_expert_intermediate_size") else 0,
            dropout=float(_get(d, "attention_dropout", default=0.0)),
            sliding_window=_llama_window(d, mtype), **_stated_constants(d),
        )
    if mtype in _DEEPSEEK_TYPES:
        return _deepseek(d, name, mtype)
    if mtype in _WINDOWED_TYPES:
        return _windowed(d, name, mtype)
    raise KnownKeysError(name, d)


def _stated_constants(d: dict[str, Any]) -> dict[str, float]:
    """The rotary base and the norms' epsilon a decoder's config states (0: not stated)."""
    return {"rope_theta": float(_get(d, "rope_theta", default=0.0)),
            "norm_eps": float(_get(d, "rms_norm_eps", default=0.0))}


def _check_heads(d: dict[str, Any], name: str) -> None:
    """Heads that divide the width (unless ``head_dim`` is given) and K/V heads that divide them."""
    if _get(d, "head_dim") is None:
        _divides(d, name, "num_attention_heads", "hidden_size", "; give head_dim")
    if _get(d, "num_key_value_heads") is not None:
        _divides(d, name, "num_key_value_heads", "num_attention_heads")


def _top_k(d: dict[str, Any], name: str, experts: int) -> int:
    """``num_experts_per_tok`` of an MoE config (in 1..experts), 0 for a dense one."""
    top_k = int(_get(d, "num_experts_per_tok", default=0)) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ShardplanError(f"config '{name}': num_experts_per_tok must be in 1..{experts} (the experts), got {top_k}")
    return top_k


def _llama_window(d: dict[str, Any], mtype: str) -> int:
    """Mistral 7B v0.1's sliding window (later Mistrals set it to null); Qwen2's only where
    ``use_sliding_window`` turns it on (its configs carry a window they do not use)."""
    if mtype == "mistral" or d.get("use_sliding_window"):
        return int(_get(d, "sliding_window", default=0))
    return 0


def _deepseek(d: dict[str, Any], name: str, mtype: str) -> TransformerConfig:
    _check_keys(d, _DeepSeekKeys, name, mtype)
    heads, experts = int(d["num_attention_heads"]), int(d["n_routed_experts"])
    top_k = _top_k(d, name, experts)
    return TransformerConfig(
        name=name, layers=int(d["num_hidden_layers"]), hidden=int(d["hidden_size"]), heads=heads, kv_heads=heads,
        head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]), kv_lora_rank=int(d["kv_lora_rank"]),
        q_lora_rank=int(_get(d, "q_lora_rank", default=0)), ffn_hidden=int(d["intermediate_size"]),
        vocab=int(d["vocab_size"]), max_seq=int(_get(d, "max_position_embeddings", default=4096)),
        activation="swiglu", norm="rmsnorm", position="rope",
        tied_embeddings=bool(d.get("tie_word_embeddings", False)), experts=experts, top_k=top_k,
        moe_ffn_hidden=int(d["moe_intermediate_size"]), shared_experts=int(_get(d, "n_shared_experts", default=0)),
        **_group_routing(d),
        dense_layers=int(_get(d, "first_k_dense_replace", default=0)),
        mtp_layers=int(_get(d, "num_nextn_predict_layers", default=0)), **_stated_constants(d),
    )


def _group_routing(d: dict[str, Any]) -> dict[str, int]:
    """DeepSeek's group-limited routing (``n_group``, ``topk_group``) where a config limits it: V3's
    ``noaux_tc`` and V2's ``group_limited_greedy`` route within groups, V2's ``greedy`` does not."""
    groups, chosen = int(_get(d, "n_group", default=0) or 0), int(_get(d, "topk_group", default=0) or 0)
    if groups <= 1 or not chosen or d.get("topk_method") == "greedy":
        return {}
    return {"expert_groups": groups, "group_top_k": chosen}


def global_every(layer_types: list[str], name: str) -> int:
    """The period ``k`` of a ``layer_types`` list whose every ``k``-th layer is global
    (``full_attention``) and the others local (``sliding_attention``); 0 when all are local."""
    kinds = {"full_attention": True, "sliding_attention": False}
    bad = sorted({t for t in layer_types if t not in kinds})
    if bad:
        raise ShardplanError(f"config '{name}': layer_types {bad} are not full_attention or sliding_attention")
    full = [kinds[t] for t in layer_types]
    if not any(full):
        return 0
    k = full.index(True) + 1
    if full != [i % k == k - 1 for i in range(len(full))]:
        raise ShardplanError(f"config '{name}': layer_types is not one global layer in every {k}; shardplan reads "
                             "a periodic pattern only")
    return k


def _windowed(d: dict[str, Any], name: str, mtype: str) -> TransformerConfig:
    _check_keys(d, _WindowedKeys, name, mtype)
    every, tied = _WINDOWED_TYPES[mtype]
    if d.get("layer_types") is not None:
        every = global_every(d["layer_types"], name)
    elif d.get("sliding_window_pattern") is not None:
        every = int(d["sliding_window_pattern"])
    heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
    _check_heads(d, name)
    experts = int(_get(d, "num_local_experts", default=0))
    top_k = _top_k(d, name, experts)
    window = int(_get(d, "sliding_window", default=0))
    return TransformerConfig(
        name=name, layers=int(d["num_hidden_layers"]), hidden=hidden, heads=heads,
        kv_heads=int(_get(d, "num_key_value_heads", default=heads)),
        head_dim=int(_get(d, "head_dim", default=hidden // heads)), ffn_hidden=int(d["intermediate_size"]),
        vocab=int(d["vocab_size"]), max_seq=int(_get(d, "max_position_embeddings", default=8192)),
        activation="swiglu",  # a gated MLP of three matrices (GeGLU for Gemma, clamped SwiGLU for gpt-oss)
        norm="rmsnorm", position="rope", qkv_bias=bool(d.get("attention_bias", False)),
        tied_embeddings=bool(d.get("tie_word_embeddings", tied)), experts=experts, top_k=top_k,
        sliding_window=window, global_every=every if window else 0,
        sandwich_norm=mtype.startswith("gemma"), qk_norm=mtype == "gemma3_text", **_stated_constants(d),
    )


def load_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    data = decode_json(read_text(p, "model config"), f"model config '{p}'")
    if not isinstance(data, dict):
        raise ShardplanError(f"model config '{p}' must hold a JSON object")
    return data


def _is_path(spec: str, kind: str = "exists") -> bool:
    """Whether ``spec`` names an existing path (``kind`` ``exists``) or file (``is_file``); a name
    no file system accepts (a NUL byte, too long) is none."""
    try:
        return os.path.isfile(spec) if kind == "is_file" else os.path.exists(spec)
    except (OSError, ValueError):
        return False


# ---- one entry point -------------------------------------------------------------------------

def resolve_config(spec: str | dict[str, Any] | TransformerConfig) -> TransformerConfig:
    """Preset name, config.json path, or a dict of HF keys / TransformerConfig fields."""
    if isinstance(spec, TransformerConfig):
        return spec
    if isinstance(spec, dict):
        if "layers" in spec and "hidden" in spec:
            return TransformerConfig.from_dict({"name": "inline", **spec})
        return config_from_hf(spec, name=str(spec.get("name", spec.get("_name_or_path", "inline"))))
    if not isinstance(spec, str):
        raise ShardplanError(f"model must be a preset name, a config.json path or a dict, got {type(spec).__name__}")
    if spec.endswith(".json") or _is_path(spec, "is_file"):
        p = Path(spec)
        return config_from_hf(load_hf_config(spec), name=p.stem if p.stem != "config" else p.parent.name or "config")
    return _named(spec)


def _named(spec: str) -> TransformerConfig:
    """A preset by its name or Hugging Face id, a folder holding a ``config.json``, or the config
    of a Hugging Face id in the local cache."""
    try:
        return preset(spec)
    except UnknownNameError as e:
        unknown = e
    folder = Path(spec) / "config.json"
    if _is_path(spec) and _is_path(str(folder), "is_file"):
        return config_from_hf(load_hf_config(folder), name=Path(spec).resolve().name or "config")
    repo_id = spec.strip()
    if not is_hf_id(repo_id):
        raise unknown
    found = cached_hf_config(repo_id)
    if found is not None:
        return config_from_hf(load_hf_config(found), name=repo_id)
    if "/" not in repo_id:  # a bare name: a mistyped preset more likely than an old Hugging Face id
        raise unknown
    raise _not_found(repo_id)


def _not_found(repo_id: str) -> ShardplanError:
    """The one-line error of a Hugging Face id that is neither a preset's nor in the cache."""
    cache_dir = hf_hub_cache()
    close = difflib.get_close_matches(repo_id.lower(), list(hf_ids()), n=1, cutoff=0.8)
    hint = f" (did you mean '{_listed_id(close[0])}'?)" if close else ""
    return ShardplanError(
        f"model '{repo_id}' is not a preset{hint} and not in the local Hugging Face cache {cache_dir}: put its "
        f"config.json at {cache_dir / repo_folder(repo_id)}/snapshots/<revision>/config.json (HF_HUB_CACHE "
        "moves the cache), or pass --model path/to/config.json; shardplan never downloads"
    )


def _listed_id(key: str) -> str:
    """The Hugging Face id a preset lists, as written there, of its lowercased ``key``."""
    cfg = presets()[hf_ids()[key]]
    return next(i for i in cfg.hf_ids if i.lower() == key)


def default_seq_len(spec: str | dict[str, Any] | TransformerConfig, preferred: int = 4096) -> int | None:
    """The tokens per sample to show a model at when none is given: ``preferred``, or the model's
    ``max_seq`` where that is shorter; None (the builder's own default) for a traced factory, and
    for a config traced through transformers that gives no maximum."""
    if isinstance(spec, str) and ":" in spec and not _is_path(spec):
        return None
    try:
        cfg = resolve_config(spec)
    except KnownKeysError as e:
        longest = _get(e.config, "max_position_embeddings", "n_positions", "n_ctx")
        if isinstance(longest, int) and not isinstance(longest, bool) and longest > 0:
            return min(preferred, longest)
        return None
    return min(preferred, cfg.max_seq)


def load_model(spec: str | dict[str, Any] | TransformerConfig, seq_len: int | None = None) -> LayerGraph:
    """The layer graph of a preset, a config file or dict, or a ``pkg.mod:factory`` module.

    A config whose key set is not one of the common ones is built with ``transformers`` (when
    installed) on the meta device and traced. ``seq_len`` (None: the model's own) must be in
    1..:data:`~profiler.model_config.MAX_SEQ_LEN`.
    """
    if seq_len is not None:
        seq_len = check_seq_len(seq_len)
    if isinstance(spec, str) and ":" in spec and not _is_path(spec):
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
