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

from collections.abc import Callable
from dataclasses import replace

from profiler.graph import LayerGraph, LayerNode
from profiler.model_config import MAX_PARAMETERS, MAX_SEQ_LEN, TransformerConfig, check_seq_len
from vocab.errors import ShardplanError

ACT_BYTES = 2  # activations in bf16/fp16
MASK_BYTES = 1  # dropout masks
PARAM_BYTES = 2  # weights in bf16/fp16


def _linear(
    name: str, block: int | None, btype: str, s: int, d_in: int, d_out: int, *, bias: bool,
    tp: str, act_tp_sharded: bool,
) -> LayerNode:
    """A ``d_in -> d_out`` projection of ``s`` tokens; it keeps its input for backward."""
    fwd = 2.0 * s * d_in * d_out
    return LayerNode(
        name=name, kind="linear", block=block, block_type=btype,
        params=d_in * d_out + (d_out if bias else 0), param_bytes=PARAM_BYTES,
        fwd_flops=fwd, bwd_flops=2 * fwd,
        act_saved_bytes=ACT_BYTES * s * d_in,
        act_tp_sharded=act_tp_sharded, out_bytes=ACT_BYTES * s * d_out,
        mem_bytes=ACT_BYTES * s * (d_in + d_out) + PARAM_BYTES * d_in * d_out,
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


def attention_span(s: int, window: int, causal: bool) -> float | int:
    """The sequence length whose full ``s × span`` score matrix counts the FLOPs of attention over
    ``s`` tokens (FLOPs are counted over the full matrix and halved when causal): ``s`` without a
    window; with one, causal queries attend ``min(i + 1, window)`` keys, ``s·w − w²/2`` in all, so
    ``2w − w²/s``; bidirectional ones ``w`` on each side, about ``2w``."""
    if not window or window >= s:
        return s
    return 2.0 * window - window * window / s if causal else min(s, 2 * window)


def _attention_core(cfg: TransformerConfig, i: int, btype: str, s: int) -> LayerNode:
    a, kv = cfg.heads, cfg.kv_heads
    d_qk = cfg.head_dim + cfg.qk_rope_head_dim  # MLA: the non-rotary and the rotary part
    d_v = cfg.v_head_dim or cfg.head_dim
    q_bytes = ACT_BYTES * s * a * d_qk
    kv_bytes = ACT_BYTES * s * kv * (d_qk + d_v) // 2  # K and V, the mean of their widths
    window = cfg.window_of(i)
    span = attention_span(s, window, cfg.causal)
    fwd = 2.0 * s * span * a * (d_qk + d_v)  # QK^T and AV over the full score matrix (model FLOPs)
    dims = {"heads": a, "kv_heads": kv, "head_dim": d_qk, "seq": s}
    if d_v != d_qk:
        dims["v_head_dim"] = d_v
    if span < s:
        dims["span"] = span
    mem = q_bytes * 2 + 2 * kv_bytes
    if cfg.attention_impl == "eager":
        # Q, K (for QK^T), softmax output, its dropout mask and output (for AV), V.
        scores = ACT_BYTES * a * s * span
        score_mem = scores + (scores + MASK_BYTES * a * s * span if cfg.dropout else 0.0)
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
        out_bytes=ACT_BYTES * s * a * d_v, mem_bytes=mem, causal=cfg.causal, tp="heads", dims=dims,
    )


