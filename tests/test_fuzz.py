"""Input fuzzing: every input, however malformed, ends in success or a rejection.

In-process, the parsing and validation functions raise only ``ShardplanError``; on the command line
(``planner.cli.main``, in-process) a bad input exits with code 2 and one line ``error: ...`` on
stderr — never a traceback, exit code 70, a hang, a half-written ``-o`` file or a batch output
without one line per input line. Inputs are valid documents mutated by ``tests/fuzz_inputs.py``;
hypothesis draws each input's seed (of a ``random.Random`` the generator takes its choices from)
from a fixed seed, so every run makes the same inputs.

Each fuzz test runs all its examples and then fails with the distinct failures it saw (grouped by
place and exception type, with the first input of each). ``-m fuzz_long`` (or
``SHARDPLAN_FUZZ_LONG=1``) also runs the long profile, 20 times the examples from other seeds;
``benchmarks/fuzz.py`` is the large run with a table per family.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests import fuzz_families as ff
from tests import fuzz_families_commands as fc
from tests import fuzz_families_exports as fe
from tests import fuzz_families_unicode as fu
from tests import fuzz_inputs as fi
from tests import fuzz_judges as fj
from tests import fuzz_runner as fr

LONG_FACTOR = 20


@pytest.fixture(scope="module")
def fz(tmp_path_factory: pytest.TempPathFactory) -> fr.FuzzEnv:
    return fr.FuzzEnv(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(autouse=True)
def _long_only_when_asked(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("fuzz_long") is None:
        return
    asked = "fuzz_long" in (request.config.getoption("markexpr", "") or "")
    if not (asked or os.environ.get("SHARDPLAN_FUZZ_LONG")):
        pytest.skip("the long fuzz profile runs with -m fuzz_long or SHARDPLAN_FUZZ_LONG=1")


def fuzz(gen: Callable[[Any, fr.FuzzEnv], fr.Case], fz: fr.FuzzEnv, examples: int, name: str) -> list[tuple[fr.Case, fr.Outcome]]:
    """Run ``examples`` inputs of ``gen`` (hypothesis-driven, seeded by ``name``); the failures."""
    failures: list[tuple[fr.Case, fr.Outcome]] = []
    budget = fr.HangBudget(allowed=1)

    @seed(zlib.crc32(name.encode()))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case_seed=st.integers(0, 2**63))
    def one(case_seed: int) -> None:
        case = gen(random.Random(case_seed), fz)
        case.notes.append(f"case seed {case_seed}")
        out = case.execute(budget.limit())
        budget.record(out)
        if not out.ok:
            failures.append((case, out))

    one()
    return failures


IN_PROCESS_EXAMPLES = {"plan-doc": 200, "profile-doc": 200, "hf-config": 300, "cluster": 200, "accelerator": 20,
                       "batch-line": 150}
CLI_EXAMPLES = {"cli-plan-file": 80, "cli-profile": 40, "cli-config": 50, "cli-cluster": 40, "cli-batch": 40,
                "cli-values": 100}


# ---- the seeds are valid -----------------------------------------------------------------------

def test_seed_documents_are_valid(fz: fr.FuzzEnv) -> None:
    """Mutations start from documents the product accepts (else the fuzzer only tests rejection)."""
    from planner.commands.estimate import price_args
    from profiler.hardware import Accelerator, parse_cluster
    from profiler.models import load_model
    from profiler.profile_schema import parse_profile
    from vocab.plan import parse_plan

    for _, doc, path in fz.plans:
        parse_plan(doc)
        assert fr.run_cli(["explain", str(path)]).rc == 0
    parse_profile(fz.profile)
    for name, cfg in fz.configs.items():
        assert load_model(cfg, 128).num_blocks >= 1, name
    for cluster in fz.clusters:
        parse_cluster(cluster)
    for spec in fi.CLUSTER_SPECS:
        parse_cluster(spec)
    Accelerator.from_dict(fz.accelerator)
    for line in fi.batch_seeds(fz.plans[0][2]):
        assert price_args(json.loads(json.dumps(line)))["step_time_s"] > 0
    out = fr.run_cli(["estimate", *ff.ESTIMATE_BASE, "--profile", str(fz.profile_path), "--json"])
    assert out.rc == 0, out.stderr
    for argv, _ in ff.CLI_TEMPLATES.values():
        assert fr.run_cli(argv).rc == 0, argv


# ---- in-process: parsing and validation raise only ShardplanError ------------------------------

@pytest.mark.parametrize("family", sorted(IN_PROCESS_EXAMPLES))
def test_in_process_inputs_raise_only_shardplan_error(fz: fr.FuzzEnv, family: str) -> None:
    failures = fuzz(ff.IN_PROCESS[family], fz, IN_PROCESS_EXAMPLES[family], family)
    assert not failures, fr.report(failures)


# ---- the command line: exit 0, or exit 2 with one line -----------------------------------------

@pytest.mark.parametrize("family", sorted(CLI_EXAMPLES))
def test_command_line_inputs_end_in_success_or_one_line(fz: fr.FuzzEnv, family: str) -> None:
    failures = fuzz(ff.COMMAND_LINE[family], fz, CLI_EXAMPLES[family], family)
    assert not failures, fr.report(failures)


def _strict_cases() -> list[tuple[str, str, str]]:
    out = []
    for cmd, (_, flags) in ff.CLI_TEMPLATES.items():
        for flag, kind in sorted(flags.items()):
            if kind in ("count", "count0", "limit"):
                values = ["0", "-1", "nan", "inf", "abc", "1e400"] if kind == "limit" else ["0", "-1", "-0", "abc", "4.5"]
                out += [(cmd, flag, v) for v in values if ff.must_refuse(kind, v)]
    return out


@pytest.mark.parametrize(("cmd", "flag", "value"), _strict_cases())
def test_out_of_range_flag_values_are_refused(cmd: str, flag: str, value: str) -> None:
    """Counts are positive integers and limits finite positive numbers: anything else exits 2, in
    one line, before any work."""
    argv = ff.set_flag(ff.CLI_TEMPLATES[cmd][0], flag, value)
    out = fr.run_cli(argv)
    assert out.rc == 2 and out.kind == "rejected", f"{' '.join(argv)}\n  -> {out.summary()}\n  stderr: {out.stderr[:400]}"


NAMES = ["[red]gp[/red]t2", "[/x]", "[bold]gpt2", "gpt2[/]", "[link=https://x]gpt2[/link]", "\x1b[31mgpt2\x1b[0m",
         "\x1b]0;title\x07gpt2", "gp\nt2", "gp\rt2", "\x00gpt2", "\u202egpt2", "\ud800"]


def _printed(name: str) -> str:
    """How a name appears in a message: printable characters as they are, others escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in name)


