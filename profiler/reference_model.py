"""The reference transformer block: what the profiler times and the runtime trains.

A block of a :class:`~profiler.model_config.TransformerConfig` is built here once, with modules
named exactly like the operators of :func:`profiler.transformer.build_graph`::

    layers.<i>.attn_norm       LayerNorm or RMSNorm (epsilon :data:`RMS_EPS`)
    layers.<i>.attn.qkv        fused Q/K/V projection, laid out per KV group (see below)
    layers.<i>.attn.core       attention (no weights): RoPE, causal or bidirectional SDPA
    layers.<i>.attn.out        output projection
    layers.<i>.attn.dropout    where the config has dropout and the block runs it
    layers.<i>.mlp_norm
    layers.<i>.mlp.up          fused gate+up for SwiGLU (interleaved columns), up for GELU
    layers.<i>.mlp.act
    layers.<i>.mlp.down
    layers.<i>.mlp.dropout
    layers.<i>.moe.router      MoE blocks instead of mlp: router (no bias), the experts' stacked
    layers.<i>.moe.experts     weights, and the always-on shared experts (``shared.up``,
    layers.<i>.moe.shared.*    ``shared.down``) where the config has them

Layouts chosen so that tensor parallelism can shard contiguous columns: the QKV output is ordered
per KV group ``[q heads of the group, k, v]`` and the SwiGLU ``up`` output interleaves gate and
up column by column, so any contiguous slice of whole groups (or column pairs) is self-contained;
attention reshapes with ``-1`` heads so the local head count after column sharding just works.
The routed experts' weights are two stacked tensors, ``up`` (E, h, n·f) and ``down`` (E, f, h),
multiplied by the tokens sorted by expert (:func:`grouped_mm`).

:class:`Parts` says what a block runs beyond its config: the profiler runs dropout and eager
attention as the config asks (:data:`MEASURED`); the runtime leaves both out (deterministic
training, always SDPA) and substitutes its context- and expert-parallel attention core and experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from profiler.model_config import TransformerConfig

#: epsilon of the reference model's RMSNorm
RMS_EPS = 1e-6
#: standard deviation of the reference model's initial weights (GPT-2's)
INIT_STD = 0.02
#: parameters drawn with ``std / sqrt(2·layers)`` (GPT-2's scaled init of the residual outputs)
RESIDUAL_OUTPUTS = ("attn.out.weight", "mlp.down.weight", "experts.down", "shared.down.weight")


def norm(cfg: TransformerConfig) -> nn.Module:
    """The config's normalisation over the hidden width: LayerNorm or RMSNorm."""
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else nn.RMSNorm(cfg.hidden, eps=RMS_EPS)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim) at positions ``pos``
    (seq,), half-split layout."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(pos.to(torch.float32), inv)  # (s, d/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of ``x`` (sorted by expert, ``counts[e]`` for expert ``e``) times their expert's
    ``w[e]``: ``torch._grouped_mm`` on CUDA in bf16, an expert-by-expert loop otherwise (torch's
    grouped GEMM has no CPU backward)."""
    if x.device.type == "cuda" and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start:start + n] @ w[e])
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-1])


def route(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts (T, k), weights (T, k)): the ``k`` best of ``scores + bias`` (the bias chooses, it
    does not weigh), weighted by their scores renormalised to sum to one (Mixtral's top-k softmax)."""
    chosen = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(-1, chosen)
    return chosen, w / w.sum(-1, keepdim=True)


def counting() -> bool:
    """Whether this forward is the step's own (not a recomputation inside backward)."""
    return torch._C._current_graph_task_id() == -1


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, p: float,
                     training: bool) -> torch.Tensor:
    """Attention written out (scores, mask, softmax, dropout, weighted values): the scores are
    kept for backward, as ``attention_impl="eager"`` trainers keep them."""
    s = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p:
        probs = F.dropout(probs, p, training)
    return probs @ v


