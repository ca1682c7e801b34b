"""Validation against published runs: row mapping, statistics, the CLI, and the fit's recovery."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.published.fit import _multi_start, fit_memory, fit_time, levenberg_marquardt
from costmodel.published.runs import COLUMNS, PublishedRow, Skipped, load_published
from costmodel.published.validate import (
    Prediction,
    estimate_row,
    graph_of,
    predict,
    spearman,
    summarize,
    sweep_pairs,
    validate,
)
from planner.cli import app
from vocab.errors import ShardplanError

runner = CliRunner()

MPT_NOTES = ("GradAccum=2; NumParams=125311488 (from table); MFU/HFU formula in README (6N + attention, "
             "excl. norms)")
BASE = {c: "" for c in COLUMNS}


def _row(**kw: str) -> dict[str, str]:
    return {**BASE, **kw}


MPT = _row(source="mosaicml/llm-foundry README section 'A100 80GB with 1600 Gbps node-node interconnect'",
           model="MPT-125m", params_B="0.125", layers="12", hidden="768", heads="12", ffn_hidden="3072",
           seq_len="2048", vocab="50368", global_batch="512", micro_batch="32", gpus="8",
           gpu_type="A100-80GB (1600Gbps RoCE)", tp="1", pp="1", dp="8", cp="1", ep="1",
           **{"zero_stage/fsdp": "FSDP FULL_SHARD (ZeRO-3 style)"}, recompute="none",
           metric="tokens_per_s_per_gpu", value="141737", notes=MPT_NOTES, precision="amp_bf16",
           reliability="A (framework repo)")
LLAMA = _row(source="some lab blog", model="Llama 3.1 8B", params_B="8", layers="32", hidden="4096", heads="32",
             ffn_hidden="14336", seq_len="8192", vocab="128256", global_batch="64", micro_batch="2",
             gpus="32", gpu_type="H200 (8/node NVLink; 400Gb/s CX-7 per GPU)", tp="1", pp="1", dp="32",
             **{"zero_stage/fsdp": "FSDP2 degree 32"}, recompute="full", metric="mfu", value="0.4",
             notes="kv_heads=8 (arch from public model config)", precision="BF16", reliability="C (hearsay)")
NO_BATCH = {**LLAMA, "global_batch": "", "metric": "tokens_per_s_per_gpu", "value": "9000"}
RANGE = {**LLAMA, "metric": "mfu_range", "value": "0.33-0.39"}
ZERO = _row(source="ZeRO paper", model="7.5B transformer (ZeRO example)", params_B="7.5", gpus="64",
            gpu_type="any (analytic)", tp="1", pp="1", dp="64", **{"zero_stage/fsdp": "ZeRO-1 (P_os)"},
            metric="memory_GB_model_states_analytic", value="31.4", reliability="B (analytic)")


def _csv(path: Path, rows: list[dict[str, str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows(rows)
    return path


def test_rows_map_to_cost_model_inputs_or_a_reason(tmp_path: Path) -> None:
    rows, skipped = load_published(_csv(tmp_path / "r.csv", [MPT, LLAMA, NO_BATCH, RANGE, ZERO]))
    by_line = {r.row: r for r in rows}
    mpt, llama, zero = by_line[2], by_line[3], by_line[6]
    assert isinstance(mpt, PublishedRow) and mpt.reliability == "A" and mpt.flops == "6n_total"
    assert graph_of(mpt).total_params == 125311488  # learned positions, biases, tied embeddings
    assert mpt.strategy.default.sharding == "zero3" and mpt.strategy.micro_batch == 32
    assert mpt.cluster.accelerator.scale_out.gbps == pytest.approx(25.0)  # 1600 Gb/s per node of 8
    assert mpt.workload.global_batch == 512 and mpt.cluster.world_size == 8
    assert llama.config.kv_heads == 8 and llama.config.activation == "swiglu"
    assert llama.reliability == "C" and llama.cluster.accelerator.name == "h200"
    # checkpointing wraps the blocks only
    assert llama.strategy.default.recompute == "full" and llama.strategy.for_unit("head").recompute == "none"
    assert zero.config.name == "gpt3-7.5b" and zero.strategy.default.sharding == "zero1"
    reasons = {s.row: s.reason for s in skipped}
    assert set(reasons) == {4, 5}
    assert "global batch not stated" in reasons[4]
    assert "not a single comparable number" in reasons[5]
    assert all(isinstance(s, Skipped) for s in skipped)


def test_analytic_model_states_match_the_zero_paper(tmp_path: Path) -> None:
    rows, _ = load_published(_csv(tmp_path / "z.csv", [ZERO]))
    (p,), _ = predict(rows)
    assert p.ape < 0.01  # 2Ψ + 2Ψ + 12Ψ/64 with Ψ = 7.47e9


def test_spearman_known_values() -> None:
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_fast_path_equals_estimate(tmp_path: Path) -> None:
    rows, _ = load_published(_csv(tmp_path / "r.csv", [MPT, LLAMA]))
    for r in rows:
        a = estimate(graph_of(r), r.cluster, r.strategy, r.workload)
        b = estimate_row(r, DeviceModel(r.cluster))
        assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-12)
        assert b.memory_peak_gib == pytest.approx(a.memory_peak_gib, rel=1e-12)


def test_summary_and_targets(tmp_path: Path) -> None:
    rows, skipped = load_published(_csv(tmp_path / "r.csv", [MPT, LLAMA, RANGE]))
    rep = validate(rows, skipped)
    assert {s.source for s in rep.sources} == {MPT["source"], LLAMA["source"]}
    s = summarize("x", rep.predictions)
    assert s.rows == 2 and s.time_rows == 2 and s.meets_targets is None  # below five rows: no verdict
    d = rep.to_dict(rows=True)
    assert d["skipped"][0]["row"] == 4 and len(d["rows"]) == 2


def test_cli_validate_json(tmp_path: Path) -> None:
    path = _csv(tmp_path / "r.csv", [MPT, {**MPT, "metric": "mfu", "value": "0.4445"}, NO_BATCH])
    r = runner.invoke(app, ["validate", str(path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert set(data) >= {"sources", "overall", "skipped"}
    (src,) = data["sources"]
    assert {"source", "rows", "median_ape", "p90_ape", "spearman", "memory_median_ape"} <= set(src)
    assert src["rows"] == 2 and data["overall"]["rows"] == 2
    assert data["skipped"] == [{"row": 4, "source": NO_BATCH["source"], "model": "Llama 3.1 8B",
                                "metric": "tokens_per_s_per_gpu", "reason": data["skipped"][0]["reason"]}]
    r = runner.invoke(app, ["validate", str(path)])
    assert r.exit_code == 0 and "skipped rows" in r.output


def test_cli_unreadable_csv_exits_2(tmp_path: Path) -> None:
    r = runner.invoke(app, ["validate", str(tmp_path / "missing.csv")])
    assert r.exit_code == 2 and "cannot read" in r.output
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    r = runner.invoke(app, ["validate", str(bad), "--json"])
    assert r.exit_code == 2 and "missing column" in r.output


def _synthetic(tmp_path: Path, truth: CostConstants) -> list[PublishedRow]:
    """Rows whose values the model itself produced with ``truth``."""
    variants = [MPT, {**MPT, "seq_len": "512", "global_batch": "2048", "micro_batch": "128"},
                {**MPT, "seq_len": "8192", "global_batch": "128", "micro_batch": "8"},
                {**MPT, "recompute": "full (activation checkpointing)", "micro_batch": "64",
                 "global_batch": "1024"}]
    for v in variants:
        v["notes"] = ""
    rows, _ = load_published(_csv(tmp_path / "s.csv", variants))
    preds, _ = predict(rows, lambda acc: truth)
    from dataclasses import replace

    return [replace(p.row, value=p.predicted) for p in preds]


def test_fit_recovers_the_constant_that_made_the_rows(tmp_path: Path) -> None:
    truth = CostConstants(gemm_scale=0.8)
    rows = _synthetic(tmp_path, truth)
    res = fit_time(rows, base=CostConstants(), names=["gemm_scale"], per_accelerator=False)
    assert res.default["gemm_scale"] == pytest.approx(0.8, abs=0.01)
    assert res.support["default"]["rows"] == 4


def test_fit_ignores_unreliable_rows(tmp_path: Path) -> None:
    from dataclasses import replace

    rows = [replace(r, reliability="C") for r in _synthetic(tmp_path, CostConstants(gemm_scale=0.8))]
    with pytest.raises(ShardplanError, match="reliability A or B"):
        fit_time(rows, base=CostConstants(), names=["gemm_scale"], per_accelerator=False)
    assert fit_memory(rows, lambda acc: CostConstants())[1]["memory_rows"] == 0


def test_multi_start_escapes_a_local_minimum() -> None:
    """cost (x-.1)^2 (x-.9)^2 + .01 (x-.9)^2 on [0, 1]: a local minimum near 0.113, the global one at 0.9."""
    import numpy as np

    def resid(x: dict) -> np.ndarray:
        return np.array([(x["x"] - 0.1) * (x["x"] - 0.9), 0.1 * (x["x"] - 0.9)])

    bounds = {"x": (0.0, 1.0)}
    local, _ = levenberg_marquardt(resid, {"x": 0.05}, bounds)
    assert local["x"] == pytest.approx(0.113, abs=0.01)
    best, cost = _multi_start(resid, {"x": 0.05}, bounds)
    assert best["x"] == pytest.approx(0.9, abs=1e-3) and cost < 1e-6


def test_levenberg_marquardt_on_a_bounded_quadratic() -> None:
    import numpy as np

    best, cost = levenberg_marquardt(lambda x: np.array([x["a"] - 0.3, 2 * (x["b"] - 1.5)]),
                                     {"a": 0.9, "b": 0.2}, {"a": (0.0, 1.0), "b": (0.0, 2.0)})
    assert best["a"] == pytest.approx(0.3, abs=1e-3) and best["b"] == pytest.approx(1.5, abs=1e-3)
    assert cost < 1e-6


def _pred(row: PublishedRow, pub: float, pred: float, memory: float = 10.0) -> Prediction:
    return Prediction(row, pred, pub, pred, memory, 80.0)


def test_sweeps_bias_and_misfits(tmp_path: Path) -> None:
    """Pairs of one sweep whose published throughputs differ by more than 5% count, ordered or not;
    the bias is the median signed step-time error (positive: predicted too slow); a run predicted
    above the device's memory is listed."""
    rows, _ = load_published(_csv(tmp_path / "r.csv", [MPT, {**MPT, "micro_batch": "16"},
                                                       {**MPT, "micro_batch": "8"}]))
    a, b, c = rows
    runs = {1: [_pred(a, 100.0, 90.0)], 2: [_pred(b, 110.0, 95.0)], 3: [_pred(c, 106.0, 99.0, memory=81.0)]}
    assert sweep_pairs(runs) == (2, 2)  # 106 vs 110 is within 5%; the two other pairs are ordered
    runs[2] = [_pred(b, 110.0, 85.0)]
    assert sweep_pairs(runs) == (2, 1)
    s = summarize("x", [p for ps in runs.values() for p in ps])
    assert s.bias == pytest.approx(100 / 90 - 1) and len(s.misfits) == 1 and "81.0 of 80.0 GiB" in s.misfits[0]
    assert s.sweep_pairs == 2 and s.sweep_ordered == 0.5


