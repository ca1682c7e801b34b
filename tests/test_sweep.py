"""Sweeps: every point is what ``plan`` answers for it, infeasible points keep their row, the
time and cost columns follow from the throughput, outputs are whole or absent, bad input is one
line. Plots: every value drawn is a value of the table."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from planner.api import search_plan
from planner.cli import main
from planner.request import Request
from planner.sweep import grid, mesh_heatmap, sweep
from planner.sweep_plots import cost_figure, heatmap_figure, throughput_figure
from vocab.errors import ShardplanError

MODEL = "llama3-8b"


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return sweep(MODEL, gpus=[8, 16], accelerator="h100", global_batch=[32, 64], seq_len=2048, tokens=1e12,
                 gpu_hour_cost=2.0, workers=1)


def test_rows_are_the_plans_plan_makes(table: pd.DataFrame) -> None:
    assert list(table[["gpus", "global_batch"]].itertuples(index=False, name=None)) == [
        (8, 32), (8, 64), (16, 32), (16, 64)]
    assert (table["status"] == "ok").all()
    for _, r in table.iterrows():
        ref = search_plan(Request(MODEL, f"{r['gpus']}xh100", 2048, int(r["global_batch"]))).plan
        assert r["plan"] == search_plan(Request(MODEL, f"{r['gpus']}xh100", 2048, int(r["global_batch"]),
                                                top_k=0)).plan.model_dump_json()  # byte-identical but the runners-up
        assert r["plan"].startswith(ref.model_dump_json()[:ref.model_dump_json().index('"solver"')])
        assert r["step_time_s"] == ref.predicted.step_time_s
        assert r["tokens_per_s_per_gpu"] == ref.predicted.tokens_per_s_per_gpu
        assert r["tp"] == ref.strategy.mesh.tp and r["pp"] == ref.strategy.mesh.pp


def test_time_and_cost_follow_from_throughput(table: pd.DataFrame) -> None:
    for _, r in table.iterrows():
        tok_s = r["tokens_per_s_per_gpu"] * r["gpus"]
        assert r["tokens_per_s"] == pytest.approx(tok_s, rel=1e-12)
        assert r["train_days"] == pytest.approx(1e12 / tok_s / 86400, rel=1e-12)
        assert r["gpu_hours"] == pytest.approx(r["train_days"] * 24 * r["gpus"], rel=1e-12)
        assert r["cost"] == pytest.approx(2.0 * r["gpu_hours"], rel=1e-12)


def test_processes_give_the_same_table(table: pd.DataFrame) -> None:
    par = sweep(MODEL, gpus=[8, 16], accelerator="h100", global_batch=[32, 64], seq_len=2048, tokens=1e12,
                gpu_hour_cost=2.0, workers=2)
    pd.testing.assert_frame_equal(par, table)


def test_a_point_where_nothing_fits_keeps_its_row() -> None:
    df = sweep(MODEL, gpus=8, global_batch=64, seq_len=2048, memory_limit_gib=[1.0, 80.0], workers=1)
    bad, good = df.iloc[0], df.iloc[1]
    assert bad["status"] != "ok" and "memory" in bad["status"].lower()
    assert math.isnan(bad["step_time_s"]) and bad["plan"] == ""
    assert good["status"] == "ok" and good["memory_peak_gib"] <= 80.0


def test_grid_refuses_bad_values_before_searching() -> None:
    assert len(grid("h100", [8, 16], [32], [1024, 2048], [None], ["shardplan", "torchtitan"], "full")) == 8
    with pytest.raises(ShardplanError, match="gpus takes positive integers"):
        grid("h100", [0], 32, 1024)
    with pytest.raises(ShardplanError, match="memory_limit_gib takes positive"):
        grid("h100", 8, 32, 1024, [-1.0])
    with pytest.raises(ShardplanError, match="unknown search space"):
        sweep(MODEL, gpus=8, space="nope", workers=1)


def test_heatmap_cells_hold_their_degrees() -> None:
    hm = mesh_heatmap(MODEL, 16, global_batch=64, seq_len=2048, tp=(1, 2, 4), pp=(1, 2))
    assert len(hm) == 6
    for _, r in hm.iterrows():
        if r["status"] == "ok":
            plan_tp = [int(x[3:]) for x in r["mesh"].split() if x.startswith("tp=")] or [1]
            plan_pp = [int(x[3:]) for x in r["mesh"].split() if x.startswith("pp=")] or [1]
            assert (plan_tp[0], plan_pp[0]) == (r["tp"], r["pp"])
    best = hm.loc[hm["step_time_s"].idxmin()]
    full = search_plan(Request(MODEL, "16xh100", 2048, 64, tie_break=False)).plan
    if full.strategy.mesh.tp in (1, 2, 4) and full.strategy.mesh.pp in (1, 2):  # the unrestricted fastest is a cell
        assert best["step_time_s"] == pytest.approx(full.predicted.step_time_s, rel=1e-12)


def _lines_y(fig) -> list[float]:  # type: ignore[no-untyped-def]
    return sorted(float(y) for ax in fig.axes for line in ax.get_lines() for y in line.get_ydata())


def test_plots_draw_the_tables_values(table: pd.DataFrame) -> None:
    fig = throughput_figure(table)
    assert _lines_y(fig) == sorted(table["tokens_per_s_per_gpu"])
    assert "tokens/s per GPU" in fig.axes[0].get_ylabel() and MODEL in fig.axes[0].get_title()
    fig = cost_figure(table)
    days, cost = fig.axes[0], fig.axes[1]
    assert sorted(y for line in days.get_lines() for y in line.get_ydata()) == sorted(table["train_days"])
    assert sorted(y for line in cost.get_lines() for y in line.get_ydata()) == pytest.approx(
        sorted(table["cost"] / 1e6), rel=1e-12)
    assert "days" in days.get_ylabel() and "$" in cost.get_ylabel()


def test_titles_stay_inside_the_figure(table: pd.DataFrame) -> None:
    """A long model name and the held axes wrap the title; drawn, it lies within the figure."""
    long = table.assign(model="a-model-with-a-rather-long-name-from-a-config-file/config.json")
    for fig in (throughput_figure(long), cost_figure(long)):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        titles = [fig._suptitle] if fig._suptitle is not None else []
        titles += [ax.title for ax in fig.axes]
        for t in titles:
            ext = t.get_window_extent(renderer)
            assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, (t.get_text(), ext, box)


def test_heatmap_figure_draws_every_cell() -> None:
    hm = mesh_heatmap(MODEL, 16, global_batch=64, seq_len=2048, tp=(1, 2), pp=(1, 2))
    fig = heatmap_figure(hm)
    data = fig.axes[0].images[0].get_array()
    assert sorted(float(x) for x in data.compressed()) == sorted(hm["tokens_per_s_per_gpu"].dropna())
    assert MODEL in fig.axes[0].get_title() and "tp" in fig.axes[0].get_ylabel()


def test_cli_writes_table_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plots = tmp_path / "sweep.parquet", tmp_path / "plots"
    rc = main(["sweep", "-m", MODEL, "--gpus", "8..16", "--global-batch", "32", "--seq-len", "2048",
               "--tokens", "1e12", "--gpu-hour-cost", "2", "--workers", "1", "-o", str(out), "--plots", str(plots),
               "--no-heatmap"])
    assert rc == 0
    df = pd.read_parquet(out)
    assert list(df["gpus"]) == [8, 16] and (df["status"] == "ok").all()
    assert sorted(p.name for p in plots.iterdir()) == ["cost.png", "throughput.png"]
    assert "2 points, 2 with a plan" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--gpus", "8,x"], "--gpus takes numbers of GPUs as a comma list or a doubling range, e.g. 256,512,1024"),
    (["--gpus", "8", "--memory-limit", "80GB"], "--memory-limit takes numbers of GiB (or 'default'), e.g. 60,80"),
    (["--gpus", "8", "-o", "x.txt"], "-o must name a .csv or .parquet file"),
    (["--gpus", "8", "--accelerator", "h1000"], "h1000"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                   message: str) -> None:
    rc = main(["sweep", "-m", MODEL, "--seq-len", "2048", "--workers", "1", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.txt").exists()


def test_cli_table_reads_at_80_columns_and_wide(table: pd.DataFrame) -> None:
    """Piped or at 80 columns every point is one labelled row wrapped at words; a wide terminal
    keeps the table. No line is longer than the width, nothing is cut short."""
    import io

    from rich.console import Console

    from planner.commands.sweep import money, render_sweep

    for width in (80, 200):
        buf = io.StringIO()
        render_sweep(table, Console(file=buf, width=width, force_terminal=False))
        text = buf.getvalue()
        assert all(len(line) <= width for line in text.splitlines())
        assert "…" not in text
        for _, r in table.iterrows():
            assert r["mesh"] in text and money(r["cost"]) in text
    assert (money(83_000.7), money(10_540_000.0), money(12.0)) == ("$83k", "$10.5M", "$12")


def test_a_factory_model_is_swept_too() -> None:
    """A ``pkg.module:factory`` is traced by each point, not refused by the up-front name check."""
    df = sweep("tests.fixtures_models:tiny_mlp", gpus=[2, 4], accelerator="cpu", global_batch=8, seq_len=16,
               workers=1)
    assert (df["status"] == "ok").all() and (df["step_time_s"] > 0).all()


def test_cli_sweep_where_nothing_fits_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.csv"
    rc = main(["sweep", "-m", MODEL, "--gpus", "8", "--global-batch", "32", "--seq-len", "2048", "--memory-limit", "1",
               "--workers", "1", "-o", str(out), "--plots", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: no point of the sweep has a plan; the first:") and len(err.splitlines()) == 1
    assert not out.exists() and not (tmp_path / "p").exists()
