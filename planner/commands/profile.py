"""``shardplan profile compute|comm|model``: measure this machine and write a profile document.

Every subcommand checks its input (device, backend, model size) before measuring, writes the
profile atomically only when the whole sweep succeeded, and with ``--merge`` lays its section over
an existing profile of the same device kind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, err_console, guard, print_json
from planner.options import Opt, Values, command, count_option, number_option
from vocab.errors import ShardplanError
from vocab.io import check_writable

profile_app = typer.Typer(
    name="profile", no_args_is_help=True,
    help="Measure compute, communication and real layers on this machine; write a profile document.",
)
app.add_typer(profile_app, name="profile")

OUTPUT = typer.Option(..., "--output", "-o", help="profile file to write (JSON)")
MERGE = typer.Option(False, "--merge", help="merge into the output profile if it exists (same device kind)")
QUICK = typer.Option(False, "--quick", help="a smaller grid and fewer repeats")
NO_PROGRESS = typer.Option(False, "--no-progress", help="no progress bars on stderr")
AS_JSON = typer.Option(False, "--json", help="print the summary as JSON")


def _base(output: Path, merge: bool, kind: str) -> Any:
    """Check the output can be written (before measuring) and read it when merging."""
    check_writable(output, "output")
    if merge and output.exists():
        from profiler.profile_schema import load_profile

        base = load_profile(output)
        base.check_kind(kind, f"this measurement (merged into '{output}')")
        return base
    return None


def _warn_if_busy(cpu: bool) -> float | None:
    """Warn on stderr when a CPU measurement starts on a busy host; the load it saw."""
    from profiler.measure_compute import busy_warning, host_load

    load = host_load()
    msg = busy_warning(load) if cpu else None
    if msg:
        err_console.print(msg, style="yellow", highlight=False)
    return load


def _write(new: Any, base: Any, output: Path) -> Any:
    prof = base.merged(new) if base is not None else new
    try:
        prof.save(output)
    except OSError as e:
        raise ShardplanError(f"cannot write '{output}': {e.strerror}") from None
    return prof


def _g(x: float) -> str:
    return f"{x / 1e9:.1f}"


@profile_app.command("compute")
@guard
def compute(
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N"),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (bf16 on GPUs and on CPUs with bf16 matrix units, else fp32), bf16, fp16, fp32"
    ),
    quick: bool = QUICK,
    output: Path = OUTPUT,
    merge: bool = MERGE,
    no_progress: bool = NO_PROGRESS,
    as_json: bool = AS_JSON,
) -> None:
    """Time forward and backward of GEMMs, attention and bandwidth-bound ops on one device."""
    from profiler.measure_compute import profile_compute, resolve_device, resolve_dtype
    from profiler.profile_schema import Profile

    dev = resolve_device(device)  # a missing device fails here, before anything is measured
    dtype = resolve_dtype(dtype, dev)
    base = _base(output, merge, "gpu" if dev.type == "cuda" else "cpu")
    _warn_if_busy(dev.type == "cpu")
    info, comp = profile_compute(dev, dtype, quick, progress=not no_progress)
    prof = _write(Profile(device=info, compute=comp), base, output)
    if comp.skipped:
        err_console.print(f"warning: {comp.skipped} grid point(s) were left out to keep the time limit "
                          "(a slow or busy host)", style="yellow", highlight=False)
    big = max(comp.gemm, key=lambda p: p.flops) if comp.gemm else None
    summary = {
        "output": str(output), "device": info.name, "kind": info.kind, "dtype": comp.dtype,
        "wall_s": round(comp.wall_s, 1), "skipped": comp.skipped, "gemm_points": len(comp.gemm), "attention_points": len(comp.attention),
        "gemm_best_gflops": max((p.flops_per_s for p in comp.gemm), default=0) / 1e9,
        "gemm_largest": {"mnk": [big.m, big.n, big.k], "gflops": big.flops_per_s / 1e9,
                         "fwd_gflops": big.flops / big.fwd_s / 1e9} if big else None,
        "attention_best_gflops": max((p.flops_per_s for p in comp.attention), default=0) / 1e9,
        "bandwidth_gbps": {op: prof.bytes_per_s(op) / 1e9 for op in comp.bandwidth},
        "dtensor_overhead": comp.dtensor.model_dump() if comp.dtensor else None,
    }
    if as_json:
        print_json(summary)
        return
    t = Table(title=f"compute profile of {info.name} ({comp.dtype}, {comp.wall_s:.0f} s) -> {output}")
    t.add_column("curve")
    t.add_column("points", justify="right")
    t.add_column("at the largest size", justify="right")
    t.add_column("best", justify="right")
    if comp.gemm:
        t.add_row("GEMM GFLOP/s (fwd+bwd)", str(len(comp.gemm)), _g(big.flops_per_s), f"{summary['gemm_best_gflops']:.1f}")
    if comp.attention:
        a = max(comp.attention, key=lambda p: p.flops)
        t.add_row("SDPA GFLOP/s (fwd+bwd)", str(len(comp.attention)), _g(a.flops_per_s),
                  f"{summary['attention_best_gflops']:.1f}")
    for op, pts in comp.bandwidth.items():
        t.add_row(f"{op} GB/s (fwd)", str(len(pts)), f"{prof.bytes_per_s(op) / 1e9:.2f}",
                  f"{max(p.bytes_per_s for p in pts) / 1e9:.2f}")
    if comp.dtensor:
        d = comp.dtensor
        for role in ("linear", "norm", "loss"):
            f, b = d.host(role)
            t.add_row(f"DTensor TP {role}: host ms (fwd+bwd)", "1", f"{1e3 * (f + b):.2f}", "")
        t.add_row("DTensor parallel loss: traffic ratio", "1", f"{d.loss_traffic_ratio:.2f}", "")
    console.print(t)


@profile_app.command("comm")
@guard
def comm(
    nproc: int = count_option(2, "--nproc", help="processes to start on this host", maximum=256),
    backend: str = typer.Option("gloo", "--backend", help="gloo or nccl"),
    sizes: str = typer.Option("", "--sizes", help="message sizes, e.g. 1K,64K,1M,256M (default 1 KiB..256 MiB)"),
    stat: str = typer.Option("median", "--stat", help="median | min: the statistic of the repeats fitted"),
    timeout: float = number_option(120.0, "--timeout", help="seconds without progress before a rank counts as hung "
                                   "(at most a day)", minimum=0.001, maximum=86_400.0),
    quick: bool = QUICK,
    output: Path = OUTPUT,
    merge: bool = MERGE,
    no_progress: bool = NO_PROGRESS,
    as_json: bool = AS_JSON,
) -> None:
    """Time collectives between N local processes and fit alpha (latency) and beta (s/byte)."""
    from profiler.measure_comm import check_backend, check_stat, parse_sizes, profile_comm
    from profiler.profile_schema import Profile

    check_stat(stat)
    size_list = parse_sizes(sizes) if sizes.strip() else None
    check_backend(backend, nproc)
    base = _base(output, merge, "gpu" if backend == "nccl" else "cpu")
    _warn_if_busy(backend == "gloo")
    t0 = time.perf_counter()
    info, fits = profile_comm(nproc, backend, size_list, quick, stat=stat, progress=not no_progress,
                              timeout_s=timeout)
    wall = time.perf_counter() - t0
    _write(Profile(device=info, comm=fits), base, output)
    rows = [{"collective": f.collective, "world": f.world, "alpha_us": f.alpha_s * 1e6,
             "beta_s_per_byte": f.beta_s_per_byte,
             "gbps": (1 / f.beta_s_per_byte / 1e9) if f.beta_s_per_byte else None,
             "median_rel_error": f.median_rel_error} for f in fits]
    load = {"wait_s": fits[0].wait_s, "sharing_efficiency": fits[0].sharing_efficiency} if fits else {}
    if as_json:
        print_json({"output": str(output), "backend": backend, "nproc": nproc, "wall_s": round(wall, 1), "fits": rows,
                    **load})
        return
    t = Table(title=f"{backend} x{nproc}: t = alpha + beta * bytes ({wall:.0f} s) -> {output}")
    for col in ("collective", "world", "alpha µs", "1/beta GB/s", "median error"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for r in rows:
        t.add_row(r["collective"], str(r["world"]), f"{r['alpha_us']:.1f}",
                  f"{r['gbps']:.2f}" if r["gbps"] else "-", f"{r['median_rel_error']:.0%}")
    console.print(t)
    if load and (load["wait_s"] or load["sharing_efficiency"] != 1.0):
        console.print(f"under load (ranks time-sharing {os.cpu_count()} cores): a blocking collective waits "
                      f"{load['wait_s'] * 1e3:.2f} ms for its partner; compute gets "
                      f"{load['sharing_efficiency']:.0%} of its fair share of the cores")


#: ``shardplan profile model``'s options
MODEL_OPTIONS = (
    Opt("model_name", str, typer.Option(..., "--model", "-m", help="preset name or config.json path")),
    Opt("device", str, typer.Option("cpu", "--device", help="cpu, cuda or cuda:N")),
    Opt("micro_batch", int, count_option(1, "--micro-batch", help="samples per step", maximum=4096)),
    Opt("seq_len", int, count_option(128, "--seq-len", help="tokens per sample", maximum=1 << 20)),
    Opt("layers", int, count_option(2, "--layers", help="blocks of the stack to build and run", maximum=1024)),
    Opt("dtype", str, typer.Option(
        "auto", "--dtype", help="auto (bf16 on GPUs and on CPUs with bf16 matrix units, else fp32), bf16, fp16, fp32"
    )),
    Opt("repeats", int, count_option(5, "--repeats", help="timed steps (after 2 warm-up steps)", maximum=10_000)),
    Opt("profile", Path | None, typer.Option(None, "--profile", help="a compute profile the predictions use")),
    Opt("accelerator", str | None, typer.Option(None, "--accelerator", help="accelerator file for the predictions")),
    Opt("output", Path, OUTPUT),
    Opt("merge", bool, MERGE),
    Opt("as_json", bool, AS_JSON),
)


@profile_app.command("model")
@guard
@command(MODEL_OPTIONS)
def model(o: Values) -> None:
    """Run a few real layers; record per-layer time and saved bytes beside the cost model's prediction."""
    from costmodel.compute import with_predicted_times
    from profiler.measure_compute import device_info, resolve_device, resolve_dtype
    from profiler.measure_model import accelerator_for, checked_graph, measure_layers
    from profiler.models import resolve_config
    from profiler.profile_schema import Profile, load_profile

    model_name, device, layers, micro_batch, seq_len = o.model_name, o.device, o.layers, o.micro_batch, o.seq_len
    output = o.output
    if ":" in model_name and not Path(model_name).exists():
        raise ShardplanError(f"profile model needs a preset name or a config.json, not a factory ('{model_name}')")
    dev = resolve_device(device)
    dtype = resolve_dtype(o.dtype, dev)
    cfg = resolve_config(model_name)
    calib = load_profile(o.profile) if o.profile else None
    if calib is not None:
        calib.check_kind("gpu" if dev.type == "cuda" else "cpu", f"--device {device}")
    base = _base(output, o.merge, "gpu" if dev.type == "cuda" else "cpu")
    acc = accelerator_for(dev, o.accelerator)  # before measuring
    graph = checked_graph(cfg, layers, micro_batch, seq_len, o.repeats, dtype, dev)  # refused before the warning
    load = _warn_if_busy(dev.type == "cpu")
    rows = measure_layers(cfg, dev, layers=layers, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
                          repeats=o.repeats, model_name=model_name)
    rows = with_predicted_times(rows, graph, acc, calib)
    _write(Profile(device=device_info(dev, load), model=rows), base, output)
    if o.as_json:
        print_json({"output": str(output), "layers": [r.model_dump() for r in rows]})
        return

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.3f}"

    t = Table(title=f"{model_name}: {layers} layer(s), micro-batch {micro_batch}, seq {rows[0].seq_len}, "
                    f"{dtype} on {dev} -> {output}")
    for col in ("layer", "kind", "fwd ms", "pred", "bwd ms", "pred", "saved KiB", "pred"):
        t.add_column(col, justify="left" if col in ("layer", "kind") else "right")
    for r in rows:
        t.add_row(r.layer, r.kind, ms(r.fwd_s), ms(r.predicted_fwd_s), ms(r.bwd_s), ms(r.predicted_bwd_s),
                  f"{r.saved_bytes / 1024:.0f}",
                  "-" if r.predicted_saved_bytes is None else f"{r.predicted_saved_bytes / 1024:.0f}")
    console.print(t)