@pytest.mark.parametrize("where", ["model", "cluster", "schedule", "export-to", "plot-kind"])
@pytest.mark.parametrize("name", NAMES, ids=[ascii(n) for n in NAMES])
def test_names_with_markup_and_escapes_are_printed_literally(fz: fr.FuzzEnv, where: str, name: str) -> None:
    plan = str(fz.plans[0][2])
    argv = {
        "model": ["estimate", "--model", name, "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8"],
        "cluster": ["estimate", "--model", "gpt2", "--cluster", f"4x{name}", "--seq-len", "128", "--global-batch", "8"],
        "schedule": ["estimate", *ff.ESTIMATE_BASE, "--pp", "2", "--schedule", name],
        "export-to": ["export", plan, "--to", name],
        "plot-kind": ["plot", plan, "--kind", name, "-o", str(fz.name(".svg"))],
    }[where]
    out = fr.run_cli(argv)
    assert out.kind == "rejected", f"{argv}\n  -> {out.summary()}"
    assert _printed(name) in out.stderr, f"{name!r} not printed literally: {out.stderr!r}"


@pytest.mark.parametrize("kind", [k for k in ff.OUTPUT_KINDS if k != "odd-suffix"])
@pytest.mark.parametrize("cmd", ["plan", "export", "plot"])
def test_output_targets(fz: fr.FuzzEnv, cmd: str, kind: str, tmp_path: Path) -> None:
    """-o onto a folder or under a regular file is refused in one line; a failed command leaves the
    target as it was, a successful one a whole file."""
    target = ff.output_target(tmp_path, cmd, kind)
    before = fr.snapshot(target)
    seed_plan = str(fz.plans[0][2])
    argv = {
        "plan": ["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8",
                 "--space", "fsdp", "-o", str(target)],
        "export": ["export", seed_plan, "--to", "megatron", "-o", str(target)],
        "plot": ["plot", seed_plan, "--kind", "memory", "-o", str(target)],
    }[cmd]
    out = fr.run_cli(argv)
    assert out.ok, f"{argv}\n  -> {out.summary()}"
    if kind in ("dir", "under-file", "dot"):
        assert out.rc == 2, f"{argv}: exit {out.rc}"
    else:
        problem = fr.check_output_file(target, before, out, {"plan": "plan", "export": "text", "plot": "svg"}[cmd])
        assert problem is None, f"{argv}: {problem}"


