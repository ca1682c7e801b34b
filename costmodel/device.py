"""Time of compute and of collectives on one cluster: spec sheet, optionally a measured profile.

Collectives use an α–β model per network tier with NCCL's bus-bandwidth factors (ring
all-reduce moves ``2(n-1)/n`` of the buffer, all-gather and reduce-scatter ``(n-1)/n``). Which
tier a mesh axis uses follows from the axis order (outermost ``pp`` … innermost ``tp``) and the
scale-up domain: a group whose ranks lie in one scale-up domain uses it; a group that spans
domains runs hierarchically (scale-up part and scale-out part pipelined, as NCCL does), the
scale-out part carried by each GPU's own NIC share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from costmodel.configs import AxisGroup
from costmodel.constants import CostConstants, constants_for
from profiler.hardware import Cluster
from vocab.errors import ShardplanError
from vocab.strategy import FP8_PRECISIONS

if TYPE_CHECKING:  # the profile document belongs to the profiler
    from profiler.profile_schema import Profile

COLLECTIVE_FACTORS = {  # bytes on the wire per rank, over the buffer size, for a ring of n
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


class DeviceModel:
    """Prices compute and communication on a cluster, from spec sheets or a profile."""

    def __init__(self, cluster: Cluster, profile: Profile | None = None,
                 constants: CostConstants | None = None):
        self.cluster = cluster
        self.acc = cluster.accelerator
        self.profile = profile
        self.c = constants or constants_for(self.acc.name).with_overrides(self.acc.cost_constants)
        self.share = self._compute_share()
        self._coefficient_cache: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._dtensor = profile.compute.dtensor if profile is not None and profile.compute is not None else None
        # the embedding backward's two slopes, fitted once (None: no fit, or no bandwidth curves)
        self._embedding_fit = profile.embedding_backward() if self.measured("bandwidth") else None
        if profile is not None:
            kind = profile.device.kind
            if kind != self.acc.kind:
                raise ShardplanError(
                    f"profile was measured on a {kind} device ({profile.device.name}) but the cluster's "
                    f"accelerator '{self.acc.name}' is a {self.acc.kind}: profile and cluster must match"
                )

    def measured(self, curves: str) -> bool:
        """Whether the profile holds measured ``curves`` (``gemm``, ``attention``, ``bandwidth``),
        which then price that kind of work instead of the spec sheet."""
        return self.profile is not None and self.profile.compute is not None and bool(getattr(self.profile.compute, curves))

    def _compute_share(self) -> float:
        """The fraction of its measured speed a rank gets when a node's ranks share fewer cores
        than their profiled threads (CPU hosts): the fair share ``cores / (ranks · threads)`` times
        the sharing efficiency the comm profile measured (caches and switches cost a little more);
        1 otherwise."""
        cores = self.acc.cores_per_node
        if not cores or self.profile is None or self.profile.compute is None:
            return 1.0
        ranks = min(self.cluster.world_size, self.cluster.gpus_per_node)
        fair = cores / (ranks * self.profile.device.threads)
        if fair >= 1.0:
            return 1.0
        # ranks that all compute at once get at most their fair share: a measured efficiency
        # above 1 is the noise of timing the rank alone
        eff = min((f.sharing_efficiency for f in self.profile.comm), default=1.0)
        return fair * min(eff, 1.0)

    # ---- compute ---------------------------------------------------------------------------
    def gemm_rate(self, precision: str) -> float:
        """Achieved FLOP/s of a large GEMM."""
        rate = self.acc.peak_flops("bf16") * self.acc.gemm_efficiency * self.c.gemm_scale
        if self.fp8_gemms(precision):
            rate *= self.c.fp8_gemm_speedup
        if precision == "fp32":
            rate = self.acc.peak_flops("fp32") * self.acc.gemm_efficiency * self.c.gemm_scale
        return rate

    def gemm_time(self, flops: float, precision: str = "bf16", calls: float = 1.0, backward: bool = False,
                  shape: tuple[float, float, float] | None = None, groups: float | None = None) -> float:
        """Seconds for ``calls`` GEMMs of ``flops`` forward FLOPs each (backward: their two GEMMs).

        ``shape`` (m, n, k) of one GEMM, when known, prices it by shape: a measured profile by its
        curves; the spec sheet by the roofline, the call bound by memory when its operands and
        output (:func:`gemm_bytes`) take longer to read at ``gemm_stream_efficiency`` of the HBM
        bandwidth than its FLOPs to compute (a GEMM of few rows reads its whole weight for them).
        A grouped call (``groups`` GEMMs of ``shape`` in one kernel, as MoE experts run) pays
        ``grouped_gemm_overhead_s`` once; a measured profile, which times GEMMs one call each,
        prices it as ``groups`` calls."""
        if flops <= 0:
            return 0.0
        if self.measured("gemm"):
            phase = "bwd" if backward else "fwd"
            rate = self.profile.gemm_flops_per_s(flops / (groups or 1.0), phase, shape) * self.share
            return calls * flops * (2 if backward else 1) / rate
        fixed = self.c.fp8_gemm_overhead_s if self.fp8_gemms(precision) else self.c.gemm_overhead_s
        if groups is not None:
            fixed = max(fixed, self.c.grouped_gemm_overhead_s)
        t = flops / self.gemm_rate(precision)
        if shape is not None:
            nbytes = (groups or 1.0) * gemm_bytes(shape, precision, self.fp8_gemms(precision))
            t = max(t, nbytes / (self.acc.hbm_tbps * 1e12 * self.c.gemm_stream_efficiency))
        return calls * (t + fixed) * (2 if backward else 1)

    def stream_rate(self) -> float:
        """Bytes per second a streaming kernel moves on the spec sheet."""
        return self.acc.hbm_tbps * 1e12 * self.c.memory_efficiency

    def fp8_gemms(self, precision: str) -> bool:
        """Whether GEMMs of ``precision`` (fp8, or mxfp8: block-scaled fp8 at the fp8 rate) run in fp8
        on this accelerator (one without fp8 runs them in bf16)."""
        return precision in FP8_PRECISIONS and bool(self.acc.peak_tflops.get("fp8"))

    def attention_rate(self, kernel: str = "auto") -> float:
        """Achieved forward FLOP/s of the flash-attention ``kernel`` in training."""
        return self.acc.peak_flops("bf16") * self.acc.attention_fraction(kernel) * self.c.attention_efficiency

    def attention_time(self, flops: float, causal: bool, backward: bool = False, kernel: str = "auto",
                       shape: tuple[float, float] | None = None) -> float:
        """Flash-attention seconds for ``flops`` model FLOPs (full count, halved if causal);
        ``shape`` (query tokens per rank, head dim) prices the kernel's shape
        (:func:`attention_shape_factor`) on spec sheets."""
        if flops <= 0:
            return 0.0
        work = flops * (0.5 if causal else 1.0)
        if self.measured("attention"):
            if backward:  # the measured backward rate counts 2x the forward FLOPs
                return 2 * work / (self.profile.attention_flops_per_s(flops, phase="bwd") * self.share)
            return work / (self.profile.attention_flops_per_s(flops, phase="fwd") * self.share)
        rate = self.attention_rate(kernel)
        if shape is not None:
            rate *= attention_shape_factor(self.acc.attention_kernel(kernel), shape[0], shape[1], causal,
                                           "bwd" if backward else "fwd")
        t = work / rate + self.c.gemm_overhead_s
        return t * (self.c.attention_bwd_ratio if backward else 1.0)

    def memory_time(self, nbytes: float, op: str = "elementwise", backward: bool = False) -> float:
        """Seconds to move ``nbytes`` (the forward's traffic) through memory in a bandwidth-bound op."""
        if nbytes <= 0:
            return 0.0
        if self.measured("bandwidth"):
            t = nbytes / (self.profile.bytes_per_s(op) * self.share)
            return t * self.profile.bwd_fwd_ratio(op) if backward else t
        t = nbytes / self.stream_rate()
        return 2 * t if backward else t

    def kernel_times(self, nbytes: float, op: str, traffic: tuple[float, float]) -> tuple[float, float]:
        """(forward, backward) seconds of a bandwidth-bound operator of ``nbytes`` minimal forward
        traffic whose kernels move ``traffic`` times that each way (:func:`costmodel.kernels.traffic`),
        streamed at ``memory_efficiency`` of the HBM bandwidth; a measured profile prices the
        kernels the host ran instead (its bandwidth and backward ratio for ``op``)."""
        if nbytes <= 0:
            return 0.0, 0.0
        if self.measured("bandwidth"):
            return self.memory_time(nbytes, op), self.memory_time(nbytes, op, backward=True)
        return self.memory_time(nbytes * traffic[0], op), self.memory_time(nbytes * traffic[1], op)

    def embedding_backward_time(self, nbytes: float, table_bytes: float) -> float:
        """Seconds of an embedding's backward whose forward moves ``nbytes``, over a table of
        ``table_bytes`` (this rank's): the dense gradient of the whole table is zeroed, then the
        looked-up rows' gradients added. A profile's fit (:meth:`Profile.embedding_backward`)
        prices both; spec sheets the backward of the lookups plus one write of the table at peak
        memory bandwidth (a memset streams at close to it, unlike the small ops the fitted
        ``memory_efficiency`` describes); a profile without the fit, its backward-to-forward ratio."""
        if self.measured("bandwidth"):
            fit = self._embedding_fit
            if fit is None:
                return self.memory_time(nbytes, "embedding", backward=True)
            return (fit[0] * nbytes + fit[1] * table_bytes) / self.share
        return self.memory_time(nbytes, "embedding", backward=True) + table_bytes / (self.acc.hbm_tbps * 1e12)

    def dtensor_host(self, role: str) -> tuple[float, float]:
        """(forward, backward) host seconds DTensor tensor parallelism adds to one module of
        ``role`` (``linear``, ``norm``, ``loss``) on one rank: the profile's measurement, stretched
        like compute where ranks share cores; (0, 0) without one (spec sheets say nothing of the
        host: on a GPU the host runs ahead of the kernels, and at scale they hide it)."""
        if self._dtensor is None:
            return 0.0, 0.0
        f, b = self._dtensor.host(role)
        return f / self.share, b / self.share

    def loss_traffic_ratio(self) -> float:
        """Vocabulary-parallel cross-entropy's time per logit over plain cross-entropy's (1 unmeasured)."""
        return self._dtensor.loss_traffic_ratio if self._dtensor is not None else 1.0

    def with_host(self, device_s: Any, host_s: Any) -> Any:
        """Time of work that takes ``device_s`` on the device and ``host_s`` of the host's Python
        (scalars or numpy arrays): one thread does both on a CPU; a GPU's host runs ahead, so the
        slower of the two sets the pace."""
        return device_s + host_s if self.acc.kind == "cpu" else np.maximum(device_s, host_s)

    def host_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` between device and host memory."""
        return nbytes / (self.acc.host_link_gbps * 1e9) if nbytes > 0 else 0.0

    # ---- communication ---------------------------------------------------------------------
    # One α–β model for every caller: scalars (one group) or numpy arrays over configurations.
    def collective_latency(self, kind: str, group: AxisGroup) -> Any:
        """Seconds one more collective adds when the same bytes are cut into one more piece issued
        back to back: the constant part of :meth:`collective_time` (α; the spec's per-step
        latencies), which is linear in the bytes, without the wait for partners — pieces that
        follow each other wait once, as ``benchmarks/grad_sync_collectives.py`` measures (about α
        per extra all-reduce of DDP's per-tensor sync)."""
        return (2 * self.collective_time(kind, 1.0, group) - self.collective_time(kind, 2.0, group)
                - self.collective_wait(kind, group))

    def collective_wait(self, kind: str, group: AxisGroup) -> Any:
        """Seconds one more blocking collective waits for its partners beyond the bytes it moves:
        the profile's wait under load (ranks time-sharing cores), 0 without one (NCCL, spec sheets)."""
        n = np.asarray(group.size, dtype=float)
        if self.profile is None or not self.profile.comm:
            out = np.zeros(n.shape)
        else:
            out = _per_size(n, lambda x: self.profile.comm_fit(kind, x).wait_s)
        return _scalar_or(np.where(n <= 1, 0.0, out))

    def collective_time(self, kind: str, nbytes: Any, group: AxisGroup) -> Any:
        """Seconds for one collective over ``group`` of a buffer of ``nbytes`` (full size):
        α + β · bytes, with α and β of the group (:meth:`_coefficients`)."""
        alpha, beta, n = self._coefficients(kind, group)
        nbytes = np.asarray(nbytes, dtype=float)
        moves = (n > 1) & (nbytes > 0)
        if not moves.any():
            return _scalar_or(np.zeros(np.broadcast_shapes(n.shape, nbytes.shape)))
        return _scalar_or(np.where(moves, alpha + beta * nbytes, 0.0))

    def _coefficients(self, kind: str, group: AxisGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(α seconds, β seconds per byte, group size) of ``kind`` over ``group``, computed once per
        distinct group: the profile's fit when it measured collectives, else the spec sheet's."""
        if kind not in COLLECTIVE_FACTORS:
            raise ShardplanError(f"unknown collective '{kind}'")
        n = np.asarray(group.size, dtype=float)
        stride = np.asarray(group.stride, dtype=float)
        n, stride = np.broadcast_arrays(n, stride)
        key = (kind, n.shape, n.tobytes(), stride.tobytes())
        hit = self._coefficient_cache.get(key)
        if hit is not None:
            return hit
        if self.profile is not None and self.profile.comm:
            alpha = _per_size(n, lambda x: self.profile.comm_fit(kind, x).alpha_s + self.profile.comm_fit(kind, x).wait_s)
            beta = _per_size(n, lambda x: self.profile.comm_fit(kind, x).beta_s_per_byte)
        else:
            alpha, beta = self._alpha_beta(kind, n, stride)
        if len(self._coefficient_cache) > 4096:
            self._coefficient_cache.clear()
        self._coefficient_cache[key] = hit = (alpha, beta, n)
        return hit

    def domain_split(self, size: Any, stride: Any) -> tuple[np.ndarray, np.ndarray]:
        """(ranks per scale-up domain, domains) of a group of ``size`` ranks ``stride`` apart."""
        size, stride = np.maximum(np.asarray(size, dtype=float), 1), np.asarray(stride, dtype=float)
        domain = self.cluster.scale_up_domain
        dom_k = np.minimum(size, np.maximum(domain // np.maximum(stride, 1), 1))
        k = np.where(stride >= domain, 1, np.gcd(dom_k.astype(np.int64), size.astype(np.int64)))
        return k, size // k

    def _alpha_beta(self, kind: str, n: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Spec-sheet (α, β) of a collective: a ring within one scale-up domain; across domains the
        scale-up part and the scale-out part (each GPU's NIC share, on 1/k of the data) pipelined,
        so the slower part's bytes set β. In a mesh domain (``NetworkTier.topology``) a group's
        ranks have only their links to each other: ``k - 1`` of ``domain - 1``."""
        fac = COLLECTIVE_FACTORS[kind]
        up, out = self.acc.scale_up, self.acc.scale_out
        eff = self.acc.busbw_efficiency
        up_bw, out_bw = up.gbps * 1e9 * eff, out.gbps * 1e9 * eff
        with np.errstate(divide="ignore", invalid="ignore"):
            size = np.maximum(n, 1)
            factor = fac(size) * np.ones_like(size)
            log_n = np.ceil(np.log2(size))
            steps = np.ones_like(n) if kind == "send_recv" else log_n * (2 if kind == "all_reduce" else 1)
            k, m = self.domain_split(size, stride)
            if up.topology == "mesh":  # the group's ranks use their links to each other only
                links = max(self.cluster.scale_up_domain - 1, 1)
                up_bw = up_bw * np.minimum(np.maximum(k - 1, 1) / links, 1.0)
            single = (steps * up.latency_us * 1e-6, factor / up_bw)
            if kind == "send_recv":
                multi = (out.latency_us * 1e-6 * np.ones_like(size), np.full(size.shape, 1 / out_bw))
            else:
                intra = np.where(k > 1, fac(np.maximum(k, 1)) / up_bw, 0.0)
                inter = fac(m) / k / out_bw
                if kind == "all_to_all":  # no hierarchy to exploit: every rank sends (n-1)/n across
                    inter = factor * (1 - (k - 1) / np.maximum(size - 1, 1)) / out_bw
                lat = steps * np.where(k > 1, up.latency_us, 0.0) * 1e-6 + np.ceil(
                    np.log2(np.maximum(m, 1))) * out.latency_us * 1e-6
                multi = (lat, np.maximum(intra, inter))  # bytes >= 0: max(a·x, b·x) = max(a, b)·x
            one = m == 1
            return np.where(one, single[0], multi[0]), np.where(one, single[1], multi[1])


def gemm_bytes(shape: tuple[float, float, float], precision: str, fp8: bool) -> float:
    """Bytes one GEMM of ``shape`` (m, n, k) moves at least: its two operands read once (one byte
    an element in fp8, four in fp32, else two) and its output written once (16 bits; fp32 in
    fp32). Backward's two GEMMs move twice that, as they compute twice the FLOPs."""
    m, n, k = shape
    width = 1.0 if fp8 else (4.0 if precision == "fp32" else 2.0)
    return (m * k + n * k) * width + m * n * (4.0 if precision == "fp32" else 2.0)


#: a flash kernel's throughput by head dim, over its throughput at 128 (the dim its tiles are
#: tuned for; the accelerator files' efficiencies are at 128): a smaller head dim halves the work
#: per K/V tile loaded. Read off the kernels' papers: FlashAttention-2 (Dao, 2023, figures 4-6,
#: A100: head dim 64 at about 0.9 of 128), FlashAttention-3 (Shah et al., 2024, figures 5-6, H100:
#: 64 at about 0.7 of 128, 256 a little above it).
HEAD_DIM_FACTOR = {"flash2": ((64, 0.88), (128, 1.0), (256, 1.0)),
                   "flash3": ((64, 0.72), (128, 1.0), (256, 1.08))}
#: query and key rows per tile of a flash kernel: a causal kernel computes whole tiles on the diagonal
FLASH_TILE = 128
#: the work of a flash kernel that is linear in its query tokens (forward: the softmax statistics,
#: the output's rescale and write; backward: the dO·O pass, the dQ accumulation, the dK/dV writes),
#: as the attention span, in key tokens, whose FLOPs it costs per query. Fitted to the kernels'
#: measured rates on one H200 (FlashAttention-2 and cuDNN, head dims 64-256, 512-32,768 tokens,
#: causal and not; ``benchmarks/gpu_kernels.py``, docs/validation.md): the median error of the
#: resulting length curve is 4% forward and 3% backward, the worst 20% and 26% (causal, 512 tokens).
FLASH_LINEAR_TOKENS = {"fwd": 80.0, "bwd": 255.0}


def attention_shape_factor(kernel: str, tokens: float, head_dim: float, causal: bool, phase: str = "fwd") -> float:
    """Throughput of a flash kernel at ``tokens`` query tokens per rank and ``head_dim``, over its
    throughput on long sequences at head dim 128: the head-dim curve (:data:`HEAD_DIM_FACTOR`,
    interpolated in log2 of the dim); when causal, the diagonal tiles computed whole (with ``n``
    tiles of :data:`FLASH_TILE` rows, ``n(n+1)/2`` tiles for ``n²/2`` tiles of useful work); and
    the ``phase``'s linear work (:data:`FLASH_LINEAR_TOKENS`), which costs ``c/tokens`` of the
    quadratic work, twice that when causal (half the quadratic work)."""
    pts = HEAD_DIM_FACTOR.get(kernel, HEAD_DIM_FACTOR["flash2"])
    xs = [np.log2(d) for d, _ in pts]
    f = float(np.interp(np.log2(max(head_dim, 1.0)), xs, [v for _, v in pts]))
    if tokens > 0:
        if causal:
            n = max(tokens / FLASH_TILE, 1.0)
            f *= n / (n + 1.0)
        f /= 1.0 + (2.0 if causal else 1.0) * FLASH_LINEAR_TOKENS[phase] / tokens
    return f


def _per_size(n: np.ndarray, fn: Any) -> np.ndarray:
    """``fn`` of every group size in ``n`` above 1 (0 for the others), called once per distinct size."""
    uniq, inv = np.unique(n, return_inverse=True)
    vals = np.array([fn(int(x)) if x > 1 else 0.0 for x in uniq])
    return vals[inv.reshape(-1)].reshape(n.shape)


def _scalar_or(x: np.ndarray) -> Any:
    """A float for a 0-d array, the array otherwise."""
    return float(x) if x.ndim == 0 else x
