"""Documents do not choose files, and their strings reach the terminal as text.

A plan names its profile and its model for the record: re-pricing opens the profile only with
``--profile-from-plan`` (or one given with ``--profile``) and a model config path only where
``--model`` names it; an import header naming a file is refused without ``--model``/``--cluster``.
explain and compare print a plan's strings literally: no escape sequence, BEL or carriage return
reaches the terminal, and rich markup shows as written.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import profiler.models
import profiler.profile_schema
from planner.cli import main
from planner.compare import compare, render_compare
from planner.explain import explain_data, render_explain
from planner.layout import printable
from planner.reprice import plan_from_strategy
from planner.trainers.reading import inputs_line
from profiler.graph import graph_to_dict
from profiler.models import load_model
from profiler.profile_schema import ComputeProfile, Profile
from tests.test_profiler_schema import DEV, attn, bw, fit, gemm
from vocab.plan import Plan, load_plan, parse_plan

DATA = Path(__file__).parent / "data"
GPT2_CONFIG = DATA / "gpt2-config.json"
MARKER = "TOPSECRET-1234"
STRATEGY = {"mesh": {"tp": 2, "dp_shard": 2}, "sequence_parallel": True}  # deepspeed lacks SP: export re-prices
NOT_LOADED = "(not loaded: pass --profile-from-plan or --profile PATH)"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return json.loads(plan_from_strategy("gpt2", "4xcpu", STRATEGY, 128, 8).to_json())


def write(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture()
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the profiles and model config files read."""
    paths: list[str] = []
    real_profile, real_config = profiler.profile_schema.load_profile, profiler.models.load_hf_config

    def load_profile(path: Any) -> Profile:
        paths.append(str(path))
        return real_profile(path)

    def load_hf_config(path: Any) -> dict[str, Any]:
        paths.append(str(path))
        return real_config(path)

    monkeypatch.setattr(profiler.profile_schema, "load_profile", load_profile)
    monkeypatch.setattr(profiler.models, "load_hf_config", load_hf_config)
    return paths


def valid_profile(path: Path) -> Path:
    """A CPU profile with the curves and collectives a gpt2 plan on 4 CPUs prices with."""
    compute = ComputeProfile(
        dtype="bf16", gemm=[gemm(1e6, 1e9), gemm(1e8, 3e9), gemm(1e10, 4e9, m=1)],
        attention=[attn(1e6, 1e9, False), attn(1e8, 2e9, False), attn(1e6, 4e9, True), attn(1e8, 2e9, True)],
        bandwidth={"norm": [bw(1e6, 1e9, "layernorm")], "softmax": [bw(1e6, 2e9)]})
    comm = [fit(c, w, 1e-4, 1e-9) for c in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
            for w in (2, 4)]
    Profile(device=DEV, compute=compute, comm=comm).save(path)
    return path


# ---- the profile a plan names ---------------------------------------------------------------------

def secret_plan(base: dict[str, Any], tmp_path: Path, content: str) -> tuple[Path, Path]:
    secret = tmp_path / "secret.json"
    secret.write_text(content)
    doc = json.loads(json.dumps(base))
    doc["inputs"]["profile"] = str(secret)
    return write(doc, tmp_path / "plan.json"), secret


