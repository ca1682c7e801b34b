"""The reference model: a GPT / Llama style decoder whose module paths are the layer graph's names.

``Transformer(cfg)`` builds, for a :class:`~profiler.model_config.TransformerConfig`, the token
table (``embed.tok``) and learned positions (``embed.pos``), the blocks ``layers.<i>`` of
:mod:`profiler.reference_model` (the profiler measures the same blocks: one owner of their
structure, the fused QKV and SwiGLU layouts and the expert weights), ``final_norm`` and the LM
``head`` (with tied embeddings it shares ``embed.tok.weight``); its parameter count equals
``build_graph(cfg).total_params``.

The runtime's blocks add context parallelism to the attention core (:class:`AttentionCore`) and
expert parallelism to the experts (:class:`Experts`). Dropout is not modelled (training runs are
deterministic) and attention always runs through ``scaled_dot_product_attention`` whatever
``attention_impl`` says; neither changes parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from profiler import reference_model as reference
from profiler.model_config import TransformerConfig
from profiler.reference_model import (  # noqa: F401  (re-exported: the runtime's model parts)
    INIT_STD,
    MLP,
    Activation,
    Attention,
    MoE,
    SharedExperts,
    init_weights,
)
from runtime import experts as moe_routing
from runtime import origins
from runtime.context_parallel import ContextShard
from runtime.experts import ExpertShard
from runtime.features import unsupported_features
from vocab.errors import ShardplanError

#: Small decoders for tests and for ``shardplan train --model tiny-*`` (no download needed).
TINY_MODELS: dict[str, TransformerConfig] = {
    "tiny-gpt": TransformerConfig(
        name="tiny-gpt", layers=4, hidden=64, heads=4, vocab=256, max_seq=64, activation="gelu",
        norm="layernorm", position="learned", bias=True, tied_embeddings=True,
        source="shardplan runtime test model (GPT-2 style)",
    ),
    "tiny-llama": TransformerConfig(
        name="tiny-llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, max_seq=64,
        ffn_hidden=128, activation="swiglu", norm="rmsnorm", position="rope", bias=False,
        tied_embeddings=False, source="shardplan runtime test model (Llama style, GQA)",
    ),
    "tiny-mixtral": TransformerConfig(
        name="tiny-mixtral", layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, max_seq=64,
        ffn_hidden=64, activation="swiglu", norm="rmsnorm", position="rope", bias=False,
        tied_embeddings=False, experts=4, top_k=2,
        source="shardplan runtime test model (Mixtral style: every block 4 experts, top-2)",
    ),
    "tiny-deepseek": TransformerConfig(
        name="tiny-deepseek", layers=4, hidden=64, heads=4, kv_heads=4, vocab=256, max_seq=64,
        ffn_hidden=128, moe_ffn_hidden=32, activation="swiglu", norm="rmsnorm", position="rope", bias=False,
        tied_embeddings=False, experts=8, top_k=2, shared_experts=1, dense_layers=1,
        source="shardplan runtime test model (DeepSeek style: a dense first block, 8 fine experts top-2, one shared)",
    ),
}


def resolve_config(name: str | TransformerConfig) -> TransformerConfig:
    """A tiny runtime model by name, a :class:`TransformerConfig`, or a preset (any size: a large one
    is built on the meta device and initialised shard by shard, :func:`build`)."""
    if isinstance(name, TransformerConfig):
        cfg = name
    elif name.strip().lower() in TINY_MODELS:
        cfg = TINY_MODELS[name.strip().lower()]
    else:
        from profiler.models import resolve_config as _resolve

        cfg = _resolve(name)
    bad = unsupported_features(cfg)
    if bad:
        raise ShardplanError(f"the runtime reference model cannot build '{cfg.name}': {'; '.join(bad)}")
    return cfg


class Embedding(nn.Module):
    """Token table ``tok`` plus, for learned positions, a position table ``pos``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq, cfg.hidden) if cfg.position == "learned" else None
        self.context: ContextShard | None = None  # context parallelism: this rank's tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            h = h + self.pos(positions(tokens.shape[1], tokens.device, self.context))
        return h


def positions(n: int, device: torch.device, context: ContextShard | None) -> torch.Tensor:
    """Global positions of the ``n`` tokens a rank holds (all of them without context parallelism)."""
    return torch.arange(n, device=device) if context is None else context.positions(n, device)


class AttentionCore(reference.AttentionCore):
    """The reference attention core with context parallelism: with a :class:`ContextShard` set,
    RoPE takes this rank's global positions and attention runs across the sequence group."""

    def __init__(self, cfg: TransformerConfig, eager: bool = False) -> None:
        super().__init__(cfg, eager)
        self.context: ContextShard | None = None

    def positions(self, n: int, device: torch.device) -> torch.Tensor:
        return positions(n, device, self.context)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            return super().attend(q, k, v)
        # it moves the K/V heads, then repeats them for their query heads
        return self.context.attention(q.contiguous(), k.contiguous(), v.contiguous())