def test_error_bands_per_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands are the 10th-90th percentiles of the signed step-time errors per slice (every row, the
    accelerator, the accelerator at a precision), slices of under ten rows or one source left to the
    wider one; a prediction's band scales its step time, and a measured profile has none."""
    import math

    import costmodel.constants as constants
    from costmodel.published.fit import FitResult, error_bands
    from planner.reprice import band_text, step_band

    sweep = [{**MPT, "micro_batch": str(mb)} for mb in (1, 2, 4, 8, 16, 32)]
    other = {"source": MPT["source"] + " (a second source)", "gpus": "16", "dp": "16"}
    rows, _ = load_published(_csv(tmp_path / "r.csv", [*sweep[:5], *[{**s, **other} for s in sweep]]))
    assert len({r.key for r in rows}) == 11
    preds = [_pred(r, 100.0 + i, 100.0) for i, r in enumerate(rows)]  # errors 0%, 1%, ..., 10%
    bands = error_bands(preds)
    assert set(bands) == {"all", "a100-80gb", "a100-80gb/bf16"}
    assert bands["all"]["rows"] == 11 and bands["all"]["sources"] == 2 and bands["all"]["low"] == pytest.approx(0.01)
    one_source, _ = load_published(_csv(tmp_path / "one.csv", [*sweep[:5], *[{**s, "gpus": "16", "dp": "16"}
                                                                            for s in sweep]]))
    assert error_bands([_pred(r, 100.0 + i, 100.0) for i, r in enumerate(one_source)]) == {}
    assert bands["all"]["high"] == pytest.approx(0.09)
    # two sweeps (8 and 16 GPUs) of 5 and 6 runs: 10 + 15 pairs, each off by the log of its ratio
    pairs = sorted(abs(math.log((100 + i) / (100 + j))) for grp in (range(5), range(5, 11))
                   for i in grp for j in grp if i < j)
    assert bands["all"]["pair"] == pytest.approx(float(np.percentile(pairs, 90)))
    assert error_bands(preds[:9]) == {}
    assert FitResult(default={}, bands=bands).to_yaml()["error_bands"]["a100-80gb"]["high"] == 0.09
    monkeypatch.setattr(constants, "_overrides_file", lambda: {"error_bands": {
        "all": {"rows": 300, "low": -0.1, "high": 0.2}, "h100-sxm": {"rows": 50, "low": -0.05, "high": 0.05}}})
    b = step_band(2.0, "h100-sxm", "fp8")
    assert b is not None and b["slice"] == "h100-sxm" and b["range_s"] == pytest.approx([1.9, 2.1])
    assert step_band(2.0, "a100-80gb", "bf16")["slice"] == "all"
    assert step_band(2.0, "h100-sxm", "bf16", measured=True) is None
    assert band_text(b) == ("likely 1.9-2.1 s (published runs on h100-sxm, each source held out of the fit: "
                            "10th-90th percentile, 50 rows)")
    monkeypatch.setattr(constants, "_overrides_file", lambda: {
        "error_bands": {"all": {"rows": 300, "low": -0.1, "high": 0.2}, "h100-sxm": {"rows": 50, "low": -0.05, "high": 0.05}},
        "held_out_rows": {"h100-sxm/bf16": 5, "h200/fp8": 2}})
    assert band_text(step_band(2.0, "h100-sxm", "bf16")).endswith("50 rows; 5 on h100-sxm/bf16, too few for a band)")
    assert band_text(step_band(2.0, "h200", "fp8")).endswith("300 rows; 2 on h200/fp8, too few for a band)")
    assert band_text(step_band(2.0, "h100-sxm", "fp8")).endswith("50 rows; no run on h100-sxm/fp8 was fitted)")
    assert band_text(step_band(2.0, "b200", "bf16")) == (
        "likely 1.8-2.4 s (published runs on all accelerators, each source held out of the fit: 10th-90th "
        "percentile, 300 rows; no run on b200 was fitted: other accelerators' band, not widened)")


