"""Measure forward and backward time of the operators the cost model prices, on one device.

``profile_compute`` sweeps GEMMs over (m, n, k) shapes (squares for the curve, transformer shapes
and their tensor-parallel shrinks for realism), scaled-dot-product attention (causal and not,
several sequence lengths and head dims) and the bandwidth-bound operators. Every point is
warmed up, repeated until a time budget or a repeat cap, and summarised by its median and
spread. CUDA is timed with events and synchronisation, the CPU with ``time.perf_counter``.
Grids can be injected (tests use tiny ones).
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.nn.functional as F

from profiler.measure_dtensor import measure_dtensor_overhead
from profiler.profile_schema import (
    ADAM_BYTES_PER_PARAM,
    AttnPoint,
    BwPoint,
    ComputeProfile,
    DeviceInfo,
    GemmPoint,
)
from vocab.errors import ShardplanError, first_line

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GemmShape = tuple[int, int, int, str]  # m, n, k, tag
AttnShape = tuple[int, int, int, int, bool]  # batch, heads, seq, head_dim, causal
BwCase = tuple[str, str, tuple[int, ...]]  # op, variant, shape


# ---- devices -----------------------------------------------------------------------------------

def resolve_device(spec: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a device that is not there is a :class:`ShardplanError`."""
    s = spec.strip().lower()
    if s == "cpu":
        return torch.device("cpu")
    if s == "cuda" or s.startswith("cuda:"):
        idx_text = s.partition(":")[2]
        if idx_text and not idx_text.isdigit():
            raise ShardplanError(f"device '{spec}': the CUDA index must be a number (cuda:0)")
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)")
            raise ShardplanError(f"device '{spec}' is not available: {why} (torch {torch.__version__}); "
                                 "use --device cpu")
        n = torch.cuda.device_count()
        idx = int(idx_text) if idx_text else torch.cuda.current_device()
        if idx >= n:
            raise ShardplanError(f"device '{spec}' does not exist: {n} CUDA device(s) visible "
                                 f"(cuda:0..cuda:{n - 1})")
        return torch.device("cuda", idx)
    raise ShardplanError(f"device '{spec}': expected cpu, cuda or cuda:N")


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); without them PyTorch runs
    bf16 GEMMs on fallback kernels several times slower than fp32 (measured here: 5x forward)."""
    checks = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(f()) for f in checks if callable(f))


def resolve_dtype(name: str | None, device: torch.device) -> str:
    """``auto``: bf16 on GPUs and on CPUs with bf16 matrix instructions, else fp32 (what training on
    such a CPU would use)."""
    if name is None or name == "auto":
        return "bf16" if device.type == "cuda" or cpu_has_fast_bf16() else "fp32"
    if name not in DTYPES:
        raise ShardplanError(f"dtype '{name}' is not one of auto, {', '.join(DTYPES)}")
    return name


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def guess_accelerator(device_name: str, mem_gb: float = 0.0) -> str | None:
    """The accelerator file a CUDA device name matches (``NVIDIA H100 80GB HBM3`` → h100-sxm)."""
    n = device_name.lower()
    if "gb200" in n:
        return "gb200"
    for key in ("h200", "b200", "mi300x"):
        if key in n:
            return key
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100-80gb" if "80" in n or mem_gb > 60 else "a100-40gb"
    return None


def host_load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_warning(load: float | None) -> str | None:
    """A warning when other work competes for the CPU (timings of a busy host are inflated)."""
    cores = os.cpu_count() or 1
    if load is not None and load > 0.5 * cores:
        return (f"warning: the host is busy (load {load:.1f} on {cores} cores) when measuring starts; "
                "timings will be inflated and noisy")
    return None


def device_info(device: torch.device, load_before: float | None = None) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, kind = props.name, "gpu"
        acc = guess_accelerator(name, props.total_memory / 1e9)
        threads = os.cpu_count() or 1
    else:
        name, kind, acc, threads = _cpu_name(), "cpu", "cpu", torch.get_num_threads()
    return DeviceInfo(
        kind=kind, name=name, torch_version=torch.__version__, cuda_version=torch.version.cuda,
        threads=threads, hostname=socket.gethostname(), created=datetime.now(UTC).isoformat(timespec="seconds"),
        index=device.index if device.type == "cuda" else None, accelerator=acc, load_before=load_before,
    )


# ---- timing ------------------------------------------------------------------------------------

class Clock:
    """Marks on a monotonic clock (CPU) or CUDA events on the current stream (GPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def elapsed(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (call :meth:`sync` first on CUDA)."""
        if self.cuda:
            return max(a.elapsed_time(b) / 1e3, 1e-9)
        return max(b - a, 1e-9)


@dataclass(frozen=True)
class Timing:
    """Warm-up runs, then repeats until ``target_s`` of measuring, within [min_reps, max_reps].

    Past ``budget_s`` of a whole sweep (a slow or busy host) the remaining points get one warm-up
    and one timed run each; past ``deadline_s`` only operators without any point yet are measured.
    So ``--quick`` keeps its time limit.
    """

    warmup: int = 1
    min_reps: int = 3
    max_reps: int = 15
    target_s: float = 0.25
    budget_s: float | None = None
    deadline_s: float | None = None


QUICK = Timing(warmup=1, min_reps=3, max_reps=12, target_s=0.2, budget_s=120.0, deadline_s=200.0)
FULL = Timing(warmup=2, min_reps=5, max_reps=50, target_s=1.0)
MINIMAL = Timing(warmup=1, min_reps=1, max_reps=1, target_s=0.0)


def spread(xs: list[float]) -> float:
    """Relative interquartile range with 4+ samples, else (max - min) / median."""
    med = statistics.median(xs)
    if med <= 0:
        return 0.0
    if len(xs) >= 4:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        return (q[2] - q[0]) / med
    return (max(xs) - min(xs)) / med


def timed_runs(once: Callable[[], tuple[Any, ...]], clock: Clock, timing: Timing) -> list[tuple[Any, ...]]:
    """The clock marks ``once()`` returns, over as many repeats as ``timing`` asks for (from the
    time between its first and last mark in the warm-up runs), the device synchronised after."""
    est = 0.0
    for _ in range(max(1, timing.warmup)):
        marks = once()
        clock.sync()
        est = clock.elapsed(marks[0], marks[-1])
    reps = int(min(timing.max_reps, max(timing.min_reps, math.ceil(timing.target_s / max(est, 1e-9)))))
    runs = [once() for _ in range(reps)]
    clock.sync()
    return runs


def time_fwd_bwd(fwd: Callable[[], torch.Tensor], leaves: list[torch.Tensor], clock: Clock,
                 timing: Timing) -> tuple[float, float, float]:
    """Median forward and backward seconds of ``fwd()`` (a tensor; backward with ones-like
    gradient) and the spread of their sum. Gradients of ``leaves`` are cleared between runs."""

    def once() -> tuple[Any, Any, Any]:
        for t in leaves:
            t.grad = None
        m0 = clock.mark()
        out = fwd()
        m1 = clock.mark()
        out.backward(grad)
        m2 = clock.mark()
        return m0, m1, m2

    with torch.no_grad():
        grad = torch.ones_like(fwd())
    runs = timed_runs(once, clock, timing)
    fw = [clock.elapsed(a, b) for a, b, _ in runs]
    bw = [clock.elapsed(b, c) for _, b, c in runs]
    return statistics.median(fw), statistics.median(bw), spread([f + b for f, b in zip(fw, bw, strict=True)])


# ---- grids -------------------------------------------------------------------------------------

def gemm_grid(quick: bool, kind: str) -> list[GemmShape]:
    """Squares for the curve, plus qkv/out/up/down shapes of a block and their TP shrinks
    (column-parallel GEMMs lose n, row-parallel ones lose k)."""
    gpu = kind == "gpu"
    if gpu:
        squares = [256, 512, 1024, 2048, 4096, 8192, 16384] if quick else [128 * 2**i for i in range(9)]
        blocks = [(2048, 2048), (8192, 4096), (8192, 8192)] if quick else \
            [(m, h) for m in (1024, 4096, 16384) for h in (1024, 2048, 4096, 8192, 12288)]
    else:
        squares = [128, 256, 512, 1024, 2048] if quick else [64, 128, 256, 512, 1024, 2048, 3072, 4096]
        blocks = [(128, 1024), (512, 1024), (1024, 2048)] if quick else \
            [(m, h) for m in (128, 512, 2048) for h in (1024, 2048, 4096)]
    out: dict[tuple[int, int, int], str] = {}
    for s in squares:
        out.setdefault((s, s, s), "square")
    for m, h in blocks:
        f = 4 * h
        for tp in (1, 2, 4, 8):
            for name, n, k, col in (("qkv", 3 * h, h, True), ("out", h, h, False),
                                    ("up", f, h, True), ("down", h, f, False)):
                shape = (m, n // tp, k) if col else (m, n, k // tp)
                out.setdefault(shape, f"{name}/h{h}/tp{tp}")
    return [(m, n, k, tag) for (m, n, k), tag in out.items()]


def attn_grid(quick: bool, kind: str) -> list[AttnShape]:
    if kind == "gpu":
        b, heads = (4, 16) if quick else (8, 32)
        seqs = [512, 1024, 2048, 4096, 8192] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    else:
        b, heads = 1, 8
        seqs = [256, 1024] if quick else [128, 256, 512, 1024, 2048]
    return [(b, heads, s, d, c) for s in seqs for d in (64, 128) for c in (False, True)]


def bw_grid(quick: bool, kind: str) -> list[BwCase]:
    if kind == "gpu":
        tokens = [4096, 16384, 65536] if quick else [2048, 8192, 32768, 131072]
        h, vocab, ce_tokens = 4096, [50304, 128256], ([2048, 8192] if quick else [1024, 4096, 16384])
    else:
        tokens = [1024, 4096, 8192] if quick else [256, 1024, 4096, 16384, 32768]
        h, vocab, ce_tokens = 2048, [50304], ([256, 1024] if quick else [256, 1024, 2048])
    cases: list[BwCase] = []
    for t in tokens:
        cases += [("norm", "layernorm", (t, h)), ("norm", "rmsnorm", (t, h)),
                  ("softmax", "softmax", (t, 2048)), ("activation", "gelu", (t, 2 * h)),
                  ("activation", "swiglu", (t, 2 * h)), ("elementwise", "add", (t, h)),
                  ("elementwise", "dropout", (t, h)),
                  ("embedding", "lookup", (t, 32000 if quick else 128256, h))]
    for v in vocab:
        for t in ce_tokens:
            cases.append(("cross_entropy", "cross_entropy", (t, v)))
    for n in ([1 << 26, 1 << 28] if kind == "gpu" else [1 << 22, 1 << 24]):  # parameters one rank steps
        cases.append(("optimizer", "adamw", (n,)))
    return cases


# ---- the sweeps --------------------------------------------------------------------------------

def _leaf(shape: Iterable[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(True)


def measure_gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, clock: Clock,
                 timing: Timing, tag: str = "") -> GemmPoint:
    x, w = _leaf((m, k), dtype, device), _leaf((n, k), dtype, device, 0.02)
    fw, bw, sp = time_fwd_bwd(lambda: F.linear(x, w), [x, w], clock, timing)
    flops = 2.0 * m * n * k
    return GemmPoint(m=m, n=n, k=k, fwd_s=fw, bwd_s=bw, flops=flops, flops_per_s=3 * flops / (fw + bw),
                     spread=sp, tag=tag)


def measure_attention(b: int, h: int, s: int, d: int, causal: bool, dtype: torch.dtype, device: torch.device,
                      clock: Clock, timing: Timing) -> AttnPoint:
    q, k, v = (_leaf((b, h, s, d), dtype, device) for _ in range(3))
    fw, bw, sp = time_fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                              [q, k, v], clock, timing)
    flops = 4.0 * b * h * s * s * d
    return AttnPoint(batch=b, heads=h, seq=s, head_dim=d, causal=causal, fwd_s=fw, bwd_s=bw, flops=flops,
                     flops_per_s=3 * flops / (fw + bw), spread=sp)


def _bw_case(op: str, variant: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], float]:
    """(forward closure, leaves, forward bytes moved) of one bandwidth-bound case."""
    es = torch.tensor([], dtype=dtype).element_size()
    if op == "norm":
        t, h = shape
        x, w = _leaf((t, h), dtype, device), _leaf((h,), dtype, device)
        if variant == "rmsnorm":
            return (lambda: F.rms_norm(x, (h,), w)), [x, w], 2.0 * t * h * es
        bias = _leaf((h,), dtype, device)
        return (lambda: F.layer_norm(x, (h,), w, bias)), [x, w, bias], 2.0 * t * h * es
    if op == "softmax":
        r, c = shape
        x = _leaf((r, c), dtype, device)
        return (lambda: torch.softmax(x, dim=-1)), [x], 2.0 * r * c * es
    if op == "activation":
        t, f = shape
        if variant == "swiglu":
            x = _leaf((t, 2 * f), dtype, device)

            def swiglu() -> torch.Tensor:
                gate, up = x.chunk(2, dim=-1)
                return F.silu(gate) * up
            return swiglu, [x], 3.0 * t * f * es
        x = _leaf((t, f), dtype, device)
        return (lambda: F.gelu(x, approximate="tanh")), [x], 2.0 * t * f * es
    if op == "elementwise":
        t, h = shape
        a, b = _leaf((t, h), dtype, device), _leaf((t, h), dtype, device)
        if variant == "dropout":  # random numbers, a mask (1 byte), the scaled output
            return (lambda: F.dropout(a, 0.1, training=True)), [a], 2.0 * t * h * es + t * h
        return (lambda: a + b), [a, b], 3.0 * t * h * es
    if op == "embedding":
        t, v, h = shape
        table = _leaf((v, h), dtype, device, 0.02)
        idx = torch.randint(0, v, (t,), device=device)
        return (lambda: F.embedding(idx, table)), [table], 2.0 * t * h * es + 8.0 * t
    if op == "cross_entropy":
        t, v = shape
        logits = _leaf((t, v), dtype, device)
        target = torch.randint(0, v, (t,), device=device)
        return (lambda: F.cross_entropy(logits, target)), [logits], 2.0 * t * v * es
    raise ShardplanError(f"unknown bandwidth op '{op}'")


def measure_optimizer(n: int, device: torch.device, clock: Clock, timing: Timing) -> BwPoint:
    """One AdamW step over ``n`` fp32 parameters (the master weights), as the runtime steps them:
    fused where PyTorch has the kernel (CPU and CUDA), else for-each. ``bytes`` is
    :data:`ADAM_BYTES_PER_PARAM` per parameter, the traffic the cost model prices the step by, so
    ``bytes_per_s`` converts its bytes into this step's seconds."""
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device) * 1e-3
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0, fused=True)
        opt.step()
    except RuntimeError:
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0, foreach=True)

    def once() -> tuple[Any, Any]:
        m0 = clock.mark()
        opt.step()
        return m0, clock.mark()

    ts = [clock.elapsed(a, b) for a, b in timed_runs(once, clock, timing)]
    sec, nbytes = statistics.median(ts), float(ADAM_BYTES_PER_PARAM * n)
    return BwPoint(bytes=nbytes, seconds=sec, bytes_per_s=nbytes / sec, variant="adamw", shape=[n], spread=spread(ts))


