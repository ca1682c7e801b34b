"""The headline plans' analogs trained in bf16 on 4 ranks, run after run; and a large model built on
the meta device, trained under FSDP2 and resumed from a checkpoint.

    python benchmarks/runtime_headline.py --runs 10 --docs     # the table, also into docs/runtime.md
    python benchmarks/runtime_headline.py --large gpt2-large   # meta build, 4 ranks, ZeRO-3, DCP resume

Analogs (:mod:`tests.headline_analogs`): each run is one launch of the four plans (``shardplan
train`` jobs on 4 local processes; gloo on CPU, NCCL on GPUs), bf16 against a bf16 run in one
process. Per analog: runs without failure, whether every run's losses are bit-identical, the largest
loss gap to one process against the tolerance (``runtime.train.parity_tolerance``), the median step
time, and rank 0's state bytes against the cost model's prediction.

Large (``--large``): a preset built on the meta device (each rank draws its FSDP2 shards), 2 steps
of ZeRO-3 on 4 ranks saved with torch.distributed.checkpoint, then a launch that resumes and trains
the third step, against a launch that trains 3 steps at once (same loss expected, bit for bit);
no single-process reference (the whole model would not fit beside the ranks).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.launch import Job, LaunchError, launch  # noqa: E402
from runtime.model import spec_for  # noqa: E402
from runtime.train import TrainSettings  # noqa: E402
from tests.headline_analogs import ANALOGS, WORLD  # noqa: E402
from tests.runtime_checks import predicted_state_bytes, state_bytes  # noqa: E402
from vocab.io import write_atomic  # noqa: E402
from vocab.strategy import LayerStrategy as L  # noqa: E402
from vocab.strategy import Mesh, Strategy  # noqa: E402

BF16 = TrainSettings(steps=3, global_batch=8, seq_len=32, seed=0, precision="bf16")
BEGIN, END = "<!-- runtime_headline:begin -->", "<!-- runtime_headline:end -->"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def analogs(runs: int) -> list[dict[str, Any]]:
    """Each analog's outcome over ``runs`` launches."""
    seen: dict[str, dict[str, Any]] = {n: {"failed": [], "losses": [], "gaps": [], "times": [], "bytes": None}
                                       for n in ANALOGS}
    for k in range(runs):
        jobs = [Job(model=spec_for(m, init="seeded"), plan_json=s.model_dump_json(), settings=BF16.to_dict(),
                    name=n, reference=True) for n, (m, s, _) in ANALOGS.items()]
        try:
            results = launch(jobs, WORLD)
        except LaunchError as e:  # one failing job ends the launch: every analog counts it
            for n in ANALOGS:
                seen[n]["failed"].append(f"run {k}: {e}")
            continue
        for r in results:
            x = seen[r["name"]]
            got = [st["loss"] for st in r["steps"]]
            x["losses"].append(got)
            x["gaps"].append(max(abs(a - b) / abs(b) for a, b in zip(got, r["reference_losses"], strict=True)))
            x["rtol"] = r["parity_rtol"]
            x["times"] += [st["step_time_s"] for st in r["steps"][1:]]
            x["bytes"] = state_bytes(r)[0]
        print(f"run {k + 1}/{runs} done", flush=True)
    rows = []
    for n, x in seen.items():
        model, s, what = ANALOGS[n]
        rows.append({"analog": n, "model": model, "features": what, "runs": runs, "failures": len(x["failed"]),
                     "identical": len({tuple(v) for v in x["losses"]}) <= 1, "max_gap": max(x["gaps"], default=None),
                     "rtol": x.get("rtol"), "step_s": statistics.median(x["times"]) if x["times"] else None,
                     "bytes": x["bytes"], "predicted": predicted_state_bytes(model, s, WORLD, BF16)[0],
                     "losses": x["losses"][0] if x["losses"] else None, "why": x["failed"][:1]})
    return rows


