"""Fuzz families of the commands that start work: ``sweep`` (bad grids and values), ``train`` (bad
plans and flags), ``profile compute|comm|model`` (bad flags), ``validate`` and ``fit`` (bad CSVs,
paths and flags), and Ctrl-C at start-up.

``train``, ``profile`` and ``fit`` never get to their work here: what starts ranks, measures or fits
is replaced for the call by a stub that stops the command (:func:`stopped_before`); an input that
gets there is counted as accepted (a valid input, not run) unless one of its values is out of range,
which must have been refused before. Such cases run in-process only (no ``argv``: the benchmark's
process sample leaves them out). ``fit`` runs in a temporary working folder, with ``-o`` always given.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.fuzz_families import BAD_NUMBERS, HUGE_NUMBERS, ODD_NAMES, ODD_NUMBERS, set_flag
from tests.fuzz_inputs import NASTY_STRINGS, REPO, mutate_document, mutate_text
from tests.fuzz_runner import HANG_S, Case, FuzzEnv, Outcome, check_output_file, run_cli, snapshot

#: the detail of an input that got to the stubbed work
STOPPED = "valid input: stopped at"


class WouldStart(BaseException):
    """Raised by the stubs in place of starting ranks, measuring or fitting (a BaseException: the
    command's error handling does not catch it)."""


@contextlib.contextmanager
def stopped_before(targets: list[tuple[str, str]], started: list[str]) -> Iterator[None]:
    """Within the block, each ``(module, function)`` raises :class:`WouldStart` (recording its name
    in ``started``) instead of running."""
    saved = []
    for mod_name, attr in targets:
        mod = importlib.import_module(mod_name)

        def stub(*args: Any, _name: str = f"{mod_name}.{attr}", **kwargs: Any) -> Any:
            started.append(_name)
            raise WouldStart(_name)

        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, stub)
    try:
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def guarded_run(argv: list[str], targets: list[tuple[str, str]], must: list[str], cwd: Path | None = None
                ) -> Callable[[float | None], Outcome]:
    """``run_cli(argv)`` with ``targets`` stubbed (and in ``cwd``): reaching one is a valid input not
    run (accepted), or a failure when ``must`` names values that had to be refused."""

    def run(limit: float | None) -> Outcome:
        started: list[str] = []
        with stopped_before(targets, started), contextlib.chdir(cwd or Path.cwd()):
            o = run_cli(argv, limit)
        if started:
            if must:
                return Outcome("other", f"got to {started[0]} with out-of-range value(s) {', '.join(must)} "
                                        "(must exit 2 before)", rc=o.rc, stdout=o.stdout, stderr=o.stderr)
            return Outcome("accepted", f"{STOPPED} {started[0]}", seconds=o.seconds, rc=0)
        return o

    return run


def _refused_if(must: list[str]) -> Callable[[Outcome], str | None]:
    def check(o: Outcome) -> str | None:
        return f"accepted out-of-range value(s) {', '.join(must)} (must exit 2)" if must and o.rc == 0 else None

    return check


def _flag_value(rnd: Any, kind: str) -> tuple[str, bool]:
    """A value for a flag of ``kind`` and whether it must be refused."""
    from tests.fuzz_families import must_refuse

    if kind == "name":
        v = rnd.choice(ODD_NAMES + ["nope", "", "cpu", "gpt2"])
        return v, False
    v = rnd.choice(BAD_NUMBERS + HUGE_NUMBERS + ODD_NUMBERS)
    return v, must_refuse(kind, v)


# ---- sweep --------------------------------------------------------------------------------------

SWEEP_BASE = ["sweep", "-m", "gpt2", "--gpus", "4,8", "-a", "cpu", "--global-batch", "8", "--seq-len", "128",
              "--workers", "1"]
#: grids that are not lists of positive integers (each must be refused)
BAD_GRIDS = ["0", "-4", "4..2", "0..8", "a,b", "", ",", " ", "1e3", "4.5", "８", "٤", "4..", "..8", "4..8..16",
             "4;8", "[red]4", "\x1b[31m4", "4,-8", "4,x", "nan", "inf", "-1..4", "1" + "0" * 30, "9" * 5000]
