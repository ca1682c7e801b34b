"""The MIP back-ends on the project's own instances: every integer program a search solves.

    python benchmarks/mip_backends.py                  # the 70B / 1,024 H100 searches
    python benchmarks/mip_backends.py --rounds 3       # medians of alternating rounds

Runs the searches once (MathOpt's HiGHS, the default) and keeps every model they solve: the
OSDP programs of the meshes without a pipeline (``full`` space) and the stage MIPs of the
pipelines (``staged`` space). Then solves each again with every back-end: ``highs`` (MathOpt's
HiGHS), ``highspy`` (HiGHS 1.16 directly), ``scip`` (MathOpt's GSCIP) and, measured only,
MathOpt's CP-SAT. Per back-end and
kind of program: total and largest seconds, and how many answers equal the default's (same status,
and the same objective within 1e-9 where there is one); an answer that differs is wrong: every
back-end is asked for a proven optimum.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from solvers.mip import Model  # noqa: E402
from vocab.strategy import Workload  # noqa: E402

BACKENDS = ("highs", "highspy", "scip", "cp-sat")
JOBS = {  # kind: (model, cluster, seq_len, global batch, space)
    "osdp": ("llama3-70b", "1024xh100", 8192, 1024, "full"),
    "stage MIP": ("llama3-70b", "1024xh100", 8192, 1024, "staged"),
}


def captured(job: tuple) -> list[tuple[Model, tuple, dict]]:
    """Every model the search solves, with the arguments of its solve."""
    model, cluster, seq, gb, space = job
    seen: list[tuple[Model, tuple, dict]] = []
    solve = Model.solve

    def spy(self: Model, *a, **k):  # type: ignore[no-untyped-def]
        seen.append((self, a, k))
        return solve(self, *a, **k)

    Model.solve = spy  # type: ignore[method-assign]
    try:
        search(load_model(model, seq), parse_cluster(cluster), Workload(seq_len=seq, global_batch=gb), space)
    finally:
        Model.solve = solve  # type: ignore[method-assign]
    return seen


def run(md: Model, args: tuple, kw: dict, backend: str) -> tuple[float, str, float]:
    """(seconds, status, objective) of one model under ``backend``."""
    offset, time_limit, cutoff, presolve = (list(args) + [None, None, None, True][len(args):])[:4]
    cutoff, presolve = kw.get("cutoff", cutoff), kw.get("presolve", presolve)
    t = time.perf_counter()
    try:
        if backend == "highspy":
            md.solver = "highspy"
            status, _, obj, _ = md.solve(offset, time_limit, cutoff, presolve)
        else:
            status, _, obj, _ = md.solve_mathopt(offset, time_limit, cutoff, presolve, solver=backend)
    except Exception as e:  # noqa: BLE001 (a back-end that fails is a finding, not a crash)
        return time.perf_counter() - t, f"error: {type(e).__name__}", float("nan")
    return time.perf_counter() - t, status, obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="rounds, alternating the back-ends' order")
    a = ap.parse_args()
    print(f"{'program':10s} {'back-end':14s} {'models':>6s} {'total s':>8s} {'max s':>7s} {'same':>5s} "
          f"{'wrong':>5s} {'errors':>6s}")
    for kind, job in JOBS.items():
        models = captured(job)
        times: dict[str, list[float]] = {b: [] for b in BACKENDS}
        worst: dict[str, float] = dict.fromkeys(BACKENDS, 0.0)
        same, wrong, errors = (dict.fromkeys(BACKENDS, 0) for _ in range(3))
        for r in range(a.rounds):
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            total = dict.fromkeys(BACKENDS, 0.0)
            for md, args, kw in models:
                answers = {}
                for b in order:
                    answers[b] = run(md, args, kw, b)
                    total[b] += answers[b][0]
                    worst[b] = max(worst[b], answers[b][0])
                ref = answers["highs"]
                if r == 0:
                    for b, (_, status, obj) in answers.items():
                        if status.startswith("error"):
                            errors[b] += 1
                        elif status == ref[1] and (obj == ref[2] or abs(obj - ref[2]) <= 1e-9 * abs(ref[2])):
                            same[b] += 1
                        else:
                            wrong[b] += 1
                md.solver = "highs"
            for b in BACKENDS:
                times[b].append(total[b])
        for b in BACKENDS:
            print(f"{kind:10s} {b:14s} {len(models):6d} {statistics.median(times[b]):8.2f} {worst[b]:7.2f} "
                  f"{same[b]:5d} {wrong[b]:5d} {errors[b]:6d}")


if __name__ == "__main__":
    main()
