"""Input-handling defects of a fuzz run: a solver stopped before proving a bound, batch estimates,
interrupts, arguments checked before work, typed errors of the public API, ASCII numbers, output
files (modes, temporary names, reproducible SVG)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from planner import api
from planner.cli import main
from solvers import hybrid
from solvers.chain import ChainSolution
from solvers.result import proven_bound
from tests.fuzz_families_commands import interruptible
from vocab.errors import ShardplanError
from vocab.plan import PlanError, parse_plan


@pytest.mark.parametrize("stopped", [-np.inf, np.nan])
def test_a_mip_stopped_without_a_bound_gives_a_plan_without_one(monkeypatch: pytest.MonkeyPatch,
                                                                 stopped: float) -> None:
    """A per-layer MIP stopped by the time limit before its first bound (HiGHS and MathOpt report
    -inf or NaN): the plan records no bound and no gap, and the status time_limit."""
    monkeypatch.setattr(hybrid, "solve_ilp", lambda *a, **k: ChainSolution(None, np.inf, stopped, "time_limit"))
    p = api.plan("gpt2", "4xcpu", 128, 8, space="osdp", time_limit=5, tie_break=False)
    assert (p.solver.status, p.solver.bound, p.solver.gap) == ("time_limit", None, None)
    assert p.solver.objective == p.predicted.step_time_s


def test_proven_bound_is_the_least_finite_bound_or_none() -> None:
    assert proven_bound(2.0, [1.5, np.inf]) == 1.5
    assert proven_bound(2.0, []) == 2.0
    assert proven_bound(2.0, [1.5, -np.inf]) is None
    assert proven_bound(2.0, [np.nan]) is None


# ---- 2. estimate --batch ---------------------------------------------------------------------

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 1000, "n_positions": 256}
LINE = {"cluster": "4xcpu", "seq_len": 128, "global_batch": 8}
ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "any"])
def test_a_batch_line_with_an_inline_model_and_a_target_is_priced(tmp_path: Path, target: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({**LINE, "model": TINY_GPT2, "target": target}) + "\n")
    rc, out, err = run(["estimate", "--batch", str(f)], capsys)
    rep = json.loads(out)
    assert (rc, err, rep["target"], rep["fits"]) == (0, "", target, True)


def test_a_batch_from_standard_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [json.dumps({**LINE, "model": "gpt2"}), json.dumps({**LINE, "model": TINY_GPT2})]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    rc, out, err = run(["estimate", "--batch", "-"], capsys)
    assert (rc, err) == (0, "") and [("step_time_s" in json.loads(x)) for x in out.splitlines()] == [True, True]


def test_a_batch_piped_to_dev_stdin() -> None:
    data = json.dumps({**LINE, "model": "gpt2"}) + "\n"
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "estimate", "--batch", "/dev/stdin"], input=data,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (r.returncode, r.stderr) == (0, "") and "step_time_s" in json.loads(r.stdout)


def test_a_batch_with_failed_lines_exits_2_naming_their_count(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    good = json.dumps({**LINE, "model": "gpt2"})
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join([good, "{", good, json.dumps({**LINE, "model": "gpt2", "tp": 5}), "[]"]) + "\n")
    rc, out, err = run(["estimate", "--batch", str(f)], capsys)
    got = [json.loads(x) for x in out.splitlines()]
    assert (rc, err) == (2, "error: 3 of 5 lines failed\n")
    assert [sorted(g)[0] == "error" and len(g) == 1 for g in got] == [False, True, False, True, True]


# ---- 3. Ctrl-C --------------------------------------------------------------------------------

def _interrupted(delay: float) -> tuple[int | None, str]:
    """``shardplan estimate --batch -`` (which waits for its input) run as the program (``python -m
    planner.cli``, as the console script runs it; a program that only imports the command line keeps
    its own Ctrl-C, see :func:`planner.sigint.loaded`) in a fresh process, sent SIGINT
    ``delay`` seconds after its first line of the package ran (``-X importtime`` names each module
    as it finishes loading: ``planner.sigint`` is the first the package loads); its exit code and stderr."""
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "planner.cli", "estimate", "--batch", "-"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=interruptible)
    watchdog = threading.Timer(120, p.kill)
    watchdog.start()
    try:
        assert p.stderr is not None and p.stdin is not None
        seen = []
        for line in p.stderr:
            seen.append(line)
            if line.rstrip().endswith(" planner.sigint"):
                break
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        seen.append(p.stderr.read())  # to its end: the process ends (its input stays open)
        return p.wait(), "".join(seen)
    finally:
        watchdog.cancel()
        p.kill()
        p.stdin.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3, 1.0])
def test_ctrl_c_at_any_moment_exits_130_with_one_line(delay: float) -> None:
    """While the modules load (0, 0.05 s), the commands register, or the command waits for input."""
    rc, err = _interrupted(delay)
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("import time:")]
    assert (rc, lines) == (130, ["interrupted"]), err[-2000:]


def test_ctrl_c_inside_a_command_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from planner.commands import estimate

    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(estimate, "price", interrupt)
    rc, out, err = run(["estimate", "-m", "gpt2", "-c", "4xcpu", "--seq-len", "128", "--global-batch", "8"], capsys)
    assert (rc, out, err) == (130, "", "interrupted\n")


# ---- 4. arguments checked before any work -----------------------------------------------------

def _never(what: str) -> Any:
    def called(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what} ran")

    return called


@pytest.mark.parametrize("argv, message", [
    (["profile", "comm", "--quick", "--stat", "mean"], "error: --stat must be median or min, got 'mean'\n"),
    (["profile", "comm", "--quick", "--backend", "mpi"], "error: backend 'mpi' is not gloo or nccl\n"),
])
def test_profile_comm_refuses_its_options_before_measuring(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str], argv: list[str],
                                                           message: str) -> None:
    from profiler import measure_comm, measure_compute

    monkeypatch.setattr(measure_comm, "profile_comm", _never("the measurement"))
    monkeypatch.setattr(measure_compute, "host_load", lambda: 99.0)  # a busy host: its warning is for a measurement
    rc, out, err = run([*argv, "-o", str(tmp_path / "p.json")], capsys)
    assert (rc, out, err) == (2, "", message)
    assert list(tmp_path.iterdir()) == []


def test_profile_model_refuses_an_unknown_accelerator_before_measuring(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from profiler import measure_model

    monkeypatch.setattr(measure_model, "measure_layers", _never("the measurement"))
    rc, out, err = run(["profile", "model", "-m", "gpt2", "--accelerator", "h1000", "-o", str(tmp_path / "p.json")],
                       capsys)
    assert (rc, out) == (2, "") and err.startswith("error: ") and "h1000" in err and err.count("\n") == 1


# ---- 5. the public API's types; plans given as data -------------------------------------------

@pytest.mark.parametrize("args, kwargs, message", [
    (("gpt2", "4xcpu", "128", 8), {}, "plan: seq_len must be an integer, got str '128'"),
    (("gpt2", "4xcpu", 128, 8.0), {}, "plan: global_batch must be an integer or a list of integers, got float 8.0"),
    (("gpt2", "4xcpu", 128, 8), {"target": None}, "plan: target must be a string, got NoneType None"),
    (("gpt2", "4xcpu", True, 8), {}, "plan: seq_len must be an integer, got bool True"),
    (("gpt2", "4xcpu", 128, [8, "16"]), {}, "plan: global_batch must be an integer or a list of integers, got "
                                           "list [8, '16']"),
    (("gpt2", 4, 128, 8), {}, "plan: cluster must be a string or a dict or a Cluster, got int 4"),
    (("gpt2", "4xcpu", 128, 8), {"top_k": 2.0}, "plan: top_k must be an integer, got float 2.0"),
    (("gpt2", "4xcpu", 128, 8), {"time_limit": "5"}, "plan: time_limit must be a number or None, got str '5'"),
    (("gpt2", "4xcpu", 128, 8), {"tie_break": 1}, "plan: tie_break must be true or false, got int 1"),
    (("gpt2", "4xcpu", 128, 8), {"bogus": 1}, "plan: got an unexpected keyword argument 'bogus'"),
])
def test_the_public_api_names_a_parameter_of_the_wrong_type(args: tuple[Any, ...], kwargs: dict[str, Any],
                                                             message: str) -> None:
    with pytest.raises(ShardplanError) as e:
        api.plan(*args, **kwargs)
    assert str(e.value) == message


def test_every_public_function_of_the_api_checks_its_arguments() -> None:
    from planner.request import Request
    from vocab.targets import load_target

    with pytest.raises(ShardplanError, match="^search_plan: request must be a Request, got str 'gpt2'$"):
        api.search_plan("gpt2")
    with pytest.raises(ShardplanError, match="^Request: seq_len must be an integer, got float 128.0$"):
        api.search_plan(Request("gpt2", "4xcpu", 128.0, 8))
    with pytest.raises(ShardplanError, match="^target_behaviour: precision must be a string, got NoneType None$"):
        api.target_behaviour(load_target("shardplan"), None)
    with pytest.raises(ShardplanError, match="^target_behaviour: cross_entropy must be a string or None, got int 1$"):
        api.target_behaviour(load_target("shardplan"), "bf16", cross_entropy=1)
    with pytest.raises(ShardplanError, match="^check_capacity: capacity must be a number or None, got str '1.5'$"):
        api.check_capacity(load_target("megatron"), "1.5")
    public = [n for n, f in vars(api).items() if callable(f) and getattr(f, "__module__", "") == api.__name__
              and not n.startswith("_") and not isinstance(f, type)]
    assert sorted(public) == ["check_capacity", "plan", "search_plan", "target_behaviour"]
    assert all(hasattr(getattr(api, n), "__wrapped__") for n in public)


@pytest.fixture(scope="module")
def plan_doc() -> dict[str, Any]:
    return json.loads(api.plan({**TINY_GPT2, "n_layer": 2}, "4xcpu", 128, 8, top_k=0).to_json())


def _nested(levels: int) -> Any:
    node: Any = 1
    for _ in range(levels):
        node = [node]
    return node


@pytest.mark.parametrize("where", [("solver", "options"), ("inputs", "model_graph", "config")])
@pytest.mark.parametrize("value, reason", [
    ({1, 2}, "plan: {at} holds a set, which JSON cannot hold"),
    (b"x", "plan: {at} holds a bytes, which JSON cannot hold"),
    (1j, "plan: {at} holds a complex, which JSON cannot hold"),
    (float("nan"), "plan is not a valid plan: {field} is not a finite number"),
    (float("inf"), "plan is not a valid plan: {field} is not a finite number"),
    (_nested(40), "plan nests deeper than 32 levels"),
])
def test_a_plan_given_as_a_dict_is_checked_as_text_is(plan_doc: dict[str, Any], where: tuple[str, ...],
                                                      value: Any, reason: str) -> None:
    doc = json.loads(json.dumps(plan_doc))
    node = doc
    for key in where:
        node = node[key]
    node["fuzz"] = value
    with pytest.raises(PlanError) as e:
        parse_plan(doc)
    field = f"{'.'.join(where[:-1])}: {where[-1]}.fuzz"  # the schema's words: the model, then the field
    assert str(e.value) == reason.format(at=".".join([*where, "fuzz"]), field=field)


def test_a_plan_dict_with_a_key_that_is_no_string_is_refused(plan_doc: dict[str, Any]) -> None:
    doc = json.loads(json.dumps(plan_doc))
    doc["solver"]["options"] = {(1, 2): 3}
    with pytest.raises(PlanError) as e:
        parse_plan(doc)
    assert str(e.value) == "plan: solver.options has a key (1, 2) that is not a string"


def test_a_plan_dict_that_parses_is_written(plan_doc: dict[str, Any]) -> None:
    doc = json.loads(json.dumps(plan_doc))
    doc["solver"]["options"]["pair"] = (1, 2)
    assert json.loads(parse_plan(doc).to_json())["solver"]["options"]["pair"] == [1, 2]
    assert parse_plan(plan_doc).to_json() == parse_plan(json.dumps(plan_doc)).to_json()


# ---- 6. numbers in ASCII digits; an output that looks like an option --------------------------

PLAN = ["plan", "-m", "gpt2", "--seq-len", "128", "--global-batch", "8"]
EST = ["estimate", "-m", "gpt2", "-c", "4xcpu", "--seq-len", "128", "--global-batch", "8"]


@pytest.mark.parametrize("argv, message", [
    ([*PLAN, "-c", "\u0664xcpu"], "cluster '\u0664xcpu': expected 'N x accelerator'"),
    ([*PLAN, "-c", "\uff18xh100"], "cluster '\uff18xh100': expected 'N x accelerator'"),
    ([*PLAN, "-c", "4 xcpu"], "cluster '4 xcpu': expected 'N x accelerator'"),
    ([*EST, "--micro-batch", "\uff18"], "--micro-batch takes an integer number of samples, e.g. 1, got '\uff18'"),
    ([*EST, "--tp", "\u0662"], "--tp takes an integer degree, e.g. 8, got '\u0662'"),
    ([*EST, "--zero", "\u0661"], "--zero takes a ZeRO stage, e.g. 1, got '\u0661'"),
    ([*EST, "--tp", "1_0"], "--tp takes an integer degree, e.g. 8, got '1_0'"),
    ([*EST, "--memory-limit", "\uff18\uff10"], "--memory-limit takes a number of GiB, e.g. 80, got '\uff18\uff10'"),
    ([*PLAN, "-c", "4xcpu", "--top-k", "\u0663"], "--top-k takes an integer number of runners-up, e.g. 5, got '\u0663'"),
    ([*PLAN, "-c", "4xcpu", "--reserve", "\u0665"], "--reserve takes a percentage, e.g. 5, got '\u0665'"),
    (["plan", "-m", "gpt2", "-c", "4xcpu", "--seq-len", "\u0661\u0662\u0668", "--global-batch", "8"],
     "--seq-len takes an integer number of tokens, e.g. 8192, got '\u0661\u0662\u0668'"),
    ([*PLAN[:-1], "\u0668", "-c", "4xcpu"], "--global-batch must be an integer or a comma-separated list, got "
                                             "'\u0668'"),
    (["inspect", "-m", "gpt2", "--seq-len", "\uff11\uff12\uff18"],
     "--seq-len takes an integer number of tokens, e.g. 8192, got '\uff11\uff12\uff18'"),
    (["sweep", "-m", "gpt2", "--gpus", "\u0664", "-a", "cpu"], "--gpus takes numbers of GPUs as a comma list"),
    (["sweep", "-m", "gpt2", "--gpus", "4", "-a", "cpu", "--memory-limit", "\uff18"],
     "--memory-limit takes numbers of GiB (or 'default'), e.g. 60,80, got '\uff18'"),
    (["sweep", "-m", "gpt2", "--gpus", "4", "-a", "cpu", "--workers", "\u0662"],
     "--workers takes an integer number of processes, e.g. 4, got '\u0662'"),
    (["train", "-m", "gpt2", "-p", "x.json", "--seed", "\u0661"], "--seed takes an integer, e.g. 0, got '\u0661'"),
    (["profile", "comm", "--sizes", "\u0664K", "-o", "p.json"], "--sizes: cannot read '\u0664K'"),
])
def test_numbers_are_ascii_digits(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = run(argv, capsys)
    assert (rc, out, err.count("\n")) == (2, "", 1) and err.startswith(f"error: {message}"), err


def test_every_number_option_reads_ascii_digits() -> None:
    """Every integer and float option of every command is parsed by planner.options (not by int(),
    which reads any Unicode digit)."""
    import typer

    import planner.commands  # noqa: F401  (registers the commands)
    from planner.cli import app

    def params(command: Any, path: str) -> Any:
        for name, sub in (getattr(command, "commands", None) or {}).items():
            yield from params(sub, f"{path} {name}")
        for param in getattr(command, "params", []):
            yield path, param

    numeric = [(path, param) for path, param in params(typer.main.get_command(app), "shardplan")
               if {int, float} & set(typing.get_args(param.type_descriptor.annotation) or
                                     [param.type_descriptor.annotation])]
    assert len(numeric) > 30
    loose = [f"{path} {param.name}" for path, param in numeric
             if getattr(param.type_descriptor.parameter_info.parser, "__module__", None) != "planner.options"]
    assert loose == []


def test_numbers_of_a_megatron_config_are_ascii_digits(tmp_path: Path) -> None:
    from planner.trainers import ConfigError
    from planner.trainers.megatron.read import _int

    with pytest.raises(ConfigError, match="must be an integer >= 1, got '\u0668'"):
        _int({"--global-batch-size": ["\u0668"]}, "global_batch", "args")


def test_ascii_numbers_read_as_before() -> None:
    from vocab.digits import is_digits, read_float, read_int

    assert [read_int(x) for x in ("8", " 8", "8\n", "+3", "-0", "007")] == [8, 8, 8, 3, 0, 7]
    assert [read_float(x) for x in ("1.5", ".5", "1e3", "2.", "-4")] == [1.5, 0.5, 1000.0, 2.0, -4.0]
    assert [str(read_float(x)) for x in ("inf", "-Infinity", "nan")] == ["inf", "-inf", "nan"]
    for bad in ("\u0664", "\uff18", "1_000", "4 4", "", "0x10", "\u00b2", "1e", "\u3000" + "8"):
        with pytest.raises(ValueError):
            read_int(bad)
        with pytest.raises(ValueError):
            read_float(bad)
    assert (is_digits("12"), is_digits("\u0661\u0662"), is_digits("\u00b2"), is_digits("")) == (True, False, False, False)


@pytest.mark.parametrize("argv", [
    ["fit", "-o", "--bogus"],
    [*PLAN, "-c", "4xcpu", "-o", "-plan.json"],
    ["export", "x.json", "--to", "megatron", "-o", "-x"],
    ["import", "x.toml", "-o", "-p.json"],
    ["profile", "compute", "-o", "-p.json"],
    ["sweep", "-m", "gpt2", "--gpus", "4", "-a", "cpu", "-o", "-t.csv"],
])
def test_an_output_that_starts_with_a_dash_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(argv, capsys)
    name = argv[argv.index("-o") + 1]
    assert (rc, out) == (2, "") and err.count("\n") == 1 and f"'{name}' starts with '-'" in err, err
    assert list(tmp_path.iterdir()) == []


# ---- 7. output files: modes, temporary names, the same bytes ----------------------------------

@pytest.fixture()
def umask() -> Any:
    """Set the process's umask for a test; the one before it comes back afterwards."""
    before = os.umask(0o022)
    os.umask(before)
    yield lambda mask: os.umask(mask)
    os.umask(before)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_output_gets_the_mode_of_the_umask(tmp_path: Path, umask: Any, mask: int, mode: int) -> None:
    from vocab.io import write_atomic

    umask(mask)
    write_atomic(tmp_path / "a.json", "{}\n")
    assert (tmp_path / "a.json").stat().st_mode & 0o7777 == mode


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o640, 0o664])
def test_a_replaced_output_keeps_its_mode(tmp_path: Path, umask: Any, mode: int) -> None:
    from vocab.io import write_atomic

    umask(0o077)
    out = tmp_path / "a.json"
    out.write_text("old")
    out.chmod(mode)
    write_atomic(out, "new")
    assert (out.read_text(), out.stat().st_mode & 0o7777) == ("new", mode)


