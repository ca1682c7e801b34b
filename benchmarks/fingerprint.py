"""A fingerprint of what the planner answers: plans, prices and exports of the headline jobs on every
target, their published configurations priced, and the published-run predictions.

    python benchmarks/fingerprint.py            # one hash per item, then the total
    python benchmarks/fingerprint.py --quick    # the 70B and Mixtral jobs only
    python benchmarks/fingerprint.py --numbers  # each plan's step, memory and mesh instead of hashes

A refactor that must not change a number is checked by running this before and after: every line
must be equal. Solver wall times are left out (they vary run to run); everything else of the plan
document, the export's text and each published row's predicted step and memory is hashed.
``--numbers`` prints what a change of the document's format (a schema version) leaves comparable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.published.runs import default_csv_path, load_published  # noqa: E402
from costmodel.published.validate import validate  # noqa: E402
from planner.api import plan as search  # noqa: E402
from planner.trainers import export  # noqa: E402
from vocab.errors import ShardplanError  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling scripts, after the packages
from target_jobs import JOBS, TARGETS, expert, exporter  # noqa: E402


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plan_doc(p: Any) -> dict[str, Any]:
    d = json.loads(p.model_dump_json())
    d["solver"].pop("time_s", None)
    d["solver"].get("options", {}).pop("wall_s", None)
    return d


def _numbers(p: Any) -> str:
    """A plan's step, peak memory and mesh."""
    from planner.compare import mesh_text

    return f"{p.predicted.step_time_s:.6g} s {p.predicted.memory_peak_gib:.5g} GiB {mesh_text(p.strategy)} mb{p.strategy.micro_batch}"


def job_items(job: str, numbers: bool = False) -> list[tuple[str, str]]:
    """The job's plan and export on each target, and its published configuration priced (``numbers``:
    the plans' step, memory and mesh, no exports)."""
    model, cluster, seq, gb = JOBS[job]
    out = []
    for target in (*TARGETS, "any"):
        try:
            p = search(model, cluster, seq, gb, target=target, top_k=3)
        except ShardplanError as e:
            out.append((f"{job} {target} plan", _digest(str(e))))
            continue
        out.append((f"{job} {target} plan", _numbers(p) if numbers else _digest(_plan_doc(p))))
        if target != "any" and not numbers:
            out.append((f"{job} {target} export", _digest(export(p, exporter(target)).text)))
    pub = expert(job)["plan"]
    out.append((f"{job} published", _numbers(pub) if numbers else _digest(_plan_doc(pub))))
    return out


def published_items() -> list[tuple[str, str]]:
    """Each published run's predicted step time and memory with the shipped constants."""
    rows, skipped = load_published(default_csv_path())
    report = validate(rows, skipped)
    preds = [(repr(p.row), p.predicted, p.predicted_tps, p.memory_gib) for p in report.predictions]
    return [("published predictions", _digest(preds))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 70B and Mixtral jobs only")
    ap.add_argument("--numbers", action="store_true", help="each plan's step, memory and mesh, not hashes")
    a = ap.parse_args()
    items = [] if a.numbers else published_items()
    for job in (("70b", "mixtral") if a.quick else JOBS):
        items += job_items(job, a.numbers)
    for name, h in items:
        print(f"{h}  {name}", flush=True)
    print(f"{_digest(items)}  total")


if __name__ == "__main__":
    main()
