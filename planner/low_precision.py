"""Why a plan in fp8 or MXFP8 prices slower than the same plan in bf16, said where it happens.

The faster GEMMs of fp8 come with casts: every GEMM input is cast (and transposed) to fp8, a
memory-bound kernel whose bytes depend on how the trainer runs it (``costmodel.kernels``:
27 bytes per element eagerly, as torchtitan without ``torch.compile`` does; 4 fused, as Transformer
Engine does; MXFP8 adds its block scales). Where they cost more than the GEMMs save, the plan is
priced slower than bf16 and the user is told why, with both step times.
"""

from __future__ import annotations

from typing import Any

from vocab.strategy import FP8_PRECISIONS, Strategy, Workload


def slower_than_bf16(graph: Any, cluster: Any, s: Strategy, w: Workload, step_s: float,
                     profile: Any = None, device: Any = None) -> str | None:
    """A note where ``s`` at ``w.precision`` (fp8 or mxfp8), priced at ``step_s``, is slower than the
    same plan in bf16; None where it is not, or the precision is not a low one."""
    if w.precision not in FP8_PRECISIONS:
        return None
    from costmodel.estimate import estimate
    from costmodel.kernels import fp8_cast_bytes

    bf16 = estimate(graph, cluster, s, w.model_copy(update={"precision": "bf16"}), profile, None, device).step_time_s
    if step_s <= bf16:
        return None
    return (f"{w.precision} prices {step_s - bf16:.3g} s slower than bf16 for this plan ({step_s:.4g} s against "
            f"{bf16:.4g} s): its casts to fp8 ({w.kernels} kernels, {fp8_cast_bytes(w.kernels, w.precision):g} bytes "
            "moved per element cast) cost more than its faster GEMMs save at these shapes")
