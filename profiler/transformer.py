"""Build the layer graph of a :class:`TransformerConfig` from first principles.

Saved activations follow Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022): with eager attention and dropout a GPT block keeps
``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit training, of which ``10·s·b·h`` are not split by tensor
parallelism (layer-norm inputs, the inputs of the column-parallel GEMMs, dropout masks) and the rest
is. The same bookkeeping extends to GQA (smaller K/V), SwiGLU (two FFN inputs of the
activation), flash attention (no score matrix, only a log-sum-exp per head and row) and MoE
(each token's hidden state routed to ``top_k`` experts).
"""

from __future__ import annotations

from profiler.graph import LayerGraph, LayerNode
from profiler.model_config import MAX_PARAMETERS, MAX_SEQ_LEN, TransformerConfig, check_seq_len
from vocab.errors import ShardplanError

ACT_BYTES = 2  # activations in bf16/fp16
MASK_BYTES = 1  # dropout masks


def _linear(
    name: str, block: int | None, btype: str, s: int, d_in: int, d_out: int, *, bias: bool,
    tp: str, act_tp_sharded: bool, save_input: bool = True, pb: int = 2,
) -> LayerNode:
    fwd = 2.0 * s * d_in * d_out
    return LayerNode(
        name=name, kind="linear", block=block, block_type=btype,
        params=d_in * d_out + (d_out if bias else 0), param_bytes=pb,
        fwd_flops=fwd, bwd_flops=2 * fwd,
        act_saved_bytes=ACT_BYTES * s * d_in if save_input else 0.0,
        act_tp_sharded=act_tp_sharded, out_bytes=ACT_BYTES * s * d_out,
        mem_bytes=ACT_BYTES * s * (d_in + d_out) + pb * d_in * d_out,
        tp=tp, dims={"in": d_in, "out": d_out},
    )


def _norm(name: str, block: int | None, btype: str, s: int, h: int, kind: str) -> LayerNode:
    params = 2 * h if kind == "layernorm" else h
    return LayerNode(
        name=name, kind="norm", block=block, block_type=btype, params=params,
        act_saved_bytes=ACT_BYTES * s * h, out_bytes=ACT_BYTES * s * h,
        mem_bytes=2 * ACT_BYTES * s * h, tp="replicated", dims={"hidden": h},
    )


def _dropout(name: str, block: int | None, btype: str, s: int, width: int, tp_sharded: bool) -> LayerNode:
    return LayerNode(
        name=name, kind="dropout", block=block, block_type=btype,
        act_saved_bytes=MASK_BYTES * s * width, act_tp_sharded=tp_sharded,
        out_bytes=ACT_BYTES * s * width, mem_bytes=(2 * ACT_BYTES + MASK_BYTES) * s * width,
        tp="none", dims={"hidden": width},
    )


def _attention_core(cfg: TransformerConfig, i: int, btype: str, s: int) -> LayerNode:
    a, kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    q_bytes = ACT_BYTES * s * a * d
    kv_bytes = ACT_BYTES * s * kv * d
    fwd = 4.0 * s * s * a * d  # QK^T and AV, counted in full (model-FLOPs convention)
    dims = {"heads": a, "kv_heads": kv, "head_dim": d, "seq": s}
    mem = q_bytes * 2 + 2 * kv_bytes
    if cfg.attention_impl == "eager":
        # Q, K (for QK^T), softmax output, its dropout mask and output (for AV), V.
        scores = ACT_BYTES * a * s * s
        score_mem = scores + (scores + MASK_BYTES * a * s * s if cfg.dropout else 0.0)
        saved = q_bytes + 2 * kv_bytes + score_mem
        selective = score_mem
        # Two batched GEMMs over the whole s x s (no causal skipping) and, between them, passes
        # over the scores that each read and write them: scale, mask, softmax (and dropout).
        dims["eager"] = 1
        mem = 2 * scores * (4 if cfg.dropout else 3)
    else:
        # Flash attention keeps Q, K, V and a float32 log-sum-exp per head and row; its output
        # is the input of the output projection and is counted there.
        saved = q_bytes + 2 * kv_bytes + 4.0 * a * s
        selective = 0.0
    return LayerNode(
        name=f"layers.{i}.attn.core", kind="attention", block=i, block_type=btype,
        fwd_flops=fwd, bwd_flops=2 * fwd,
        act_saved_bytes=saved, act_tp_sharded=True, act_selective_bytes=selective,
        out_bytes=q_bytes, mem_bytes=mem, causal=cfg.causal, tp="heads", dims=dims,
    )