def _mla_projections(cfg: TransformerConfig, i: int, btype: str, s: int) -> list[LayerNode]:
    """Multi-head latent attention's projections (DeepSeek-V2, arXiv 2405.04434, section 2.1): the
    query down to ``q_lora_rank``, normalised, up to every head's non-rotary and rotary parts; the
    hidden state down to the K/V latent plus the shared rotary key, the latent normalised and up to
    every head's key and value. The down-projections are whole on every TP rank (Megatron-core's
    MLA), the up-projections split by heads."""
    h, a, p = cfg.hidden, cfg.heads, f"layers.{i}.attn"
    d_qk, d_v = cfg.head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    nodes: list[LayerNode] = []
    if cfg.q_lora_rank:
        nodes += [_linear(f"{p}.q_down", i, btype, s, h, cfg.q_lora_rank, bias=False, tp="replicated",
                          act_tp_sharded=False),
                  _norm(f"{p}.q_norm", i, btype, s, cfg.q_lora_rank, "rmsnorm"),
                  _linear(f"{p}.q_up", i, btype, s, cfg.q_lora_rank, a * d_qk, bias=False, tp="column",
                          act_tp_sharded=False)]
    else:
        nodes.append(_linear(f"{p}.q", i, btype, s, h, a * d_qk, bias=False, tp="column", act_tp_sharded=False))
    nodes += [_linear(f"{p}.kv_down", i, btype, s, h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False,
                      tp="replicated", act_tp_sharded=False),
              _norm(f"{p}.kv_norm", i, btype, s, cfg.kv_lora_rank, "rmsnorm"),
              _linear(f"{p}.kv_up", i, btype, s, cfg.kv_lora_rank, a * (cfg.head_dim + d_v), bias=False,
                      tp="column", act_tp_sharded=False)]
    return nodes


def _mlp(cfg: TransformerConfig, i: int, btype: str, s: int) -> list[LayerNode]:
    h, f = cfg.hidden, cfg.ffn_hidden
    p = f"layers.{i}.mlp"
    n_in = 2 if cfg.activation == "swiglu" else 1
    up = _fused(_linear(f"{p}.up", i, btype, s, h, n_in * f, bias=cfg.bias, tp="column", act_tp_sharded=False), n_in)
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
        tp="column", dims={"in": h, "out": f, "experts": e, "top_k": k, "matrices": n_mat,
                           **({"groups": cfg.expert_groups, "group_top_k": cfg.group_top_k} if cfg.expert_groups else {})},
    )
    nodes = [router, experts]
    if cfg.shared_experts:
        fs = f * cfg.shared_experts
        n_in = n_mat - 1
        nodes += [
            _fused(_linear(f"{p}.shared.up", i, btype, s, h, n_in * fs, bias=False, tp="column", act_tp_sharded=False),
                   n_in),
            _linear(f"{p}.shared.down", i, btype, s, fs, h, bias=False, tp="row", act_tp_sharded=True),
        ]
    return nodes


def _block(cfg: TransformerConfig, i: int, s: int) -> list[LayerNode]:
    h, a, kv, d = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    btype = "encoder" if cfg.arch != "decoder" else "decoder"
    p = f"layers.{i}"
    nodes = [_norm(f"{p}.attn_norm", i, btype, s, h, cfg.norm)]
    if cfg.is_mla:
        nodes += _mla_projections(cfg, i, btype, s)
    else:
        qkv = _linear(
            f"{p}.attn.qkv", i, btype, s, h, (a + 2 * kv) * d, bias=cfg.bias or cfg.qkv_bias,
            tp="column", act_tp_sharded=False,
        )
        if cfg.qk_norm:  # two per-head RMSNorm weights; their saved inputs are Q and K again
            qkv = _with_params(qkv, qkv.params + 2 * d)
        nodes.append(_fused(qkv, 3, a * d))
    nodes.append(_attention_core(cfg, i, btype, s))
    d_out = a * (cfg.v_head_dim or d)
    nodes.append(_linear(f"{p}.attn.out", i, btype, s, d_out, h, bias=cfg.bias, tp="row", act_tp_sharded=True))
    if cfg.sandwich_norm:
        nodes.append(_norm(f"{p}.attn_post_norm", i, btype, s, h, cfg.norm))
    if cfg.dropout:
        nodes.append(_dropout(f"{p}.attn.dropout", i, btype, s, h, tp_sharded=False))
    nodes.append(_norm(f"{p}.mlp_norm", i, btype, s, h, cfg.norm))
    nodes += _moe(cfg, i, btype, s) if cfg.is_moe_layer(i) else _mlp(cfg, i, btype, s)
    if cfg.sandwich_norm:
        nodes.append(_norm(f"{p}.mlp_post_norm", i, btype, s, h, cfg.norm))
    return nodes