PATH_KINDS = ["dir", "fifo", "missing", "newline", "long", "loop", "empty", "markup"]
PATH_USES = ["explain", "estimate-plan", "profile", "batch", "model", "cluster", "compare", "export", "inspect"]


@pytest.mark.parametrize("use", PATH_USES)
def test_file_arguments_of_every_kind(fz: fr.FuzzEnv, use: str) -> None:
    """A folder, a FIFO, a missing file, a name with a newline, a too-long name, a symlink loop or an
    empty file in place of an input file: refused in one line, at once."""
    failures = []
    budget = fr.HangBudget(allowed=1)
    for kind in PATH_KINDS:
        case = ff.gen_cli_paths(_Fixed(kind, use), fz)
        out = case.execute(budget.limit())
        budget.record(out)
        if not out.ok:
            failures.append((case, out))
    assert not failures, fr.report(failures)


class _Fixed:
    """A stand-in for ``rnd`` that picks given values (for the generators' fixed variants)."""

    def __init__(self, *picks: str):
        self.picks = list(picks)

    def choice(self, seq: Any) -> Any:
        for p in self.picks:
            if p in seq:
                self.picks.remove(p)
                return p
        return seq[0]

    def random(self) -> float:
        return 0.0

    def randrange(self, n: int) -> int:
        return 0


def test_batch_output_has_one_line_per_input_line(fz: fr.FuzzEnv, tmp_path: Path) -> None:
    """Bad lines of every kind between good ones: one JSON line out per line in, in order."""
    good = json.dumps(fi.batch_seeds()[0])
    bad = ["", "   ", "{", "[]", "null", "42", '"x"', "NaN", "{}", '{"model": "gpt2"}', "{} {}",
           '{"model": 5, "cluster": "4xcpu", "seq_len": 128, "global_batch": 8}',
           '{"model": "gpt2", "cluster": [1], "seq_len": 128, "global_batch": 8}',
           '{"model": "gpt2", "cluster": "4xcpu", "seq_len": "x", "global_batch": 8}',
           '{"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "memory_limit": "x"}',
           '{"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "tp": 1e400}',
           '{"plan": ["a.json"]}', "[" * 5000 + "]" * 5000,
           '{"model": "gpt2\u2028", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8}']
    lines = [x for b in bad for x in (good, b)] + [good]
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    out = fr.run_cli(["estimate", "--batch", str(path)])
    assert out.ok, out.summary()
    problem = fr.check_batch(data, out)
    assert problem is None, problem


