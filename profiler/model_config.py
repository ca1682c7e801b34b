"""Architecture of a transformer, enough to build its layer graph analytically.

Presets (``profiler/data/models/*.yaml``) and Hugging Face ``config.json`` files both become a
:class:`TransformerConfig`; :func:`profiler.transformer.build_graph` turns one into a layer graph.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from vocab.errors import ShardplanError, shown
from vocab.limits import MAX_SEQ_LEN

ARCHS = ("decoder", "encoder", "vit")
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "none")

# The supported range of every size: far above any published model, small enough that building,
# inspecting and pricing a model stays a matter of seconds and every count fits the cost model's
# 64-bit integers. Tokens per sample: at most ``vocab.strategy.MAX_SEQ_LEN`` (10M), as in plans.
#: transformer blocks
MAX_LAYERS = 10_000
#: model width, attention heads, per-head width, image and patch sizes, channels
MAX_HIDDEN = 1_048_576
#: MLP inner width (dense or per expert): four times the widest model
MAX_FFN = 4 * MAX_HIDDEN
#: vocabulary (or classes), token types
MAX_VOCAB = 10_000_000
#: a model's ``max_seq`` (Hugging Face ``max_position_embeddings``): 16.8M, above every published
#: context window; the tokens per sample it defaults to must still be at most :data:`MAX_SEQ_LEN`
MAX_POSITIONS = 1 << 24
#: routed or shared experts per MoE layer, and the experts a token is routed to
MAX_EXPERTS = 100_000
#: parameters of a whole model (a graph with more is refused)
MAX_PARAMETERS = 10**15

Layers = Annotated[int, Field(gt=0, le=MAX_LAYERS)]
Width = Annotated[int, Field(gt=0, le=MAX_HIDDEN)]
FfnWidth = Annotated[int, Field(gt=0, le=MAX_FFN)]
Vocab = Annotated[int, Field(gt=0, le=MAX_VOCAB)]
Positions = Annotated[int, Field(gt=0, le=MAX_POSITIONS)]
Experts = Annotated[int, Field(ge=0, le=MAX_EXPERTS)]
Probability = Annotated[float, Field(ge=0.0, lt=1.0)]
#: a Hugging Face model id: ``org/name`` or (the oldest models) ``name``
HF_ID = r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$"
HfId = Annotated[StrictStr, Field(min_length=2, max_length=200, pattern=HF_ID)]


class _Fields(BaseModel):
    """Types and ranges of the :class:`TransformerConfig` fields (strict: no strings, floats or
    booleans where an integer belongs; finite numbers only). ``0`` means "derived" where the
    dataclass fills a default."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    name: StrictStr
    layers: Layers
    hidden: Width
    heads: Width
    vocab: Vocab
    arch: StrictStr
    kv_heads: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    head_dim: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    ffn_hidden: Annotated[int, Field(ge=0, le=MAX_FFN)]
    max_seq: Positions
    activation: StrictStr
    norm: StrictStr
    position: StrictStr
    bias: StrictBool
    qkv_bias: StrictBool
    qk_norm: StrictBool
    tied_embeddings: StrictBool
    experts: Experts
    top_k: Experts
    moe_ffn_hidden: Annotated[int, Field(ge=0, le=MAX_FFN)]
    shared_experts: Experts
    expert_groups: Experts
    group_top_k: Experts
    dense_layers: Annotated[int, Field(ge=0, le=MAX_LAYERS)]
    dropout: Probability
    attention_impl: StrictStr
    sliding_window: Annotated[int, Field(ge=0, le=MAX_SEQ_LEN)]
    global_every: Annotated[int, Field(ge=0, le=MAX_LAYERS)]
    q_lora_rank: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    kv_lora_rank: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    qk_rope_head_dim: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    v_head_dim: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    mtp_layers: Annotated[int, Field(ge=0, le=MAX_LAYERS)]
    sandwich_norm: StrictBool
    rope_theta: Annotated[float, Field(ge=0.0, le=1e12)]
    norm_eps: Annotated[float, Field(ge=0.0, lt=1.0)]
    type_vocab: Annotated[int, Field(ge=0, le=MAX_VOCAB)]
    image_size: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    patch_size: Annotated[int, Field(ge=0, le=MAX_HIDDEN)]
    channels: Width
    params_published: Annotated[float, Field(ge=0.0)]
    source: StrictStr
    hf_ids: list[HfId] | tuple[HfId, ...]
    extra: dict[str, Any]


