"""What one operator costs on one rank over configurations: its share of the work and of the
parameters under TP/SP/TSP and EP, its activation width, and its forward and backward seconds."""

from __future__ import annotations

from typing import Any

import numpy as np

from costmodel.configs import ConfigArrays
from costmodel.device import DeviceModel
from costmodel.experts import expert_times, tokens_per_sample
from costmodel.host import with_dtensor
from costmodel.kernels import (
    MX_BLOCK,
    experts_low_precision,
    fp8_cast_bytes,
    fp8_cast_elements,
    fp8_runs,
    traffic,
)
from profiler.graph import LayerNode
from vocab.strategy import FP8_PRECISIONS, LOSS_CHUNKS, Workload

F = np.ndarray
GEMM_KINDS = ("linear", "router", "experts")
TP_SPLIT_ROLES = ("column", "row", "heads", "vocab")
TP_SPLIT_OUTPUTS = ("column", "heads", "vocab")  # roles whose output Megatron TP alone splits
#: above every TP division: packs (calls, TP division) into one exact float key
TDIV_RANGE = 1 << 16

#: the profile's bandwidth case each bandwidth-bound node kind is priced by (else ``elementwise``)
MEMORY_OPS = {"norm": "norm", "embedding": "embedding", "loss": "cross_entropy", "activation": "activation",
              "dropout": "dropout"}


def act_width(n: LayerNode | None, precision: str) -> float:
    """The graph counts activations as 2-byte (bf16) tensors: fp32 training doubles them, except the
    loss (its softmax is fp32 already) and dropout masks (one byte either way)."""
    if precision != "fp32" or (n is not None and n.kind in ("loss", "dropout")):
        return 1.0
    return 2.0


def fp8_saved_byte(precision: str) -> float:
    """Bytes per element of an input a Transformer Engine fp8 linear keeps for its weight gradient: the
    fp8 copy it cast, in one orientation; mxfp8 adds one 8-bit scale per block of ``MX_BLOCK``."""
    return 1.0 + (1.0 / MX_BLOCK if precision == "mxfp8" else 0.0)


def saved_widths(nodes: list[LayerNode], widths: list[float], w: Workload, dev: DeviceModel,
                 cfg: ConfigArrays) -> list[Any]:
    """How many times its graph bytes (16-bit tensors) each node of a unit keeps for backward, per
    configuration: its activation width (``widths``, :func:`act_width`), except where the trainer keeps
    an fp8 linear layer's input as the fp8 copy it cast (``Workload.fp8_saved_inputs`` quantized) and
    the layer runs in fp8: a linear keeps
    its input at :func:`fp8_saved_byte` (not one whose input is the attention core's output, which the
    core keeps in 16 bits and the layer shares), and the routed experts their two GEMM inputs (the
    token, ``in`` wide, and the down projection's, ``out`` wide) so, their activation input in 16 bits;
    and where the loss runs in sequence chunks (:func:`chunked_loss_widths`)."""
    out: list[Any] = list(widths)
    if w.fp8_saved_inputs == "quantized" and dev.fp8_gemms(w.precision):
        half = fp8_saved_byte(w.precision) / 2.0
        low = experts_low_precision(w.precision, w.low_precision_experts, cfg.pp, cfg.cp)
        for i, n in enumerate(nodes):
            if n.kind == "linear" and fp8_runs(n, w.precision) and not (i and nodes[i - 1].kind == "attention"):
                out[i] = half
            elif n.kind == "experts":
                h, f, mats = (float(n.dims.get(x, d)) for x, d in (("in", 0), ("out", 0), ("matrices", 2)))
                whole = h + mats * f  # per routed copy: its input, the activation's input(s), the down input
                out[i] = np.where(low, (half * (h + f) + (mats - 1) * f) / whole, 1.0) if whole else 1.0
    return chunked_loss_widths(nodes, out) if w.cross_entropy == "chunked" else out


def chunked_loss_widths(nodes: list[LayerNode], widths: list[Any]) -> list[Any]:
    """Saved widths under a chunked loss (``Workload.cross_entropy`` chunked, :data:`LOSS_CHUNKS`): the loss
    holds one chunk's fp32 softmax at a time, and the head's linear layer adds an fp32 accumulator of its
    input's gradient (two more 16-bit copies of its input; torchtitan keeps it whole on every tp rank,
    which the head input's tp division here understates)."""
    out = list(widths)
    for i, n in enumerate(nodes):
        if n.kind == "loss":
            out[i] = out[i] / LOSS_CHUNKS
        elif n.kind == "linear" and i + 1 < len(nodes) and nodes[i + 1].kind == "loss":
            out[i] = out[i] + 2.0
    return out


def traffic_width(n: LayerNode, precision: str) -> float:
    """Bytes moved by a bandwidth-bound op scale like its activations; the loss is fp32 already."""
    return act_width(n if n.kind == "loss" else None, precision)


def carries_weights(n: LayerNode) -> bool:
    """Whether ``n`` has weights of its own on a rank (a tied head's copy on the last pipeline stage
    too): the ops whose output gradients a deferred weight pass keeps (zero bubble)."""
    return bool(n.params) or (n.kind == "linear" and n.tp == "vocab")


