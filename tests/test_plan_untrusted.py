"""A plan or batch file never runs code; batch output is one line per input line; command-line
counts and limits are checked; plan documents obey their cross-field rules."""

from __future__ import annotations

import importlib
import json
import os
import pdb
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from planner.commands import estimate as estimate_mod
from planner.reprice import FACTORY_REFUSED, plan_from_strategy, plan_graph, stage_times
from profiler.graph import graph_from_dict, graph_to_dict
from profiler.models import load_model
from vocab.plan import READABLE_VERSIONS, SCHEMA_VERSION, PlanError, load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("os:abort", "sys:exit", "pdb:set_trace", "tempfile:mkdtemp")
FACTORY = "tests.fixtures_models:tiny_mlp"
GPT2_LINE = {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8}


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    """A gpt2 plan (TP with sequence parallelism, which deepspeed cannot express: export re-prices)."""
    p = plan_from_strategy("gpt2", "4xcpu", {"mesh": {"tp": 2, "dp_shard": 2}, "sequence_parallel": True}, 128, 8)
    return json.loads(p.to_json())


def write_plan(base: dict[str, Any], path: Path, model: str, version: str = SCHEMA_VERSION) -> Path:
    doc = json.loads(json.dumps(base))
    doc["inputs"]["model"] = model
    doc["schema_version"] = version
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture()
def no_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[str]]:
    """Record (and refuse) any import of the specs' modules and any call of their functions."""
    calls: list[str] = []
    real = importlib.import_module

    def guarded(name: str, package: str | None = None) -> Any:
        if name.split(".")[0] in ("os", "sys", "pdb", "tempfile", "tests"):
            calls.append(f"import {name}")
            raise AssertionError(f"imported {name}")
        return real(name, package)

    def refuse(what: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> Any:
            calls.append(what)
            raise AssertionError(f"called {what}")
        return fn

    monkeypatch.setattr(importlib, "import_module", guarded)
    monkeypatch.setattr(os, "abort", refuse("os.abort"))
    monkeypatch.setattr(pdb, "set_trace", refuse("pdb.set_trace"))
    monkeypatch.setattr(tempfile, "mkdtemp", refuse("tempfile.mkdtemp"))
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    yield calls
    assert not list(tmpdir.iterdir()), "a temporary directory was made"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


COMMANDS = {
    "estimate": lambda f, tmp: ["estimate", "--plan", str(f), "--json"],
    "explain": lambda f, tmp: ["explain", str(f)],
    "plot-timeline": lambda f, tmp: ["plot", str(f), "--kind", "timeline", "-o", str(tmp / "t.png")],
    "export": lambda f, tmp: ["export", str(f), "--to", "deepspeed", "--nearest"],
}


# ---- 1. a plan file never runs code ------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_plan_naming_a_factory_fails_to_load_and_imports_nothing(
    spec: str, command: str, base: dict[str, Any], tmp_path: Path, no_code: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = write_plan(base, tmp_path / "evil.json", spec)
    rc, out, err = run(COMMANDS[command](f, tmp_path), capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"inputs: model '{spec}' names a factory, which a plan never imports" in err
    assert no_code == [] and not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("spec", SPECS)
def test_an_old_plan_naming_a_factory_is_read_but_never_imported(
    spec: str, base: dict[str, Any], tmp_path: Path, no_code: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    """A 1.0 document names a factory without recording its graph: whatever needs the model says
    so (estimate: exit 2) or does without it (explain, the even timeline, an export noting it)."""
    f = write_plan(base, tmp_path / "old.json", spec, "1.0")
    rc, out, err = run(COMMANDS["estimate"](f, tmp_path), capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"the plan's model '{spec}' is a package.module:factory and the plan records no layer graph: " \
           f"{FACTORY_REFUSED}" in err
    assert run(COMMANDS["explain"](f, tmp_path), capsys)[0] == 0
    assert run(COMMANDS["plot-timeline"](f, tmp_path), capsys)[0] == 0
    assert stage_times(load_plan(f)).exact is False
    rc, out, err = run(COMMANDS["export"](f, tmp_path), capsys)
    assert rc == 0 and FACTORY_REFUSED in err
    assert no_code == []


@pytest.mark.parametrize("spec", SPECS)
def test_a_batch_line_naming_a_factory_is_an_error_line(
    spec: str, base: dict[str, Any], tmp_path: Path, no_code: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    old = write_plan(base, tmp_path / "old.json", spec, "1.0")
    new = write_plan(base, tmp_path / "new.json", spec)
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(json.dumps(x) for x in (
        {**GPT2_LINE, "model": spec}, {"plan": str(old)}, {"plan": str(new)}, GPT2_LINE)) + "\n")
    rc, out, err = run(["estimate", "--batch", str(batch)], capsys)
    lines = [json.loads(x) for x in out.splitlines()]
    assert rc == 2 and err == "error: 3 of 4 lines failed\n" and len(lines) == 4
    assert lines[0] == {"error": f"line 1: model '{spec}' is a package.module:factory: {FACTORY_REFUSED}"}
    assert lines[1] == {"error": f"line 2: the plan's model '{spec}' is a package.module:factory and the plan "
                                 f"records no layer graph: {FACTORY_REFUSED}"}
    assert lines[2]["error"].startswith(f"line 3: plan '{new}' is not a valid plan: inputs: model '{spec}' names")
    assert "step_time_s" in lines[3]
    assert no_code == []


def test_the_process_survives_every_command_on_evil_plans(base: dict[str, Any], tmp_path: Path) -> None:
    """No patches: the real os.abort, sys.exit and pdb.set_trace would end or stop the process."""
    plans = [write_plan(base, tmp_path / f"{i}-{v}.json", spec, v)
             for i, spec in enumerate(SPECS) for v in READABLE_VERSIONS]
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(json.dumps({**GPT2_LINE, "model": s}) for s in SPECS) + "\n")
    argvs = [cmd(f, tmp_path) for f in plans for cmd in COMMANDS.values()] + [["estimate", "--batch", str(batch)]]
    code = ("import json, sys, tempfile\nfrom planner.cli import main\n"
            "rcs = [main(a) for a in json.loads(sys.argv[1])]\n"
            "print('RCS', json.dumps(rcs), 'tests.fixtures_models' in sys.modules, 'torch' in sys.modules)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(ROOT)}
    (tmp_path / "tmp").mkdir()
    r = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=300, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    tail = r.stdout.strip().splitlines()[-1].split(" ", 1)[1]
    rcs = json.loads(tail.rsplit(" ", 2)[0])
    expected = []
    for _spec in SPECS:
        expected += [2, 0, 0, 0]  # 1.0: estimate needs the model; explain, timeline, export do without
        expected += [2, 2, 2, 2] * (len(READABLE_VERSIONS) - 1)  # 1.1 and later: the document is invalid
    assert rcs == [*expected, 2] and tail.endswith("False False")  # the batch: every line refused, exit 2
    assert not list((tmp_path / "tmp").iterdir())


@pytest.fixture(scope="module")
def factory_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan made on the command line from a factory model (imported: the user's explicit choice)."""
    f = tmp_path_factory.mktemp("factory") / "plan.json"
    rc = main(["plan", "--model", FACTORY, "--cluster", "1xcpu", "--seq-len", "16", "--global-batch", "2",
               "-o", str(f), "--top-k", "1"])
    assert rc == 0
    return f


def test_a_factory_plan_records_its_graph_and_reprices_from_it_without_an_import(factory_plan: Path) -> None:
    doc = json.loads(factory_plan.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["inputs"]["model"] == FACTORY
    assert doc["inputs"]["model_graph"]["seq_len"] == 16 and doc["inputs"]["model_graph"]["source"] == "traced"
    plan = load_plan(factory_plan)
    assert plan_graph(plan).content_hash() == plan.inputs.model_hash == load_model(FACTORY, 16).content_hash()
    assert stage_times(plan).exact
    code = ("import json, sys\nfrom planner.cli import main\n"
            f"rcs = [main(['estimate', '--plan', {str(factory_plan)!r}, '--json']),\n"
            f"       main(['export', {str(factory_plan)!r}, '--to', 'deepspeed']),\n"
            f"       main(['plot', {str(factory_plan)!r}, '--kind', 'timeline', '-o', "
            f"{str(factory_plan.with_suffix('.png'))!r}])]\n"
            "print('RCS', json.dumps(rcs), 'tests.fixtures_models' in sys.modules, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "RCS [0, 0, 0] False False"
    report = json.JSONDecoder().raw_decode(r.stdout)[0]  # estimate's report, then the export
    assert report["step_time_s"] == doc["predicted"]["step_time_s"]


def test_a_factory_on_the_command_line_is_imported(factory_plan: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["estimate", "--plan", str(factory_plan), "--model", FACTORY, "--json"], capsys)
    assert rc == 0 and json.loads(out)["step_time_s"] == json.loads(factory_plan.read_text())["predicted"]["step_time_s"]
    rc, _, err = run(["plot", str(factory_plan), "--kind", "timeline", "-o", str(tmp_path / "t.svg"),
                      "--model", FACTORY], capsys)
    assert rc == 0 and (tmp_path / "t.svg").exists()
    rc, out, _ = run(["estimate", "--plan", str(factory_plan), "--seq-len", "32", "--json"], capsys)
    assert rc == 2  # the recorded graph is for seq_len 16: another length needs --model


def test_an_altered_recorded_graph_is_refused(factory_plan: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(factory_plan.read_text())
    doc["inputs"]["model_graph"]["nodes"][0]["params"] += 1
    f = tmp_path / "altered.json"
    f.write_text(json.dumps(doc))
    rc, out, err = run(["estimate", "--plan", str(f), "--json"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "inputs.model_graph does not match its inputs.model_hash" in err
    doc["inputs"]["model_graph"]["seq_len"] = 8
    with pytest.raises(PlanError, match=r"inputs: model_graph.seq_len 8 is not workload.seq_len 16"):
        parse_plan(doc)
    doc["inputs"]["model_graph"]["seq_len"] = 16
    doc["schema_version"] = "1.0"
    with pytest.raises(PlanError, match="inputs: model_graph needs schema_version 1.1"):
        parse_plan(doc)


@pytest.mark.parametrize("spec", ["gpt2", "mixtral-8x7b", "llama3-8b"])
def test_graph_round_trip_keeps_the_hash_and_compacts_repeated_layers(spec: str) -> None:
    g = load_model(spec, 64)
    d = json.loads(json.dumps(graph_to_dict(g)))
    back = graph_from_dict(d)
    assert back.content_hash() == g.content_hash() and back.config == g.config
    assert [n.to_dict() for n in back.nodes] == [n.to_dict() for n in g.nodes]
    alike = [n for n in d["nodes"] if "like" in n]
    assert len(alike) >= len(g.nodes) // 2 and all(set(n) == {"name", "block", "like"} for n in alike)
    d["nodes"][1] = {"name": "x", "block": None, "like": 5}
    with pytest.raises(ValueError, match="'like' must be the index of an earlier node"):
        graph_from_dict(d)


# ---- 2. one output line per batch line ---------------------------------------------------------

def nan_message() -> str:
    try:
        json.dumps(float("nan"), allow_nan=False)
    except ValueError as e:
        return str(e)
    raise AssertionError("json.dumps printed NaN")


def test_batch_writes_one_line_per_input_line_whatever_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    real = estimate_mod.price_args

    def price(a: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if a.get("seq_len") == 96:
            raise ZeroDivisionError("division by zero")
        if a.get("seq_len") == 64:
            return {"step_time_s": float("nan")}
        return real(a, **kw)

    monkeypatch.setattr(estimate_mod, "price_args", price)
    good = estimate_mod.report_json(real(dict(GPT2_LINE)))
    lines = [
        "",
        "not json",
        "[1, 2]",
        '"a string"',
        "3",
        "null",
        json.dumps({**GPT2_LINE, "cluster": {"accelerator": "h100", "nodes": "x"}}),
        json.dumps({**GPT2_LINE, "tp": 0}),
        json.dumps({**GPT2_LINE, "tp": "2"}),
        json.dumps({**GPT2_LINE, "tp": 2.5}),
        json.dumps({**GPT2_LINE, "sequence_parallel": 1}),
        json.dumps({**GPT2_LINE, "memory_limit": -1}),
        json.dumps({**GPT2_LINE, "memory_limit": 0}),
        json.dumps({**GPT2_LINE, "model": 5}),
        json.dumps({**GPT2_LINE, "bogus": 1}),
        json.dumps({**GPT2_LINE, "seq_len": 96}),
        json.dumps({**GPT2_LINE, "seq_len": 64}),
        "   ",
        json.dumps(GPT2_LINE) + "\r",
        "[" * 100_000 + "]" * 100_000,
        json.dumps({**GPT2_LINE, "profile": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}),
        '{"memory_limit": NaN}',
        json.dumps({**GPT2_LINE, "model": "os:abort"}),
    ]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(lines) + "\n")
    rc, out, err = run(["estimate", "--batch", str(f)], capsys)
    expected = [
        {"error": "line 1: empty line"},
        {"error": "line 2: not valid JSON: Expecting value at column 1"},
        {"error": "line 3: each line must be a JSON object"},
        {"error": "line 4: each line must be a JSON object"},
        {"error": "line 5: each line must be a JSON object"},
        {"error": "line 6: each line must be a JSON object"},
        {"error": 'line 7: cluster.nodes must be a positive integer, got "x"'},
        {"error": "line 8: tp must be a positive integer, got 0"},
        {"error": 'line 9: tp must be a positive integer, got "2"'},
        {"error": "line 10: tp must be a positive integer, got 2.5"},
        {"error": "line 11: sequence_parallel must be true or false, got 1"},
        {"error": "line 12: memory_limit must be a finite positive number of GiB, got -1"},
        {"error": "line 13: memory_limit must be a finite positive number of GiB, got 0"},
        {"error": "line 14: model must be a name or an object, got 5"},
        {"error": "line 15: unknown key(s) ['bogus']; known: " + ", ".join(estimate_mod.KEYS)},
        {"error": "line 16: internal error: ZeroDivisionError: division by zero -- this is a bug"},
        {"error": f"line 17: internal error: ValueError: {nan_message()} -- this is a bug"},
        {"error": "line 18: empty line"},
        json.loads(good),
        {"error": "line 20: the line nests deeper than 32 levels"},
        {"error": "line 21: the line nests deeper than 32 levels"},
        {"error": "line 22: not valid JSON: NaN is not a number JSON allows"},
        {"error": f"line 23: model 'os:abort' is a package.module:factory: {FACTORY_REFUSED}"},
    ]
    assert rc == 2 and err == f"error: {len(lines) - 1} of {len(lines)} lines failed\n"
    assert out.splitlines()[18] == good
    got = [json.loads(x) for x in out.splitlines()]
    assert len(got) == len(lines)
    for i, (g, e) in enumerate(zip(got, expected, strict=True), 1):
        assert g == e, f"line {i}"


@pytest.mark.parametrize("content, needle", [
    (b"\n\n", "holds no plans"),
    (b"\xff\xfe{}\n", "is not UTF-8 text"),
])
def test_a_batch_file_that_cannot_be_read_is_one_error(tmp_path: Path, content: bytes, needle: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "in.jsonl"
    f.write_bytes(content)
    rc, out, err = run(["estimate", "--batch", str(f)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and needle in err
    rc, out, err = run(["estimate", "--batch", str(tmp_path)], capsys)
    assert rc == 2 and out == "" and "is a directory" in err


# ---- 3. command-line values --------------------------------------------------------------------

BASE = ["estimate", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8"]


@pytest.mark.parametrize("flag, value", [
    ("--tp", "0"), ("--pp", "0"), ("--cp", "0"), ("--ep", "0"), ("--micro-batch", "0"), ("--vpp", "0"),
    ("--tp", "-2"), ("--dp", "0"), ("--dp-shard", "0"), ("--dp-replicate", "-1"), ("--seq-len", "0"),
    ("--global-batch", "0"), ("--memory-limit", "0"), ("--memory-limit", "-4"), ("--memory-limit", "nan"),
    ("--memory-limit", "inf"),
])
def test_bad_counts_and_limits_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run([*BASE, flag, value, "--json"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and flag in err, err


def test_good_values_still_price(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([*BASE, "--tp", "2", "--memory-limit", "20", "--json"], capsys)
    rep = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the output"))
    assert rc == 0 and rep["memory_limit_gib"] == 20.0 and rep["step_time_s"] > 0


def test_report_json_refuses_nan() -> None:
    with pytest.raises(ValueError):
        estimate_mod.report_json({"x": float("inf")})


# ---- 4. cross-field rules of plan documents ----------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda d: d["inputs"]["cluster"].update(world_size=5),
     "inputs.cluster: world_size 5 is not nodes x gpus_per_node = 1 x 4 = 4"),
    (lambda d: d["inputs"]["cluster"].update(nodes=2, world_size=8),
     "strategy: mesh spans 4 GPUs; inputs.cluster.world_size is 8"),
    (lambda d: d["inputs"]["workload"].update(global_batch=7),
     "strategy: mesh.dp, micro_batch: global batch 7 is not divisible by dp*micro_batch = 2*1 = 2 "
     "(inputs.workload.global_batch)"),
    (lambda d: d["alternatives"][0]["strategy"].update(micro_batch=3),
     "alternatives: 0.strategy.mesh.dp, 0.strategy.micro_batch: global batch 8 is not divisible by "
     "dp*micro_batch = 4*3 = 12 (inputs.workload.global_batch)"),
])
def test_cross_field_rules(edit: Any, message: str, base: dict[str, Any], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(json.dumps(base))
    doc["alternatives"] = [{"strategy": {"mesh": {"dp_shard": 4}}, "predicted": doc["predicted"]}]
    parse_plan(doc)
    edit(doc)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="^" + "plan '.*' is not a valid plan: " + re.escape(message)):
        load_plan(f)
    rc, out, err = run(["explain", str(f)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("where, message", [
    (("predicted", "mfu"), "predicted.mfu: Input should be a finite number"),
    (("predicted", "time", "compute_s"), "predicted: time.compute_s is not a finite number"),
    (("inputs", "memory_limit_gib"), "inputs.memory_limit_gib: Input should be a finite number"),
    (("solver", "objective"), "solver.objective: Input should be a finite number"),
])
def test_numbers_are_finite(where: tuple[str, ...], message: str, base: dict[str, Any]) -> None:
    doc = json.loads(json.dumps(base))
    node = doc
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = float("inf")
    with pytest.raises(PlanError, match=message.replace(".", r"\.")):
        parse_plan(doc)
    doc = json.loads(json.dumps(base))
    doc["solver"]["options"] = {"x": [1.0, float("nan")]}
    with pytest.raises(PlanError, match=r"solver: options\.x\.1 is not a finite number"):
        parse_plan(doc)


def test_old_plans_are_read(base: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(json.dumps(base))
    doc["schema_version"] = "1.0"
    del doc["inputs"]["model_graph"]
    f = tmp_path / "old.json"
    f.write_text(json.dumps(doc))
    assert load_plan(f).schema_version == "1.0"
    rc, out, _ = run(["estimate", "--plan", str(f), "--json"], capsys)
    assert rc == 0 and json.loads(out)["step_time_s"] == base["predicted"]["step_time_s"]
