"""Close the loop on this CPU: profile, plan, run; predicted vs measured step time and memory.

    python benchmarks/close_the_loop.py [--profile P.json] [--work DIR] [--json]

1. Profile: ``shardplan profile compute --device cpu --quick --dtype fp32`` (``OMP_NUM_THREADS=1``,
   the runtime's per-rank thread count) and ``shardplan profile comm --nproc 4 --backend gloo
   --quick``, merged into one file, measured afresh into the work directory on every run (a profile
   already there is never reused); ``--profile P`` reuses P.
2. Model: a gpt2-shaped config (HF ``config.json`` keys) that ``shardplan train`` builds. The cost
   model gets the graph of what the runtime runs: SDPA attention, no dropout (the gpt2 loader says
   ``eager``; the runtime always runs SDPA). fp32 throughout.
3. Baselines (DDP, FSDP everywhere, TP2xDP2, PP2xDP2) priced with ``estimate(..., profile)``; the
   memory limit is set between the two hungriest baselines' predicted peaks, so that at least one is
   excluded; ``planner.api.plan`` plans under it.
4. Every plan runs ``shardplan train --nproc 4 --steps N --json``, ``--repeats`` times (default 4),
   round robin over the plans, every other round in reverse order (A B C, C B A, A B C, ...): with an
   even number of rounds every plan's launches sit at the same mean time, so a drift of the host's
   speed that is linear over the run cancels. A launch's figure is the median of its steps after
   the first, leaving out the step whose memory was tracked; a plan's the mean of its launches'. A
   pair of plans counts as told apart when their difference exceeds the sum of their spreads (each
   the larger of a launch's half-range and half the range between its launches' medians). Each
   launch also gives how busy the cores were: the ranks' CPU time over the step's wall time and the
   host's cores (the model's pipelines on shared cores assume they stay busy). Memory
   compared: predicted tensor memory (worst stage's params + grads + optimizer + activations +
   buffers, *without* the context/fragmentation overhead) against the measured peak of live tensor bytes (the runtime's
   ``tensor_peak_bytes``: what ``torch.cuda.max_memory_allocated`` reports on a GPU, counted op by op
   on CPU). Also shown: peak RSS minus the baseline RSS of the same launch path (tiny-gpt under the
   same mesh, less its own predicted tensor memory), which adds what is not a tensor (gloo buffers,
   allocator slack). A plan fits (measured) when the measured tensor peak + the predicted overhead
   stays under the limit.
5. A comparison column (``plain``) re-prices without the CPU physics the accelerator file gives
   (``cpu.yaml``: no communication/computation overlap under gloo, a process-sized context, ranks
   sharing the host's cores): what the model predicts without them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from costmodel.constants import constants_for
from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.report import Report
from planner.api import plan as make_plan
from profiler.hardware import parse_cluster
from profiler.models import resolve_config
from profiler.profile_schema import Profile, load_profile
from profiler.transformer import build_graph
from runtime.model import resolve_config as runtime_config
from runtime.plans import hand_plan
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

MIB = 1024**2
NPROC = 4


def sh(cmd: list[str], env: dict[str, str] | None = None, quiet: bool = False) -> None:
    print(f"[load {os.getloadavg()[0]:.1f}] $", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL if quiet else sys.stderr)


def get_profile(path: Path) -> Profile:
    if not path.exists():
        sh(["shardplan", "profile", "compute", "--device", "cpu", "--quick", "--dtype", "fp32", "-o", str(path),
            "--no-progress"], env={"OMP_NUM_THREADS": "1"})
        sh(["shardplan", "profile", "comm", "--nproc", str(NPROC), "--backend", "gloo", "--quick", "-o", str(path),
            "--merge", "--no-progress"])
    return load_profile(path)


def baselines(gb: int) -> dict[str, Strategy]:
    rep, z3 = LayerStrategy(sharding="replicate"), LayerStrategy(sharding="zero3")
    return {
        "DDP": Strategy(mesh=Mesh(dp_shard=4), micro_batch=gb // 4, default=rep),
        "FSDP": Strategy(mesh=Mesh(dp_shard=4), micro_batch=gb // 4, default=z3),
        "TP2xDP2": Strategy(mesh=Mesh(dp_shard=2, tp=2), micro_batch=gb // 2, default=rep),
        "PP2xDP2": Strategy(mesh=Mesh(pp=2, dp_shard=2), micro_batch=1, schedule="1f1b", default=rep),
    }


def tensor_bytes(r: Report) -> float:
    """Worst stage's predicted tensor memory: the peak without the context/fragmentation overhead."""
    return max(st.total - st.overhead for st in r.stages)


