"""``shardplan sweep``: plan over a grid of cluster sizes, accelerators, global batches, sequence
lengths, memory limits, targets and spaces (:mod:`planner.sweep`); a table, CSV or Parquet, and
plots.

Lists are comma-separated (``--gpus 256,512,1024``); ``--gpus 256..8192`` doubles from the first
to the last. Bad input is one line and exit code 2 before any search; every output is written
whole or not at all.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, err_console, guard
from planner.layout import literal
from planner.options import Opt, Values, command, int_option, positive_option
from planner.request import option
from vocab.digits import read_float, read_int
from vocab.errors import ShardplanError, shown
from vocab.io import check_writable
from vocab.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN

TABLE_FORMATS = (".csv", ".parquet")


def int_list(text: str, flag: str, unit: str, example: str, maximum: int) -> list[int]:
    """``a,b,c`` or ``a..b`` (doubling from a to b) as positive integers up to ``maximum`` (the
    supported range, checked before any point is made)."""
    text = text.replace(" ", "")
    try:
        if ".." in text:
            lo, hi = (read_int(x) for x in text.split(".."))
            if lo < 1 or hi < lo:
                raise ValueError
            if hi > maximum:
                raise ShardplanError(f"{flag}: {shown(hi)} is over the supported {maximum:,}")
            out = []
            while lo <= hi:
                out.append(lo)
                lo *= 2
            return out
        out = [read_int(x) for x in text.split(",") if x]
    except ShardplanError:
        raise
    except ValueError:
        raise ShardplanError(f"{flag} takes {unit} as a comma list or a doubling range, e.g. {example}, "
                             f"got '{text}'") from None
    if not out or any(v < 1 for v in out):
        raise ShardplanError(f"{flag} takes positive {unit}, e.g. {example}, got '{text}'")
    if max(out) > maximum:
        raise ShardplanError(f"{flag}: {shown(max(out))} is over the supported {maximum:,}")
    return out


def float_list(text: str, flag: str, example: str) -> list[float | None]:
    """``a,b`` as positive finite numbers; ``default`` stands for the accelerator's own limit."""
    out: list[float | None] = []
    for x in text.replace(" ", "").split(","):
        if x == "default":
            out.append(None)
            continue
        try:
            v = read_float(x)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v > 0):
            raise ShardplanError(f"{flag} takes numbers of GiB (or 'default'), e.g. {example}, got '{x}'")
        out.append(v)
    return out


def names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


#: ``shardplan sweep``'s options: the model, the axes of the grid (comma lists), a token budget, outputs
SWEEP_OPTIONS = (
    option("model", help="preset name, Hugging Face id or config.json path"),
    Opt("gpus", str, typer.Option(..., "--gpus", help="cluster sizes: '256,512,1024' or '256..8192' (doubling)")),
    Opt("accelerator", str, typer.Option("h100", "--accelerator", "-a", help="accelerators: 'h100,h200,b200'")),
    option("global_batch", "1024", help="samples per step: '512,1024'"),
    Opt("seq_len", str, typer.Option("4096", "--seq-len", help="tokens per sample: '4096,8192,32768'")),
    Opt("memory_limit", str, typer.Option("default", "--memory-limit", help="GiB per GPU: '60,80' ('default': the "
                                          "GPU's memory less the reserve)")),
    option("target", help="targets: 'shardplan,torchtitan' (docs/targets.md)"),
    option("space", help="spaces: 'full,fsdp'"),
    Opt("tokens", float, positive_option(None, "--tokens", help="tokens to train (e.g. 15e12): days and GPU-hours")),
    Opt("gpu_hour_cost", float, positive_option(None, "--gpu-hour-cost", help="$ per GPU-hour: the cost to train "
                                                "--tokens")),
    Opt("output", Path, typer.Option(None, "--output", "-o", help="the table as .csv or .parquet")),
    Opt("plots", Path, typer.Option(None, "--plots", help="directory for throughput.png, cost.png (with --tokens) "
                                    "and heatmap.png")),
    Opt("heatmap", bool, typer.Option(True, "--heatmap/--no-heatmap", help="with --plots: the tp x pp heatmap at "
                                      "the point of most tokens/s per GPU")),
    Opt("workers", int, int_option(None, "--workers", minimum=1, maximum=64, help="processes (default: 2)")),
    option("calibration", help="price every point with this calibration of your cluster (shardplan calibrate; its "
           "accelerator only)"),
)


