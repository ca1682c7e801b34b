"""Architecture of a transformer, enough to build its layer graph analytically.

Presets (``profiler/data/models/*.yaml``) and Hugging Face ``config.json`` files both become a
:class:`TransformerConfig`; :func:`profiler.transformer.build_graph` turns one into a layer graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vocab.errors import ShardplanError

ARCHS = ("decoder", "encoder", "vit")
ACTIVATIONS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope", "none")


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
        dense_layers: leading blocks that are dense in an MoE model.
        dropout: dropout probability (adds 1-byte masks to the saved activations).
        attention_impl: ``flash`` (no s² activations) or ``eager`` (scores kept for backward).
        type_vocab: token-type embeddings (BERT).
        image_size / patch_size / channels: ViT input.
        params_published: the parameter count the authors publish, for checks.
        source: where the numbers come from.
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
    dense_layers: int = 0
    dropout: float = 0.0
    attention_impl: str = "flash"
    type_vocab: int = 0
    image_size: int = 0
    patch_size: int = 0
    channels: int = 3
    params_published: float = 0.0
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ShardplanError(f"model '{self.name}': {msg}")

        for f in ("layers", "hidden", "heads", "vocab"):
            if int(getattr(self, f)) <= 0:
                bad(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.arch not in ARCHS:
            bad(f"arch '{self.arch}' is not one of {ARCHS}")
        if self.activation not in ACTIVATIONS:
            bad(f"activation '{self.activation}' is not one of {ACTIVATIONS}")
        if self.norm not in NORMS:
            bad(f"norm '{self.norm}' is not one of {NORMS}")
        if self.position not in POSITIONS:
            bad(f"position '{self.position}' is not one of {POSITIONS}")
        if self.attention_impl not in ("flash", "eager"):
            bad(f"attention_impl '{self.attention_impl}' is not 'flash' or 'eager'")
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
        if self.arch == "vit" and (self.image_size <= 0 or self.patch_size <= 0):
            bad("a ViT needs image_size and patch_size")
        if not 0.0 <= self.dropout < 1.0:
            bad(f"dropout {self.dropout} must be in [0, 1)")

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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShardplanError(
                f"model '{data.get('name', '?')}': unknown field(s) {unknown}; known: {sorted(known)}"
            )
        missing = [f for f in ("name", "layers", "hidden", "heads", "vocab") if f not in data]
        if missing:
            raise ShardplanError(f"model '{data.get('name', '?')}': missing field(s) {missing}")
        try:
            return cls(**data)
        except TypeError as e:  # wrong value types
            raise ShardplanError(f"model '{data.get('name', '?')}': {e}") from None
