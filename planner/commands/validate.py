"""``shardplan validate`` and ``shardplan fit``: the cost model against published training runs.

``validate`` is a report: it exits 0 whether or not the targets are met, and 2 only when a CSV
cannot be read. ``fit`` refits the few cost constants on the A/B rows and writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, err_console, guard, print_json
from planner.layout import literal
from planner.options import count_option
from vocab.errors import ShardplanError
from vocab.io import check_writable


def _load(csvs: list[Path]) -> tuple[list[Any], list[Any]]:
    from costmodel.published.runs import default_csv_path, load_published

    paths = csvs or [default_csv_path()]
    if not csvs and not paths[0].exists():
        raise ShardplanError(f"no CSV given and the default '{paths[0]}' does not exist")
    rows: list[Any] = []
    skipped: list[Any] = []
    for p in paths:
        r, s = load_published(p)
        rows += r
        skipped += s
    return rows, skipped


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _rho(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def render_validation(data: dict[str, Any], title: str = "cost model vs published runs") -> None:
    """Per-source table, the overall row, then the skipped rows with their reasons."""
    from costmodel.published.validate import source_label

    t = Table(title=title)
    t.add_column("source", no_wrap=True, overflow="ellipsis", max_width=44)
    t.add_column("priced as", no_wrap=True)
    for col in ("rows", "time", "median", "p90", "bias", "rho", "sweep", "nofit", "mem", "mem med", "targets"):
        t.add_column(col, justify="right", no_wrap=True)
    for s in [*data["sources"], data["overall"]]:
        ok = {True: "[green]met[/]", False: "[red]missed[/]", None: "–"}[s["meets_targets"]]
        if s["source"] == "overall":
            t.add_section()
            ok = "–"
        sweep = f"{round(s['sweep_ordered'] * s['sweep_pairs'])}/{s['sweep_pairs']}" if s["sweep_pairs"] else "–"
        bias = "–" if s["bias"] is None else f"{100 * s['bias']:+.1f}%"
        t.add_row(literal(source_label(s["source"])), literal(s.get("target") or "–"), str(s["rows"]), str(s["time_rows"]), _pct(s["median_ape"]),
                  _pct(s["p90_ape"]), bias, _rho(s["spearman"]), sweep, str(len(s["misfits"])),
                  str(s["memory_rows"]), _pct(s["memory_median_ape"]), ok)
    console.print(t)
    tg = data["targets"]
    console.print(f"priced as: the trainer's target whose behaviour prices the source's runs (– a stack with "
                  f"no target: the source's own rules); median/p90: absolute % error of time-like metrics; bias: median signed step-time error "
                  f"(+: predicted too slow); rho: Spearman of throughput within the source; sweep: pairs of one "
                  f"sweep > 5% apart ordered right; nofit: runs predicted above the device's memory; mem med: "
                  f"median absolute % error of memory. Targets per source with >= {tg['min_rows']} rows: "
                  f"median <= {_pct(tg['median_ape'])}, p90 <= {_pct(tg['p90_ape'])}, |bias| <= "
                  f"{_pct(tg['bias'])}, every run fits, sweep >= {_pct(tg['sweep_ordered'])}, rho >= "
                  f"{tg['spearman']}, mem med <= {_pct(tg['memory_median_ape'])}.", highlight=False)
    misfits = [(s["source"], m) for s in data["sources"] for m in s["misfits"]]
    if misfits:
        k = Table(title=f"runs predicted not to fit ({len(misfits)})")
        for col in ("source", "run: predicted peak of the worst rank, device"):
            k.add_column(col, overflow="fold")
        for src, m in misfits:
            k.add_row(literal(source_label(src, 30)), literal(m))
        console.print(k)
    if data["skipped"]:
        k = Table(title=f"skipped rows ({len(data['skipped'])})")
        for col in ("row", "source", "metric", "reason"):
            k.add_column(col, justify="right" if col == "row" else "left", overflow="fold")
        for s in data["skipped"]:
            k.add_row(str(s["row"]), literal(source_label(s["source"], 30)), literal(s["metric"]), literal(s["reason"]))
        console.print(k)


@app.command("validate")
@guard
def validate_cmd(
    csvs: list[Path] = typer.Argument(None, help="published-runs CSV files (default: the shared calibration file)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    profile: Path = typer.Option(None, "--profile", help="price compute and collectives from a measured profile"),
    rows: bool = typer.Option(False, "--rows", help="with --json: every row's prediction too"),
) -> None:
    """Compare the cost model with published runs: errors per source, rank correlation, skipped rows."""
    from costmodel.published.validate import validate

    prof = None
    if profile is not None:
        from profiler.profile_schema import load_profile

        prof = load_profile(profile)
    published, skipped = _load(list(csvs or []))
    report = validate(published, skipped, profile=prof)
    data = report.to_dict(rows=rows)
    if as_json:
        print_json(data)
    else:
        render_validation(data)


@app.command("fit")
@guard
def fit_cmd(
    csv_path: Path = typer.Argument(None, help="published-runs CSV (default: the shared calibration file)"),
    output: Path = typer.Option(None, "--output", "-o", help="constants file to write "
                                "(default: costmodel/data/constants.yaml)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    jobs: int = count_option(1, "--jobs", "-j", maximum=64,
                             help="leave-one-source-out refits run at a time (processes)"),
) -> None:
    """Fit the cost constants on the A/B rows (globally, then per accelerator) and write them, with
    the error bands of the runs held out: each source predicted by constants fitted on the others
    (their predictions go to the constants file's name with ``.held_out.csv``)."""
    from costmodel.constants import CONSTANTS_PATH, held_out_path
    from costmodel.published.fit import fit, write_constants, write_held_out
    from costmodel.published.validate import validate

    out = check_writable(output or CONSTANTS_PATH, "output")
    published, skipped = _load([csv_path] if csv_path else [])
    if not published:
        raise ShardplanError("no usable rows to fit on")
    result = fit(published, jobs=jobs)
    header = ("# Written by `shardplan fit` from the published runs (reliability A/B rows only).\n"
              "# Each section lists the rows, distinct runs and sources its constants were fitted on.\n"
              "# error_bands: per slice, the 10th-90th percentile of the step-time error of the rows held\n"
              "# out (each source predicted by constants fitted on the other sources; the predictions are\n"
              f"# in {held_out_path(out).name}); held_out_rows: those rows per accelerator and precision.")
    try:
        write_constants(result, out, header)
        write_held_out(result.held_out, held_out_path(out))
    except OSError as e:
        raise ShardplanError(f"cannot write '{out}': {e.strerror}") from None
    report = validate(published, skipped, result.constants())
    data = {"output": str(out), "constants": result.to_yaml(), "validation": report.to_dict()}
    if as_json:
        print_json(data)
        return
    t = Table(title=f"fitted constants -> {out}")
    t.add_column("section")
    t.add_column("constant")
    t.add_column("value", justify="right")
    t.add_column("fitted on", justify="right")
    sections = {"default": data["constants"]["default"], **data["constants"]["accelerators"]}
    for name, sec in sections.items():
        for i, (k, v) in enumerate(sec["constants"].items()):
            t.add_row(name if i == 0 else "", k, f"{v:.4g}",
                      f"{sec.get('rows', 0)} rows / {sec.get('sources', 0)} sources" if i == 0 else "")
    console.print(t)
    render_validation(data["validation"], "after the fit")
    err_console.print(literal(f"wrote {out}"), soft_wrap=True)
