"""shardplan calibrate and check: the trainers' logs read with known answers, constants recovered from
logs written from them, refusals in one line, the calibration carried by plans, check naming the part."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from costmodel.calibration.logs import read_log, steady, warmup_count
from planner.cli import app
from tests.calibration_data import DATA, import_options

runner = CliRunner()
FORMATS = ("megatron", "torchtitan", "deepspeed", "nanotron", "shardplan")
#: how close a log's printed figures are to the numbers written (the format's rounding)
TIME_ROUNDING = {"megatron": 1e-4, "torchtitan": 1e-3, "deepspeed": 1e-9, "nanotron": 6e-3, "shardplan": 1e-9}
MEMORY_ROUNDING = {"megatron": 1e-9, "torchtitan": 1e-3, "deepspeed": 1e-3, "nanotron": 6e-3, "shardplan": 1e-8}
#: the memory figures each trainer prints
MEMORY_KINDS = {"megatron": {"allocated", "reserved"}, "torchtitan": {"reserved"}, "deepspeed": {"allocated"},
                "nanotron": {"reserved"}, "shardplan": {"allocated", "process"}}


def answers(fmt: str) -> dict[str, Any]:
    return json.loads((DATA / fmt / "answers.json").read_text())


def run_args(fmt: str, root: Path = DATA) -> list[str]:
    """``CONFIG LOG ...`` of a trainer's five runs, and the options its configurations need."""
    a = answers(fmt)
    args = [str(root / fmt / p) for r in a["runs"] for p in (r["config"], r["log"])]
    opts = import_options(fmt)
    for key, flag in (("model", "--model"), ("cluster", "--cluster"), ("seq_len", "--seq-len")):
        if key in opts:
            args += [flag, str(opts[key])]
    return args


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_trainers_log_reads_as_written(fmt: str) -> None:
    """Every log gives back the steady step time and peak memory it was written with, within its
    format's rounding, with the warm-up step dropped."""
    a = answers(fmt)
    for r in a["runs"]:
        log = read_log(DATA / fmt / r["log"])
        assert log.format == fmt
        cfg = json.loads((DATA / fmt / r["config"]).read_text()) if fmt == "shardplan" else None
        world = 4 if fmt == "shardplan" else 16
        gb = cfg["inputs"]["workload"]["global_batch"] if cfg else _global_batch(fmt, r)
        st = steady(log, gb, 128 if fmt == "shardplan" else 2048, world)
        assert st.warmup == 1 and st.used >= 8
        assert st.step_time_s == pytest.approx(r["step_time_s"], rel=TIME_ROUNDING[fmt])
        assert set(st.memory) == MEMORY_KINDS[fmt]
        for kind, value in st.memory.items():
            assert value == pytest.approx(r["memory"][kind], rel=MEMORY_ROUNDING[fmt]), kind


def _global_batch(fmt: str, r: dict[str, Any]) -> int:
    from planner.calibration import ImportOptions, plan_of

    return plan_of(DATA / fmt / r["config"], ImportOptions(**import_options(fmt))).inputs.workload.global_batch


@pytest.mark.parametrize("fmt", FORMATS)
def test_calibrate_recovers_the_constants_the_logs_were_written_from(fmt: str, tmp_path: Path) -> None:
    """Five runs of each trainer, their logs written from known constants: calibrate gets every one
    of them back within 2%, says how far each moved from its prior, and the runs' error goes to
    about nothing."""
    out = tmp_path / "cluster.yaml"
    r = runner.invoke(app, ["calibrate", *run_args(fmt), "-o", str(out)])
    assert r.exit_code == 0, r.output
    doc = yaml.safe_load(out.read_text())
    fitted = {p["name"]: p for p in doc["parameters"]}
    truth = answers(fmt)["truth"]
    assert set(fitted) == set(truth) - ({"fragmentation"} if fmt == "deepspeed" else set())
    for name, p in fitted.items():
        assert p["value"] == pytest.approx(truth[name], rel=0.02), name
        assert p["moved"] == pytest.approx(p["value"] / p["prior"] - 1, abs=1e-3)
    assert doc["error"]["after"]["step_time"]["max_abs"] < 0.01 < doc["error"]["before"]["step_time"]["max_abs"]
    assert "parameters fitted on" in r.output and f"wrote {out}" in r.output


