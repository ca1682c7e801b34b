"""The reference model: a GPT / Llama style decoder whose module paths are the layer graph's names.

``Transformer(cfg)`` builds, for a :class:`~profiler.model_config.TransformerConfig`, modules named
exactly like the operators of :func:`profiler.transformer.build_graph`::

    embed                      token table (``embed.tok``) and learned positions (``embed.pos``)
    layers.<i>.attn_norm       LayerNorm or RMSNorm
    layers.<i>.attn.qkv        fused Q/K/V projection, laid out per KV group (see below)
    layers.<i>.attn.core       attention (no weights): RoPE, causal SDPA
    layers.<i>.attn.out        output projection
    layers.<i>.mlp_norm
    layers.<i>.mlp.up          fused gate+up for SwiGLU (interleaved columns), up for GELU
    layers.<i>.mlp.act
    layers.<i>.mlp.down
    layers.<i>.moe.router      MoE blocks instead of mlp: router (no bias), the experts' stacked
    layers.<i>.moe.experts     weights, and the always-on shared experts (``shared.up``,
    layers.<i>.moe.shared.*    ``shared.down``) where the config has them
    final_norm
    head                       LM head; with tied embeddings it shares ``embed.tok.weight``

and its parameter count equals ``build_graph(cfg).total_params``.

Layouts chosen so that tensor parallelism can shard contiguous columns: the QKV output is ordered
per KV group ``[q heads of the group, k, v]`` and the SwiGLU ``up`` output interleaves gate and
up column by column, so any contiguous slice of whole groups (or column pairs) is self-contained;
attention reshapes with ``-1`` heads so the local head count after column sharding just works.

Dropout is not modelled (training runs are deterministic) and attention always runs through
``scaled_dot_product_attention`` whatever ``attention_impl`` says; neither changes parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from profiler.model_config import TransformerConfig
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

#: standard deviation of the reference model's initial weights (GPT-2's)
INIT_STD = 0.02


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


def _norm(cfg: TransformerConfig) -> nn.Module:
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else nn.RMSNorm(cfg.hidden, eps=1e-6)


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


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim) at positions ``pos``
    (seq,), half-split layout."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(pos.to(torch.float32), inv)  # (s, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class AttentionCore(nn.Module):
    """Causal attention over the fused QKV output; no weights (``layers.<i>.attn.core``)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.group = cfg.heads // cfg.kv_heads  # query heads per KV head
        self.head_dim = cfg.head_dim
        self.rope = cfg.position == "rope"
        self.context: ContextShard | None = None  # context parallelism: attention across ranks

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        g, d = self.group, self.head_dim
        x = qkv.view(b, s, -1, g + 2, d)  # -1 = local KV heads (fewer after TP column sharding)
        q = x[:, :, :, :g].reshape(b, s, -1, d)
        k, v = x[:, :, :, g], x[:, :, :, g + 1]
        if self.rope:
            pos = positions(s, qkv.device, self.context)
            q, k = _rope(q, pos), _rope(k, pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        if self.context is not None:  # it moves the K/V heads, then repeats them for their query heads
            o = self.context.attention(q.contiguous(), k.contiguous(), v.contiguous())
        else:
            if g > 1:
                k = k.repeat_interleave(g, dim=1)
                v = v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        a, kv, d, h = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
        self.qkv = nn.Linear(h, (a + 2 * kv) * d, bias=cfg.bias or cfg.qkv_bias)
        self.core = AttentionCore(cfg)
        self.out = nn.Linear(a * d, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.core(self.qkv(x)))


class Activation(nn.Module):
    """GELU, or SwiGLU over interleaved (gate, up) column pairs (``layers.<i>.mlp.act``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return F.gelu(x, approximate="tanh")
        pairs = x.view(*x.shape[:-1], x.shape[-1] // 2, 2)  # no -1: an expert may get no tokens
        return F.silu(pairs[..., 0]) * pairs[..., 1]


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        n_in = 2 if cfg.activation == "swiglu" else 1
        self.up = nn.Linear(cfg.hidden, n_in * cfg.ffn_hidden, bias=cfg.bias)
        self.act = Activation(cfg.activation)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class SharedExperts(nn.Module):
    """Always-on experts of a MoE block (``moe.shared``): one MLP of their summed width."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        n_in, width = (2 if cfg.activation == "swiglu" else 1), cfg.moe_ffn_hidden * cfg.shared_experts
        self.up = nn.Linear(cfg.hidden, n_in * width, bias=False)
        self.act = Activation(cfg.activation)
        self.down = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Experts(nn.Module):
    """The routed experts' weights (``moe.experts``): ``up`` (E, h, n·f) and ``down`` (E, f, h),
    gate and up interleaved as in :class:`MLP`; with expert parallelism this rank's E/ep only."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        n_in, f = (2 if cfg.activation == "swiglu" else 1), cfg.moe_ffn_hidden
        self.up = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, n_in * f))
        self.down = nn.Parameter(torch.empty(cfg.experts, f, cfg.hidden))
        self.act = Activation(cfg.activation)
        self.ep: ExpertShard | None = None

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by this rank's experts, ``counts`` of each."""
        up, down = self.up, self.down
        if self.ep is not None:  # the gradient sums the EP group's ranks: see runtime.experts
            up, down = moe_routing.scale_grad(up, 1 / self.ep.size), moe_routing.scale_grad(down, 1 / self.ep.size)
        return moe_routing.grouped_mm(self.act(moe_routing.grouped_mm(x, up, counts)), down, counts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep is None:
            return self.compute(x, counts.tolist())
        return moe_routing.dispatch_compute_combine(x, counts, self.ep, self.compute)


class MoE(nn.Module):
    """A mixture-of-experts MLP (``layers.<i>.moe``): each token's hidden state goes to ``top_k``
    experts (:func:`runtime.experts.route`), their outputs weighed and summed, plus the shared
    experts'. Balancing is auxiliary-loss-free (:func:`runtime.experts.rebalance`)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = SharedExperts(cfg) if cfg.shared_experts else None
        self.register_buffer("balance_bias", torch.zeros(cfg.experts))
        self.register_buffer("load", torch.zeros(cfg.experts), persistent=False)  # tokens per expert this step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, x.shape[-1])
        scores = self.router(t).float().softmax(-1)
        chosen, weights = moe_routing.route(scores, self.balance_bias, self.top_k)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=scores.shape[-1])
        if moe_routing.counting():
            self.load += counts.to(self.load.dtype)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        ys = self.experts(t[token], counts) * weights.reshape(-1)[order, None].to(t.dtype)
        out = torch.zeros_like(t).index_add(0, token, ys)
        if self.shared is not None:
            out = out + self.shared(t)
        return out.view_as(x)


class Block(nn.Module):
    """One pre-norm transformer block (``layers.<i>``): attention, then an MLP or a MoE."""

    def __init__(self, cfg: TransformerConfig, i: int = 0) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg) if not cfg.is_moe_layer(i) else None
        self.moe = MoE(cfg) if cfg.is_moe_layer(i) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        ffn = self.mlp if self.mlp is not None else self.moe
        return x + ffn(self.mlp_norm(x))


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
        self.final_norm: nn.Module | None = _norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if self.head.weight.device.type != "meta":  # nothing to draw on meta tensors (shapes only)
            self._init(init_std)
        if cfg.tied_embeddings:
            self.head.weight = self.embed.tok.weight

    def _init(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, Experts):
                nn.init.normal_(m.up, std=std)
        for name, p in self.named_parameters():  # GPT-2 style scaled init of residual outputs
            if name.endswith(("attn.out.weight", "mlp.down.weight", "experts.down", "shared.down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.layers))

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