@app.command("sweep")
@guard
@command(SWEEP_OPTIONS)
def sweep_cmd(o: Values) -> None:
    """Plan over a grid (cluster size, accelerator, global batch, sequence length, memory limit,
    target, space): one row per point, with time and cost to train a token budget."""
    from planner.sweep import sweep

    sizes = int_list(o.gpus, "--gpus", "numbers of GPUs", "256,512,1024 or 256..8192", MAX_GPUS)
    batches = int_list(o.global_batch, "--global-batch", "numbers of samples", "512,1024", MAX_GLOBAL_BATCH)
    seqs = int_list(o.seq_len, "--seq-len", "numbers of tokens", "4096,8192", MAX_SEQ_LEN)
    limits = float_list(o.memory_limit, "--memory-limit", "60,80")
    if o.output is not None:
        if o.output.suffix.lower() not in TABLE_FORMATS:
            raise ShardplanError(f"-o must name a .csv or .parquet file, got '{o.output}'")
        check_writable(o.output, "-o")
    if o.plots is not None:
        check_writable(o.plots / "throughput.png", "--plots")
    cal = None
    if o.calibration is not None:
        from costmodel.calibration.document import load_calibration

        cal = load_calibration(o.calibration)
    t0 = time.perf_counter()
    with _progress() as update:
        df = sweep(o.model, sizes, names(o.accelerator), batches, seqs, limits, names(o.target), names(o.space),
                   tokens=o.tokens, gpu_hour_cost=o.gpu_hour_cost, workers=o.workers, progress=update,
                   calibration=cal)
    wall = time.perf_counter() - t0
    render_sweep(df, console)
    ok = int((df["status"] == "ok").sum())
    console.print(f"{len(df)} points, {ok} with a plan, in {wall:.1f} s", highlight=False)
    if not ok:  # nothing to write or draw: an impossible request, like a plan that does not fit
        raise ShardplanError(f"no point of the sweep has a plan; the first: {df['status'].iloc[0]}")
    written = []
    if o.output is not None:
        write_table(df, o.output)
        written.append(str(o.output))
    if o.plots is not None:
        written += _plots(df, o, cal)
    for path in written:
        console.print(literal(f"wrote {path}"), soft_wrap=True)


def _plots(df: Any, o: Values, calibration: Any) -> list[str]:
    """Write the sweep's figures into ``--plots``: throughput, cost (with ``--tokens``) and the tp x pp
    heatmap at the point of most tokens/s per GPU (with ``--heatmap``); the paths written."""
    from planner.plots_common import save_figure
    from planner.sweep import mesh_heatmap
    from planner.sweep_plots import cost_figure, heatmap_figure, throughput_figure

    figs = {"throughput.png": throughput_figure(df)}
    if o.tokens is not None:
        figs["cost.png"] = cost_figure(df)
    if o.heatmap:
        best = df[df["status"] == "ok"].sort_values("tokens_per_s_per_gpu", ascending=False).iloc[0]
        lim = best["memory_limit_gib"]
        hm = mesh_heatmap(o.model, int(best["gpus"]), calibration=calibration, accelerator=best["accelerator"],
                          global_batch=int(best["global_batch"]), seq_len=int(best["seq_len"]),
                          memory_limit_gib=None if lim is None or lim != lim else float(lim), target=best["target"],
                          space=best["space"])
        figs["heatmap.png"] = heatmap_figure(hm)
    for name, fig in figs.items():
        save_figure(fig, o.plots / name, "png")
    return [str(o.plots / name) for name in figs]


