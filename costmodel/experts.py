"""What a mixture-of-experts layer costs on one rank besides its all-to-all: the experts' GEMMs by
the tokens each expert receives, and the token permutations around them.

A MoE layer routes each of the rank's tokens to ``top_k`` of ``E`` experts. Under expert
parallelism (``ep`` ranks, ``E/ep`` experts each) the dispatch all-to-all sends every routed copy
to its expert's rank, so a rank computes, on average, as many copies as it routed: ``tokens · k``
rows over its ``E/ep`` experts. The slowest rank sets the pace of the all-to-all that follows:
it holds ``CostConstants.moe_imbalance`` times the mean load (GShard, Lepikhin et al. 2020, §2.2:
per-expert loads vary even with a balancing loss). On one rank (``ep = 1``) every expert is
local and the total is the mean exactly.

The experts' GEMMs run as grouped GEMMs (Megatron's ``moe_grouped_gemm``, Transformer Engine's
``GroupedLinear``, torchtitan's ``torch._grouped_mm``): one kernel over the local experts, each
expert's rows padded to the kernel's tile (:data:`GROUPED_GEMM_TILE`): with loads that vary from
step to step the padding is half a tile per expert on average. An expert that receives few rows
reads its whole weight for them, so fine-grained experts at small batches are bound by memory
(the roofline of :meth:`costmodel.device.DeviceModel.gemm_time`). A measured profile prices the
experts one GEMM call each, as this project's runtime runs them.

Around the GEMMs the tokens are permuted into expert order and back (:data:`PERMUTE_ELEMENTS`):
memory-bound copies that no FLOP count sees.

Under tensor parallelism each rank dispatches its share of the tokens (sequence parallelism); the
ranks that split every expert's width (``etp``: ``tp`` unless the mesh folds the experts over the
tensor-parallel ranks) gather the routed copies after the dispatch and reduce-scatter the experts'
outputs before the combine (:func:`expert_tp_time`). With ``etp = 1`` (MoE parallel folding) each
rank runs whole experts on its own share, and the expert ranks are carved out of the tensor- and
data-parallel ranks together.

Across scale-up domains the dispatch is bound by the scale-out network. An all-to-all sends each
routed copy whose expert lies in another domain; a de-duplicating dispatcher (DeepEP: DeepSeek-V3
technical report, §3.2.2) sends a token once to every other domain that holds one of its experts
and forwards it inside the domain (:func:`dispatch_time`). Node-limited routing (DeepSeek-V3's
``n_group``/``topk_group``: experts in ``expert_groups`` groups, each token routed within
``group_top_k`` of them) bounds the domains a token reaches when the groups are the domains.
"""

from __future__ import annotations

from math import comb
from typing import Any

import numpy as np

from costmodel.configs import AxisGroup
from costmodel.device import DeviceModel
from costmodel.kernels import fp8_cast_bytes, fp8_cast_elements
from profiler.graph import LayerNode

#: rows per tile of a Hopper grouped GEMM (CUTLASS and cuBLAS grouped kernels tile M by 128)
GROUPED_GEMM_TILE = 128

#: 16-bit elements of the hidden size moved per token by the permutations of one MoE layer, as
#: ``(a, b)`` for ``a·k + b`` forward and ``(c, d)`` for ``c·k + d`` backward (``k``: top-k):
#:
#: * ``fused`` (Transformer Engine's ``moe_permute`` / ``moe_unpermute`` with ``moe_permute_fusion``,
#:   DeepEP's fused layout): the permute reads each token once per copy and writes the copy (2k);
#:   the unpermute reads every copy and writes the weighted sum (k + 1). Backward mirrors them and
#:   reads the copies again for the routing weights' gradient (+k).
#: * ``eager`` (PyTorch ops one by one: ``index_select``, the multiply by the routing weights, a
#:   zeroed output and ``index_add``/``scatter_add``): the gather (2k), the weighting (2k), the
#:   zero fill (1) and the scatter-add (k reads, 2 of the output); backward the same passes, and
#:   the weights' gradient (2k).
PERMUTE_ELEMENTS = {"fused": ((3.0, 1.0), (4.0, 1.0)), "eager": ((5.0, 3.0), (7.0, 3.0))}
#: the eager permutations' rate over a streaming kernel's, on the spec sheet: ``index_select``
#: gathers scattered rows and ``index_add`` adds them back with atomics. On an H200 they moved the
#: counted bytes at 0.9-1.25 TB/s, 0.22-0.31 of a streaming kernel's 4.1 TB/s (Mixtral-,
#: DeepSeek-V3- and Qwen3-shaped tokens, top-2 and top-8; ``benchmarks/gpu_kernels.py``, section
#: ``moe``). The fused kernels copy whole rows and are priced at the streaming rate (not measured).
EAGER_PERMUTE_RATE = 0.26