#: grids of positive integers, some odd (a point out of range gets a row saying why)
ODD_GRIDS = ["4", "8,4", "4, 8", "4,4", "1..8", "2..2", "16", "128", "3", "4,,8,", "1..1" + "0" * 30]
BAD_LIMITS = ["0", "-1", "nan", "inf", "-inf", "x", "default,0", "1e400", "", ",", "defaults", "60,nan"]
SWEEP_NAMES = {"-a": ["h100,cpu", "nope", "", ",", "cpu,", "[red]cpu", "\x1b[31mcpu", "cpu\ncpu", "x" * 5000],
               "--target": ["nope", "", "any", "shardplan,nope", "torchtitan", "[bold]x", "megatron,,"],
               "--space": ["nope", "", "full,x", "fsdp", "megatron", ",", "FULL"],
               "-m": ODD_NAMES}


def gen_cli_sweep(rnd: Any, fz: FuzzEnv) -> Case:
    """``sweep`` with one or two values replaced: bad grids, limits, names, token counts and costs,
    outputs; an out-of-range value exits 2 before any search."""
    argv, notes, extra = list(SWEEP_BASE), [], []
    bad_by_flag: dict[str, str] = {}
    output_check: dict[str, Any] = {}  # the check of the last -o given (set_flag replaces an earlier one)
    for _ in range(1 + rnd.randrange(2)):
        what = rnd.choice(("--gpus", "--gpus", "--global-batch", "--seq-len", "--memory-limit", "name", "--tokens",
                           "--gpu-hour-cost", "-o", "--plots", "--workers"))
        if what in ("--gpus", "--global-batch", "--seq-len"):
            bad = rnd.random() < 0.75
            value = rnd.choice(BAD_GRIDS if bad else ODD_GRIDS)
        elif what == "--memory-limit":
            bad, value = True, rnd.choice(BAD_LIMITS)
        elif what == "name":
            what = rnd.choice(sorted(SWEEP_NAMES))
            bad, value = False, rnd.choice(SWEEP_NAMES[what])
        elif what in ("--tokens", "--gpu-hour-cost"):
            value, bad = _flag_value(rnd, "limit")
        elif what == "--workers":
            value = rnd.choice(("0", "65", "-1", "x", "1.5", "", "1"))
            bad = value != "1"
        else:
            base = fz.name("", stem="sweep-out")
            base.mkdir()
            extra.append(base)
            kind = rnd.choice(("new", "dir", "under-file", "missing-dir"))
            (base / "f").write_text("x")
            name = rnd.choice(("t.csv", "t.parquet", "t.txt", "t")) if what == "-o" else "plots"
            target = {"new": base / name, "dir": base, "under-file": base / "f" / name,
                      "missing-dir": base / "a" / name}[kind]
            bad = kind == "under-file" or (what == "-o" and (kind == "dir" or target.suffix not in (".csv", ".parquet")))
            value = str(target)
            if what == "-o":
                output_check[what] = lambda o, t=target, b=snapshot(target): check_output_file(t, b, o, "text")
        argv = set_flag(argv, what, value)
        notes.append(f"{what} {value[:120]!r}")
        bad_by_flag.pop(what, None)
        if bad:
            bad_by_flag[what] = f"{what} {value[:40]!r}"
    must = list(bad_by_flag.values())
    return Case("cli-sweep", "shardplan sweep", notes, lambda limit: run_cli(argv, limit), argv=argv,
                checks=[_refused_if(must), *output_check.values()], cleanup=extra)


# ---- train --------------------------------------------------------------------------------------

LAUNCH = [("runtime.launch", "launch")]
TRAIN_FLAGS = {"--nproc": "count", "--steps": "count", "--seed": "seed", "--seq-len": "count",
               "--global-batch": "count", "--precision": "precision", "--watchdog-s": "watchdog", "--model": "name"}
PRECISIONS = ["fp32", "bf16", "fp8", "FP32", "", "fp16", "int8", "[red]fp32", "\x1b[31mfp32"]