def table(rows: list[dict[str, Any]], stamp: str) -> str:
    out = [f"`python benchmarks/runtime_headline.py --runs {rows[0]['runs']} --docs` (commit {stamp}; tiny reference "
           f"models, {WORLD} CPU ranks, gloo, bf16 against bf16 in one process, {BF16.steps} steps, seq "
           f"{BF16.seq_len}, global batch {BF16.global_batch}; bytes: rank 0's params, grads, optimizer).", "",
           "| analog of | model | features kept | runs / failures | losses run to run | largest loss gap (tolerance) "
           "| step s | rank 0 bytes measured | predicted |", "|---|---|---|---|---|---|---:|---|---|"]
    for r in rows:
        gap = "-" if r["max_gap"] is None else f"{r['max_gap']:.2e} ({r['rtol']:g})"
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        got = "-" if r["bytes"] is None else ", ".join(f"{b:,}" for b in r["bytes"])
        out.append(f"| {r['analog']} | {r['model']} | {r['features']} | {r['runs']} / {r['failures']} | "
                   f"{'identical' if r['identical'] else 'DIFFER'} | {gap} | {step} | {got} | "
                   f"{', '.join(f'{b:,}' for b in r['predicted'])} |")
    return "\n".join(out)


def write_docs(text: str) -> None:
    doc = ROOT / "docs" / "runtime.md"
    old = doc.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, old, flags=re.S) if BEGIN in old \
        else old.rstrip("\n") + "\n\n" + block + "\n"
    write_atomic(doc, new)


def large(model: str, steps: int = 2, seq_len: int = 64, global_batch: int = 4) -> dict[str, Any]:
    """``model`` built on meta, ZeRO-3 on 4 ranks: 3 steps at once, against 2 steps, a checkpoint and
    a resumed third step."""
    s = Strategy(mesh=Mesh(dp_shard=WORLD), default=L(sharding="zero3"), micro_batch=global_batch // WORLD)
    spec = spec_for(model, init="seeded")

    def job(n: int, **kw: Any) -> Job:
        st = TrainSettings(steps=n, global_batch=global_batch, seq_len=seq_len, seed=0, **kw)
        return Job(model=spec, plan_json=s.model_dump_json(), settings=st.to_dict(), name=f"{model}/{n}")

    from profiler.transformer import build_graph
    from runtime.model import resolve_config

    out: dict[str, Any] = {"model": model, "params": build_graph(resolve_config(model), 1).total_params}
    with tempfile.TemporaryDirectory() as tmp:
        ck = str(Path(tmp) / "ck")
        t0 = time.perf_counter()
        whole = launch([job(steps + 1)], WORLD, watchdog_s=0)[0]
        t1 = time.perf_counter()
        saved = launch([job(steps, save=ck)], WORLD, watchdog_s=0)[0]
        ck_bytes = sum(f.stat().st_size for f in Path(ck).iterdir())
        t2 = time.perf_counter()
        resumed = launch([job(1, resume=ck)], WORLD, watchdog_s=0)[0]
        t3 = time.perf_counter()
    out.update(losses=[st["loss"] for st in whole["steps"]], saved=[st["loss"] for st in saved["steps"]],
               resumed=[(st["step"], st["loss"]) for st in resumed["steps"]], checkpoint_bytes=ck_bytes,
               wall_s=[round(t1 - t0), round(t2 - t1), round(t3 - t2)],
               peak_rss=[r["peak_bytes"] for r in whole["steps"][-1]["ranks"]],
               state=[(r["param_bytes"], r["grad_bytes"], r["optim_bytes"]) for r in whole["steps"][-1]["ranks"]])
    out["same_loss"] = out["resumed"] == [(steps, out["losses"][steps])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=0, help="launches of the four analogs")
    ap.add_argument("--docs", action="store_true", help="write the analogs' table into docs/runtime.md")
    ap.add_argument("--large", help="a preset to build on meta and resume from a checkpoint (e.g. gpt2-large)")
    args = ap.parse_args()
    if args.runs:
        text = table(analogs(args.runs), _commit())
        print(text)
        if args.docs:
            write_docs(text)
    if args.large:
        print(large(args.large))


if __name__ == "__main__":
    main()