def test_a_plan_written_by_the_command_line_gets_the_umask_mode(tmp_path: Path, umask: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    umask(0o022)
    out = tmp_path / "p.json"
    rc, _, _ = run([*PLAN, "-c", "4xcpu", "--space", "fsdp", "-o", str(out)], capsys)
    assert rc == 0 and out.stat().st_mode & 0o7777 == 0o644


def test_temporary_files_are_named_for_people_and_stale_ones_removed(tmp_path: Path) -> None:
    from vocab.io import STALE_TMP_S, write_with

    out = tmp_path / "plan.json"
    seen: list[str] = []

    def write(tmp: str) -> None:
        seen.append(Path(tmp).name)
        Path(tmp).write_text("{}")

    stale, fresh = tmp_path / ".plan.json.shardplan-tmp-dead1234", tmp_path / ".plan.json.shardplan-tmp-live5678"
    other = tmp_path / ".other.json.shardplan-tmp-dead1234"
    for f in (stale, fresh, other):
        f.write_text("half a pl")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    write_with(out, write)
    assert seen[0].startswith(".plan.json.shardplan-tmp-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, fresh.name, other.name])


def test_a_write_killed_midway_leaves_a_temporary_file_the_next_write_removes(tmp_path: Path) -> None:
    """SIGKILL inside the write: the target is not there, the named temporary is; the next write of
    that target once it is stale removes it."""
    from vocab.io import STALE_TMP_S, write_atomic

    out = tmp_path / "plan.json"
    code = ("import os, signal, sys\nfrom pathlib import Path\nfrom vocab.io import write_with\n"
            "def die(tmp):\n    Path(tmp).write_text('{\"half')\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "write_with(Path(sys.argv[1]), die)\n")
    r = subprocess.run([sys.executable, "-c", code, str(out)], timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    left = list(tmp_path.iterdir())
    assert r.returncode == -signal.SIGKILL and not out.exists()
    assert [p.name.startswith(".plan.json.shardplan-tmp-") for p in left] == [True]
    old = time.time() - STALE_TMP_S - 1
    os.utime(left[0], (old, old))
    write_atomic(out, "{}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("kind", ["memory", "timeline", "layers", "pareto"])
@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_a_plot_saved_twice_is_the_same_bytes(plan_doc: dict[str, Any], tmp_path: Path, kind: str,
                                               suffix: str) -> None:
    from planner.plots import save_plot

    plan = parse_plan(plan_doc)
    a, b = save_plot(plan, kind, tmp_path / f"a{suffix}"), save_plot(plan, kind, tmp_path / f"b{suffix}")
    assert a.read_bytes() == b.read_bytes()
    if suffix == ".svg":
        assert b"<dc:date>" not in a.read_bytes()


@pytest.mark.parametrize("name", [" gpt2 ", "gpt2\t", "gpt2;rm", "-gpt2"])
def test_a_model_name_no_plan_can_hold_is_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    rc = main(["plan", "--model", name, "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["sweep", "-m", "gpt2", "--accelerator", "cpu", "--gpus", "4", "--seq-len", "128",
     "--global-batch", "1180591620717411303424"],
    ["sweep", "-m", "gpt2", "--accelerator", "cpu", "--gpus", "4", "--seq-len", "1..1" + "0" * 30],
    ["profile", "comm", "--quick", "--timeout", "1e30", "-o", "never-written.json"],
], ids=["sweep-batch", "sweep-range", "profile-timeout"])
def test_values_past_the_supported_range_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "internal error" not in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("kw", [{"memory_limit_gib": float("inf")}, {"global_batch": 2**70}, {"seq_len": 10**9},
                                {"time_limit": float("nan")}], ids=["inf-limit", "huge-batch", "huge-seq", "nan-time"])
def test_api_plan_refuses_values_past_the_supported_range(kw: dict[str, Any]) -> None:
    from vocab.errors import ShardplanError

    with pytest.raises(ShardplanError):
        api.plan("gpt2", "4xcpu", **{"seq_len": 128, "global_batch": 8, **kw})


@pytest.mark.parametrize("call", ["export", "load_plan", "check_target", "importer_for", "read_text"])
def test_public_functions_refuse_wrong_types_in_one_error(call: str) -> None:
    from planner.trainers import check_target, export, importer_for
    from vocab.errors import ShardplanError
    from vocab.io import read_text
    from vocab.plan import load_plan

    calls = {"export": lambda: export(1, "megatron"), "load_plan": lambda: load_plan(None),
             "check_target": lambda: check_target(3), "importer_for": lambda: importer_for(3, None),
             "read_text": lambda: read_text(7, "plan")}
    with pytest.raises(ShardplanError):
        calls[call]()


def test_names_match_whole_strings_only() -> None:
    from vocab.names import MODEL_REF, matches

    assert matches(MODEL_REF, "meta-llama/Llama-3.1-8B") and not matches(MODEL_REF, "gpt2\n")


def test_sizes_past_the_largest_message_are_refused_before_measuring() -> None:
    from profiler.measure_comm import parse_sizes
    from vocab.errors import ShardplanError

    for text in ("9" * 30, "9" * 400, "17G"):
        with pytest.raises(ShardplanError, match="largest message"):
            parse_sizes(text)


def test_a_sweep_calibration_must_be_a_calibration() -> None:
    from planner.sweep import sweep
    from vocab.errors import ShardplanError

    with pytest.raises(ShardplanError, match="calibration"):
        sweep("gpt2", [4], ["cpu"], [8], [128], calibration=float("nan"))


@pytest.mark.parametrize("finished", [False, True])
def test_a_caught_interrupt_inside_evaluated_text_keeps_the_exit_code(finished: bool, tmp_path: Path) -> None:
    """CPython marks a KeyboardInterrupt that left an ``exec``/``eval`` of a string as unhandled
    even when caught, and a program run as ``-m`` (as the console script is) then ends by SIGINT
    (-2) instead of with its exit code; :func:`planner.sigint.finished` clears the mark (typer
    evaluates annotations that way, so a Ctrl-C while the commands registered exited -2)."""
    (tmp_path / "interrupted_program.py").write_text(
        "import planner.sigint as s\ntry:\n    exec('raise KeyboardInterrupt')\nexcept KeyboardInterrupt:\n    pass\n"
        + ("s.finished()\n" if finished else "") + "raise SystemExit(130)\n")
    p = subprocess.run([sys.executable, "-m", "interrupted_program"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert (p.returncode, p.stderr) == ((130, "") if finished else (-signal.SIGINT, ""))


def test_an_error_a_library_makes_of_ctrl_c_is_an_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-core reports a KeyboardInterrupt raised while it builds a validator as a SchemaError:
    once SIGINT has arrived, the guard reports the interrupt, not an internal error."""
    import typer

    from planner import sigint
    from planner.cli import guard

    def schema_build() -> None:
        raise RuntimeError("Error building validator")

    monkeypatch.setattr(sigint, "received", True)
    with pytest.raises(KeyboardInterrupt):
        guard(schema_build)()
    monkeypatch.setattr(sigint, "received", False)
    with pytest.raises(typer.Exit) as bug:
        guard(schema_build)()
    assert bug.value.exit_code == 70


def test_validate_prints_a_source_name_that_looks_like_markup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A published-runs file whose source reads ``[/x]`` (rich's closing tag) is printed as text, not read
    as markup (the long fuzz profile found an internal error)."""
    import csv

    src = Path(__file__).resolve().parents[1] / "costmodel" / "data" / "calibration" / "published_runs.csv"
    rows = list(csv.reader(src.open(newline="", encoding="utf-8")))[:12]
    rows[7][0] = "[/x]"
    path = tmp_path / "runs.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    assert main(["validate", str(path)]) == 0
    assert "[/x]" in capsys.readouterr().out


def test_train_with_a_model_name_no_file_system_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``train --model`` of 300 characters (too long for a file name) is an unknown model in one line,
    not an internal error."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), "--model", "x" * 300]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model") and err.count("\n") == 1