def _train_value(rnd: Any, kind: str) -> tuple[str, bool]:
    if kind == "seed":
        v = rnd.choice(("-1", "x", "1.5", str(2**63), "9" * 30, "0", "7", ""))
        return v, v not in ("0", "7")
    if kind == "precision":
        v = rnd.choice(PRECISIONS)
        return v, v not in ("fp32", "bf16", "fp8")
    if kind == "watchdog":
        v = rnd.choice(("-1", "nan", "inf", "-inf", "x", "", "1e400", "0", "5", "0.5"))
        return v, v in ("-1", "nan", "-inf", "x", "")
    if kind == "name":
        return rnd.choice(ODD_NAMES + ["tiny-gpt", "gpt2", "hf-gpt2", "nope", "llama3-70b"]), False
    return _flag_value(rnd, kind)


def gen_cli_train(rnd: Any, fz: FuzzEnv) -> Case:
    """``train`` with a mutated plan file or bad flags: refused before any rank starts (a valid
    input stops where ranks would start)."""
    name, doc, seed_path = rnd.choice(fz.plans[:1] * 3 + fz.plans[1:])
    argv = ["train", "--model", "gpt2", "--plan", str(seed_path)]
    notes, cleanup = [f"seed plan {name}"], []
    bad_by_flag: dict[str, str] = {}
    if rnd.random() < 0.5:
        _, data, changes = mutate_document(rnd, doc, text_p=0.3)
        path = fz.file(data, ".json", stem="train-plan")
        argv = set_flag(argv, "--plan", str(path))
        notes += changes
        cleanup.append(path)
    if rnd.random() < 0.8 or len(argv) == 5:
        for _ in range(1 + rnd.randrange(2)):
            flag = rnd.choice(sorted(TRAIN_FLAGS))
            value, bad = _train_value(rnd, TRAIN_FLAGS[flag])
            argv = set_flag(argv, flag, value)
            notes.append(f"{flag} {value[:80]!r}")
            bad_by_flag.pop(flag, None)
            if bad:
                bad_by_flag[flag] = f"{flag} {value[:40]!r}"
    must = list(bad_by_flag.values())
    if rnd.random() < 0.15:
        out = fz.name("", stem="train-out")
        out.mkdir()
        argv += ["-o", str(rnd.choice((out, out / "x" / "r.json", out / "r.json")))]
        cleanup.append(out)
    notes.append("argv: " + " ".join(repr(a) if not a.isprintable() or " " in a else a for a in argv)[:600])
    return Case("cli-train", "shardplan train", notes, guarded_run(argv, LAUNCH, must), checks=[_refused_if(must)],
                cleanup=cleanup)


# ---- profile ------------------------------------------------------------------------------------

#: where each measurement starts, after its own checks (the first timer, the workers' store, the layers)
MEASURE = [("profiler.measure_compute", "Clock"), ("torch.distributed", "TCPStore"),
           ("profiler.measure_model", "build_stack")]
PROFILE_FLAGS: dict[str, dict[str, str]] = {
    "compute": {"--device": "device", "--dtype": "dtype"},
    "comm": {"--nproc": "count", "--backend": "backend", "--sizes": "sizes", "--stat": "stat", "--timeout": "limit"},
    "model": {"--model": "name", "--micro-batch": "count", "--seq-len": "count", "--layers": "count",
              "--repeats": "count", "--device": "device", "--dtype": "dtype", "--accelerator": "name",
              "--profile": "file"},
}
ODD_VALUES = {
    "device": (["cuda:99", "gpu", "", "cuda:-1", "cuda:x", "[red]cpu", "\x1b[31mcpu", "cpu:0:0", "meta", "xla"],
               ["cpu", "cuda", "cuda:0"]),
    "dtype": (["fp64", "", "int8", "FP32!", "[red]bf16", "float"], ["fp32", "bf16", "fp16", "auto"]),
    "backend": (["mpi", "", "ucc", "[red]gloo", "gloo\n"], ["gloo", "nccl"]),
    "sizes": (["0", "-1K", "1X", ",", "1e400", "9" * 30, "1K,,", "nan", "1.5.5K", "K", "-1"], ["1K,64K", "1M", "1K"]),
    "stat": (["mean", "", "MEDIAN", "max", "[red]min"], ["median", "min"]),
}