def test_runs_that_cannot_separate_the_parameters_are_refused_in_one_line(tmp_path: Path) -> None:
    """Three copies of one run change every run's time alike for compute and overhead: one line, exit
    2, no file; a network on runs that move no bytes likewise."""
    a = answers("megatron")["runs"][0]
    pair = [str(DATA / "megatron" / a["config"]), str(DATA / "megatron" / a["log"])]
    out = tmp_path / "c.yaml"
    r = runner.invoke(app, ["calibrate", *pair * 3, "-o", str(out), "--fit", "compute,overhead"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "cannot separate compute from overhead" in r.output and not out.exists()
    r = runner.invoke(app, ["calibrate", *pair, "-o", str(out)])
    assert r.exit_code == 2 and "3 time parameters (compute, network, overhead) need at least 3 runs" in r.output
    r = runner.invoke(app, ["calibrate", *pair * 3, "-o", str(out), "--fit", "compute,gemm"])
    assert r.exit_code == 2 and "'compute' and 'gemm' move the same constants" in r.output


def test_a_network_that_moves_no_run_is_refused(tmp_path: Path) -> None:
    from costmodel.calibration.fit import CalibrationError, calibrate
    from planner.calibration import load_run

    d = tmp_path / "one"
    d.mkdir()
    runs = []
    for gb in (8, 16, 32):  # one process: no collective at all
        cfg, log = _one_process_run(d, gb)
        runs.append(load_run(cfg, log))
    with pytest.raises(CalibrationError, match="cannot separate network: a change of it moves no run's step time"):
        calibrate(runs, ["compute", "network", "overhead"])
    assert calibrate(runs, ["compute", "overhead"]).values["compute"] > 0


def _one_process_run(d: Path, gb: int) -> tuple[Path, Path]:
    from costmodel.calibration import synthetic
    from planner.reprice import plan_from_strategy

    plan = plan_from_strategy("gpt2", "1xcpu", {"mesh": {"dp_replicate": 1}}, 128, gb, precision="fp32")
    cfg = d / f"plan{gb}.json"
    plan.save(cfg)
    t = plan.predicted.step_time_s * (1.3 + 0.1 / plan.predicted.step_time_s)
    log = d / f"plan{gb}.log"
    log.write_text(synthetic.shardplan(synthetic.SynthRun(gb, 128, 1, synthetic.step_times(t))))
    return cfg, log


def test_warm_up_is_the_first_step_and_those_still_slow_after_it() -> None:
    assert warmup_count([3.0, 1.01, 1.0, 0.99, 1.0]) == 1
    assert warmup_count([3.0, 2.0, 1.5, 1.0, 1.0, 1.01, 0.99]) == 3
    assert warmup_count([1.0, 1.0]) == 1


def test_a_log_that_is_no_trainers_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.log"
    bad.write_text("hello\nworld\n")
    cfg = DATA / "megatron" / "run0.args"
    r = runner.invoke(app, ["calibrate", str(cfg), str(bad), str(cfg), str(bad), str(cfg), str(bad), "-o",
                            str(tmp_path / "c.yaml")])
    assert r.exit_code == 2 and "not a training log of megatron, torchtitan" in r.output
    one = tmp_path / "one.log"
    one.write_text((DATA / "megatron" / "run0.log").read_text().splitlines()[0] + "\n")
    r = runner.invoke(app, ["check", str(cfg), str(one)])
    assert r.exit_code == 2 and "1 timed step record(s)" in r.output and r.output.count("\n") == 1
    r = runner.invoke(app, ["calibrate", str(cfg), "-o", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2 and "CONFIG LOG pairs" in r.output


def _calibration(tmp_path: Path, fmt: str = "megatron") -> Path:
    out = tmp_path / "cluster.yaml"
    assert runner.invoke(app, ["calibrate", *run_args(fmt), "-o", str(out)]).exit_code == 0
    return out


def test_a_plan_records_its_calibration_and_is_repriced_with_it(tmp_path: Path) -> None:
    """plan --calibration records the file's values; estimate --plan re-prices with them (the same step
    time, no file opened); explain shows the calibration's band; the wrong accelerator and a sweep
    over other accelerators are refused in one line."""
    cal = _calibration(tmp_path)
    shutil.copy(cal, tmp_path / "moved.yaml")
    base = ["--model", "llama3-8b", "--cluster", "16xh100", "--seq-len", "2048", "--global-batch", "64"]
    r = runner.invoke(app, ["plan", *base, "--calibration", str(cal), "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    ref = doc["inputs"]["calibration"]
    assert doc["schema_version"] == "1.12" and ref["accelerator"] == "h100-sxm" and ref["band"]["runs"] == 5
    assert ref["network_scale"] == pytest.approx(0.6, rel=0.02)
    cal.unlink()  # re-pricing reads the values the plan records
    est = json.loads(runner.invoke(app, ["estimate", "--plan", str(tmp_path / "p.json"), "--json"]).stdout)
    assert est["step_time_s"] == pytest.approx(doc["predicted"]["step_time_s"], rel=1e-9)
    assert est["error_band"]["calibration"] == ref["path"]
    plain = json.loads(runner.invoke(app, ["estimate", *base, "--dp", "16", "--json"]).stdout)
    cald = json.loads(runner.invoke(app, ["estimate", *base, "--dp", "16", "--json", "--calibration",
                                          str(tmp_path / "moved.yaml")]).stdout)
    assert cald["step_time_s"] > plain["step_time_s"] * 1.1  # the cluster is slower than the spec sheet
    r = runner.invoke(app, ["explain", str(tmp_path / "p.json"), "--json"])
    assert json.loads(r.stdout)["predicted"]["band"]["calibration"] == ref["path"]
    r = runner.invoke(app, ["explain", str(tmp_path / "p.json")])
    said = f"(calibration {ref['path']}: its 5 runs, after the fit)"  # a long path may wrap at 80 columns
    assert "".join(said.split()) in "".join(r.output.split())
    r = runner.invoke(app, ["estimate", "--model", "llama3-8b", "--cluster", "16xh200", "--seq-len", "2048",
                            "--global-batch", "16", "--dp", "16", "--calibration", str(tmp_path / "moved.yaml")])
    assert r.exit_code == 2 and "was fitted on h100-sxm runs; the cluster's accelerator is h200" in r.output
    r = runner.invoke(app, ["sweep", "-m", "llama3-8b", "--gpus", "16", "-a", "h100,h200", "--global-batch", "64",
                            "--seq-len", "2048", "--calibration", str(tmp_path / "moved.yaml")])
    assert r.exit_code == 2 and "the sweep also plans on h200" in r.output


def test_explain_prices_a_plan_with_a_calibration_given(tmp_path: Path) -> None:
    cal = _calibration(tmp_path)
    base = ["--model", "llama3-8b", "--cluster", "16xh100", "--seq-len", "2048", "--global-batch", "64"]
    assert runner.invoke(app, ["plan", *base, "-o", str(tmp_path / "p.json")]).exit_code == 0
    plain = json.loads(runner.invoke(app, ["explain", str(tmp_path / "p.json"), "--json"]).stdout)
    r = runner.invoke(app, ["explain", str(tmp_path / "p.json"), "--json", "--calibration", str(cal)])
    cald = json.loads(r.stdout)
    band = cald["predicted"]["band"]
    assert "published runs" not in json.dumps(band) and band["calibration"] == str(cal)
    assert cald["predicted"]["step_time_s"] > plain["predicted"]["step_time_s"]


def test_a_calibration_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: shardplan-calibration\nversion: 1\naccelerator: h100-sxm\nconstants: {warp_speed: 2.0}\n"
                   "network_scale: 1.0\nband: {low: -0.1, high: 0.1, runs: 3}\n")
    r = runner.invoke(app, ["estimate", "--model", "gpt2", "--cluster", "8xh100", "--seq-len", "1024",
                            "--global-batch", "8", "--calibration", str(bad)])
    assert r.exit_code == 2 and "unknown cost constant(s) ['warp_speed']" in r.output and r.output.count("\n") == 1
    bad.write_text("kind: something\n")
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "8xh100", "--seq-len", "1024", "--global-batch",
                            "8", "--calibration", str(bad)])
    assert r.exit_code == 2 and "is not a valid calibration" in r.output


def test_cpu_plans_quote_no_band_from_gpu_runs() -> None:
    r = runner.invoke(app, ["estimate", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128",
                            "--global-batch", "8", "--dp", "4", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["error_band"] is None
    r = runner.invoke(app, ["estimate", "--model", "gpt2", "--cluster", "8xh100", "--seq-len", "1024",
                            "--global-batch", "8", "--dp", "8", "--json"])
    assert json.loads(r.stdout)["error_band"]["slice"] == "h100-sxm/bf16"


@pytest.mark.parametrize("fmt, run, part, factor, needle", [
    ("megatron", 3, "dp", 3.0, "data-parallel reduction 3.0x the priced time"),
    ("megatron", 2, "pipeline", 3.0, "pipeline send/receive and bubble 3.0x the priced time"),
    ("megatron", 1, "compute", 1.3, "compute (forward and backward, with TP/CP/EP collectives) 1.3x"),
    ("deepspeed", 2, "dp", 2.0, "data-parallel reduction 2.0x the priced time"),
    ("deepspeed", 0, "optimizer", 2.0, "optimizer step 2.0x the priced time"),
])
def test_check_names_the_part_whose_time_was_injected(fmt: str, run: int, part: str, factor: float, needle: str,
                                                     tmp_path: Path) -> None:
    """A log whose step differs from the plan's price by a known amount in one part: check names it."""
    from costmodel.calibration import synthetic
    from costmodel.calibration.check import priced_parts
    from planner.calibration import ImportOptions, plan_of

    config = DATA / fmt / answers(fmt)["runs"][run]["config"]
    opts = import_options(fmt)
    plan = plan_of(config, ImportOptions(**opts))
    parts = priced_parts(plan.predicted.model_dump())
    extra = parts[part] * (factor - 1)
    parts[part] *= factor
    w = plan.inputs.workload
    step = plan.predicted.step_time_s + extra
    log = tmp_path / "job.log"
    log.write_text(synthetic.WRITERS[fmt](synthetic.SynthRun(w.global_batch, w.seq_len, 16,
                                                             synthetic.step_times(step), {}, parts)))
    flags = [a for k, f in (("model", "--model"), ("cluster", "--cluster"), ("seq_len", "--seq-len")) if k in opts
             for a in (f, str(opts[k]))]
    r = runner.invoke(app, ["check", str(config), str(log), *flags, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert needle in out["cause"], out["cause"]
    step_row = next(x for x in out["rows"] if x["what"] == "step time")
    assert step_row["difference"] == pytest.approx(extra, rel=0.02)
    r = runner.invoke(app, ["check", str(config), str(log), *flags])
    assert needle in " ".join(r.output.split())


def test_check_of_a_log_that_times_whole_steps_only_says_so(tmp_path: Path) -> None:
    """torchtitan prints throughput, not parts: check says how far the step is and which priced term is
    the largest; priced with the cluster's calibration, the same log is where the plan says."""
    a = answers("torchtitan")["runs"][2]
    job = [str(DATA / "torchtitan" / a["config"]), str(DATA / "torchtitan" / a["log"])]
    out = json.loads(runner.invoke(app, ["check", *job, "--json"]).stdout)
    assert "the log times whole steps only" in out["cause"] and "largest priced term, compute" in out["cause"]
    cal = _calibration(tmp_path, "torchtitan")
    out = json.loads(runner.invoke(app, ["check", *job, "--json", "--calibration", str(cal)]).stdout)
    assert out["cause"].startswith("the step is within 5% of its price") and "nothing stands out" in out["cause"]
    assert out["memory"] == "memory within 10% of the prediction"


def test_real_runs_of_the_runtime_lower_the_held_out_error() -> None:
    """Five plans trained by shardplan's runtime on four CPU processes (benchmarks/calibration_runs.py,
    its reports kept in tests/data/calibration/cpu-runs): each plan predicted by a calibration of the
    four others is closer to its measured step time and memory than the spec sheet's prediction."""
    from planner.calibration import load_run
    from tests.benchmark_scripts import benchmark_script

    bench = benchmark_script("calibration_runs")
    d = DATA / "cpu-runs"
    runs = [load_run(d / f"{name}.plan.json", d / f"{name}.run0.json") for name in bench.plans()]
    rows = bench.held_out(runs, None)
    assert not [x for x in rows if "refused" in x]
    s = bench.summary(rows)
    assert s["time_after"] < s["time_before"] and s["memory_after"] < s["memory_before"], s
