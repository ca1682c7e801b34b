"""Why a plan in fp8 or MXFP8 prices slower than the same plan in bf16, said where it happens.

The faster GEMMs of fp8 come with casts: every GEMM input is cast (and transposed) to fp8, a
memory-bound kernel whose bytes depend on how the trainer runs it (``costmodel.kernels``:
27 bytes per element eagerly, as torchtitan without ``torch.compile`` does; 4 fused, as Transformer
Engine does; MXFP8 adds its block scales). Where they cost more than the GEMMs save, the plan is
priced slower than bf16 and the user is told why, with both step times. Where the trainer runs a
mixture-of-experts model's experts in bf16 on the plan's mesh (``Workload.low_precision_experts``:
torchtitan's float8 grouped-GEMM converter refuses pipelines and context parallelism), the price
does too, and the output says so.
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


def bf16_experts(graph: Any, s: Strategy, w: Workload) -> str | None:
    """A note where an fp8/mxfp8 plan's experts are priced in bf16 on its mesh
    (:func:`costmodel.kernels.experts_low_precision`); None elsewhere."""
    from costmodel.kernels import experts_low_precision

    m = s.mesh
    if w.precision not in FP8_PRECISIONS or bool(experts_low_precision(w.precision, w.low_precision_experts, m.pp, m.cp)):
        return None
    if not graph.has_experts:
        return None
    why = {"never": "no grouped-GEMM converter converts them",
           "float8_unpiped": "the trainer's float8 grouped-GEMM converter runs only with pp = cp = 1"}
    return (f"the experts' GEMMs are priced in bf16, the other GEMMs in {w.precision}: "
            f"{why.get(w.low_precision_experts, 'as the trainer runs them')} (pp={m.pp}, cp={m.cp})")


def low_precision_notes(graph: Any, cluster: Any, s: Strategy, w: Workload, step_s: float,
                        profile: Any = None, device: Any = None) -> list[str]:
    """What an fp8/mxfp8 plan's price assumes that a user would not guess: experts in bf16
    (:func:`bf16_experts`), a step slower than bf16's (:func:`slower_than_bf16`)."""
    notes = [bf16_experts(graph, s, w), slower_than_bf16(graph, cluster, s, w, step_s, profile, device)]
    return [x for x in notes if x]