def measure_bw(op: str, variant: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
               clock: Clock, timing: Timing) -> BwPoint:
    if op == "optimizer":
        return measure_optimizer(shape[0], device, clock, timing)
    fwd, leaves, nbytes = _bw_case(op, variant, shape, dtype, device)
    fw, bw, sp = time_fwd_bwd(fwd, leaves, clock, timing)
    return BwPoint(bytes=nbytes, seconds=fw, bytes_per_s=nbytes / fw, bwd_s=bw, variant=variant,
                   shape=list(shape), spread=sp)


@contextmanager
def sweep_progress(enabled: bool) -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """``new_task(description, total)`` returns an ``advance()``; a rich bar per sweep on stderr."""
    if not enabled:
        yield lambda desc, total: (lambda: None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as prog:
        def new_task(desc: str, total: int) -> Callable[[], None]:
            tid = prog.add_task(desc, total=total)
            return lambda: prog.advance(tid)
        yield new_task


def profile_compute(
    device: str | torch.device = "cpu", dtype: str | None = None, quick: bool = False, *,
    gemm_shapes: list[GemmShape] | None = None, attn_shapes: list[AttnShape] | None = None,
    bw_cases: list[BwCase] | None = None, timing: Timing | None = None, progress: bool = True,
    dtensor: bool = True,
) -> tuple[DeviceInfo, ComputeProfile]:
    """Run the compute sweeps; grids default to :func:`gemm_grid`, :func:`attn_grid`, :func:`bw_grid`;
    ``dtensor`` also measures DTensor TP's host overhead (:mod:`profiler.measure_dtensor`)."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dname = resolve_dtype(dtype, dev)
    dt = DTYPES[dname]
    kind = "gpu" if dev.type == "cuda" else "cpu"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timing = timing or (QUICK if quick else FULL)
    gemms = gemm_grid(quick, kind) if gemm_shapes is None else [(*s[:3], s[3] if len(s) > 3 else "") for s in gemm_shapes]
    attns = attn_grid(quick, kind) if attn_shapes is None else attn_shapes
    cases = bw_grid(quick, kind) if bw_cases is None else bw_cases
    clock = Clock(dev)
    load = host_load()
    t0 = time.perf_counter()
    out = ComputeProfile(dtype=dname)
    def tm() -> Timing:
        if timing.budget_s is not None and time.perf_counter() - t0 > timing.budget_s:
            return MINIMAL
        return timing

    def skip(have: int) -> bool:
        late = timing.deadline_s is not None and time.perf_counter() - t0 > timing.deadline_s
        if late and have:
            out.skipped += 1
        return late and have > 0

    try:
        with sweep_progress(progress) as new_task:
            if gemms:
                adv = new_task("GEMM (fwd+bwd)", len(gemms))
                for m, n, k, tag in gemms:
                    if not skip(len(out.gemm)):
                        out.gemm.append(measure_gemm(m, n, k, dt, dev, clock, tm(), tag))
                    adv()
            if attns:
                adv = new_task("attention (SDPA)", len(attns))
                for b, h, s, d, c in attns:
                    if not skip(len(out.attention)):
                        out.attention.append(measure_attention(b, h, s, d, c, dt, dev, clock, tm()))
                    adv()
            if cases:
                adv = new_task("bandwidth-bound ops", len(cases))
                for op, variant, shape in cases:
                    if not skip(len(out.bandwidth.get(op, []))):
                        out.bandwidth.setdefault(op, []).append(
                            measure_bw(op, variant, tuple(shape), dt, dev, clock, tm()))
                    adv()
            if dtensor:
                adv = new_task("DTensor TP overhead", 1)
                out.dtensor, why = measure_dtensor_overhead(dev, reps=10 if quick else 30)
                if why:
                    print(f"note: DTensor overhead not measured: {why}", file=sys.stderr)
                adv()
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) is a RuntimeError too
        msg = first_line(e)
        if isinstance(e, torch.OutOfMemoryError) or "allocate" in msg:
            raise ShardplanError(f"out of memory on {dev} during the compute sweep: {msg}") from None
        raise
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out.wall_s = time.perf_counter() - t0
    return device_info(dev, load), out