def _progress() -> Any:
    """A context giving ``update(done, total)``: a bar on a terminal, nothing in logs and pipes."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextmanager
    def bar() -> Any:
        with Progress(TextColumn("sweeping"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True, disable=not err_console.is_terminal) as p:
            task = p.add_task("points", total=None)
            yield lambda done, total: p.update(task, completed=done, total=total)

    return bar()


def sweep_table(df: Any) -> Table:
    """The sweep's rows: the axes that vary, the plan, its throughput, MFU, memory, time and cost."""
    from planner.sweep import AXES

    varying = [a for a in AXES if df[a].astype(str).nunique() > 1] or ["gpus"]
    t = Table(title=literal(f"sweep of {df['model'].iloc[0]}"), show_lines=False)
    heads = {"accelerator": "GPU", "gpus": "GPUs", "global_batch": "batch", "seq_len": "seq",
             "memory_limit_gib": "limit GiB", "target": "target", "space": "space"}
    for a in varying:
        t.add_column(heads[a], justify="right" if a in ("gpus", "global_batch", "seq_len") else "left")
    has_days = not df["train_days"].isna().all()
    has_cost = not df["cost"].isna().all()
    cols = ["plan", "step s", "tok/s/GPU", "MFU", "mem GiB"] + (["days"] if has_days else []) + (
        ["cost"] if has_cost else [])
    words = max((len(w) for m in df["mesh"] for w in str(m).split()), default=4)
    for c in cols:
        t.add_column(c, justify="left" if c == "plan" else "right", min_width=words if c == "plan" else None)
    for _, r in df.iterrows():
        axes = [literal("default" if r[a] is None or r[a] != r[a] else f"{r[a]:,}" if isinstance(r[a], int) else r[a])
                for a in varying]
        if r["status"] != "ok":
            t.add_row(*axes, literal(f"no plan: {r['status']}"), *[""] * (len(cols) - 1))
            continue
        cells = [literal(r["mesh"]), f"{r['step_time_s']:.3g}", f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}",
                 f"{r['memory_peak_gib']:.1f}"]
        if has_days:
            cells.append(f"{r['train_days']:,.1f}")
        if has_cost:
            cells.append(money(r["cost"]))
        t.add_row(*axes, *cells)
    return t


def render_sweep(df: Any, out: Any) -> None:
    """The sweep's table where it fits ``out``'s width; else one row per point, its axes as the
    name and the plan and its numbers wrapped at words (80 columns, a pipe)."""
    from planner.layout import fits, kv_table

    wide = sweep_table(df)
    if fits(out, wide):
        out.print(wide)
        return
    t = kv_table(literal(f"sweep of {df['model'].iloc[0]}"))
    for label, text in sweep_lines(df):
        t.add_row(literal(label), literal(text))
    out.print(t)


def sweep_lines(df: Any) -> list[tuple[str, str]]:
    """(the point's varying axes, its plan and numbers) per row, for the narrow layout."""
    from planner.sweep import AXES

    varying = [a for a in AXES if df[a].astype(str).nunique() > 1] or ["gpus"]
    units = {"gpus": "{:,} GPUs", "accelerator": "{}", "global_batch": "batch {:,}", "seq_len": "seq {:,}",
             "memory_limit_gib": "limit {} GiB", "target": "{}", "space": "{} space"}
    out = []
    for _, r in df.iterrows():
        label = ", ".join(units[a].format("default" if r[a] is None or r[a] != r[a] else r[a]) for a in varying)
        if r["status"] != "ok":
            out.append((label, f"no plan: {r['status']}"))
            continue
        parts = [r["mesh"], f"{r['step_time_s']:.3g} s/step", f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU",
                 f"MFU {r['mfu']:.1%}", f"{r['memory_peak_gib']:.1f} GiB"]
        if r["train_days"] == r["train_days"]:
            parts.append(f"{r['train_days']:,.1f} days")
        if r["cost"] == r["cost"]:
            parts.append(money(r["cost"]))
        out.append((label, "; ".join(parts)))
    return out


def money(x: float) -> str:
    """Dollars, to three figures: $83.0k, $10.5M."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"${x / scale:.3g}{suffix}"
    return f"${x:.3g}"


def write_table(df: Any, path: Path) -> None:
    """The table as CSV or Parquet (by the suffix), written whole or not at all."""
    from vocab.io import write_with

    if path.suffix.lower() == ".csv":
        write_with(path, lambda tmp: df.to_csv(tmp, index=False))
    else:
        out = df.assign(memory_limit_gib=df["memory_limit_gib"].astype(float))
        write_with(path, lambda tmp: out.to_parquet(tmp, index=False))
