"""Input fuzzing at scale: malformed inputs of every kind must end in success or a one-line rejection.

    python benchmarks/fuzz.py                      # 13,500 in-process inputs, 5,410 commands, 200 processes
    python benchmarks/fuzz.py --scale 0.05         # a quick run (5% of every count)
    python benchmarks/fuzz.py --families cli-batch,hf-config --seed 3

Valid documents (plans, profiles, model configs, clusters, accelerator files, batch lines, command
lines, trainer configurations, published-runs CSVs) are mutated by ``tests/fuzz_inputs.py`` from a
fixed seed. In-process inputs call the parsing and validation functions and the public API directly
(anything but a ``ShardplanError`` is a failure); command-line inputs run ``planner.cli.main``
in-process (exit 0, or exit 2 with one line ``error: ...`` on stderr; a traceback, exit 70, another
exit code, a half-written ``-o`` file, a batch output without one line per input line, an
out-of-range flag value accepted, or raw control characters on stderr are failures); a sample of
them also runs as ``python -m planner.cli`` processes. A call over 30 s is a hang; after three hangs
in a family its later calls get 5 s.

What users and attackers touch has its own families (``tests/fuzz_families_exports.py``,
``tests/fuzz_families_commands.py``, ``tests/fuzz_families_unicode.py``): ``export`` of plans with
injection payloads in one string each (the file, read as its trainer reads it and a Python script
run at top level with its imports stubbed, must have the shape of the export of the same plan with a
harmless string and make no marker file), ``import`` of mutated trainer files (no file opened that
only the file's header names), ``sweep``, ``train``, ``profile``, ``validate`` and ``fit`` with bad
values (``train``, ``profile`` and ``fit`` stop where ranks would start, measuring or fitting would
begin: such cases run in-process only), the public API with values of the wrong type, odd Unicode and
control characters in every document string (none may reach stdout raw), and Ctrl-C while ``plan``
starts (exit 130, one line).

Prints a table per family (inputs, accepted, rejected, exceptions, exit 70, hangs, multi-line
rejections, other rule breaks) and each family's distinct failures with the first input of each.
Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fuzz_families as ff  # noqa: E402
from tests import fuzz_families_commands as fc  # noqa: E402
from tests import fuzz_families_exports as fe  # noqa: E402
from tests import fuzz_families_unicode as fu  # noqa: E402
from tests import fuzz_runner as fr  # noqa: E402

IN_PROCESS = {**ff.IN_PROCESS, **fu.IN_PROCESS}
COMMAND_LINE = {**ff.COMMAND_LINE, **fe.COMMAND_LINE, **fc.COMMAND_LINE, **fu.COMMAND_LINE}
IN_PROCESS_COUNTS = {"plan-doc": 2500, "profile-doc": 2000, "hf-config": 2000, "cluster": 2000, "accelerator": 500,
                     "batch-line": 1000, "doc-unicode": 2500, "api-types": 1000}
CLI_COUNTS = {"cli-plan-file": 500, "cli-profile": 250, "cli-config": 300, "cli-cluster": 300, "cli-batch": 200,
              "cli-values": 300, "cli-output": 80, "cli-paths": 70, "export-injection": 1200, "import-injection": 800,
              "cli-unicode": 300, "cli-sweep": 200, "cli-train": 200, "cli-profile-command": 300, "cli-validate": 200,
              "cli-fit": 200, "cli-signals": 10}
SUBPROCESSES = 200
COLUMNS = ("inputs", "accepted", "rejected", "exception", "exit70", "hang", "multiline", "other")
HEAD = ("family", "inputs", "accepted", "rejected", "exception", "exit 70", "hang", "multi-line", "other",
        "ms/input", "max s")


class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0
        self.max_s = 0.0
        self.failures: list[tuple[fr.Case, fr.Outcome]] = []

    def add(self, case: fr.Case, out: fr.Outcome) -> None:
        self.counts["inputs"] += 1
        self.counts[out.kind] += 1
        self.seconds += out.seconds
        self.max_s = max(self.max_s, out.seconds)
        if not out.ok:
            self.failures.append((case, out))

    def row(self, name: str) -> list[str]:
        n = self.counts["inputs"]
        return [name, *(f"{self.counts[c]:,}" for c in COLUMNS),
                f"{1000 * self.seconds / n:.0f}" if n else "-", f"{self.max_s:.1f}"]


def run_family(name: str, gen, count: int, fz: fr.FuzzEnv, seed: int, verbose: bool) -> Tally:
    rnd = random.Random(f"{seed}/{name}")
    tally, budget = Tally(), fr.HangBudget()
    t0 = time.perf_counter()
    for i in range(count):
        case = gen(rnd, fz)
        case.notes.append(f"case {i} of {name}, seed {seed}")
        out = case.execute(budget.limit())
        budget.record(out)
        tally.add(case, out)
        if verbose and (i + 1) % 500 == 0:
            print(f"  {name}: {i + 1}/{count} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"{name}: {count} inputs in {time.perf_counter() - t0:.1f} s, {len(tally.failures)} failing",
          file=sys.stderr, flush=True)
    return tally


def run_subprocesses(count: int, fz: fr.FuzzEnv, seed: int, families: list[str]) -> dict[str, Tally]:
    """``count`` command-line inputs as ``python -m planner.cli`` processes, families in turn."""
    rnd = random.Random(f"{seed}/subprocess")
    tallies: dict[str, Tally] = {}
    budget = fr.HangBudget()
    t0 = time.perf_counter()
    done = 0
    while done < count and families:
        name = families[done % len(families)]
        case = COMMAND_LINE[name](rnd, fz)
        if not case.subprocess_ok:
            case.discard()
            continue
        case.notes.append(f"process {done}, seed {seed}")
        out = case.execute(budget.limit(), subprocess_mode=True)
        budget.record(out)
        tallies.setdefault(f"{name} (process)", Tally()).add(case, out)
        done += 1
    print(f"processes: {done} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return tallies


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="seed of every family's inputs (default 0)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the default counts (e.g. 0.05)")
    ap.add_argument("--families", default="", help="comma-separated families (default: all)")
    ap.add_argument("--subprocess", type=int, default=None, help=f"processes to run (default {SUBPROCESSES} x scale)")
    ap.add_argument("--show", type=int, default=8, help="distinct failures shown per family, each with its first input")
    ap.add_argument("--json", type=Path, default=None, help="also write every failure to this JSON file")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = ap.parse_args()

    wanted = [f for f in args.families.split(",") if f] or [*IN_PROCESS_COUNTS, *CLI_COUNTS]
    unknown = [f for f in wanted if f not in IN_PROCESS_COUNTS and f not in CLI_COUNTS]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join([*IN_PROCESS_COUNTS, *CLI_COUNTS])}")
    n_sub = args.subprocess if args.subprocess is not None else round(SUBPROCESSES * args.scale)

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardplan-fuzz-") as tmp:
        fz = fr.FuzzEnv(Path(tmp))
        fz.plans  # noqa: B018 (made once, before the clock of the first family)
        tallies: dict[str, Tally] = {}
        for name in wanted:
            gen = IN_PROCESS.get(name) or COMMAND_LINE[name]
            count = max(1, round({**IN_PROCESS_COUNTS, **CLI_COUNTS}[name] * args.scale))
            tallies[name] = run_family(name, gen, count, fz, args.seed, not args.quiet)
        cli_wanted = [f for f in wanted if f in CLI_COUNTS and f not in fc.NOT_AS_PROCESS]
        if n_sub and cli_wanted:
            tallies.update(run_subprocesses(n_sub, fz, args.seed, cli_wanted))
        wall = time.perf_counter() - t_start

        total = Tally()
        for t in tallies.values():
            total.counts.update(t.counts)
            total.seconds += t.seconds
            total.max_s = max(total.max_s, t.max_s)
            total.failures += t.failures
        in_proc = sum(t.counts["inputs"] for k, t in tallies.items() if k in IN_PROCESS_COUNTS)
        cli = sum(t.counts["inputs"] for k, t in tallies.items() if k in CLI_COUNTS)
        procs = sum(t.counts["inputs"] for k, t in tallies.items() if k.endswith("(process)"))

        print(f"shardplan input fuzzing: seed {args.seed}, scale {args.scale:g}: {in_proc:,} in-process inputs, "
              f"{cli:,} commands in-process, {procs:,} processes; {wall:.0f} s\n")
        rows = [list(HEAD)] + [t.row(k) for k, t in tallies.items()] + [total.row("total")]
        print(table(rows))

        failing = {k: t for k, t in tallies.items() if t.failures}
        print(f"\n{len(total.failures):,} failing input(s) in {len(failing)} famil{'y' if len(failing) == 1 else 'ies'}")
        for k, t in failing.items():
            print(f"\n== {k}: " + fr.report(t.failures, groups=args.show, width=400).replace("\n", "\n   "))
        if args.json:
            args.json.write_text(json.dumps([
                {"family": c.family, "target": c.target, "notes": c.notes, "argv": c.argv, "env": c.env,
                 "payload": c.payload.decode("utf-8", "backslashreplace") if c.payload is not None else None,
                 "kind": o.kind, "where": o.where, "detail": o.detail, "rc": o.rc, "seconds": o.seconds,
                 "signature": list(fr.signature(c, o))}
                for c, o in total.failures], indent=1))
    return 1 if total.failures else 0


if __name__ == "__main__":
    sys.exit(main())