def moe_dims(n: LayerNode) -> tuple[int, int, int, int, int]:
    """(hidden, expert FFN width, experts, top-k, weight matrices per expert) of an experts node."""
    d = n.dims
    return int(d["in"]), int(d["out"]), int(d.get("experts", 1)), int(d.get("top_k", 1)), int(d.get("matrices", 2))


def tokens_per_sample(n: LayerNode) -> float:
    """Tokens an experts node routes per sample: its forward FLOPs over each routed copy's."""
    h, f, _, k, mats = moe_dims(n)
    return n.fwd_flops / (2.0 * k * mats * h * f)


def load_imbalance(dev: DeviceModel, ep: Any, capacity: float | None = None) -> Any:
    """The slowest expert rank's routed copies over the mean (per configuration where ``ep`` is an
    array): ``moe_imbalance`` across ``ep > 1`` ranks, 1 on one rank (all experts local). The
    experts' GEMMs and the dispatch and combine all-to-alls both wait on that rank. A capacity
    factor caps every expert's tokens at that multiple of its mean (the rest dropped before the
    dispatch, GShard's capacity; Megatron's ``moe_expert_capacity_factor``), so at most it."""
    load = np.where(np.asarray(ep) > 1, dev.c.moe_imbalance, 1.0)
    return load if capacity is None else np.minimum(load, capacity)


def permute_bytes(hidden: float, top_k: float, tokens: float, kernels: str) -> tuple[float, float]:
    """(forward, backward) bytes of the token permutations of one MoE layer over ``tokens`` tokens
    of ``hidden`` 16-bit elements, each routed to ``top_k`` experts (:data:`PERMUTE_ELEMENTS`)."""
    (a, b), (c, d) = PERMUTE_ELEMENTS["fused" if kernels == "fused" else "eager"]
    return 2.0 * hidden * tokens * (a * top_k + b), 2.0 * hidden * tokens * (c * top_k + d)


def grouped_gemm_time(dev: DeviceModel, rows: float, groups: float, cols: float, depth: float, precision: str,
                      backward: bool = False) -> float:
    """Seconds of one grouped GEMM over ``groups`` experts of ``rows`` rows each on average (their
    loads varying), each ``rows × depth`` by ``depth × cols``: on the spec sheet every expert's
    rows padded by half a tile (:data:`GROUPED_GEMM_TILE`) and one launch; a measured profile
    prices ``groups`` calls of the mean shape."""
    if not dev.measured("gemm"):
        rows += GROUPED_GEMM_TILE / 2  # each expert's last tile, half empty on average
    return dev.gemm_time(2.0 * rows * cols * depth * groups, precision, backward=backward,
                         shape=(rows, cols, depth), groups=groups)


def expert_times(n: LayerNode, dev: DeviceModel, tokens: float, ep: float, tdiv: float, gemm_precision: str,
                 fp8_casts: bool, kernels: str, capacity: float | None = None, cast_precision: str = "fp8"
                 ) -> tuple[float, float]:
    """(forward, backward) seconds of the routed experts of one MoE layer on the slowest rank, for
    ``tokens`` tokens through the layer on it (a tensor-parallel rank's share gathered over the
    ``tdiv`` expert-TP ranks, which split every expert's FFN width): the grouped GEMMs of its ``E/ep`` experts (the input
    projection(s), then the output one), their fp8 casts where ``fp8_casts`` (with the block scales where
    ``cast_precision`` is ``mxfp8``: :func:`costmodel.kernels.fp8_cast_bytes`), and the permutations;
    ``capacity``: the workload's capacity factor (:func:`load_imbalance`)."""
    h, f, e, k, mats = moe_dims(n)
    local = max(1.0, e / ep)
    rows = tokens * k * float(load_imbalance(dev, ep, capacity)) / local  # per local expert, on the slowest rank
    fwd = bwd = 0.0
    cast_bytes = fp8_cast_bytes(kernels, cast_precision)
    for cols, depth in (((mats - 1) * f / tdiv, h), (h, f / tdiv)):
        fwd += grouped_gemm_time(dev, rows, local, cols, depth, gemm_precision)
        bwd += grouped_gemm_time(dev, rows, local, cols, depth, gemm_precision, backward=True)
        if fp8_casts:
            shape = (rows, cols, depth)
            ef, eb = fp8_cast_elements(shape)
            fwd += dev.memory_time(local * ef * cast_bytes, "elementwise")
            bwd += dev.memory_time(local * eb * cast_bytes, "elementwise")
    pf, pb = permute_times(dev, h, k, tokens, kernels)
    return fwd + pf, bwd + pb