def describe_fields(err: ValidationError, limit: int = 3) -> str:
    """A pydantic error as ``field: reason (got value); ...``, the first ``limit`` of them."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(x) for x in e["loc"]) or "(document)"
        got = ""
        if e["type"] not in ("missing", "extra_forbidden") and not isinstance(e.get("input"), dict | list):
            got = f" (got {shown(e.get('input'))})"
        parts.append(f"{loc}: {e['msg']}{got}")
    more = f" (and {err.error_count() - limit} more)" if err.error_count() > limit else ""
    return "; ".join(parts) + more


def check_seq_len(seq_len: Any, what: str = "seq_len") -> int:
    """``seq_len`` as an int if it is a whole number in 1..:data:`MAX_SEQ_LEN`, else a
    :class:`ShardplanError` naming ``what`` and the supported range."""
    if isinstance(seq_len, bool):
        raise ShardplanError(f"{what} must be an integer, got {seq_len!r}")
    try:
        s = operator.index(seq_len)
    except TypeError:
        raise ShardplanError(f"{what} must be an integer, got {shown(seq_len)}") from None
    if not 0 < s <= MAX_SEQ_LEN:
        raise ShardplanError(f"{what} must be in 1..{MAX_SEQ_LEN:,} tokens, got {shown(s)}")
    return s


@dataclass(frozen=True)
class TransformerConfig:
    """A GPT / Llama / Mixtral / BERT / ViT style stack.

    Attributes:
        name: preset or file name.
        arch: ``decoder`` (causal LM), ``encoder`` (BERT, bidirectional) or ``vit``.
        layers: number of transformer blocks.
        hidden: model width h.
        heads: attention (query) heads.
        kv_heads: key/value heads (GQA); equal to ``heads`` for MHA.
        head_dim: per-head width; ``hidden // heads`` unless the model says otherwise.
        ffn_hidden: MLP inner width (per expert for MoE models when ``moe_ffn_hidden`` is 0).
        vocab: vocabulary size (classes for ViT).
        max_seq: longest sequence the model was trained with (learned positions).
        activation: ``gelu`` (2 matrices) or ``swiglu`` (3 matrices).
        norm: ``layernorm`` (weight + bias) or ``rmsnorm`` (weight).
        position: ``learned`` (a table of ``max_seq`` rows), ``rope`` or ``none``.
        bias: whether linears carry biases (GPT-2, BERT, ViT).
        qkv_bias: biases on q/k/v only (Qwen2).
        qk_norm: per-head RMSNorm of q and k (Qwen3).
        tied_embeddings: the LM head reuses the token embedding.
        experts: routed experts per MoE layer (0 = dense).
        top_k: experts each token is routed to.
        moe_ffn_hidden: inner width of one expert (0 = ``ffn_hidden``).
        shared_experts: always-on experts per MoE layer (DeepSeek / Qwen-MoE style).
        expert_groups: group-limited routing (DeepSeek-V2/V3 ``n_group``): the routed experts in
            this many equal groups, each token routed within ``group_top_k`` of them (0 = none).
        group_top_k: groups each token's experts come from (DeepSeek-V3 ``topk_group``: 4 of 8).
        dense_layers: leading blocks that are dense in an MoE model.
        dropout: dropout probability (adds 1-byte masks to the saved activations).
        attention_impl: ``flash`` (no s² activations) or ``eager`` (scores kept for backward).
        sliding_window: tokens each query attends back to in a local layer (Mistral 7B v0.1,
            Gemma-2/3, gpt-oss; 0 = every layer attends the whole sequence).
        global_every: with a window, every ``global_every``-th layer (``i % k == k - 1``) attends
            the whole sequence (Gemma-2 and gpt-oss 2, Gemma-3 6); 0 = every layer is local.
        q_lora_rank: multi-head latent attention (DeepSeek-V2/V3): the rank of the query's
            down-projection (0 = queries projected directly).
        kv_lora_rank: MLA: the width of the compressed key/value latent (0 = no MLA). With MLA,
            ``head_dim`` is the per-head width of the non-rotary query/key part.
        qk_rope_head_dim: MLA: the decoupled rotary part of each query/key head.
        v_head_dim: MLA: the value head width (0 = ``head_dim``).
        mtp_layers: multi-token-prediction modules after the main stack (DeepSeek-V3: 1), each a
            projection of two normalised streams, one more block and a pass of the shared head.
        sandwich_norm: a norm after the attention and after the MLP too, before each joins the
            residual stream (Gemma-2/3).
        rope_theta: the rotary embedding's base (``rope_theta`` of the config; 0 = not stated). It
            prices nothing; an export writes it (Megatron-LM's ``--rotary-base``).
        norm_eps: the norms' epsilon (``rms_norm_eps`` / ``layer_norm_epsilon``; 0 = not stated),
            written by an export (``--norm-epsilon``), priced nothing.
        type_vocab: token-type embeddings (BERT).
        image_size / patch_size / channels: ViT input.
        params_published: the parameter count the authors publish, for checks.
        source: where the numbers come from.
        hf_ids: the Hugging Face ids whose ``config.json`` is this model (``--model
            meta-llama/Meta-Llama-3-8B`` names the preset; matched ignoring case). Not part of the
            model: left out of :meth:`to_dict` (so of graphs and plans) and of comparisons.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    arch: str = "decoder"
    kv_heads: int = 0
    head_dim: int = 0
    ffn_hidden: int = 0
    max_seq: int = 2048
    activation: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    shared_experts: int = 0
    expert_groups: int = 0
    group_top_k: int = 0
    dense_layers: int = 0
    dropout: float = 0.0
    attention_impl: str = "flash"
    sliding_window: int = 0
    global_every: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    sandwich_norm: bool = False
    rope_theta: float = 0.0
    norm_eps: float = 0.0
    type_vocab: int = 0
    image_size: int = 0
    patch_size: int = 0
    channels: int = 3
    params_published: float = 0.0
    source: str = ""
    hf_ids: tuple[str, ...] = field(default=(), compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ShardplanError(f"model '{self.name}': {msg}")

        try:
            _Fields.model_validate({f.name: getattr(self, f.name) for f in fields(self)})
        except ValidationError as e:
            bad(describe_fields(e))
        object.__setattr__(self, "hf_ids", tuple(self.hf_ids))
        if self.arch not in ARCHS:
            bad(f"arch {shown(self.arch)} is not one of {ARCHS}")
        if self.activation not in ACTIVATIONS:
            bad(f"activation {shown(self.activation)} is not one of {ACTIVATIONS}")
        if self.norm not in NORMS:
            bad(f"norm {shown(self.norm)} is not one of {NORMS}")
        if self.position not in POSITIONS:
            bad(f"position {shown(self.position)} is not one of {POSITIONS}")
        if self.attention_impl not in ("flash", "eager"):
            bad(f"attention_impl {shown(self.attention_impl)} is not 'flash' or 'eager'")
        # Fill derived defaults (frozen dataclass: go through object.__setattr__).
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0:
            if self.hidden % self.heads:
                bad(f"hidden {self.hidden} is not divisible by heads {self.heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.heads % self.kv_heads:
            bad(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.experts:
            if not 0 < self.top_k <= self.experts:
                bad(f"top_k {self.top_k} must be in 1..experts ({self.experts})")
            if self.moe_ffn_hidden == 0:
                object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)
            if not 0 <= self.dense_layers <= self.layers:
                bad(f"dense_layers {self.dense_layers} must be in 0..layers ({self.layers})")
            if self.expert_groups and (self.experts % self.expert_groups
                                       or not 0 < self.group_top_k <= self.expert_groups):
                bad(f"expert_groups {self.expert_groups} must divide the {self.experts} experts, and group_top_k "
                    f"{self.group_top_k} be in 1..expert_groups")
        if self.kv_lora_rank:
            if self.kv_heads != self.heads:
                bad(f"multi-head latent attention up-projects K/V per head: kv_heads {self.kv_heads} must be heads "
                    f"{self.heads}")
            if self.v_head_dim == 0:
                object.__setattr__(self, "v_head_dim", self.head_dim)
        elif self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
            bad("q_lora_rank, qk_rope_head_dim and v_head_dim describe multi-head latent attention: give "
                "kv_lora_rank too")
        if self.global_every and not self.sliding_window:
            bad("global_every describes which layers escape a sliding window: give sliding_window too")
        if self.mtp_layers and self.arch != "decoder":
            bad("multi-token prediction (mtp_layers) is for decoders")
        if self.arch == "vit":
            if not 0 < self.patch_size <= self.image_size:
                bad("a ViT needs image_size and patch_size (at most image_size)")
            if self.num_patches + 1 > MAX_SEQ_LEN:
                bad(f"image_size {self.image_size} / patch_size {self.patch_size} makes {self.num_patches:,} "
                    f"patches; the supported range is up to {MAX_SEQ_LEN - 1:,}")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def causal(self) -> bool:
        return self.arch == "decoder"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.arch == "vit" else 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.dense_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def window_of(self, i: int) -> int:
        """The sliding window of block ``i`` in tokens, 0 where it attends the whole sequence."""
        if not self.sliding_window or (self.global_every and i % self.global_every == self.global_every - 1):
            return 0
        return self.sliding_window

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.pop("hf_ids")
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """A config from a preset document or a dict of field values (each type and range
        checked, nothing coerced)."""
        if not isinstance(data, dict):
            raise ShardplanError(f"model: expected a mapping of fields, got {type(data).__name__}")
        name = data.get("name") if isinstance(data.get("name"), str) else "?"
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise ShardplanError(f"model '{name}': unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [f for f in ("name", "layers", "hidden", "heads", "vocab") if f not in data]
        if missing:
            raise ShardplanError(f"model '{name}': missing field(s) {missing}")
        return cls(**data)
