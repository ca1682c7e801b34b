"""The few physical constants of the cost model, documented and fitted, never per row.

Defaults hold for every accelerator; ``costmodel/data/constants.yaml`` may override them per
accelerator (written by ``shardplan fit``, each override with the rows it was fitted on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from vocab.errors import ShardplanError

CONSTANTS_PATH = Path(__file__).parent / "data" / "constants.yaml"
#: the published MoE runs' step-time errors (``benchmarks/moe_runs.py --write-band``)
MOE_BAND_PATH = Path(__file__).parent / "data" / "moe_band.yaml"


def held_out_path(constants_path: Path) -> Path:
    """Where ``shardplan fit`` writes the leave-one-source-out predictions beside a constants file."""
    return constants_path.with_name(constants_path.stem + ".held_out.csv")


@dataclass(frozen=True)
class CostConstants:
    """Constants of the cost model.

    Attributes:
        gemm_overhead_s: fixed time per GEMM call (launch, tail wave); makes small, TP-shrunk
            GEMMs less efficient than the spec-sheet GEMM efficiency.
        gemm_scale: achieved fraction of the accelerator's measured best GEMM throughput in
            real training (shapes, fused epilogues, interference with communication kernels).
        attention_efficiency: achieved fraction, in training (causal masks, head dims, sequence
            lengths of real runs), of the attention kernel's best published throughput (the
            accelerator file's ``attention_efficiency`` per kernel); backward costs
            ``attention_bwd_ratio`` × forward.
        attention_bwd_ratio: flash-attention backward time over forward time on long sequences
            (it recomputes the scores: 2.5 is the FLOP ratio; measured 2.7-2.8 at 32,768 tokens,
            head dims 64 and 128, for FlashAttention-2 and cuDNN on an H200,
            ``benchmarks/gpu_kernels.py``; shorter sequences: ``device.FLASH_LINEAR_TOKENS``).
        memory_efficiency: achieved fraction of peak HBM bandwidth of one streaming kernel over a
            large array (STREAM / BabelStream-class copy and triad kernels reach 85-90% of the
            peak on A100 and H100); how many passes an operator's kernels make is
            ``costmodel.kernels``' count, not part of this fraction.
        fp8_gemm_speedup: fp8 over bf16 throughput of a large GEMM (per-tensor scales): 1.91
            measured on an H200 (``benchmarks/gpu_kernels.py``, the median over GEMMs of more
            than 100 GFLOP; 1.85 with per-row scales), not fitted. The casts to fp8 are priced
            as memory-bound kernels (``costmodel.kernels.FP8_CAST_BYTES``).
        fp8_gemm_overhead_s: fixed time per fp8 GEMM call (measured 9.8 us against 5.8 us for
            bf16 on the same H200): small GEMMs gain less from fp8, the smallest nothing.
        grouped_gemm_overhead_s: fixed time per grouped GEMM call (MoE experts, one kernel over
            the local experts): 15.5 us measured for ``torch._grouped_mm`` on an H200, the same
            over 8 and 32 experts (``benchmarks/gpu_kernels.py``, section ``moe``).
        gemm_stream_efficiency: fraction of peak HBM bandwidth at which a GEMM bound by its bytes
            (few rows: each expert's weight read for a handful of tokens) reads its operands:
            3.1 TB/s of the H200's 4.8 measured on grouped GEMMs of 16-64 rows per expert (same
            benchmark), below a streaming copy's ``memory_efficiency``.
        fsdp_overlap: fraction of a layer's compute under which its FSDP all-gather and
            reduce-scatter can hide (prefetch).
        dp_overlap: fraction of backward under which the bucketed DP gradient all-reduce hides.
        tp_overlap: fraction of TP/SP collectives hidden by communication-GEMM overlap.
        cp_overlap: fraction of a ring-attention step's attention under which the next K/V block's
            transfer hides (asynchronous point-to-point on GPUs: all of it; gloo on a CPU: none).
        ep_overlap: fraction of MoE all-to-all hidden.
        pp_overlap: fraction of pipeline send/recv hidden.
        comm_interference: fraction of the hidden communication time that still costs compute
            time: NCCL kernels occupy SMs and HBM bandwidth while GEMMs run beside them, so
            overlapped traffic slows the compute it hides under (0 = free overlap). Applies to
            every overlapped collective (FSDP, DP, TP, CP, EP, PP); host offload copies run on
            copy engines and are exempt.
        moe_imbalance: slowest expert rank's routed tokens over the mean, across ep > 1 ranks
            (costmodel.experts.load_imbalance; GShard, Lepikhin et al. 2020: loads vary even with a
            balancing loss). Not fitted: no published MoE run is in the calibration file.
        context_bytes: per-GPU memory that is not tensors (CUDA context, NCCL buffers).
        dp_bucket_bytes: gradient buckets in flight while data parallelism reduces gradients
            (PyTorch DDP and Megatron: two 25 MiB buckets); shardplan's own runtime reduces
            gradients in place and only coalesces small ones (1 MiB, its CPU accelerator file).
        grad_coalesce_bytes: how a replicated (DDP) gradient all-reduce is cut into collectives.
            0: one per unit, the unit's gradients bucketed together (DDP, Megatron: the bytes
            are what counts, latency hides); > 0: one per gradient tensor of at least this many
            bytes, smaller ones sharing flat buffers of this size (shardplan's own runtime,
            ``runtime.zero.COALESCE_BYTES``; on gloo each collective costs milliseconds).
        grad_accumulate_passes: memory passes over the held gradients each micro-batch after a
            step's first costs where gradients accumulate by a separate add (PyTorch autograd's
            ``AccumulateGrad``: read both, write one = 3; shardplan's runtime, DDP, DeepSpeed);
            0 where the weight-gradient GEMM accumulates in place (Megatron's gradient
            accumulation fusion into ``main_grad``), the default.
        host_adam_bytes_per_s: optimizer state a host-side Adam step streams per second for one
            GPU's parameters under optimizer offload (fp32 master, two moments and the gradient,
            16 bytes per parameter): a few GB/s, a vectorised CPU Adam on a GPU's share of the
            host's cores (ZeRO-Offload, Ren et al. 2021, section 5: CPU-Adam).
        fragmentation: allocator slack as a fraction of the peak tensor memory.
        step_overhead_s: per-step fixed cost (data loading, logging, launch).
    """

    gemm_overhead_s: float = 6e-6
    gemm_scale: float = 0.92
    attention_efficiency: float = 0.65
    attention_bwd_ratio: float = 2.8
    memory_efficiency: float = 0.85
    fp8_gemm_speedup: float = 1.9
    fp8_gemm_overhead_s: float = 10e-6
    grouped_gemm_overhead_s: float = 15e-6
    gemm_stream_efficiency: float = 0.65
    fsdp_overlap: float = 0.85
    dp_overlap: float = 0.85
    tp_overlap: float = 0.0
    cp_overlap: float = 1.0
    ep_overlap: float = 0.0
    pp_overlap: float = 0.9
    comm_interference: float = 0.0
    moe_imbalance: float = 1.15
    context_bytes: float = 2.5 * 1024**3
    dp_bucket_bytes: float = 2 * 25 * 1024**2
    grad_coalesce_bytes: float = 0.0
    grad_accumulate_passes: float = 0.0
    host_adam_bytes_per_s: float = 4e9
    fragmentation: float = 0.08
    step_overhead_s: float = 0.02

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v < 0:
                raise ShardplanError(f"cost constant {f.name} must be >= 0, got {v}")
        for f in ("fsdp_overlap", "dp_overlap", "tp_overlap", "cp_overlap", "ep_overlap", "pp_overlap",
                  "comm_interference"):
            if getattr(self, f) > 1:
                raise ShardplanError(f"cost constant {f} is a fraction, got {getattr(self, f)}")

    def exposed(self, comm: Any, window: Any) -> Any:
        """Exposed seconds of ``comm`` seconds of communication overlapped with ``window`` seconds
        of compute (scalars or numpy arrays): what does not fit under the window, plus
        ``comm_interference`` of what does."""
        if isinstance(comm, np.ndarray) or isinstance(window, np.ndarray):
            hidden = np.minimum(comm, window)
        else:
            hidden = min(comm, window)
        return comm - (1.0 - self.comm_interference) * hidden

    def with_overrides(self, overrides: dict[str, Any]) -> CostConstants:
        known = {f.name for f in fields(self)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ShardplanError(f"unknown cost constant(s) {bad}; known: {sorted(known)}")
        bad = sorted(k for k, v in overrides.items()
                     if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v))
        if bad:
            raise ShardplanError(f"cost constant(s) {bad} must be finite numbers")
        return replace(self, **{k: float(v) for k, v in overrides.items()})


@cache
def _overrides_file() -> dict[str, Any]:
    if not CONSTANTS_PATH.exists():
        return {}
    with CONSTANTS_PATH.open() as f:
        return yaml.safe_load(f) or {}


def moe_band() -> dict[str, Any] | None:
    """The published MoE runs' step-time errors: ``rows``, ``low`` and ``high`` (10th and 90th
    percentiles of published over predicted, less 1), ``accelerators``, ``source``; None without the file."""
    if not MOE_BAND_PATH.exists():
        return None
    with MOE_BAND_PATH.open() as f:
        return yaml.safe_load(f) or None


def error_band(accelerator: str, precision: str, moe: bool = False) -> dict[str, Any] | None:
    """The error band of step-time predictions on ``accelerator`` at ``precision`` from the narrowest
    slice of the constants file that has one (``accelerator/precision``, ``accelerator``, ``all``):
    ``slice``, ``rows``, ``sources``, ``low`` and ``high`` (the 10th and 90th percentiles of
    published over predicted step time, less 1, on the published rows each predicted by constants
    fitted without its source) and ``pair``; and, where the slice is wider than asked, ``asked``
    (``accelerator/precision``) with ``asked_rows``: the held-out rows there (0: no run on the
    accelerator at that precision was fitted; ``accelerator_rows`` 0: none on the accelerator at
    all). For a mixture-of-experts model (``moe``) the band is widened to hold the published MoE
    runs' errors too (:func:`moe_band`; the dense runs the constants were fitted on have no experts),
    with ``moe`` saying how many and where they ran. None when the file has no bands."""
    data = _overrides_file()
    bands = data.get("error_bands", {})
    asked = f"{accelerator}/{precision}"
    for key in (asked, accelerator, "all"):
        if key in bands:
            band = {"slice": key, **bands[key]}
            if key != asked and "held_out_rows" in data:
                seen = data["held_out_rows"]
                band.update(asked=asked, asked_rows=int(seen.get(asked, 0)),
                            accelerator_rows=sum(int(n) for k, n in seen.items() if k.split("/")[0] == accelerator))
            extra = moe_band() if moe else None
            if extra is not None:
                band.update(low=min(band["low"], extra["low"]), high=max(band["high"], extra["high"]),
                            moe={"rows": extra["rows"], "accelerators": extra["accelerators"]})
            return band
    return None


def constants_for(accelerator: str) -> CostConstants:
    """Defaults, then the file's ``default`` section, then its section for ``accelerator``."""
    data = _overrides_file()
    c = CostConstants().with_overrides(data.get("default", {}).get("constants", {}))
    section = data.get("accelerators", {}).get(accelerator, {})
    return c.with_overrides(section.get("constants", {}))