def permute_times(dev: DeviceModel, hidden: float, top_k: float, tokens: float, kernels: str) -> tuple[float, float]:
    """(forward, backward) seconds of the permutations of :func:`permute_bytes`: streamed, eager
    ones at :data:`EAGER_PERMUTE_RATE` of that on the spec sheet."""
    pf, pb = permute_bytes(hidden, top_k, tokens, kernels)
    slow = EAGER_PERMUTE_RATE if kernels != "fused" and not dev.measured("bandwidth") else 1.0
    return dev.memory_time(pf, "elementwise") / slow, dev.memory_time(pb, "elementwise") / slow


def overlap_runs(pp: Any, vpp: Any, full_recompute: Any) -> Any:
    """Where Megatron's 1F1B all-to-all overlap (``overlap_moe_expert_parallel_comm``) runs, per
    configuration: without a pipeline or with virtual stages, and not under full recomputation
    (megatron-core 0.16.1 asserts both)."""
    return ((np.asarray(pp) == 1) | (np.asarray(vpp) > 1)) & ~np.asarray(full_recompute, dtype=bool)


def remote_copies(experts: int, top_k: int, domains: int) -> float:
    """Expected copies of a token an all-to-all sends out of its scale-up domain when its ``top_k``
    experts are spread over ``domains`` domains: each lies elsewhere with probability (m-1)/m."""
    return top_k * (domains - 1) / domains