def _mlp(cfg: TransformerConfig, i: int, btype: str, s: int) -> list[LayerNode]:
    h, f = cfg.hidden, cfg.ffn_hidden
    p = f"layers.{i}.mlp"
    n_in = 2 if cfg.activation == "swiglu" else 1
    up = _linear(f"{p}.up", i, btype, s, h, n_in * f, bias=cfg.bias, tp="column", act_tp_sharded=False)
    act = LayerNode(
        name=f"{p}.act", kind="activation", block=i, block_type=btype,
        act_saved_bytes=ACT_BYTES * s * n_in * f, act_tp_sharded=True,
        out_bytes=ACT_BYTES * s * f, mem_bytes=ACT_BYTES * s * (n_in + 1) * f, tp="none",
        dims={"hidden": f},
    )
    down = _linear(f"{p}.down", i, btype, s, f, h, bias=cfg.bias, tp="row", act_tp_sharded=True)
    nodes = [up, act, down]
    if cfg.dropout:
        nodes.append(_dropout(f"{p}.dropout", i, btype, s, h, tp_sharded=False))
    return nodes


def _moe(cfg: TransformerConfig, i: int, btype: str, s: int) -> list[LayerNode]:
    h, e, k, f = cfg.hidden, cfg.experts, cfg.top_k, cfg.moe_ffn_hidden
    p = f"layers.{i}.moe"
    n_mat = 3 if cfg.activation == "swiglu" else 2
    router = LayerNode(
        name=f"{p}.router", kind="router", block=i, block_type=btype, params=h * e,
        fwd_flops=2.0 * s * h * e, bwd_flops=4.0 * s * h * e,
        act_saved_bytes=ACT_BYTES * s * h + 4.0 * s * e, out_bytes=4.0 * s * e,
        mem_bytes=ACT_BYTES * s * h, tp="replicated", dims={"in": h, "out": e},
    )
    # Per routed token copy: the expert's input h, its activation input(s) and the down input f.
    per_tok = ACT_BYTES * (h + (n_mat - 1) * f + f)
    fwd = 2.0 * s * k * n_mat * h * f
    experts = LayerNode(
        name=f"{p}.experts", kind="experts", block=i, block_type=btype, params=e * n_mat * h * f,
        fwd_flops=fwd, bwd_flops=2 * fwd, act_saved_bytes=per_tok * s * k, act_tp_sharded=True,
        out_bytes=ACT_BYTES * s * h, mem_bytes=ACT_BYTES * s * k * 2 * h,
        tp="column", dims={"in": h, "out": f, "experts": e, "top_k": k, "matrices": n_mat},
    )
    nodes = [router, experts]
    if cfg.shared_experts:
        fs = f * cfg.shared_experts
        n_in = n_mat - 1
        nodes += [
            _linear(f"{p}.shared.up", i, btype, s, h, n_in * fs, bias=False, tp="column", act_tp_sharded=False),
            _linear(f"{p}.shared.down", i, btype, s, fs, h, bias=False, tp="row", act_tp_sharded=True),
        ]
    return nodes


def _block(cfg: TransformerConfig, i: int, s: int) -> list[LayerNode]:
    h, a, kv, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    btype = "encoder" if cfg.arch != "decoder" else "decoder"
    p = f"layers.{i}"
    qkv = _linear(
        f"{p}.attn.qkv", i, btype, s, h, (a + 2 * kv) * d, bias=cfg.bias or cfg.qkv_bias,
        tp="column", act_tp_sharded=False,
    )
    if cfg.qk_norm:  # two per-head RMSNorm weights; their saved inputs are Q and K again
        qkv = _with_params(qkv, qkv.params + 2 * d)
    nodes = [_norm(f"{p}.attn_norm", i, btype, s, h, cfg.norm), qkv, _attention_core(cfg, i, btype, s)]
    nodes.append(_linear(f"{p}.attn.out", i, btype, s, a * d, h, bias=cfg.bias, tp="row", act_tp_sharded=True))
    if cfg.dropout:
        nodes.append(_dropout(f"{p}.attn.dropout", i, btype, s, h, tp_sharded=False))
    nodes.append(_norm(f"{p}.mlp_norm", i, btype, s, h, cfg.norm))
    nodes += _moe(cfg, i, btype, s) if cfg.is_moe_layer(i) else _mlp(cfg, i, btype, s)
    return nodes