COMMANDS = {
    "estimate": lambda f, tmp: ["estimate", "--plan", str(f), "--json"],
    "explain": lambda f, tmp: ["explain", str(f)],
    "export": lambda f, tmp: ["export", str(f), "--to", "deepspeed", "--nearest"],
    "plot-timeline": lambda f, tmp: ["plot", str(f), "--kind", "timeline", "-o", str(tmp / "t.png")],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_profile_a_plan_names_is_not_opened(command: str, base: dict[str, Any], tmp_path: Path,
                                                loaded: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    f, secret = secret_plan(base, tmp_path, json.dumps({"kind": MARKER}))
    rc, out, err = run(COMMANDS[command](f, tmp_path), capsys)
    assert rc == 0 and loaded == [] and MARKER not in out + err, err
    note = f"the plan names profile {secret} {NOT_LOADED}"
    if command == "estimate":
        assert note in json.loads(out)["notes"]
    elif command == "explain":
        assert "not loaded" not in err  # explain prices nothing: no profile to speak of
    else:
        assert f"note: {note}\n" in err


@pytest.mark.parametrize("command", ["estimate", "export", "plot-timeline"])
def test_profile_from_plan_loads_it_and_quotes_at_most_40_characters(
    command: str, base: dict[str, Any], tmp_path: Path, loaded: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    kind = MARKER + "-" + "x" * 200
    f, secret = secret_plan(base, tmp_path, json.dumps({"kind": kind}))
    rc, out, err = run([*COMMANDS[command](f, tmp_path), "--profile-from-plan"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and loaded == [str(secret)]
    assert f"is not a shardplan profile (its 'kind' is {repr(kind)[:37]}..., expected" in err
    assert "x" * 30 not in err and not (tmp_path / "t.png").exists()


def test_profile_from_plan_prices_with_it_as_profile_path_does(base: dict[str, Any], tmp_path: Path,
                                                              loaded: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    prof = valid_profile(tmp_path / "prof.json")
    doc = json.loads(json.dumps(base))
    doc["inputs"]["profile"] = str(prof)
    f = write(doc, tmp_path / "plan.json")
    rc, out, _ = run(["estimate", "--plan", str(f), "--json"], capsys)
    without = json.loads(out)
    assert rc == 0 and loaded == []
    rc, out, _ = run(["estimate", "--plan", str(f), "--profile-from-plan", "--json"], capsys)
    from_plan = json.loads(out)
    rc2, out, _ = run(["estimate", "--plan", str(f), "--profile", str(prof), "--json"], capsys)
    assert rc == rc2 == 0 and loaded == [str(prof), str(prof)]
    assert from_plan == json.loads(out) and from_plan["step_time_s"] != without["step_time_s"]
    assert from_plan["error_band"] is None and not any("not loaded" in n for n in from_plan["notes"])


@pytest.mark.parametrize("argv, message", [
    (["--profile-from-plan", "--profile", "p.json"], "give --profile PATH or --profile-from-plan, not both"),
    (["--profile-from-plan"], "--profile-from-plan needs --plan"),
])
def test_profile_flags_misused_are_one_line(argv: list[str], message: str, base: dict[str, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    f, _ = secret_plan(base, tmp_path, MARKER)
    plan = ["--plan", str(f)] if "--profile" in argv else ["--model", "gpt2", "--cluster", "4xcpu", "--seq-len",
                                                            "128", "--global-batch", "8"]
    rc, out, err = run(["estimate", *plan, *argv], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err and MARKER not in err


# ---- the model config path a plan names -------------------------------------------------------------

@pytest.fixture(scope="module")
def path_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("path") / "plan.json"
    plan_from_strategy(str(GPT2_CONFIG), "4xcpu", STRATEGY, 128, 8).save(f)
    return f


def test_a_plan_naming_a_config_path_is_repriced_only_with_model(path_plan: Path, tmp_path: Path,
                                                                 loaded: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert load_plan(path_plan).inputs.model == str(GPT2_CONFIG)
    rc, out, err = run(["estimate", "--plan", str(path_plan), "--json"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and loaded == []
    assert "is a file path, not a preset; pass --model PATH to load it" in err
    rc, out, err = run(["export", str(path_plan), "--to", "deepspeed", "--nearest"], capsys)
    assert rc == 0 and loaded == [] and "pass --model PATH to load it" in err  # written, its cost unknown
    rc, out, _ = run(["explain", str(path_plan)], capsys)
    assert rc == 0 and loaded == []
    rc, out, _ = run(["estimate", "--plan", str(path_plan), "--model", str(GPT2_CONFIG), "--json"], capsys)
    assert rc == 0 and loaded == [str(GPT2_CONFIG)]
    assert json.loads(out)["step_time_s"] == load_plan(path_plan).predicted.step_time_s


def test_a_plan_recording_its_graph_never_opens_its_model_path(path_plan: Path, tmp_path: Path, loaded: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(path_plan.read_text())
    graph = graph_to_dict(load_model(str(GPT2_CONFIG), 128))
    graph.pop("model_id")
    doc["inputs"]["model_graph"] = json.loads(json.dumps(graph, default=str))
    loaded.clear()
    f = write(doc, tmp_path / "recorded.json")
    parse_plan(doc)
    rc, out, _ = run(["estimate", "--plan", str(f), "--json"], capsys)
    assert rc == 0 and loaded == [] and json.loads(out)["step_time_s"] == doc["predicted"]["step_time_s"]


# ---- an import header naming a file ----------------------------------------------------------------

def torchtitan_config(tmp_path: Path, model: str, cluster: Any) -> Path:
    cfg = tmp_path / "job.toml"
    cfg.write_text(inputs_line(model, cluster).join(["# ", "\n"])
                   + "[parallelism]\ntensor_parallel_degree = 2\n[training]\nseq_len = 128\nlocal_batch_size = 2\n")
    return cfg


def test_an_import_header_naming_a_model_file_is_refused_without_model(tmp_path: Path, loaded: list[str],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = torchtitan_config(tmp_path, str(GPT2_CONFIG), "4xcpu")
    rc, out, err = run(["import", str(cfg)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and loaded == []
    assert "its shardplan-inputs: line names model" in err and "pass --model PATH to load it" in err
    rc, out, err = run(["import", str(cfg), "--model", str(GPT2_CONFIG)], capsys)
    assert rc == 0 and loaded == [str(GPT2_CONFIG)] and "tp=2" in out
    rc, out, err = run(["import", str(torchtitan_config(tmp_path, "gpt2", "4xcpu"))], capsys)
    assert rc == 0 and "tp=2" in out  # a preset and the 4xcpu shorthand need no file


def test_an_import_header_naming_a_cluster_file_is_refused_without_cluster(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"accelerator: cpu\nnodes: 1\ngpus_per_node: 4\n# {MARKER}\n")
    cfg = torchtitan_config(tmp_path, "gpt2", str(cluster))
    rc, out, err = run(["import", str(cfg)], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and MARKER not in err
    assert "names cluster file" in err and "pass --cluster PATH to load it" in err
    rc, out, _ = run(["import", str(cfg), "--cluster", str(cluster)], capsys)
    assert rc == 0 and "tp=2" in out
    rc, out, _ = run(["import", str(torchtitan_config(tmp_path, "gpt2", {"accelerator": "cpu", "nodes": 1,
                                                                            "gpus_per_node": 4}))], capsys)
    assert rc == 0 and "tp=2" in out


# ---- strings of a plan on the terminal ---------------------------------------------------------------

EVIL = ("\x1b]0;pwn\x07", "\x1b[2J", "\r", "[bold]x[/bold]")
RAW = ("\x1b", "\x07", "\r")


def evil_doc(base: dict[str, Any], s: str) -> dict[str, Any]:
    """``s`` in the plan's strings: the model, the target's version, the solver's space and an option,
    a stage's units, an exposed communication axis and a note of the prediction."""
    doc = json.loads(json.dumps(base))
    doc["inputs"]["model"] = f"m{s}"
    doc["inputs"]["target"]["version"] = f"v{s}.1"
    doc["solver"]["space"] = f"space{s}"
    doc["solver"]["options"] = {"note": f"opt{s}"}
    pred = doc["predicted"]
    pred["notes"] = [f"note{s}"]
    pred["stages"][0]["units"] = [*pred["stages"][0]["units"], f"unit{s}"]
    pred["time"]["comm_s"][f"axis{s}"] = 0.25 * pred["step_time_s"]
    return doc


def free_text_only(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with ``s`` left only in strings that no name pattern constrains: the solver's
    space and options, the prediction's notes and communication axes."""
    inputs = {**doc["inputs"], "model": "gpt2", "target": {"name": "shardplan", "version": None}}
    stages = [{**st, "units": [u for u in st["units"] if not u.startswith("unit")]} for st in doc["predicted"]["stages"]]
    return {**doc, "inputs": inputs, "predicted": {**doc["predicted"], "stages": stages}}


def no_raw(text: str) -> bool:
    return not any(raw in text for raw in RAW)


@pytest.mark.parametrize("s", EVIL)
def test_explain_and_compare_of_a_plan_with_control_characters_refuse_or_print_them_escaped(
    s: str, base: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Refused where the plan is read (one clean line, exit 2), or printed literally: no ESC, BEL or
    CR reaches the terminal either way, and markup shows as written."""
    for doc in (evil_doc(base, s), free_text_only(evil_doc(base, s))):
        f = write(doc, tmp_path / "evil.json")
        plain = write(json.loads(json.dumps(base)), tmp_path / "plain.json")
        for argv in (["explain", str(f)], ["compare", str(f), str(plain)]):
            rc, out, err = run(argv, capsys)
            assert no_raw(out + err), repr(out + err)
            if rc == 2:
                assert out == "" and err.count("\n") == 1
                continue
            assert rc == 0 and err == "" and (printable(f"axis{s}") in out or "[bold]" not in s)
            if "[bold]" in s:
                assert "axis[bold]x[/bold]" in out.replace("\n", "")


def test_markup_in_free_text_is_printed_as_written(base: dict[str, Any], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    f = write(free_text_only(evil_doc(base, "[bold red]x[/]")), tmp_path / "markup.json")
    rc, out, err = run(["explain", str(f)], capsys)
    assert rc == 0 and err == "" and "space[bold red]x[/]" in out and "axis[bold red]x[/] comm" in out
    plain = write(json.loads(json.dumps(base)), tmp_path / "plain.json")
    rc, out, err = run(["compare", str(f), str(plain)], capsys)
    assert rc == 0 and err == "" and "time.comm.axis[bold red]x[/]" in out.replace("\n", "")


def evil_plan(base: dict[str, Any], s: str) -> Plan:
    """The plan with ``s`` in its strings, made without validation: what the views print whatever the
    document rules let through."""
    plan = parse_plan(base)
    pred = plan.predicted.model_dump()
    time = {**pred["time"], "comm_s": {**pred["time"]["comm_s"], f"axis{s}": 0.25 * pred["step_time_s"]}}
    stages = [{**st, "units": [*st["units"], f"unit{s}"]} for st in pred["stages"]]
    target = plan.inputs.target.model_copy(update={"name": "shardplan", "version": f"v{s}.1"})
    return plan.model_copy(update={
        "inputs": plan.inputs.model_copy(update={"model": f"m{s}", "target": target}),
        "solver": plan.solver.model_copy(update={"space": f"space{s}", "options": {"note": f"opt{s}"}}),
        "predicted": plan.predicted.model_copy(update={"notes": [f"note{s}"], "time": time, "stages": stages})})


@pytest.mark.parametrize("width", [60, 80, 200])
@pytest.mark.parametrize("s", EVIL)
def test_the_views_print_every_plan_string_escaped(s: str, width: int, base: dict[str, Any]) -> None:
    """explain and compare on a console that writes no colour, wide and narrow: no ESC, BEL or CR,
    each string escaped (``\\x1b[2J``) and markup as written."""
    plan, plain = evil_plan(base, s), parse_plan(base)
    shown = printable(s)
    views = {"explain": (lambda c: render_explain(explain_data(plan), c), ("m", "space", "axis", "unit", "v")),
             "compare": (lambda c: render_compare(compare([plan, plain], [f"a{s}", "b"]), c), ("m", "a"))}
    for render, names in views.values():
        buf = io.StringIO()
        render(Console(file=buf, width=width, force_terminal=False, color_system=None))
        text = buf.getvalue()
        assert no_raw(text), repr(text)
        flat = "".join(line.strip(" │┃") for line in text.splitlines())
        for name in names:
            assert f"{name}{shown}" in flat, (name, text)