def test_subprocess_exit_codes_and_stderr(fz: fr.FuzzEnv, tmp_path: Path) -> None:
    """A few inputs through a real ``python -m planner.cli`` process: exit 2, one line, no traceback."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**fi.TINY_GPT2, "n_layer": "two"}))
    plan = tmp_path / "plan.json"
    plan.write_bytes(fz.plans[0][2].read_bytes()[:500])
    cases = [["explain", str(plan)], ["estimate", *ff.ESTIMATE_BASE, "--tp", "nan"], ["inspect", "--model", str(cfg)]]
    bad = [(argv, out) for argv in cases if (out := fr.run_cli_subprocess(argv)).kind != "rejected"]
    assert not bad, "\n".join(f"{argv}: {out.summary()}\n  stderr: {out.stderr[-600:]}" for argv, out in bad)


# ---- inputs the fuzzer found, kept as fixed cases --------------------------------------------

def _plan_with(fz: fr.FuzzEnv, path: tuple[Any, ...], value: Any) -> Path:
    doc = json.loads(fz.plans[0][2].read_text())
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return fz.file(json.dumps(doc).encode(), ".json", stem="found")


def _found_cases(fz: fr.FuzzEnv) -> dict[str, Callable[[], fr.Outcome]]:
    from planner.commands.estimate import price_args
    from profiler.hardware import parse_cluster

    line = {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8}
    profile = fi.valid_profile()
    profile["comm"][5]["sharing_efficiency"] = 5e-324
    profile_path = fz.file(json.dumps(profile).encode(), ".json", stem="found")
    batch = fz.file(json.dumps({**line, "memory_limit": 10**400}).encode() + b"\n", ".jsonl", stem="found")
    acc = fi.accelerator_seed()
    del acc["peak_tflops"]["fp8"]
    acc_dir = fz.name("", stem="found-acc")
    acc_dir.mkdir()
    (acc_dir / "fuzzacc.json").write_text(json.dumps(acc))
    seed_plan = str(fz.plans[0][2])

    def batch_run() -> fr.Outcome:
        out = fr.run_cli(["estimate", "--batch", str(batch)])
        problem = fr.check_batch(batch.read_bytes(), out) if out.ok else None
        if problem:
            out.kind, out.detail = "other", problem
        return out

    return {
        "parse_cluster-gpus_per_node-null": lambda: fr.call(
            parse_cluster, {"accelerator": "h100", "nodes": 2, "gpus_per_node": None}),
        "price_args-memory_limit-10**400": lambda: fr.call(price_args, {**line, "memory_limit": 10**400}),
        "batch-memory_limit-10**400": batch_run,
        "profile-sharing_efficiency-5e-324": lambda: fr.run_cli(
            ["estimate", *ff.ESTIMATE_BASE, "--profile", str(profile_path)]),
        "plot-pareto-predicted.memory_limit_gib-x": lambda: fr.run_cli(
            ["plot", str(_plan_with(fz, ("predicted", "memory_limit_gib"), "x")), "--kind", "pareto",
             "-o", str(fz.name(".png"))]),
        "explain-predicted.stages[0].activations_gib-x": lambda: fr.run_cli(
            ["explain", str(_plan_with(fz, ("predicted", "stages", 0, "activations_gib"), "x"))]),
        "explain-predicted.time-x": lambda: fr.run_cli(
            ["explain", str(_plan_with(fz, ("predicted", "time"), "x"))]),
        "compare-predicted.time-x": lambda: fr.run_cli(
            ["compare", str(_plan_with(fz, ("predicted", "time"), "x")), seed_plan]),
        "export-predicted.stages[0].units[0]-7": lambda: fr.run_cli(
            ["export", str(_plan_with(fz, ("predicted", "stages", 0, "units", 0), 7)), "--to", "megatron"]),
        "plot-memory-predicted.stages[0].units[0]-7": lambda: fr.run_cli(
            ["plot", str(_plan_with(fz, ("predicted", "stages", 0, "units", 0), 7)), "--kind", "memory",
             "-o", str(fz.name(".svg"))]),
        "broken-accelerator-file-named": lambda: fr.run_cli(
            ["estimate", "--model", "gpt2", "--cluster", "8xfuzzacc", "--seq-len", "128", "--global-batch", "8"],
            env={"SHARDPLAN_ACCELERATOR_PATH": str(acc_dir)}),
    }


FOUND = ["parse_cluster-gpus_per_node-null", "price_args-memory_limit-10**400", "batch-memory_limit-10**400",
         "profile-sharing_efficiency-5e-324", "plot-pareto-predicted.memory_limit_gib-x",
         "explain-predicted.stages[0].activations_gib-x", "explain-predicted.time-x", "compare-predicted.time-x",
         "export-predicted.stages[0].units[0]-7", "plot-memory-predicted.stages[0].units[0]-7",
         "broken-accelerator-file-named"]


@pytest.mark.parametrize("name", FOUND)
def test_inputs_the_fuzzer_found(fz: fr.FuzzEnv, name: str) -> None:
    """Rare inputs the long runs found, run every time: in-process a ShardplanError at most, on the
    command line exit 0 or 2 with one line."""
    out = _found_cases(fz)[name]()
    assert out.ok, f"{name}: {out.summary()}\n  stderr: {out.stderr[-600:]}"


# ---- what users and attackers touch: exports, imports, commands that start work, the API --------

#: the families of tests/fuzz_families_{exports,commands,unicode}.py and their examples here
TOUCHED_EXAMPLES = {"export-injection": 150, "import-injection": 120, "cli-unicode": 60, "doc-unicode": 300,
                    "api-types": 120, "cli-sweep": 40, "cli-train": 40, "cli-profile-command": 50, "cli-validate": 30,
                    "cli-fit": 40}
TOUCHED = {**fe.COMMAND_LINE, **fc.COMMAND_LINE, **fu.IN_PROCESS, **fu.COMMAND_LINE}
#: families with known defects (un-mark each when its fix lands)
KNOWN_DEFECTS = {
}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(reason=KNOWN_DEFECTS[f], strict=False))
                                    if f in KNOWN_DEFECTS else f for f in sorted(TOUCHED_EXAMPLES)])
def test_touched_inputs(fz: fr.FuzzEnv, family: str) -> None:
    """Exports of plans with injection payloads in their strings, imports of mutated trainer files,
    sweep / train / profile / validate / fit with bad values, the API with wrong types, odd
    Unicode in documents: success or a one-line rejection, and each family's own rules."""
    failures = fuzz(TOUCHED[family], fz, TOUCHED_EXAMPLES[family], family)
    assert not failures, fr.report(failures)