def test_a_moe_models_band_holds_the_published_moe_runs_errors(monkeypatch) -> None:
    """The dense band widened to the MoE runs' 10th-90th percentiles (the shipped file: the errors
    benchmarks/moe_runs.py measured, recomputed here from its table), named in the band's text."""
    import numpy as np

    from costmodel import constants
    from planner.reprice import band_text, step_band

    stored = constants.moe_band()
    assert stored is not None and stored["rows"] == 10 and stored["accelerators"] == ["b200", "b300", "gb200", "gb300"]
    measured = [-0.091, -0.006, 0.021, -0.349, 0.001, -0.057, 0.053, 0.141, 0.108, 0.357]  # docs/validation.md
    assert stored["low"] == pytest.approx(float(np.percentile(measured, 10)), abs=2e-3)
    assert stored["high"] == pytest.approx(float(np.percentile(measured, 90)), abs=2e-3)
    monkeypatch.setattr(constants, "_overrides_file", lambda: {"error_bands": {
        "h100-sxm/bf16": {"rows": 50, "low": -0.05, "high": 0.05}}})
    monkeypatch.setattr(constants, "moe_band", lambda: {"rows": 10, "low": -0.12, "high": 0.16,
                                                        "accelerators": ["b200", "gb200"]})
    dense, moe = step_band(2.0, "h100-sxm", "bf16"), step_band(2.0, "h100-sxm", "bf16", moe=True)
    assert dense["range_s"] == pytest.approx([1.9, 2.1]) and moe["range_s"] == pytest.approx([1.76, 2.32])
    assert band_text(moe).endswith("50 rows; widened to the errors of 10 published MoE runs on b200, gb200, none fitted)")
    monkeypatch.setattr(constants, "moe_band", lambda: {"rows": 10, "low": -0.01, "high": 0.01, "accelerators": ["b200"]})
    assert step_band(2.0, "h100-sxm", "bf16", moe=True)["range_s"] == pytest.approx([1.9, 2.1])  # never narrower