def _profile_value(rnd: Any, fz: FuzzEnv, kind: str, cleanup: list[Path]) -> tuple[str, bool]:
    if kind in ODD_VALUES:
        bad_values, good = ODD_VALUES[kind]
        return (rnd.choice(bad_values), True) if rnd.random() < 0.8 else (rnd.choice(good), False)
    if kind == "file":
        _, data, _ = mutate_document(rnd, fz.profile, text_p=0.4)
        path = fz.file(data, ".json", stem="profile-cal")
        cleanup.append(path)
        return str(path), False
    return _flag_value(rnd, kind)


def gen_cli_profile_command(rnd: Any, fz: FuzzEnv) -> Case:
    """``profile compute|comm|model --quick`` with bad flags or outputs: refused before measuring."""
    sub = rnd.choice(("compute", "comm", "model"))
    cleanup: list[Path] = []
    folder = fz.name("", stem="profile-cmd")
    folder.mkdir()
    cleanup.append(folder)
    out = folder / "p.json"
    argv = ["profile", sub] + (["--model", "gpt2"] if sub == "model" else []) + ["-o", str(out)]
    argv += ["--quick"] if sub != "model" else ["--repeats", "1"]
    notes: list[str] = []
    bad_by_flag: dict[str, str] = {}
    for _ in range(1 + rnd.randrange(2)):
        flag = rnd.choice(sorted(PROFILE_FLAGS[sub]) + ["-o"])
        if flag == "-o":
            kind = rnd.choice(("dir", "under-file", "merge-bad", "missing-dir"))
            if kind == "dir":
                value, bad = str(folder), True
            elif kind == "under-file":
                (folder / "f").write_text("x")
                value, bad = str(folder / "f" / "p.json"), True
            elif kind == "merge-bad":
                _, data, changes = mutate_document(rnd, fz.profile, text_p=0.4)
                out.write_bytes(data)
                value, bad = str(out), False
                argv.append("--merge")
                notes += changes
            else:
                value, bad = str(folder / "a" / "b" / "p.json"), False
        else:
            value, bad = _profile_value(rnd, fz, PROFILE_FLAGS[sub][flag], cleanup)
        argv = set_flag(argv, flag, value)
        notes.append(f"{flag} {value[:80]!r}")
        bad_by_flag.pop(flag, None)
        if bad:
            bad_by_flag[flag] = f"{flag} {value[:40]!r}"
    must = list(bad_by_flag.values())
    notes.append("argv: " + " ".join(repr(a) if not a.isprintable() or " " in a else a for a in argv)[:600])
    return Case("cli-profile-command", f"shardplan profile {sub}", notes, guarded_run(argv, MEASURE, must),
                checks=[_refused_if(must)], cleanup=cleanup)


# ---- validate and fit ---------------------------------------------------------------------------

FIT = [("costmodel.published.fit", "fit")]


def published_sample(rows: int = 8) -> bytes:
    """The header and the first A/B rows of the published-runs CSV (a CSV ``validate`` accepts)."""
    from costmodel.published.runs import default_csv_path

    lines = default_csv_path().read_text(encoding="utf-8").splitlines()
    keep = [lines[0]] + [ln for ln in lines[1:] if ln.rstrip().endswith(("A", "B")) or ",A" in ln][:rows]
    return ("\n".join(keep) + "\n").encode()


def mutated_csv(rnd: Any, data: bytes) -> tuple[bytes, str]:
    """A CSV with one cell, row or column changed, or its bytes mutated."""
    if rnd.random() < 0.35:
        return mutate_text(rnd, data)
    import csv
    import io

    rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    op = rnd.choice(("cell", "cell", "cell", "drop-column", "header-only", "extra-column", "short-row", "dup-header"))
    if op == "cell" and len(rows) > 1:
        i, j = 1 + rnd.randrange(len(rows) - 1), rnd.randrange(len(rows[0]))
        rows[i][j] = rnd.choice(NASTY_STRINGS + ["-1", "0", "1e400", "nan", "inf", "-inf", "９", "1,5", '"', "A"])
        note = f"row {i} column {rows[0][j]!r} = {rows[i][j][:60]!r}"
    elif op == "drop-column":
        j = rnd.randrange(len(rows[0]))
        note = f"column {rows[0][j]!r} dropped"
        rows = [r[:j] + r[j + 1:] for r in rows]
    elif op == "header-only":
        rows, note = rows[:1], "header only"
    elif op == "extra-column":
        rows = [r + [rnd.choice(("x", "", "1"))] for r in rows]
        note = "a column without a name"
    elif op == "short-row" and len(rows) > 1:
        rows[1] = rows[1][:3]
        note = "row 1 cut to 3 cells"
    else:
        rows = [rows[0], *rows]
        note = "header twice"
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue().encode("utf-8", "surrogatepass"), note