def test_export_and_import_seeds(fz: fr.FuzzEnv) -> None:
    """Every seed plan exports to some target it can express, the export of each reads back as its
    trainer reads it, and imports again (the injection families start from files that work)."""
    sources = fe.import_sources(fz)
    assert {t for _, t, _ in sources} == set(ff.EXPORT_TARGETS)
    for name, target, text in sources:
        assert fj.judge_export(target, text, text, fz.root / "no-marker", fz.root) is None, (name, target)
        path = fz.file(text.encode(), fe.IMPORT_SUFFIX[target], stem="import-seed")
        out = fr.run_cli(["import", str(path), *fe.inputs_flags(name, target)])
        assert out.rc == 0, (name, target, out.summary())


def test_judges_catch_what_broke_out(tmp_path: Path) -> None:
    """The export judges flag a string that broke out of its place in each trainer's language."""
    marker = tmp_path / "pwned"
    ref_py = '# a\n"""Train it."""\nimport sys\nPLAN = {"model": "x"}\n'
    cases = {
        "python": f'# a\n__import__("os").system("touch {marker}") #\n"""Train it."""\nimport sys\nPLAN = {{"model": "x"}}\n',
        "megatron": "# a\n--save /tmp/x\n# b\n--k 1\n",
        "torchtitan": '# a\n# b\n[job]\ndump_folder = "/tmp/x"\n[x]\nk = 1\n',
        "nanotron": "# a\x85checkpoints_path: /tmp/x\n# b\nx:\n  k: 1\n",
        "deepspeed": '{"a": 1, "b": {"c": 2, "save": "/tmp/x"}}',
    }
    refs = {"python": ref_py, "megatron": "# a\n# b\n--k 1\n", "torchtitan": "# a\n# b\n[x]\nk = 1\n",
            "nanotron": "# a\n# b\nx:\n  k: 1\n", "deepspeed": '{"a": 1, "b": {"c": 2}}'}
    for target, text in cases.items():
        assert fj.judge_export(target, refs[target], refs[target], marker, tmp_path) is None, target
        assert fj.judge_export(target, text, refs[target], marker, tmp_path) is not None, target
        marker.unlink(missing_ok=True)
    with fj.watch_opens(["pwned"]) as seen:
        marker.write_text("x")
        marker.read_text()
    assert seen == [str(marker), str(marker)]