def _with_params(n: LayerNode, params: int) -> LayerNode:
    return replace(n, params=params)


def _fused(n: LayerNode, gemms: int, first: int | None = None) -> LayerNode:
    """A linear node that runs ``gemms`` GEMMs on one input in turn (Q, K, V; SwiGLU's gate and up),
    the first ``first`` wide (the others share the rest equally): what op-level selective
    recomputation counts (:mod:`costmodel.recompute`)."""
    if gemms == 1:
        return n
    return replace(n, dims={**n.dims, "gemms": gemms, **({"first": first} if first is not None else {})})


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


def _mtp_block(cfg: TransformerConfig, j: int, s: int) -> list[LayerNode]:
    """Multi-token prediction module ``j``'s transformer block (DeepSeek-V3, arXiv 2412.19437,
    section 2.2): block ``layers + j``, after the decoder's (Megatron puts it on the last pipeline
    stage), of the same class as the decoder's last blocks, so a search splits it like them. The
    module's other parts are in the head (:func:`_mtp_head`)."""
    return _block(cfg, cfg.layers + j, s)


def _mtp_head(cfg: TransformerConfig, j: int, s: int) -> list[LayerNode]:
    """Module ``j``'s other parts, in the head: the main stream and the next token's embedding,
    each normalised, concatenated and projected back to the hidden width (before its block runs);
    its final norm, its pass of the output head (the main head's weights: no parameters of its
    own) and its loss."""
    from dataclasses import replace

    h, p = cfg.hidden, f"mtp.{j}"
    norm, lm, loss = _head(cfg, s)[-3:]
    return [_norm(f"{p}.hnorm", None, "head", s, h, cfg.norm), _norm(f"{p}.enorm", None, "head", s, h, cfg.norm),
            _linear(f"{p}.proj", None, "head", s, 2 * h, h, bias=False, tp="replicated", act_tp_sharded=False),
            replace(norm, name=f"{p}.final_norm"),
            replace(lm, name=f"{p}.head", params=0, dims={**lm.dims, "shares": "head"}),
            replace(loss, name=f"{p}.loss")]


def _parts(cfg: TransformerConfig, s: int, block: Callable[[TransformerConfig, int, int], list[LayerNode]]
           ) -> list[list[LayerNode]]:
    """The graph's operators in order, one list per part: the embedding, every block (from
    ``block``), the multi-token-prediction blocks, the head and its MTP heads."""
    return ([_embedding(cfg, s)] + [block(cfg, i, s) for i in range(cfg.layers)]
            + [_mtp_block(cfg, j, s) for j in range(cfg.mtp_layers)] + [_head(cfg, s)]
            + [_mtp_head(cfg, j, s) for j in range(cfg.mtp_layers)])


def parameter_count(cfg: TransformerConfig) -> int:
    """The parameters :func:`build_graph` gives ``cfg``, building one block of each kind: a block's
    parameters depend on whether it is a mixture-of-experts layer, not on its index (which names it
    and sets its attention window). ``shardplan models`` counts every preset this way."""
    per_kind: dict[bool, list[LayerNode]] = {}

    def one_per_kind(cfg: TransformerConfig, i: int, s: int) -> list[LayerNode]:
        moe = cfg.is_moe_layer(i)
        if moe not in per_kind:
            per_kind[moe] = _block(cfg, i, s)
        return per_kind[moe]

    s = cfg.num_patches + 1 if cfg.arch == "vit" else 1
    return sum(n.params for part in _parts(cfg, s, one_per_kind) for n in part)


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
    nodes = [n for part in _parts(cfg, s, _block) for n in part]
    params = sum(n.params for n in nodes)
    if params > MAX_PARAMETERS:
        raise ShardplanError(f"model '{cfg.name}' has {params:,} parameters; the supported range is up to "
                             f"{MAX_PARAMETERS:,}")
    return LayerGraph(model_id=cfg.name, seq_len=s, nodes=nodes, config=cfg.to_dict(), source="analytic")