class Experts(reference.Experts):
    """The reference experts with expert parallelism: with an :class:`ExpertShard` set, this rank
    holds E/ep experts and the rows go to the ranks holding theirs (:mod:`runtime.experts`)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg)
        self.ep: ExpertShard | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ep is None:
            return super().weights()
        # the gradient sums the EP group's ranks: see runtime.experts
        return moe_routing.scale_grad(self.up, 1 / self.ep.size), moe_routing.scale_grad(self.down, 1 / self.ep.size)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep is None:
            return super().forward(x, counts)
        return moe_routing.dispatch_compute_combine(x, counts, self.ep, self.compute)


#: the runtime's blocks: its parallel attention core and experts, no dropout, SDPA
PARTS = reference.Parts(core=AttentionCore, experts=Experts, dropout=False, eager=False)


class Block(reference.Block):
    """One pre-norm transformer block of the runtime (``layers.<i>``): :data:`PARTS`."""

    def __init__(self, cfg: TransformerConfig, i: int = 0) -> None:
        super().__init__(cfg, i, PARTS)


class Transformer(nn.Module):
    """The reference decoder. ``forward(tokens) -> logits``.

    Pipeline stages are copies with some parts set to ``None``: without ``embed`` the input is a
    hidden state, without ``head`` the output is one; ``layers`` is a ``ModuleDict`` keyed by the
    global block index so that names stay ``layers.<i>`` on every stage.
    """

    def __init__(self, cfg: TransformerConfig, init_std: float = INIT_STD) -> None:
        super().__init__()
        bad = unsupported_features(cfg)
        if bad:
            raise ShardplanError(f"the runtime reference model cannot build '{cfg.name}': {'; '.join(bad)}")
        self.cfg = cfg
        self.embed: Embedding | None = Embedding(cfg)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.layers)})
        self.final_norm: nn.Module | None = reference.norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if self.head.weight.device.type != "meta":  # nothing to draw on meta tensors (shapes only)
            self._init(init_std)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.tok.weight

    def _init(self, std: float) -> None:
        init_weights(self, std, self.cfg.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_params(model: nn.Module) -> int:
    """Parameters of ``model``, shared ones (tied embeddings) counted once."""
    return sum(p.numel() for p in model.parameters())


# ---- model specs: what a training job builds -------------------------------------------------

#: Tiny Hugging Face configs for tests and examples (built locally, nothing downloaded).
TINY_HF: dict[str, dict[str, object]] = {
    "hf-llama": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                 "tie_word_embeddings": False, "attn_implementation": "sdpa", "bos_token_id": 0, "eos_token_id": 0},
    "hf-gpt2": {"vocab_size": 256, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attn_implementation": "sdpa",
                "bos_token_id": 0, "eos_token_id": 0},
}


INITS = ("torch", "seeded")


def spec_for(name: str | TransformerConfig, init: str = "torch") -> dict[str, object]:
    """A picklable model spec: ``{"kind": "reference", "config": {...}, "init": ...}`` or an HF kind +
    config. ``init`` (reference model): ``torch`` — built whole, drawn from torch's global generator
    (seed it first); ``seeded`` — each parameter part drawn from its own seeded generators, so that a
    model built on the meta device initialises shard by shard (:mod:`runtime.init`)."""
    if isinstance(name, str) and name in TINY_HF:
        return {"kind": name, "config": dict(TINY_HF[name])}
    if init not in INITS:
        raise ShardplanError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    return {"kind": "reference", "config": resolve_config(name).to_dict(), "init": init}


def spec_for_weights(path: str) -> dict[str, object]:
    """The spec of the reference model holding a Hugging Face checkpoint's weights (a directory of
    ``config.json`` and ``*.safetensors``, Llama-style or GPT-2), read shard by shard (:mod:`runtime.weights`)."""
    from runtime.weights import read_config

    cfg, _ = read_config(path)
    return {"kind": "reference", "config": resolve_config(cfg).to_dict(), "init": "weights", "weights": str(path)}


def initializer(spec: dict[str, object], seed: int) -> Any:
    """What a reference model of ``spec`` built on the meta device is filled with, part by part (the
    ``init`` of ``apply_plan``); None for a ``torch``-initialised one (built whole)."""
    how = spec.get("init", "torch")
    if how == "seeded":
        from runtime.init import seeded_values

        return seeded_values(seed, INIT_STD, int(dict(spec["config"])["layers"]))  # type: ignore[call-overload]
    if how == "weights":
        from runtime.weights import values

        return values(str(spec["weights"]))
    return None


def build(spec: dict[str, object], seed: int = 0, meta: bool = False) -> tuple[nn.Module, int]:
    """Build the model of ``spec``; returns (model, vocabulary size). A ``torch``-initialised model
    draws from torch's generator (seed it first); a ``seeded`` one from ``seed`` (:mod:`runtime.init`),
    a ``weights`` one from its checkpoint (:mod:`runtime.weights`), left on the meta device when
    ``meta`` (for ``apply_plan(..., init=initializer(spec, seed))``); each parameter is marked with
    its origin (:mod:`runtime.origins`)."""
    kind, conf = spec["kind"], dict(spec["config"])  # type: ignore[call-overload]
    if kind == "reference":
        cfg = TransformerConfig.from_dict(conf)
        init = initializer(spec, seed)
        if init is None:
            model = Transformer(cfg)
            origins.mark(model)
            return model, cfg.vocab
        with torch.device("meta"):
            model = Transformer(cfg)
        origins.mark(model)
        if not meta:
            from runtime.init import materialize

            materialize(model, torch.device("cpu"), init)
        return model, cfg.vocab
    import transformers

    if kind == "hf-llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf))
    elif kind == "hf-gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**conf))
    else:
        raise ShardplanError(f"unknown model kind '{kind}' (reference, hf-llama, hf-gpt2)")
    return model, int(model.config.vocab_size)