def test_stubs_stop_valid_commands(fz: fr.FuzzEnv, tmp_path: Path) -> None:
    """A valid train, profile or fit command gets to the stub that stands for starting ranks,
    measuring or fitting (so a fuzz input never starts them, and a bad one that gets there is seen)."""
    csv_path = tmp_path / "runs.csv"
    csv_path.write_bytes(fc.published_sample(4))
    runs = [(["train", "--model", "gpt2", "--plan", str(fz.plans[0][2])], fc.LAUNCH, "runtime.launch.launch"),
            (["profile", "compute", "--quick", "-o", str(tmp_path / "p.json")], fc.MEASURE, "Clock"),
            (["profile", "model", "--model", "gpt2", "-o", str(tmp_path / "p.json")], fc.MEASURE, "build_stack"),
            (["fit", str(csv_path), "-o", str(tmp_path / "c.yaml")], fc.FIT, "costmodel.published.fit.fit")]
    for argv, stubs, where in runs:
        out = fc.guarded_run(argv, stubs, [], cwd=tmp_path)(fr.HANG_S)
        assert out.kind == "accepted" and out.detail.startswith(fc.STOPPED) and where in out.detail, (argv, out.summary())
        bad = fc.guarded_run(argv, stubs, ["a value"], cwd=tmp_path)(fr.HANG_S)
        assert bad.kind == "other", argv
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.parametrize("after_s", fc.SIGNAL_DELAYS)
def test_sigint_at_start_up(after_s: float) -> None:
    """Ctrl-C while ``plan`` starts or searches: exit 130, at most one line, no traceback."""
    out = fc.run_interrupted(fc.SIGNAL_ARGV, after_s)
    assert out.ok, f"SIGINT at {after_s} s: {out.summary()}\n  stderr: {out.stderr[-600:]}"


def test_only_tracebacks_before_the_package_are_pythons_own() -> None:
    """The SIGINT judge lets Python's own Ctrl-C through only where no line of ours but the
    package's first had run."""
    init = fc.REPO / "planner" / "__init__.py"
    start = 'Traceback (most recent call last):\n  File "<frozen runpy>", line 189, in _run_module_as_main\n'
    ours = f'  File "{init}", line {fc.FIRST_LINE}, in <module>\n'
    later = f'  File "{fc.REPO / "planner" / "cli.py"}", line 20, in <module>\n'
    assert fc.before_the_package(start + "KeyboardInterrupt")
    assert fc.before_the_package(start + ours + "KeyboardInterrupt")
    assert not fc.before_the_package(start + ours + later + "KeyboardInterrupt")


# ---- the long profile ---------------------------------------------------------------------------

@pytest.mark.fuzz_long
@pytest.mark.parametrize("family", sorted({**IN_PROCESS_EXAMPLES, **CLI_EXAMPLES, **TOUCHED_EXAMPLES}))
def test_long_profile(fz: fr.FuzzEnv, family: str) -> None:
    gen = {**ff.IN_PROCESS, **ff.COMMAND_LINE, **TOUCHED}[family]
    n = {**IN_PROCESS_EXAMPLES, **CLI_EXAMPLES, **TOUCHED_EXAMPLES}[family] * LONG_FACTOR
    failures = fuzz(gen, fz, n, f"long-{family}")
    assert not failures, fr.report(failures, groups=25)