class AttentionCore(nn.Module):
    """Attention over the fused QKV output; no weights (``layers.<i>.attn.core``)."""

    def __init__(self, cfg: TransformerConfig, eager: bool = False) -> None:
        super().__init__()
        self.group = cfg.heads // cfg.kv_heads  # query heads per KV head
        self.head_dim = cfg.head_dim
        self.rope = cfg.position == "rope"
        self.causal = cfg.causal
        self.eager = eager
        self.p = cfg.dropout if eager else 0.0

    def positions(self, n: int, device: torch.device) -> torch.Tensor:
        """Positions of the ``n`` tokens of a sample (RoPE)."""
        return torch.arange(n, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries (b, heads, s, d) over keys and values (b, KV heads, s, d), each KV head
        repeated for its group of query heads."""
        g = self.group
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        if self.eager:
            return _eager_attention(q, k, v, self.causal, self.p, self.training)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        g, d = self.group, self.head_dim
        x = qkv.view(b, s, -1, g + 2, d)  # -1 = local KV heads (fewer after TP column sharding)
        q = x[:, :, :, :g].reshape(b, s, -1, d)
        k, v = x[:, :, :, g], x[:, :, :, g + 1]
        if self.rope:
            pos = self.positions(s, qkv.device)
            q, k = apply_rope(q, pos), apply_rope(k, pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d)
        o = self.attend(q, k, v)
        return o.transpose(1, 2).reshape(b, s, -1)


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


def _inputs(cfg: TransformerConfig) -> int:
    """Columns of an FFN input projection per hidden unit: 2 for SwiGLU (gate and up), else 1."""
    return 2 if cfg.activation == "swiglu" else 1


class Experts(nn.Module):
    """The routed experts' weights (``moe.experts``): ``up`` (E, h, n·f) and ``down`` (E, f, h),
    gate and up interleaved as in :class:`MLP`. ``forward(rows, counts)``: rows sorted by expert,
    ``counts`` (E,) of each."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        f = cfg.moe_ffn_hidden
        self.up = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, _inputs(cfg) * f))
        self.down = nn.Parameter(torch.empty(cfg.experts, f, cfg.hidden))
        self.act = Activation(cfg.activation)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(up, down) as the experts multiply them."""
        return self.up, self.down

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert, ``counts`` of each."""
        up, down = self.weights()
        return grouped_mm(self.act(grouped_mm(x, up, counts)), down, counts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(x, counts.tolist())


@dataclass(frozen=True)
class Parts:
    """How a block is built beyond its config: its attention core and experts classes, and
    whether the config's dropout and eager attention run (else no dropout, SDPA)."""

    core: type[AttentionCore] = AttentionCore
    experts: type[Experts] = Experts
    dropout: bool = True
    eager: bool = True


#: the block the profiler measures: everything the config asks for
MEASURED = Parts()


def _dropout(cfg: TransformerConfig, parts: Parts) -> nn.Dropout | None:
    return nn.Dropout(cfg.dropout) if parts.dropout and cfg.dropout else None


class Attention(nn.Module):
    """QKV projection, attention core, output projection (``layers.<i>.attn``)."""

    def __init__(self, cfg: TransformerConfig, parts: Parts = MEASURED) -> None:
        super().__init__()
        a, kv, d, h = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
        self.qkv = nn.Linear(h, (a + 2 * kv) * d, bias=cfg.bias or cfg.qkv_bias)
        self.core = parts.core(cfg, eager=parts.eager and cfg.attention_impl == "eager")
        self.out = nn.Linear(a * d, h, bias=cfg.bias)
        self.dropout = _dropout(cfg, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.core(self.qkv(x)))
        return self.dropout(y) if self.dropout is not None else y


class MLP(nn.Module):
    """Up projection, activation, down projection (``layers.<i>.mlp``)."""

    def __init__(self, cfg: TransformerConfig, parts: Parts = MEASURED) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden, _inputs(cfg) * cfg.ffn_hidden, bias=cfg.bias)
        self.act = Activation(cfg.activation)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = _dropout(cfg, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.act(self.up(x)))
        return self.dropout(y) if self.dropout is not None else y


class SharedExperts(nn.Module):
    """Always-on experts of a MoE block (``moe.shared``): one MLP of their summed width."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        width = cfg.moe_ffn_hidden * cfg.shared_experts
        self.up = nn.Linear(cfg.hidden, _inputs(cfg) * width, bias=False)
        self.act = Activation(cfg.activation)
        self.down = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class MoE(nn.Module):
    """A mixture-of-experts MLP (``layers.<i>.moe``): each token's hidden state goes to ``top_k``
    experts (:func:`route`), their outputs weighed and summed, plus the shared experts'. Balancing
    is auxiliary-loss-free: ``balance_bias`` chooses the experts, ``load`` counts this step's
    tokens per expert (the runtime moves the bias after each step: ``runtime.experts.rebalance``)."""

    def __init__(self, cfg: TransformerConfig, parts: Parts = MEASURED) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = parts.experts(cfg)
        self.shared = SharedExperts(cfg) if cfg.shared_experts else None
        self.register_buffer("balance_bias", torch.zeros(cfg.experts))
        self.register_buffer("load", torch.zeros(cfg.experts), persistent=False)  # tokens per expert this step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, x.shape[-1])
        scores = self.router(t).float().softmax(-1)
        chosen, weights = route(scores, self.balance_bias, self.top_k)
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=scores.shape[-1])
        if counting():
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

    def __init__(self, cfg: TransformerConfig, i: int = 0, parts: Parts = MEASURED) -> None:
        super().__init__()
        self.attn_norm = norm(cfg)
        self.attn = Attention(cfg, parts)
        self.mlp_norm = norm(cfg)
        self.mlp = MLP(cfg, parts) if not cfg.is_moe_layer(i) else None
        self.moe = MoE(cfg, parts) if cfg.is_moe_layer(i) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        ffn = self.mlp if self.mlp is not None else self.moe
        return x + ffn(self.mlp_norm(x))


def init_weights(model: nn.Module, std: float, layers: int) -> None:
    """Draw ``model``'s reference weights from torch's generator: linear, embedding and expert
    weights normal with ``std`` (the residual outputs, :data:`RESIDUAL_OUTPUTS`, with
    ``std / sqrt(2·layers)``), biases zero; norms keep their ones."""
    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, Experts):
            nn.init.normal_(m.up, std=std)
    for name, p in model.named_parameters():
        if name.endswith(RESIDUAL_OUTPUTS):
            nn.init.normal_(p, std=std / math.sqrt(2 * layers))