def state_bytes(r: Report) -> int:
    return max(st.param_bytes + st.grad_bytes + st.optim_bytes for st in r.stages)


def train(model: str, plan_json: str, path: Path, steps: int) -> dict[str, Any]:
    path.with_suffix(".plan.json").write_text(plan_json)
    out = path.with_suffix(".train.json")
    load = os.getloadavg()[0]
    sh(["shardplan", "train", "--model", model, "--plan", str(path.with_suffix(".plan.json")), "--nproc", str(NPROC),
        "--steps", str(steps), "--json", "-o", str(out)], env={"OMP_NUM_THREADS": "1"}, quiet=True)
    rep = json.loads(out.read_text())
    last = rep["steps"][-1]["ranks"]
    timed = [s for s in rep["steps"][1:] if not s.get("memory_tracked")] or rep["steps"][:1]
    times = [s["step_time_s"] for s in timed]
    tracked = [r["tensor_peak_bytes"] for s in rep["steps"] if s.get("memory_tracked") for r in s["ranks"]]
    busy = statistics.median(sum(r["cpu_time_s"] for r in s["ranks"]) / s["step_time_s"] for s in timed)
    return {"step_time_s": statistics.median(times), "load_before": load, "cores_busy": busy / (os.cpu_count() or 1),
            "step_times_s": [s["step_time_s"] for s in rep["steps"]], "timed_s": times,
            "step_spread_s": (max(times) - min(times)) / 2,
            "peak_bytes": max(r["peak_bytes"] for r in last),
            "tensor_peak_bytes": max(tracked) if tracked else None,
            "state_bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in last)}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One plan's repeated launches as one measurement: the mean of the launches' medians (under the
    alternating round robin a linear drift of the host cancels in it); the spread the larger of the
    launches' own half-range (median over launches) and half the range of their medians (the host's
    drift between launches); memory from the first launch (tensor bytes are the same in every
    launch)."""
    meds = [r["step_time_s"] for r in runs]
    out = dict(runs[0])
    out["step_time_s"] = statistics.mean(meds)
    out["cores_busy"] = statistics.mean(r["cores_busy"] for r in runs)
    out["step_spread_s"] = max((max(meds) - min(meds)) / 2, statistics.median(r["step_spread_s"] for r in runs))
    out["launch_medians_s"] = meds
    out["step_times_s"] = [t for r in runs for t in r["step_times_s"]]
    return out


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else 1.0


def pairwise(a: list[float], b: list[float], spread: list[float] | None = None) -> tuple[float, int]:
    """(share of pairs ordered alike by ``a`` and ``b``, how many pairs); with ``spread`` (each
    measurement's half-range over its steps) only the pairs whose measured difference exceeds
    their two spreads: plans the measurement cannot tell apart have no order to agree with."""
    pairs = [(i, j) for i in range(len(a)) for j in range(i + 1, len(a))
             if spread is None or abs(b[i] - b[j]) > spread[i] + spread[j]]
    return sum((a[i] < a[j]) == (b[i] < b[j]) for i, j in pairs) / max(1, len(pairs)), len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--profile", type=Path, default=None, help="profile to reuse (measured and written if missing)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/shardplan-close-the-loop"),
                    help="plans, train reports, profile, results.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=4,
                    help="launches per plan, round robin over the plans, every other round reversed (the host's "
                         "speed drifts; an even number cancels a linear drift)")
    ap.add_argument("--memory-limit", type=float, default=None, help="GiB (default: excludes the hungriest baseline)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.profile is None:
        a.profile = a.work / "profile.json"
        a.profile.unlink(missing_ok=True)  # measured afresh: never a profile already in the work directory
    prof = get_profile(a.profile)
    cfg_path = a.work / "gpt-small.json"
    cfg_path.write_text(json.dumps({"model_type": "gpt2", "n_layer": a.layers, "n_embd": a.hidden, "n_head": a.heads,
                                    "vocab_size": a.vocab, "n_positions": a.seq_len, "resid_pdrop": 0.0}))
    model = str(cfg_path)
    cfg = replace(resolve_config(model), attention_impl="flash", dropout=0.0)  # what the runtime runs
    graph = build_graph(cfg, a.seq_len)
    cluster = parse_cluster(f"{NPROC}xcpu")
    w = Workload(seq_len=a.seq_len, global_batch=a.global_batch, precision="fp32")
    plain_dev = DeviceModel(cluster, prof, constants_for(cluster.accelerator.name))
    plain_dev.share = 1.0  # each rank a whole device, GPU overlap constants
    share = DeviceModel(cluster, prof).share

    strategies = baselines(a.global_batch)
    reports = {n: estimate(graph, cluster, s, w, profile=prof) for n, s in strategies.items()}
    peaks = sorted((r.memory_peak_gib for r in reports.values()), reverse=True)
    limit = a.memory_limit or (peaks[0] + peaks[1]) / 2
    planned = make_plan(cfg, cluster, a.seq_len, a.global_batch, memory_limit_gib=limit, precision="fp32",
                        profile=a.profile)
    planned.inputs.model = model  # the runtime builds it from the config file (same architecture)
    strategies = {"planned": planned.strategy, **strategies}
    reports = {n: estimate(graph, cluster, s, w, profile=prof, memory_limit_gib=limit) for n, s in strategies.items()}
    plan_docs = {n: hand_plan(model, s, a.seq_len, a.global_batch).to_json() for n, s in strategies.items()}
    plan_docs["planned"] = planned.to_json()

    tiny_graph = build_graph(runtime_config("tiny-gpt"), 32)
    tiny_w = Workload(seq_len=32, global_batch=a.global_batch, precision="fp32")

    def baseline_rss(name: str, s: Strategy) -> float:
        """Peak RSS of tiny-gpt under the same strategy (same imports, process groups, code path),
        less its predicted tensor memory: what a rank holds that is not the model's tensors."""
        if len(s.layers) or s.stage_layers:  # per-unit entries name this model's blocks; keep the mesh
            s = s.model_copy(update={"layers": [], "stage_layers": None})
        m = train("tiny-gpt", hand_plan("tiny-gpt", s, 32, a.global_batch).to_json(), a.work / f"base-{name}", 2)
        return m["peak_bytes"] - tensor_bytes(estimate(tiny_graph, cluster, s, tiny_w, profile=prof))

    rows: list[dict[str, Any]] = []
    twin = next((m for m, t in strategies.items() if m != "planned" and t == strategies["planned"]), None)
    names = list(strategies)
    first_of = {n: next(m for m in names if strategies[m] == strategies[n]) for n in names}
    runs: dict[str, list[dict[str, Any]]] = {}
    failed: set[str] = set()
    for rep in range(a.repeats):  # round robin, alternating: drift in the host's speed falls on every plan alike
        for n in names if rep % 2 == 0 else names[::-1]:
            if first_of[n] != n or n in failed:
                continue
            try:
                runs.setdefault(n, []).append(train(model, plan_docs[n], a.work / (n if rep == 0 else f"{n}-{rep}"), a.steps))
            except subprocess.CalledProcessError as e:
                print(f"error: {n} did not run ({e})", file=sys.stderr)
                failed.add(n)
    measured = {n: pooled(runs[first_of[n]]) for n in names if first_of[n] not in failed}
    for n, s in strategies.items():
        if n not in measured:
            continue
        same = first_of[n] if first_of[n] != n else None
        r, m = reports[n], measured[n]
        plain = estimate(graph, cluster, s, w, device=plain_dev)
        base = measured[same]["baseline_rss"] if same else baseline_rss(n, s)
        m["baseline_rss"] = base
        net = m["peak_bytes"] - base
        pred_net = tensor_bytes(r)
        meas_t = m["tensor_peak_bytes"]
        overhead = r.memory_peak_gib * 1024**3 - pred_net
        rows.append({"plan": n, "strategy": json.loads(s.model_dump_json()), "same_as": same,
                     "pred_step_s": r.step_time_s, "meas_step_s": m["step_time_s"],
                     "step_err": r.step_time_s / m["step_time_s"] - 1, "plain_step_s": plain.step_time_s,
                     "plain_step_err": plain.step_time_s / m["step_time_s"] - 1,
                     "pred_mem_mib": pred_net / MIB, "meas_mem_mib": meas_t / MIB, "mem_err": pred_net / meas_t - 1,
                     "meas_rss_net_mib": net / MIB, "rss_err": pred_net / net - 1,
                     "pred_state_mib": state_bytes(r) / MIB, "meas_state_mib": m["state_bytes"] / MIB,
                     "pred_peak_gib": r.memory_peak_gib, "baseline_rss_mib": base / MIB,
                     "load_before": m["load_before"], "meas_peak_rss_mib": m["peak_bytes"] / MIB,
                     "fits_pred": r.fits, "fits_meas": (meas_t + overhead) / 1024**3 <= limit,
                     "pred_time": r.to_dict()["time"], "plain_time": plain.to_dict()["time"],
                     "step_times_s": m["step_times_s"], "step_spread_s": m["step_spread_s"],
                     "launch_medians_s": m["launch_medians_s"], "cores_busy": m["cores_busy"]})
    pred = [x["pred_step_s"] for x in rows]
    meas = [x["meas_step_s"] for x in rows]
    spread = [x["step_spread_s"] for x in rows]
    plain_pred = [x["plain_step_s"] for x in rows]
    fitting = [x for x in rows if x["fits_meas"]]
    fastest = min(fitting or rows, key=lambda x: x["meas_step_s"])
    resolved, n_resolved = pairwise(pred, meas, spread)
    summary = {"model": model, "config": cfg.to_dict(), "params": graph.total_params, "workload": w.model_dump(),
               "memory_limit_gib": limit, "core_share": share,
               "profile_threads": prof.device.threads, "load_avg": os.getloadavg(),
               "spearman": spearman(pred, meas), "pairwise_agreement": pairwise(pred, meas)[0],
               "resolved_pairwise_agreement": resolved, "resolved_pairs": n_resolved,
               "plain_spearman": spearman(plain_pred, meas), "plain_pairwise_agreement": pairwise(plain_pred, meas)[0],
               "fastest_measured": fastest["plan"], "any_fits_measured": bool(fitting),
               "planned_twin": twin, "planned_is_fastest": fastest["plan"] in ("planned", twin), "rows": rows}
    (a.work / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"\n{cfg.name}: {graph.total_params / 1e6:.1f}M params, seq {a.seq_len}, global batch {a.global_batch}, "
          f"fp32, {NPROC} ranks on {os.cpu_count()} cores; limit {limit:.3f} GiB; load {os.getloadavg()[0]:.2f}")
    waits = [f.wait_s for f in prof.comm if f.wait_s > 0]
    print(f"profile: collective wait {1e3 * max(waits, default=0.0):.2f} ms, sharing efficiency "
          f"{min((f.sharing_efficiency for f in prof.comm), default=1.0):.3f}, CPU share per rank {share:.3f}")
    print(f"{'plan':<9}{'pred s':>8}{'meas s':>8}{'err':>6}{'plain s':>8}{'err':>6}"
          f"{'pred MiB':>9}{'meas MiB':>9}{'err':>6}{'RSS net':>8}{'err':>6}{'state':>7}{'base':>6}{'fits p/m':>9}"
          f"{'load':>6}{'busy':>6}")
    for x in rows:
        print(f"{x['plan']:<9}{x['pred_step_s']:>8.3f}{x['meas_step_s']:>8.3f}{x['step_err']:>6.0%}"
              f"{x['plain_step_s']:>8.3f}{x['plain_step_err']:>6.0%}{x['pred_mem_mib']:>9.0f}{x['meas_mem_mib']:>9.0f}"
              f"{x['mem_err']:>6.0%}{x['meas_rss_net_mib']:>8.0f}{x['rss_err']:>6.0%}"
              f"{x['pred_state_mib'] / x['meas_state_mib'] - 1:>7.0%}{x['baseline_rss_mib']:>6.0f}"
              f"{'yes' if x['fits_pred'] else 'no':>5}/{'yes' if x['fits_meas'] else 'no':<3}{x['load_before']:>6.1f}"
              f"{x['cores_busy']:>6.0%}")
    print("each launch's median step (s): " + "; ".join(
        f"{x['plan']} " + " ".join(f"{t:.3f}" for t in x["launch_medians_s"]) for x in rows))
    print(f"planned = {planned.strategy.mesh.axes()} {planned.strategy.default.sharding} mb "
          f"{planned.strategy.micro_batch} {planned.strategy.schedule}, {len(planned.strategy.layers)} per-unit "
          f"entries; same as {twin or 'no baseline'}")
    print(f"ranking: spearman {summary['spearman']:.2f}, pairwise {summary['pairwise_agreement']:.0%} "
          f"(plain: {summary['plain_spearman']:.2f}, {summary['plain_pairwise_agreement']:.0%}); "
          f"pairs the measurement tells apart: {summary['resolved_pairwise_agreement']:.0%} of "
          f"{summary['resolved_pairs']}; fastest measured "
          f"{'that fits' if fitting else '(none fits when measured)'}: {fastest['plan']}; "
          f"planned is fastest: {summary['planned_is_fastest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
