"""Kernel rates on one device against the cost model's spec-sheet prices: GEMMs by shape (bf16 and
fp8), flash attention by sequence length and head dim, and the memory-bound kernels by class.

    python benchmarks/gpu_kernels.py                       # cuda:0, against its accelerator file
    python benchmarks/gpu_kernels.py --device cpu --small  # a dry run of every section on CPU

Every row prints the measured time, the rate it implies (TFLOP/s, or TB/s over the bytes the
kernels move as ``costmodel.kernels`` counts them) and the cost model's time for the same work on
the accelerator file of the device (``DeviceModel`` on spec sheets, current constants), so a row's
``model/measured`` is the model's error on that kernel. Sections:

- ``copy``: a device-to-device copy, the streaming ceiling (bytes read and written).
- ``gemm``: the forward, input-gradient and weight-gradient GEMMs of the linear layers of
  transformer blocks of hidden 768-8192 (QKV, output, MLP up, MLP down; also MLP up split 8 ways by
  tensor parallelism) at 4,096 and 16,384 tokens; bf16 ``torch.mm`` and, where the device has
  fp8 (sm89+), ``torch._scaled_mm`` with per-tensor and per-row scales.
- ``cast``: an activation cast to fp8 in both orientations with its amax, eager and compiled.
- ``attention``: ``scaled_dot_product_attention`` forward and forward+backward with the flash and
  cuDNN back-ends, causal and not, head dim 64/128/256, 512-32,768 tokens per sequence.
- ``memory``: the eager RMSNorm, SwiGLU and cross-entropy of ``profiler.kernel_traffic`` and the
  fused references, forward and backward; the residual add; a fused and a foreach AdamW step.
- ``rows``: dense GEMMs of 16-4,096 rows (MLP projections of 8B-405B blocks) against the roofline.
- ``moe``: routed experts' grouped GEMMs (``torch._grouped_mm``, and a loop of one GEMM per
  expert) at 16-4,096 rows per expert with loads drawn at random, for Mixtral-, DeepSeek-V3- and
  Qwen3-30B-shaped experts; the eager token permutations forward and backward.

``--json PATH`` writes every row; ``--summarize PATH`` prints the summary tables of such a file
(docs/validation.md keeps them). ``--limit-s`` stops starting new sections past that time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.device import DeviceModel  # noqa: E402
from costmodel.experts import grouped_gemm_time, permute_bytes, permute_times  # noqa: E402
from costmodel.kernels import EAGER_BYTES, FP8_CAST_BYTES, FUSED_BYTES, MINIMAL_BYTES, RESIDUAL_BYTES  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.kernel_traffic import norm_fused, rmsnorm_eager, swiglu_eager  # noqa: E402
from profiler.measure_compute import guess_accelerator  # noqa: E402
from profiler.profile_schema import ADAM_BYTES_PER_PARAM  # noqa: E402

ROWS: list[dict] = []


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, target_s: float = 0.01, max_reps: int = 50) -> float:
    """Seconds of one call of ``fn``: two warm-ups, then the fastest of three blocks of calls
    (each about ``target_s``), timed with CUDA events on a GPU."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(2, target_s / one)))
    best = float("inf")
    for _ in range(3):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) / reps)
    return best


def row(section: str, name: str, measured_s: float, model_s: float, work: float, unit: str, **extra: object) -> None:
    """Record and print one row: ``work`` FLOPs (unit TFLOP/s) or bytes (TB/s) in ``measured_s``."""
    rate = work / measured_s / 1e12
    r = {"section": section, "name": name, "measured_s": measured_s, "model_s": model_s,
         "rate": rate, "unit": unit, "model_over_measured": model_s / measured_s if model_s else None, **extra}
    ROWS.append(r)
    ratio = f"{model_s / measured_s:6.2f}" if model_s else "     -"
    print(f"| {section} | {name} | {measured_s * 1e3:9.3f} | {model_s * 1e3:9.3f} | {ratio} | {rate:7.1f} {unit} |",
          flush=True)