def tp_divisor(n: LayerNode, cfg: ConfigArrays) -> F:
    """How many ways TP (and SP / TSP) splits this node's work: Megatron TP splits the ops of a
    TP role, activations, experts and the loss; sequence parallelism and TSP split every op."""
    static = n.tp in TP_SPLIT_ROLES or n.kind in ("activation", "experts", "loss")
    return np.where(cfg.tsp | static | cfg.sequence_parallel, cfg.tp, 1.0)


def is_tied_head(n: LayerNode) -> bool:
    """An LM head that shares the embedding's table (no parameters of its own); not a second pass
    of a head that has its own (a multi-token-prediction module's, ``dims["shares"]``)."""
    return n.kind == "linear" and n.tp == "vocab" and n.params == 0 and "shares" not in n.dims


def local_params(n: LayerNode, cfg: ConfigArrays) -> np.ndarray:
    """Parameters of ``n`` on one rank after TP and EP (before data-parallel sharding).

    As Megatron and DTensor TP do: row-parallel biases and position tables stay whole on every
    TP rank; a tied LM head has its own copy of the embedding on the last pipeline stage.
    """
    tp = cfg.tp.astype(np.int64)
    params = np.full(len(tp), n.params, dtype=np.int64)
    if is_tied_head(n):  # a tied head's own copy
        params = np.where(cfg.pp > 1, int(n.dims.get("in", 0)) * int(n.dims.get("out", 0)), params)
    if n.kind == "experts":  # each expert's width over the expert-TP ranks, the experts over ep
        return params // (cfg.expert_tp.astype(np.int64) * cfg.ep.astype(np.int64))
    whole = n.tp in ("column", "heads") or (n.tp == "vocab" and n.kind != "embedding")
    out = np.where(cfg.tsp | whole, params // tp, params)
    if n.tp == "row" and not whole:
        weight = int(n.dims.get("in", 0)) * int(n.dims.get("out", 0))
        out = np.where(cfg.tsp, out, weight // tp + (params - weight))
    elif n.tp == "vocab" and n.kind == "embedding":  # token table split by vocabulary
        table = int(n.dims.get("vocab", 0)) * int(n.dims.get("hidden", 0))
        out = np.where(cfg.tsp, out, table // tp + (params - table))
    return np.where(tp == 1, params, out)


def gemm_shape(n: LayerNode, per_sample: float, tdiv: float, calls: float) -> tuple[float, float, float] | None:
    """(m, n, k) of one call of a linear node priced at ``per_sample`` samples per rank (micro-batch
    over cp) with TP dividing it ``tdiv`` ways: column-parallel GEMMs lose n, row-parallel ones k,
    sequence-split ones m; OSDP's ``calls`` slices split n."""
    if n.kind != "linear" or not n.dims.get("in") or not n.dims.get("out"):
        return None
    d_in, d_out = float(n.dims["in"]), float(n.dims["out"])
    m, nn, k = n.fwd_flops / (2 * d_in * d_out) * per_sample, d_out, d_in
    if tdiv > 1:
        if n.tp in ("column", "heads", "vocab"):
            nn /= tdiv
        elif n.tp == "row":
            k /= tdiv
        else:
            m /= tdiv
    return m, nn / calls, k


def embedding_table_bytes(n: LayerNode, tdiv: float, precision: str) -> float:
    """Bytes of the dense gradient an embedding's backward zeroes on one rank: its tables (token,
    and position where learned) in the parameter dtype, the token table split ``tdiv`` ways by
    vocabulary-parallel TP."""
    table = float(n.dims.get("vocab", 0)) * float(n.dims.get("hidden", 0))
    table = min(table, n.params) or n.params
    return (table / tdiv + (n.params - table)) * 2 * act_width(None, precision)


def attention_times(n: LayerNode, dev: DeviceModel, flops: float, nbytes: float, prec: str, kernel: str,
                    cp: float = 1.0) -> tuple[float, float]:
    """Flash attention at the kernel's rate for its shape (query tokens per rank: the sequence over
    the ``cp`` ranks, at most a sliding window's span; head dim); eager attention as two batched
    GEMMs over the whole score matrix (nothing skipped when causal) plus the bandwidth-bound passes
    over the scores."""
    if n.dims.get("eager"):
        return (dev.gemm_time(flops, prec) + dev.memory_time(nbytes, "softmax"),
                dev.gemm_time(flops, prec, backward=True) + dev.memory_time(nbytes, "softmax", backward=True))
    seq, hd = float(n.dims.get("seq", 0)), float(n.dims.get("head_dim", 0))
    # a sliding window bounds the keys each query sees: the kernel's shape is at most its span
    tokens = min(seq / cp, float(n.dims.get("span", seq)))
    shape = (tokens, hd) if seq and hd else None
    return (dev.attention_time(flops, n.causal, kernel=kernel, shape=shape),
            dev.attention_time(flops, n.causal, True, kernel, shape=shape))


def _one_shape(n: LayerNode, dev: DeviceModel, sc: float, cl: float, td: float, ep: float, w: Workload,
               low: bool = True) -> tuple[float, float]:
    """Forward and backward seconds of ``n`` at ``sc`` samples of its work per rank, in ``cl``
    calls, with TP dividing it ``td`` ways (and, for experts, EP ``ep``, in the run's precision where
    ``low``: :func:`costmodel.kernels.experts_low_precision`, else in bf16)."""
    prec = w.precision
    flops = n.fwd_flops * sc
    if n.kind in GEMM_KINDS:
        fp8 = fp8_runs(n, prec) and dev.fp8_gemms(prec) and (low or n.kind != "experts")
        # an mxfp8 GEMM runs at the fp8 rate on the fp8 operands: priced as fp8's, its scales in its casts
        gprec = ("fp8" if fp8 else "bf16") if prec in FP8_PRECISIONS else prec
        cast = fp8_cast_bytes(w.kernels, prec)
        if n.kind == "experts":
            return expert_times(n, dev, tokens_per_sample(n) * sc * td, ep, td, gprec, fp8, w.kernels,
                                w.moe_capacity_factor, cast_precision=prec)
        shape = gemm_shape(n, sc * td, td, cl)
        fwd = dev.gemm_time(flops / cl, gprec, cl, shape=shape)
        bwd = dev.gemm_time(flops / cl, gprec, cl, backward=True, shape=shape)
        if fp8 and shape is not None:  # the casts, where the GEMMs really run in fp8
            ef, eb = fp8_cast_elements(shape)
            fwd += cl * dev.memory_time(ef * cast, "elementwise")
            bwd += cl * dev.memory_time(eb * cast, "elementwise")
        return fwd, bwd
    if n.kind == "attention":
        return attention_times(n, dev, flops, n.mem_bytes * sc * act_width(n, prec), prec, w.attention_kernel, cl)
    op = MEMORY_OPS.get(n.kind, "elementwise")
    nbytes = n.mem_bytes * sc * traffic_width(n, prec)
    if n.kind == "embedding":
        return dev.memory_time(nbytes, op), dev.embedding_backward_time(nbytes, embedding_table_bytes(n, td, prec))
    return dev.kernel_times(nbytes, op, traffic(n, w.kernels, w.cross_entropy))


def node_times(n: LayerNode, dev: DeviceModel, cfg: ConfigArrays, w: Workload, tdiv: Any = None,
               split: int = 1) -> tuple[F, F]:
    """Forward and backward seconds of one node for one micro-batch on one rank, per configuration
    (OSDP's ``split`` slices of it): the device model once per distinct (work, calls, TP division),
    then DTensor's host time where Megatron TP runs."""
    tdiv = tp_divisor(n, cfg) if tdiv is None else tdiv
    scale = cfg.micro_batch / cfg.cp / tdiv
    calls = np.full(cfg.size, float(split))
    if n.kind == "attention":  # one call; a ring rank's queries are the sequence over the cp ranks,
        calls = np.where(cfg.ulysses, 1.0, cfg.cp)  # Ulysses' the whole sequence (for 1/cp of the heads)
    ep = cfg.ep if n.kind == "experts" else np.ones(cfg.size)  # the experts' tokens and load depend on ep
    low = np.ones(cfg.size)  # and their precision on the mesh (1: the run's)
    width_div = np.broadcast_to(tdiv, scale.shape)
    if n.kind == "experts":
        low = np.broadcast_to(experts_low_precision(w.precision, w.low_precision_experts, cfg.pp, cfg.cp),
                              scale.shape).astype(float)
        # a rank's share of the tokens (``scale``, over tp) gathered over the expert-TP ranks, each
        # expert's width split over them (:func:`costmodel.experts.expert_times`)
        width_div = np.broadcast_to(cfg.expert_tp, scale.shape)
    keys = np.stack([scale, calls, width_div, ep, low])
    if cfg.size == 1:  # one configuration: nothing to share
        uniq, inv = keys, np.zeros(1, dtype=int)
    elif n.kind == "experts":
        uniq, inv = np.unique(keys, axis=1, return_inverse=True)
    else:  # one sortable complex key per (scale, calls, TP division; whole numbers): faster than unique rows
        uniq_c, inv = np.unique(scale + 1j * (keys[1] * TDIV_RANGE + keys[2]), return_inverse=True)
        calls_u, tdiv_u = np.divmod(uniq_c.imag, TDIV_RANGE)
        uniq = np.stack([uniq_c.real, calls_u, tdiv_u, np.ones(len(uniq_c)), np.ones(len(uniq_c))])
    fb = np.array([_one_shape(n, dev, sc, cl, td, e, w, bool(lo)) for sc, cl, td, e, lo in uniq.T]).reshape(-1, 2)
    inv = inv.reshape(-1)
    f, b = fb[inv, 0], fb[inv, 1]
    return with_dtensor(n, dev, f, b, (cfg.tp > 1) & ~cfg.tsp, cfg.sequence_parallel, split)
