"""The bytes a memory-bound operator's kernels move, by kernel class and by how the stack runs it.

The layer graph records each bandwidth-bound operator's minimal forward traffic (``mem_bytes``:
its inputs read once, its outputs written once). What the kernels really move depends on the
trainer (``Workload.kernels``): PyTorch eager decomposes an RMSNorm into eight kernels forward and
sixteen backward and a SwiGLU into two and three, each a full pass over the activations; a fused
stack (Transformer Engine, Apex and Megatron's fused kernels, ``torch.compile``) runs one kernel
each way. The cross-entropy follows ``Workload.cross_entropy``. Each kernel then streams at the
accelerator's HBM bandwidth times ``CostConstants.memory_efficiency`` (a large-array streaming
efficiency, not a fitted catch-all).
The optimizer step is a fused AdamW in every target's default (Megatron's and DeepSpeed's
FusedAdam, torchtitan's ``implementation = "fused"``).

The eager counts are ATen traffic counted op by op (``profiler.kernel_traffic``; a test recounts
them), in bytes per element of the operator's 16-bit input; the fused ones are one read of every
input and one write of every output of the single kernel (native ``layer_norm`` and ``gelu`` are
counted too and are the same either way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from profiler.graph import LayerNode
from vocab.strategy import FP8_PRECISIONS

#: counted bytes per element, (forward, backward): eager ATen ops (``profiler.kernel_traffic``)
EAGER_BYTES = {
    "rmsnorm": (36.0, 96.0),  # cast, square, mean, add, rsqrt, mul, cast, mul; autograd's mirror
    "layernorm": (4.0, 6.0),  # native_layer_norm: one kernel each way, eager or not
    "swiglu": (10.0, 18.0),  # silu, mul (per element of each of the two inputs)
    "gelu": (4.0, 6.0),  # one native kernel each way
    "cross_entropy": (14.0, 22.0),  # cast to fp32, log_softmax, nll_loss (per logit, 16-bit input)
    "dropout": (5.0, 5.0),  # one kernel each way on a GPU: x in, y and the 1-byte mask out; dy, mask in, dx out
}
#: one fused kernel each way: every input read once, every output written once
FUSED_BYTES = {
    "rmsnorm": (4.0, 6.0),  # x in, y out; x and dy in, dx out (TE / Apex / compiled RMSNorm)
    "layernorm": (4.0, 6.0),
    "swiglu": (6.0, 10.0),  # gate and up in, out out; both and dy in, both grads out (per output)
    "gelu": (4.0, 6.0),
    "cross_entropy": (2.0, 4.0),  # 16-bit logits read; read again, gradient written in place
    "dropout": (5.0, 5.0),
}
#: the residual add before every pre-norm (the block adds its branch to the residual stream, then
#: normalises it), one kernel either way: residual and branch in, sum out; backward, the two
#: gradients of the stream summed where it forks. Charged with the norm it precedes.
RESIDUAL_BYTES = (6.0, 6.0)
#: bytes per element of a tensor cast to fp8 for a GEMM, by stack. Hopper's fp8 GEMMs take both
#: operands K-major, so every cast tensor is needed in both orientations (the forward GEMM and one
#: of the two backward ones). Eager, current (dynamic) scaling, op by op as torchao writes it:
#: ``abs`` (2 + 2), ``amax`` (2), the multiply by the fp32 scale (2 + 4), the saturating clamp
#: (4 + 4), the cast (4 + 1), the transposed copy (1 + 1): 27 (measured on an H200: 0.44-0.49
#: TB/s over 7 bytes, 27 at 4.2 TB/s). Fused (Transformer Engine's cast-transpose kernel): one
#: pass reads the 16-bit tensor and writes both fp8 orientations (2 + 1 + 1), the amax taken in
#: the same pass or from the history; a cast compiled alone by ``torch.compile`` measured 2-4x
#: that, but a compiled model fuses the amax into the op that makes the tensor. Forward casts the
#: input and the weight, backward the output gradient (``fp8_cast_elements``).
FP8_CAST_BYTES = {"eager": 27.0, "fused": 4.0}
#: MXFP8 (OCP Microscaling Formats v1.0, section 5: one shared E8M0 scale, 8 bits, per block of 32
#: values) scales each block of 32 values along a GEMM's reduction dimension. The quantize kernel
#: writes, beside each orientation of the fp8 data, one scale byte per 32 values; a tensor feeds one
#: forward and one backward GEMM that reduce over its two different dimensions, so both orientations
#: and both sets of scales are written (Transformer Engine's MXFP8 tensors hold rowwise and columnwise
#: data and scales; torchao's MX linear casts along dim 0 and dim 1): 2/32 bytes more per element
#: cast than a per-tensor fp8 cast. Everything else of an mxfp8 GEMM is priced as fp8's.
MX_BLOCK = 32
MX_SCALE_BYTES = 2.0 / MX_BLOCK
#: the graph's minimal forward bytes per element, which ``mem_bytes`` counts (16-bit activations)
MINIMAL_BYTES = {"rmsnorm": 4.0, "layernorm": 4.0, "swiglu": 6.0, "gelu": 4.0, "cross_entropy": 8.0,
                 "dropout": 5.0}


def kernel_class(n: LayerNode) -> str | None:
    """The kernel class of a bandwidth-bound node, or None for the ones priced as plain traffic."""
    if n.kind == "norm":
        return "rmsnorm" if n.params <= int(n.dims.get("hidden", 0)) else "layernorm"
    if n.kind == "activation":
        return "swiglu" if n.out_bytes and n.mem_bytes / n.out_bytes > 2.5 else "gelu"  # two inputs or one
    if n.kind == "loss":
        return "cross_entropy"
    if n.kind == "dropout":
        return "dropout"
    return None


def traffic(n: LayerNode, kernels: str, cross_entropy: str) -> tuple[float, float]:
    """(forward, backward) bytes the node's kernels move per byte of its ``mem_bytes``; plain
    traffic (1, 2) for nodes of no kernel class (the generic read-and-write pass, doubled back)."""
    cls = kernel_class(n)
    if cls is None:
        return 1.0, 2.0
    stack = cross_entropy if cls == "cross_entropy" else kernels
    fwd, bwd = (FUSED_BYTES if stack == "fused" else EAGER_BYTES)[cls]  # a chunked loss runs eager per chunk
    if n.kind == "norm":
        fwd, bwd = fwd + RESIDUAL_BYTES[0], bwd + RESIDUAL_BYTES[1]
    base = MINIMAL_BYTES[cls]
    return fwd / base, bwd / base


def fp8_cast_elements(shape: tuple[float, float, float]) -> tuple[float, float]:
    """(forward, backward) elements one fp8 GEMM call of ``shape`` (m, n, k) casts: its input
    (m·k) and weight (n·k), then its output gradient (m·n)."""
    m, n, k = shape
    return m * k + n * k, m * n


def fp8_cast_bytes(kernels: str, precision: str) -> float:
    """Bytes per element a cast to fp8 moves under ``kernels`` (:data:`FP8_CAST_BYTES`), with the
    block scales of ``mxfp8`` (:data:`MX_SCALE_BYTES`)."""
    return FP8_CAST_BYTES[kernels] + (MX_SCALE_BYTES if precision == "mxfp8" else 0.0)


def fp8_runs(n: LayerNode, precision: str) -> bool:
    """Whether the GEMMs of ``n`` run in fp8: every linear layer of an fp8 or mxfp8 run except the
    output layer (the LM head), which torchtitan's float8 and MX converters (``filter_fqns =
    ["output"]``) and Megatron's Transformer Engine layers all keep in 16 bits."""
    return precision in FP8_PRECISIONS and not (n.kind == "linear" and n.tp == "vocab")


def experts_low_precision(precision: str, mode: str, pp: Any, cp: Any) -> Any:
    """Where an fp8 or mxfp8 run's grouped expert GEMMs run in that precision, per configuration
    (``vocab.strategy.Workload.low_precision_experts``): ``always`` (Transformer Engine's GroupedLinear),
    ``float8_unpiped`` (torchtitan 0.2.2's converters: ``quantize.grouped_mm.mx`` on every mesh,
    ``quantize.grouped_mm.float8`` only where pp = cp = 1, components/quantization/float8.py:193-198
    asserting it) or ``never`` (bf16 experts)."""
    shape = np.broadcast(np.asarray(pp), np.asarray(cp)).shape
    if precision not in FP8_PRECISIONS or mode == "never":
        return np.zeros(shape, dtype=bool)
    if mode == "always" or precision == "mxfp8":
        return np.ones(shape, dtype=bool)
    return (np.asarray(pp) == 1) & (np.asarray(cp) == 1)