# ---- sections ------------------------------------------------------------------------------

def copy_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    n = (1 << 20) if small else (1 << 30)  # bf16 elements: 2 GiB
    x = torch.empty(n, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), dev)
    row("copy", f"{n * 2 / 2**30:.2f} GiB", t, 2 * n * 2 / (model.acc.hbm_tbps * 1e12), 2 * n * 2, "TB/s")


def block_gemms(d: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of one transformer block's linear layers."""
    return [("qkv", 3 * d, d), ("out", d, d), ("up", ffn, d), ("down", d, ffn), ("up/tp8", ffn // 8, d)]


def gemm_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    hiddens = [256, 512] if small else [768, 1024, 1536, 2048, 2560, 4096, 5120, 8192]
    tokens = [256] if small else [4096, 16384]
    fp8 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9) and hasattr(torch, "_scaled_mm")
    for m in tokens:
        for d in hiddens:
            for lname, n, k in block_gemms(d, 4 * d):
                # forward y = x W^T (m×k · k×n); input gradient (m×n · n×k); weight gradient (n×m · m×k)
                for phase, (a, b, c) in {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}.items():
                    flops = 2.0 * a * b * c
                    x = torch.randn(a, c, dtype=torch.bfloat16, device=dev)
                    w = torch.randn(b, c, dtype=torch.bfloat16, device=dev)
                    t = timed(lambda x=x, w=w: torch.mm(x, w.t()), dev)
                    pred = model.gemm_time(flops, "bf16", shape=(a, b, c))
                    shape = {"m": a, "n": b, "k": c, "hidden": d, "tokens": m, "layer": lname, "phase": phase}
                    row("gemm bf16", f"d{d} t{m} {lname} {phase} ({a}x{b}x{c})", t, pred, flops, "TFLOP/s", **shape)
                    if fp8:
                        xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
                        one = torch.ones((), device=dev)
                        rs_a, rs_b = torch.ones(a, 1, device=dev), torch.ones(1, b, device=dev)
                        for scale, (sa, sb) in {"tensor": (one, one), "row": (rs_a, rs_b)}.items():
                            try:
                                t8 = timed(lambda xq=xq, wq=wq, sa=sa, sb=sb: torch._scaled_mm(
                                    xq, wq.t(), sa, sb, out_dtype=torch.bfloat16), dev)
                            except RuntimeError as e:  # a shape or scaling the back-end refuses
                                print(f"| gemm fp8/{scale} | {a}x{b}x{c} | refused: {str(e)[:80]} |")
                                continue
                            row(f"gemm fp8/{scale}", f"d{d} t{m} {lname} {phase} ({a}x{b}x{c})", t8,
                                model.gemm_time(flops, "fp8", shape=(a, b, c)), flops, "TFLOP/s",
                                speedup=t / t8, **shape)
                    del x, w


def cast_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    """An activation cast to fp8 for a GEMM pair, both orientations, with its per-tensor amax: eager
    (an amax pass, the cast, a transpose) and compiled (``torch.compile`` fuses what it can), as TB/s
    over the bytes ``costmodel.kernels.FP8_CAST_BYTES`` counts per element for each stack."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
        print("| fp8 cast | skipped: no fp8 on this device |")
        return

    def cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 448.0 / x.abs().amax().float().clamp(min=1e-12)
        y = (x.float() * scale).to(torch.float8_e4m3fn)
        return y, y.t().contiguous()

    compiled = torch.compile(cast)
    for m, k in ((4096, 8192), (16384, 8192), (16384, 28672)):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        for stack, fn in (("eager", cast), ("fused", compiled)):
            per = FP8_CAST_BYTES[stack]
            t = timed(lambda fn=fn, x=x: fn(x), dev)
            pred = model.memory_time(x.numel() * per, "elementwise")
            row("fp8 cast", f"{stack} {m}x{k} amax, cast, both orientations", t, pred, x.numel() * per,
                f"TB/s ({per:g} B/element)")


def _attention_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: object,
                     dev: torch.device) -> tuple[float, float]:
    """Seconds of SDPA forward, and of forward plus backward, on ``backend``."""
    from torch.nn.attention import sdpa_kernel

    g = torch.randn_like(q)
    with sdpa_kernel(backend):
        def fwd() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        tf = timed(fwd, dev)
        tfb = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), g), dev)
    return tf, tfb


def attention_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    from torch.nn.attention import SDPBackend

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION} if dev.type == "cuda" \
        else {"math": SDPBackend.MATH}
    total = 1024 if small else 32768  # tokens per call (batch × sequence)
    seqs = [128, 256] if small else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    for hd in (64, 128, 256):
        heads = (256 if small else 4096) // hd
        for s in seqs:
            b = max(1, total // s)
            for causal in (True, False):
                q, k, v = (torch.randn(b, heads, s, hd, dtype=torch.bfloat16, device=dev, requires_grad=True)
                           for _ in range(3))
                flops = 4.0 * b * heads * s * s * hd  # the full score matrix, forward
                work = flops * (0.5 if causal else 1.0)
                for bname, backend in backends.items():
                    try:
                        tf, tfb = _attention_times(q, k, v, causal, backend, dev)
                    except RuntimeError as e:
                        print(f"| attention {bname} | hd{hd} s{s} | refused: {str(e)[:80]} |")
                        continue
                    pf = model.attention_time(flops, causal, shape=(s, hd))
                    pb = model.attention_time(flops, causal, backward=True, shape=(s, hd))
                    tag = f"hd{hd} s{s} {'causal' if causal else 'full'}"
                    extra = {"head_dim": hd, "seq": s, "causal": causal, "backend": bname}
                    row(f"attention {bname} fwd", tag, tf, pf, work, "TFLOP/s", **extra)
                    row(f"attention {bname} bwd", tag, max(tfb - tf, 1e-9), pb, 2.5 * work, "TFLOP/s (2.5x fwd)",
                        **extra)
                del q, k, v


def memory_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    rows_ = 512 if small else 16384
    widths = [256] if small else [2048, 4096, 8192]

    def fwd_bwd(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> tuple[float, float]:
        xs = [torch.randn(s, dtype=torch.bfloat16, device=dev, requires_grad=True) for s in shapes]
        y = fn(*xs)
        g = torch.randn_like(y)
        tf = timed(lambda: fn(*xs), dev)
        tfb = timed(lambda: torch.autograd.grad(fn(*xs), xs, g), dev)
        return tf, max(tfb - tf, 1e-9)

    for w in widths:
        n = rows_ * w
        cases = {
            "rmsnorm eager": (lambda x, g: rmsnorm_eager(x, g), [(rows_, w), (w,)], "rmsnorm", EAGER_BYTES),
            "rmsnorm fused (layer_norm)": (lambda x, g: norm_fused(x, g), [(rows_, w), (w,)], "rmsnorm",
                                           FUSED_BYTES),
            "swiglu eager": (swiglu_eager, [(rows_, w), (rows_, w)], "swiglu", EAGER_BYTES),
            "residual add": (torch.add, [(rows_, w), (rows_, w)], None, None),
        }
        for name, (fn, shapes, cls, table) in cases.items():
            tf, tb = fwd_bwd(fn, *shapes)
            per = table[cls] if table is not None else RESIDUAL_BYTES
            nbytes = n * MINIMAL_BYTES[cls] if cls else n * 6.0
            base = MINIMAL_BYTES[cls] if cls else 6.0
            pf, pb = model.kernel_times(nbytes, "elementwise", (per[0] / base, per[1] / base))
            row("memory fwd", f"{name} {rows_}x{w}", tf, pf, n * per[0], "TB/s (counted)")
            if cls:  # an add's backward passes the gradient on: no kernel (the fork's sum is elsewhere)
                row("memory bwd", f"{name} {rows_}x{w}", tb, pb, n * per[1], "TB/s (counted)")
    ce_rows = 256 if small else 8192
    for vocab in ([1024] if small else [50304, 128256]):
        target = torch.randint(0, vocab, (ce_rows,), device=dev)
        n = ce_rows * vocab
        for name, fn, table in (("cross-entropy eager (fp32)", lambda x, t=target: F.cross_entropy(x.float(), t),
                                 EAGER_BYTES), ("cross-entropy bf16", lambda x, t=target: F.cross_entropy(x, t), None)):
            tf, tb = fwd_bwd(fn, (ce_rows, vocab))
            per = (table or FUSED_BYTES)["cross_entropy"]
            base = MINIMAL_BYTES["cross_entropy"]
            pf, pb = model.kernel_times(n * base, "loss", (per[0] / base, per[1] / base))
            row("memory fwd", f"{name} {ce_rows}x{vocab}", tf, pf if table else 0.0, n * per[0], "TB/s (counted)")
            row("memory bwd", f"{name} {ce_rows}x{vocab}", tb, pb if table else 0.0, n * per[1], "TB/s (counted)")
    numel = (1 << 18) if small else (1 << 28)  # parameters: 1 GiB of fp32 each tensor
    params = [torch.zeros(numel // 16, device=dev, requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        if name == "fused" and dev.type == "cpu" and not small:
            continue
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        t = timed(opt.step, dev, max_reps=10)
        nbytes = numel * ADAM_BYTES_PER_PARAM
        row("optimizer", f"AdamW {name} {numel / 1e6:.0f}M fp32 params", t, model.memory_time(nbytes, "optimizer"),
            nbytes, "TB/s (36 B/param)")
        del opt


def rows_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    """Dense GEMMs of few rows (the tokens a rank keeps outside attention under deep context
    parallelism, or a small micro-batch): the MLP up and down projections of 8B-, 70B- and
    405B-sized blocks at 16-4,096 rows, bf16 ``torch.mm``, against the roofline of
    ``DeviceModel.gemm_time`` (compute, or the operands' bytes at ``gemm_stream_efficiency``)."""
    shapes = {"8b": (4096, 14336), "70b": (8192, 28672), "405b": (16384, 53248)}
    if small:
        shapes = {"tiny": (256, 1024)}
    for label, (h, f) in shapes.items():
        for proj, (n, k) in (("up", (f, h)), ("down", (h, f))):
            w = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
            for m in ([16, 64] if small else [16, 64, 128, 256, 512, 1024, 4096]):
                x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
                flops = 2.0 * m * n * k
                t = timed(lambda x=x, w=w: torch.mm(x, w.t()), dev)
                row("gemm rows", f"{label} {proj} m{m} ({m}x{n}x{k})", t, model.gemm_time(flops, "bf16", shape=(m, n, k)),
                    flops, "TFLOP/s", m=m, n=n, k=k, hidden=h, layer=proj, tokens=m, phase="fwd")
                del x
            del w


def _loads(total: int, experts: int, gen: torch.Generator) -> list[int]:
    """Rows per expert for ``total`` routed copies drawn uniformly over ``experts`` (varying loads,
    as routing makes them)."""
    pick = torch.randint(0, experts, (total,), generator=gen)
    return torch.bincount(pick, minlength=experts).tolist()


def moe_section(dev: torch.device, model: DeviceModel, small: bool) -> None:
    """Grouped GEMMs of routed experts by rows per expert (``torch._grouped_mm``, the kernel
    torchtitan runs, and a loop of ``torch.mm`` per expert, as this project's runtime runs them)
    against ``costmodel.experts.grouped_gemm_time``; the eager token permutations around them
    (gather, weighting, scatter-add: ``PERMUTE_ELEMENTS["eager"]``) forward and backward."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"mixtral h4096 f14336": (4096, 14336), "deepseek-v3 h7168 f2048": (7168, 2048),
              "qwen3-30b h2048 f768": (2048, 768)}
    if small:
        shapes = {"tiny h256 f512": (256, 512)}
    grouped = hasattr(torch, "_grouped_mm") and (dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (9, 0))
    for label, (h, f) in shapes.items():
        for local in ([4] if small else [8, 32]):
            for rows in ([16, 64] if small else [16, 64, 256, 1024, 4096]):
                if not small and local * rows * max(h, 2 * f) * 2 > 6 << 30:
                    continue
                counts = _loads(rows * local, local, gen)
                offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
                for proj, (cols, depth) in (("up", (2 * f, h)), ("down", (h, f))):
                    x = torch.randn(rows * local, depth, dtype=torch.bfloat16, device=dev)
                    w = torch.randn(local, cols, depth, dtype=torch.bfloat16, device=dev)
                    flops = 2.0 * rows * local * cols * depth
                    pred = grouped_gemm_time(model, rows, local, cols, depth, "bf16")
                    name = f"{label} {proj} E{local} rows{rows}"
                    info = {"rows": rows, "experts": local, "hidden": h, "ffn": f, "proj": proj}
                    if grouped:
                        try:
                            t = timed(lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=o), dev)
                            row("moe grouped_mm", name, t, pred, flops, "TFLOP/s", **info)
                        except RuntimeError as e:
                            print(f"| moe grouped_mm | {name} | refused: {str(e)[:80]} |")
                    parts = list(zip(torch.split(x, counts), w.unbind(0), strict=True))
                    t = timed(lambda parts=parts: [torch.mm(a, b.t()) for a, b in parts], dev)
                    loop = model.gemm_time(flops, "bf16", calls=local, shape=(rows, cols, depth)) / local
                    row("moe loop", name, t, loop, flops, "TFLOP/s", **info)
                    del x, w, parts
    n_tok = 512 if small else 16384
    for label, (h, _) in shapes.items():
        for k in ([2] if small else [2, 8]):
            x = torch.randn(n_tok, h, dtype=torch.bfloat16, device=dev, requires_grad=True)
            top = torch.rand(n_tok, 64 if not small else 8, device=dev).topk(k, dim=-1)
            order = top.indices.flatten().argsort()
            src = order // k
            probs = top.values.flatten()[order].to(torch.bfloat16).requires_grad_()

            def permute_unpermute(x: torch.Tensor = x, src: torch.Tensor = src, p: torch.Tensor = probs) -> torch.Tensor:
                copies = x.index_select(0, src)  # expert order (the experts would run here)
                return torch.zeros_like(x).index_add(0, src, copies * p[:, None])

            g = torch.randn_like(permute_unpermute())
            tf = timed(permute_unpermute, dev)
            tfb = timed(lambda g=g, x=x, p=probs, fn=permute_unpermute: torch.autograd.grad(fn(), (x, p), g), dev)
            bf, bb = permute_bytes(h, k, n_tok, "eager")
            pf, pb = permute_times(model, h, k, n_tok, "eager")
            row("moe permute fwd", f"{label} k{k} {n_tok} tokens", tf, pf, bf, "TB/s (counted)")
            row("moe permute bwd", f"{label} k{k} {n_tok} tokens", max(tfb - tf, 1e-9), pb, bb, "TB/s (counted)")
            del x, g


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _moe_model(r: dict, model: DeviceModel | None) -> float:
    """A grouped-GEMM row's price: as recorded, or re-priced by ``model`` (current constants)."""
    if model is None:
        return r["model_s"]
    cols, depth = (2 * r["ffn"], r["hidden"]) if r["proj"] == "up" else (r["hidden"], r["ffn"])
    return grouped_gemm_time(model, r["rows"], r["experts"], cols, depth, "bf16")


def _permute_model(r: dict, model: DeviceModel | None) -> float:
    """A permutation row's price: as recorded, or re-priced by ``model`` from its name
    (``... h<hidden> f<ffn> k<top-k> <tokens> tokens``)."""
    if model is None or not r["section"].startswith("moe permute"):
        return r["model_s"]
    words = r["name"].split()
    tokens = int(words[-2])
    hidden = next(int(w[1:]) for w in words if w[0] == "h" and w[1:].isdigit())
    k = next(int(w[1:]) for w in words if w[0] == "k" and w[1:].isdigit())
    fwd, bwd = permute_times(model, hidden, k, tokens, "eager")
    return fwd if r["section"].endswith("fwd") else bwd


def summarize(rows: list[dict], model: DeviceModel | None = None) -> None:
    """The condensed tables docs/validation.md keeps: GEMM rates and fp8 speed-ups by hidden size,
    the per-call fit, attention by kernel, length and head dim, the memory-bound kernels, the MoE
    grouped GEMMs (re-priced by ``model`` when given: ``--summarize`` with the current constants)."""
    gemm = [r for r in rows if r["section"] == "gemm bf16"]
    if gemm:
        print("\n| hidden | bf16 TFLOP/s (4k / 16k tokens) | model/measured | fp8 speed-up, per-tensor | per-row |")
        print("|---:|---:|---:|---:|---:|")
        for d in sorted({r["hidden"] for r in gemm}):
            cells = []
            for t in sorted({r["tokens"] for r in gemm}):
                cells.append(f"{_median([r['rate'] for r in gemm if r['hidden'] == d and r['tokens'] == t]):.0f}")
            mm = _median([r["model_over_measured"] for r in gemm if r["hidden"] == d])
            sp = [f"{_median([r['speedup'] for r in rows if r['section'] == f'gemm fp8/{k}' and r['hidden'] == d]):.2f}"
                  for k in ("tensor", "row")]
            print(f"| {d} | {' / '.join(cells)} | {mm:.2f} | {sp[0]} | {sp[1]} |")
        for sec in ("gemm bf16", "gemm fp8/tensor", "gemm fp8/row"):
            rs = [r for r in rows if r["section"] == sec]
            if not rs:
                continue
            flops = np.array([2.0 * r["m"] * r["n"] * r["k"] for r in rs])
            t = np.array([r["measured_s"] for r in rs])
            (inv_rate, t0), *_ = np.linalg.lstsq(np.stack([flops / t, 1 / t], 1), np.ones_like(t), rcond=None)
            big = flops > 1e11
            print(f"{sec}: t = F / {1 / inv_rate / 1e12:.0f} TFLOP/s + {t0 * 1e6:.1f} us per call (relative least "
                  f"squares, {len(rs)} GEMMs); median above 100 GFLOP {np.median(flops[big] / t[big]) / 1e12:.0f} TFLOP/s")
    few = [r for r in rows if r["section"] == "gemm rows"]
    if few:
        print("\n| GEMM (n x k) | rows | TFLOP/s | model/measured |")
        print("|---|---:|---:|---:|")
        for r in few:
            priced = model.gemm_time(2.0 * r["m"] * r["n"] * r["k"], "bf16", shape=(r["m"], r["n"], r["k"])) \
                if model is not None else r["model_s"]
            print(f"| {r['n']} x {r['k']} | {r['m']} | {r['rate']:.0f} | {priced / r['measured_s']:.2f} |")
    moe = [r for r in rows if r["section"] == "moe grouped_mm"]
    if moe:
        print("\n| experts (hidden, FFN) | rows per expert | grouped TFLOP/s | model/measured | loop of GEMMs TFLOP/s |")
        print("|---|---:|---:|---:|---:|")
        loop = {(r["hidden"], r["ffn"], r["rows"], r["experts"], r["proj"]): r["rate"] for r in rows
                if r["section"] == "moe loop"}
        for h, f in dict.fromkeys((r["hidden"], r["ffn"]) for r in moe):
            for n in sorted({r["rows"] for r in moe if (r["hidden"], r["ffn"]) == (h, f)}):
                rs = [r for r in moe if (r["hidden"], r["ffn"], r["rows"]) == (h, f, n)]
                ratio = [_moe_model(r, model) / r["measured_s"] for r in rs]
                loops = [loop[(h, f, n, r["experts"], r["proj"])] for r in rs if (h, f, n, r["experts"], r["proj"]) in loop]
                print(f"| {h}, {f} | {n} | {_median([r['rate'] for r in rs]):.0f} | {min(ratio):.2f}-{max(ratio):.2f} | "
                      f"{_median(loops):.0f} |")
    attn = [r for r in rows if r["section"].startswith("attention")]
    if attn:
        print("\n| kernel | head dim | causal | tokens | fwd TFLOP/s | bwd/fwd time | model/measured fwd, bwd |")
        print("|---|---:|---|---:|---:|---:|---:|")
        key = {(r["backend"], r["head_dim"], r["causal"], r["seq"], r["section"].split()[-1]): r for r in attn}
        for (b, hd, causal, s, ph), f in sorted(key.items()):
            if ph != "fwd" or s not in (512, 2048, 8192, 32768) or (b, hd, causal, s, "bwd") not in key:
                continue
            bw = key[(b, hd, causal, s, "bwd")]
            print(f"| {b} | {hd} | {'yes' if causal else 'no'} | {s} | {f['rate']:.0f} | "
                  f"{bw['measured_s'] / f['measured_s']:.2f} | {f['model_over_measured']:.2f}, "
                  f"{bw['model_over_measured']:.2f} |")
    mem = [r for r in rows if r["section"].startswith(("memory", "optimizer", "copy", "fp8 cast", "moe permute"))]
    if mem:
        print("\n| kernel | case | measured ms | TB/s over counted bytes | model/measured |")
        print("|---|---|---:|---:|---:|")
        for r in mem:
            priced = _permute_model(r, model)
            mm = f"{priced / r['measured_s']:.2f}" if priced else "-"
            print(f"| {r['section']} | {r['name']} | {r['measured_s'] * 1e3:.3f} | {r['rate']:.2f} | {mm} |")


SECTIONS = {"copy": copy_section, "gemm": gemm_section, "cast": cast_section, "attention": attention_section,
            "memory": memory_section, "moe": moe_section, "rows": rows_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--accelerator", default="", help="the accelerator file to price with (default: guessed)")
    ap.add_argument("--small", action="store_true", help="small shapes (a dry run)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--limit-s", type=float, default=240.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--summarize", default="", help="print the summary tables of a saved --json and exit")
    a = ap.parse_args()
    if a.summarize:
        doc = json.loads(Path(a.summarize).read_text())
        summarize(doc["rows"], DeviceModel(parse_cluster(f"1x{doc['accelerator']}")))
        return
    dev = torch.device(a.device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        acc = a.accelerator or guess_accelerator(p.name, p.total_memory / 1e9)
        print(f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
              f"cuda {torch.version.cuda}, priced as '{acc}'")
    else:
        acc = a.accelerator or "cpu"
    model = DeviceModel(parse_cluster(f"1x{acc}"))
    print(f"constants: gemm_scale {model.c.gemm_scale:.3f}, memory_efficiency {model.c.memory_efficiency}, "
          f"attention_efficiency {model.c.attention_efficiency:.3f}, fp8_gemm_speedup {model.c.fp8_gemm_speedup:.3f}")
    print("| section | case | measured ms | model ms | model/measured | measured rate |")
    print("|---|---|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    for name in a.sections.split(","):
        if time.perf_counter() - t0 > a.limit_s:
            print(f"| {name} | skipped: past --limit-s |")
            continue
        try:
            SECTIONS[name](dev, model, a.small)
        except Exception as e:  # one section's failure must not lose the others' rows
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:200]} |")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    summarize(ROWS)
    if a.json:
        Path(a.json).write_text(json.dumps({"accelerator": acc, "torch": torch.__version__, "rows": ROWS}, indent=1))


if __name__ == "__main__":
    main()