def test_stored_bands_cover_their_held_out_rows() -> None:
    """The constants file's bands are the 10th-90th percentiles of the leave-one-source-out errors
    that ``shardplan fit`` wrote beside it: each band holds 70-90% of its slice's held-out rows (the
    exact counts, from the data), and a plan on an accelerator no published run was fitted on says so."""
    import yaml

    from costmodel.constants import CONSTANTS_PATH, held_out_path
    from costmodel.published.fit import band_coverage, band_slices, error_bands, read_held_out
    from planner.reprice import band_text, step_band

    stored = yaml.safe_load(CONSTANTS_PATH.read_text())
    held = read_held_out(held_out_path(CONSTANTS_PATH))
    bands = stored["error_bands"]
    coverage = {}
    for key, band in bands.items():
        mine = [h for h in held if key in band_slices(h)]
        assert (band["rows"], band["sources"]) == (len(mine), len({h.source for h in mine})), key
        inside, n = band_coverage(band, mine)
        assert 0.70 * n <= inside <= 0.90 * n, (key, inside, n)
        coverage[key] = (inside, n)
    assert coverage == HELD_OUT_COVERAGE
    again = error_bands(held)
    assert set(again) == set(bands)
    for key, band in again.items():
        assert [round(band[f], 4) for f in ("low", "high", "pair")] == [bands[key][f] for f in ("low", "high", "pair")]
    for acc in ("b200", "gb200"):
        text = band_text(step_band(4.0, acc, "bf16"))
        assert "published runs on all accelerators" in text and f"no run on {acc} was fitted" in text, text


#: (rows inside the band, rows) per slice of the stored bands on their held-out rows
HELD_OUT_COVERAGE: dict[str, tuple[int, int]] = {
    "all": (266, 336), "a100-80gb": (117, 147), "a100-80gb/bf16": (117, 147), "h100-sxm": (149, 187),
    "h100-sxm/bf16": (120, 150), "h100-sxm/fp8": (30, 37)}