def _odd_path(rnd: Any, folder: Path) -> tuple[Path, str]:
    kind = rnd.choice(("missing", "dir", "fifo", "empty", "newline", "long", "binary"))
    p = folder / {"newline": "a\nb.csv", "long": "c" * 300 + ".csv"}.get(kind, f"{kind}.csv")
    if kind == "dir":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "binary":
        p.write_bytes(bytes(range(256)))
    return p, kind


def gen_cli_validate(rnd: Any, fz: FuzzEnv) -> Case:
    """``validate`` on mutated CSVs of published runs, odd paths, a mutated --profile."""
    folder = fz.name("", stem="validate")
    folder.mkdir()
    if rnd.random() < 0.7:
        data, note = mutated_csv(rnd, published_sample())
        path = folder / "runs.csv"
        path.write_bytes(data)
    else:
        path, note = _odd_path(rnd, folder)
        data = b""
    argv = ["validate", str(path), *rnd.choice(([], ["--json"], ["--json", "--rows"], ["--rows"]))]
    notes = [note]
    if rnd.random() < 0.2:
        _, prof, changes = mutate_document(rnd, fz.profile, text_p=0.3)
        (folder / "prof.json").write_bytes(prof)
        argv += ["--profile", str(folder / "prof.json")]
        notes += [f"--profile: {c}" for c in changes]
    return Case("cli-validate", "shardplan validate", notes, lambda limit: run_cli(argv, limit), argv=argv,
                payload=data, cleanup=[folder])


def gen_cli_fit(rnd: Any, fz: FuzzEnv) -> Case:
    """``fit`` with a bad CSV or path, a bad ``-o`` (``-o --bogus``, a folder, under a file), or an
    unknown flag: refused before fitting (run in a temporary working folder)."""
    folder = fz.name("", stem="fit")
    folder.mkdir()
    r = rnd.random()
    if r < 0.4:
        data, note = mutated_csv(rnd, published_sample(4))
        csv_path = folder / "runs.csv"
        csv_path.write_bytes(data)
    elif r < 0.8:
        csv_path, note = _odd_path(rnd, folder)
    else:
        csv_path, note = folder / "runs.csv", "a good CSV"
        csv_path.write_bytes(published_sample(4))
    kind = rnd.choice(("--bogus", "dir", "under-file", "new", "missing-dir", "bogus-flag", "no-value"))
    out = {"dir": folder, "under-file": csv_path / "c.yaml", "new": folder / "c.yaml",
           "missing-dir": folder / "a" / "c.yaml"}.get(kind, folder / "c.yaml")
    argv = ["fit", str(csv_path), "-o", "--bogus" if kind == "--bogus" else str(out)]
    if kind == "bogus-flag":
        argv.append(rnd.choice(("--bogus", "-x", "--json=1", "--output")))
    elif kind == "no-value":
        argv = ["fit", str(csv_path), "-o"]
    must = [f"-o {kind}"] if kind in ("dir", "bogus-flag", "no-value") else []
    notes = [note, f"-o {kind}", "argv: " + " ".join(repr(a) for a in argv)[:400]]
    before = snapshot(out)
    checks = [_refused_if(must)]
    if kind in ("new", "missing-dir"):
        checks.append(lambda o: None if o.detail.startswith(STOPPED) else check_output_file(out, before, o, "text"))
    return Case("cli-fit", "shardplan fit", notes, guarded_run(argv, FIT, must, cwd=folder), checks=checks,
                cleanup=[folder])