def remote_domains(experts: int, top_k: int, domains: int, groups: int = 0, group_top_k: int = 0) -> float:
    """Expected other domains that hold at least one of a token's ``top_k`` experts, experts
    chosen uniformly (``experts / domains`` per domain): ``(m-1)(1 - C(E - E/m, k)/C(E, k))``.
    Routed within ``group_top_k`` of ``groups`` groups that nest in the domains (``groups`` a
    multiple of ``domains``), the groups are what is chosen: ``(m-1)(1 - C(G - G/m, g)/C(G, g))``,
    each chosen group holding one of the token's experts at least."""
    if domains <= 1:
        return 0.0
    if groups and group_top_k and groups % domains == 0:
        return (domains - 1) * (1 - comb(groups - groups // domains, group_top_k) / comb(groups, group_top_k))
    per = experts // domains
    return (domains - 1) * (1 - comb(experts - per, top_k) / comb(experts, top_k))


def expert_tp_time(dev: DeviceModel, nbytes: Any, group: AxisGroup) -> Any:
    """Seconds of one pass of expert-tensor parallelism's collectives over ``group`` (the expert-TP
    ranks), per configuration, where each rank received ``nbytes`` of routed copies from the
    dispatch: the copies all-gathered over the group so that every rank runs its width of the
    experts on all of them, and the outputs reduce-scattered back before the combine, each of the
    gathered size (megatron-core 0.16.1 ``transformer/moe/token_dispatcher.py:691-699``,
    ``MoEAlltoAllTokenDispatcher.dispatch_postprocess``: ``gather_from_sequence_parallel_region``
    over the expert-TP group; ``:775-781``, ``combine_preprocess``: ``reduce_scatter_to_sequence_parallel_region``).
    Backward runs the pair mirrored (a reduce-scatter and an all-gather). Nothing overlaps them."""
    gathered = np.asarray(nbytes) * group.size
    return dev.collective_time("all_gather", gathered, group) + dev.collective_time("reduce_scatter", gathered, group)


def gathers_over_tp(moe_tp: str, ep: Any) -> Any:
    """Where torchtitan's MoE layer all-gathers its input over tp before routing, per configuration
    (``Workload.moe_tp``): always under ``gathered`` (0.2.2), only without expert parallelism under
    ``gathered_without_ep`` (0.3.0: with ep > 1 each tp rank routes its own sequence share,
    ``models/common/moe_sharding.py:279-281``), never under Megatron's ``dispatcher``."""
    if moe_tp == "gathered_without_ep":
        return np.asarray(ep) == 1
    return np.full(np.shape(ep), moe_tp == "gathered")


def routes_whole_input(sequence_parallel: Any, expert_tp: Any, moe_tp: str, ep: Any = 1) -> Any:
    """Whether every tensor-parallel rank routes the MoE layer's whole input (every token of the
    micro-batch's context-parallel slice), per configuration: without sequence parallelism, and where
    torchtitan's layer gathered its input over tp (:func:`gathers_over_tp`) for experts split over it;
    else each rank routes its sequence share (Megatron's dispatcher, or folded experts)."""
    return ~np.asarray(sequence_parallel) | (gathers_over_tp(moe_tp, ep) & (np.asarray(expert_tp) > 1))


def router_divisor(n: LayerNode, divisor: Any, tsp: Any, tp: Any, moe_tp: str, ep: Any = 1) -> Any:
    """How many ways tensor parallelism splits the router's tokens (its GEMM and its saved input): where
    torchtitan's layer gathers its input over tp before the router (:func:`gathers_over_tp`), every tp
    rank routes every token (``llama4/infra/parallelize.py:517-580``, ``PrepareModuleInputOutput`` to
    ``Replicate``): none but TSP's; else ``divisor`` (sequence parallelism's share, as any replicated
    operator)."""
    if n.kind != "router" or moe_tp == "dispatcher":
        return divisor
    return np.where(gathers_over_tp(moe_tp, ep), np.where(np.asarray(tsp), tp, 1.0), divisor)


def gathered_input_bytes(n: LayerNode, saved: Any, tp: Any, expert_tp: Any, gathered: Any) -> Any:
    """Bytes the routed copies' inputs add to a rank's saved activations of expert layer ``n`` beyond
    the share a unit counts, ``saved / tp`` (``saved``: the node's saved bytes of a micro-batch on the
    rank's context-parallel slice, split over tp as if every part were): each copy's input is
    kept whole (``h`` wide) for the backward of the experts' first GEMM, for every copy the rank's
    experts run, those of ``expert_tp`` ranks' tokens where the layer's tokens are sequence-sharded
    (``gathered`` False: the dispatcher's expert-TP all-gather, :func:`expert_tp_time`), all of them
    where every tp rank routes the layer's whole input (``gathered``: :func:`routes_whole_input`).
    Folded (``expert_tp`` 1) a rank keeps its own share: nothing."""
    h, f, m = float(n.dims.get("in", 0)), float(n.dims.get("out", 0)), float(n.dims.get("matrices", 3))
    inputs = np.asarray(saved) * h / (h + m * f)  # per routed copy: its input h, then m*f of the FFN
    copies = np.where(gathered, 1.0, np.asarray(expert_tp) / np.asarray(tp))
    return np.where(np.asarray(expert_tp) > 1, inputs * (copies - 1.0 / np.asarray(tp)), 0.0)


def dispatch_time(dev: DeviceModel, nbytes: Any, group: AxisGroup, routing: tuple[int, int, int, int],
                  dedup: Any) -> Any:
    """Seconds of one dispatch (or combine) of ``nbytes`` (every routed copy's hidden state, per
    rank) over the expert-parallel ``group``, per configuration: an all-to-all; where ``dedup``,
    the copies that leave a domain cut to one per other domain reached (:func:`remote_domains`
    over :func:`remote_copies`), the forwarding inside the domain moving every copy.
    ``routing`` is (experts, top-k, expert groups, groups chosen)."""
    a2a = dev.collective_time("all_to_all", nbytes, group)
    if not np.any(dedup):
        return a2a
    e, k, g, gk = routing
    per_domain, domains = dev.domain_split(group.size, group.stride)
    ratio = np.ones(np.shape(domains))
    for m in np.unique(domains[domains > 1]):
        ratio = np.where(domains == m, remote_domains(e, k, int(m), g, gk) / remote_copies(e, k, int(m)), ratio)
    inside = dev.collective_time("all_to_all", nbytes, AxisGroup(per_domain, group.stride))
    cut = np.maximum(dev.collective_time("all_to_all", np.asarray(nbytes) * ratio, group), inside)
    return np.where(dedup & (domains > 1), cut, a2a)