def _with_params(n: LayerNode, params: int) -> LayerNode:
    from dataclasses import replace

    return replace(n, params=params)


def _embedding(cfg: TransformerConfig, s: int) -> list[LayerNode]:
    h = cfg.hidden
    if cfg.arch == "vit":
        patch_in = cfg.channels * cfg.patch_size**2
        n = _linear("embed.patch", None, "embedding", cfg.num_patches, patch_in, h, bias=True,
                    tp="replicated", act_tp_sharded=False)
        extra = h + (cfg.num_patches + 1) * h  # class token and learned positions
        return [_with_params(n, n.params + extra)]
    params = cfg.vocab * h
    if cfg.position == "learned":
        params += cfg.max_seq * h
    params += cfg.type_vocab * h
    nodes = [LayerNode(
        name="embed", kind="embedding", block=None, block_type="embedding", params=params,
        out_bytes=ACT_BYTES * s * h, mem_bytes=2 * ACT_BYTES * s * h, tp="vocab",
        dims={"vocab": cfg.vocab, "hidden": h},
    )]
    if cfg.arch == "encoder":  # BERT normalises the embedding sum
        nodes.append(_norm("embed.norm", None, "embedding", s, h, cfg.norm))
    if cfg.dropout:
        nodes.append(_dropout("embed.dropout", None, "embedding", s, h, tp_sharded=False))
    return nodes


def _head(cfg: TransformerConfig, s: int) -> list[LayerNode]:
    h, v = cfg.hidden, cfg.vocab
    nodes = [_norm("final_norm", None, "head", s, h, cfg.norm)]
    if cfg.arch == "vit":  # classify the class token only
        nodes.append(_linear("head", None, "head", 1, h, v, bias=True, tp="replicated", act_tp_sharded=False))
        return nodes
    if cfg.arch == "encoder":  # BERT MLM transform (dense + norm) before the tied decoder
        nodes.append(_linear("head.transform", None, "head", s, h, h, bias=True, tp="replicated",
                             act_tp_sharded=False))
        nodes.append(_norm("head.norm", None, "head", s, h, cfg.norm))
    lm = _linear("head", None, "head", s, h, v, bias=cfg.arch == "encoder", tp="vocab", act_tp_sharded=False)
    if cfg.tied_embeddings:
        lm = _with_params(lm, v if cfg.arch == "encoder" else 0)
    nodes.append(lm)
    nodes.append(LayerNode(
        name="loss", kind="loss", block=None, block_type="head",
        act_saved_bytes=4.0 * s * v, act_tp_sharded=True,  # fp32 softmax of the logits
        out_bytes=4.0, mem_bytes=4.0 * 2 * s * v, tp="vocab", dims={"vocab": v},
    ))
    return nodes


def build_graph(cfg: TransformerConfig, seq_len: int | None = None) -> LayerGraph:
    """The layer graph of ``cfg`` for samples of ``seq_len`` tokens (``cfg.max_seq`` if None).

    A ``seq_len`` outside 1..:data:`~profiler.model_config.MAX_SEQ_LEN` or a model of more than
    :data:`~profiler.model_config.MAX_PARAMETERS` parameters raises :class:`ShardplanError`.
    """
    if cfg.arch == "vit":
        s = cfg.num_patches + 1
    elif seq_len is not None:
        s = check_seq_len(seq_len)
    elif cfg.max_seq > MAX_SEQ_LEN:
        raise ShardplanError(f"model '{cfg.name}': its max_seq {cfg.max_seq:,} is longer than the supported "
                             f"{MAX_SEQ_LEN:,} tokens per sample; give a seq_len")
    else:
        s = cfg.max_seq
    nodes = _embedding(cfg, s)
    for i in range(cfg.layers):
        nodes += _block(cfg, i, s)
    nodes += _head(cfg, s)
    params = sum(n.params for n in nodes)
    if params > MAX_PARAMETERS:
        raise ShardplanError(f"model '{cfg.name}' has {params:,} parameters; the supported range is up to "
                             f"{MAX_PARAMETERS:,}")
    return LayerGraph(model_id=cfg.name, seq_len=s, nodes=nodes, config=cfg.to_dict(), source="analytic")