# ---- Ctrl-C at start-up -------------------------------------------------------------------------

SIGNAL_ARGV = ["plan", "--model", "llama3-70b", "--cluster", "1024xh100", "--seq-len", "8192", "--global-batch", "512"]
SIGNAL_DELAYS = (0.05, 0.3, 1.0)


#: the first line of the package (``planner/__init__.py``): SIGINT before it ran gets Python's handling
FIRST_LINE = next(i for i, line in enumerate((REPO / "planner" / "__init__.py").read_text().splitlines(), 1)
                  if line.startswith("from planner import sigint"))


def before_the_package(stderr: str) -> bool:
    """Whether a traceback's frames stop before the package's first line ran: none in this
    repository's own code but that line (interpreter start-up, ``site``, ``runpy``)."""
    ours = {(Path(f).resolve(), int(n)) for f, n in re.findall(r'File "([^"]+)", line (\d+)', stderr)
            if Path(f).is_absolute() and Path(f).resolve().is_relative_to(REPO) and ".venv" not in Path(f).parts}
    return ours <= {((REPO / "planner" / "__init__.py").resolve(), FIRST_LINE)}


def interruptible() -> None:
    """In a child before it runs the program: SIGINT at its default, as a shell starts a foreground
    command (a child inherits an ignored SIGINT, and a test process may have been left with one)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_interrupted(argv: list[str], after_s: float, limit: float = HANG_S) -> Outcome:
    """``python -m planner.cli *argv`` sent SIGINT ``after_s`` seconds after it starts: exit 130 with at
    most one line and no traceback (``rejected``), or done before the signal (exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDPLAN_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *argv], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    time.sleep(after_s)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return Outcome("hang", f"still running {limit:g} s after SIGINT", seconds=time.perf_counter() - t0)
    stderr = err.decode("utf-8", "backslashreplace")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    o = Outcome("accepted", rc=p.returncode, stdout=out.decode("utf-8", "backslashreplace"), stderr=stderr,
                seconds=time.perf_counter() - t0)
    if "Traceback (most recent call last)" in stderr and before_the_package(stderr):
        o.kind, o.detail = "rejected", "Python's own Ctrl-C: the signal came before the package's first line"
    elif p.returncode == -signal.SIGINT and not stderr.strip():
        # the signal's default action, silent: it came before the interpreter set its handler (once set, an
        # uncaught KeyboardInterrupt prints a traceback first), so before any line of the package ran
        o.kind, o.detail = "rejected", "killed by SIGINT before the interpreter set its handler"
    elif "Traceback (most recent call last)" in stderr:
        o.kind, o.detail = "exception", f"a traceback after SIGINT at {after_s:g} s: " + (lines[-1] if lines else "")
    elif p.returncode == 130:
        o.kind, o.detail = ("rejected", "interrupted") if len(lines) <= 1 else ("multiline", " | ".join(lines[:4]))
    elif p.returncode != 0:
        o.kind, o.detail = "other", f"exit code {p.returncode} after SIGINT at {after_s:g} s: " + " | ".join(lines[-2:])
    return o


def gen_cli_signals(rnd: Any, fz: FuzzEnv) -> Case:
    """``plan`` in a fresh process interrupted with SIGINT while it starts or searches."""
    after = rnd.choice(SIGNAL_DELAYS) if rnd.random() < 0.6 else round(rnd.random() * 1.5, 3)
    return Case("cli-signals", f"SIGINT at {after:g} s", [f"SIGINT {after:g} s after start",
                                                           "argv: " + " ".join(SIGNAL_ARGV)],
                lambda limit: run_interrupted(SIGNAL_ARGV, after, limit or HANG_S))


COMMAND_LINE = {
    "cli-sweep": gen_cli_sweep,
    "cli-train": gen_cli_train,
    "cli-profile-command": gen_cli_profile_command,
    "cli-validate": gen_cli_validate,
    "cli-fit": gen_cli_fit,
    "cli-signals": gen_cli_signals,
}
#: families whose cases do not run as ``python -m planner.cli`` processes in the benchmark's sample
NOT_AS_PROCESS = ("cli-train", "cli-profile-command", "cli-fit", "cli-signals")
