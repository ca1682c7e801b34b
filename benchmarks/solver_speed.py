"""How fast the searches are: vectorized pricing throughput and full-space plans at scale.

    python benchmarks/solver_speed.py              # everything
    python benchmarks/solver_speed.py --cases 70b  # one case
    python benchmarks/solver_speed.py --rounds 3   # medians of 3 rounds
    python benchmarks/solver_speed.py --space staged  # every unit of a pipeline its own sharding
    python benchmarks/solver_speed.py --against /tmp/old  # side by side with another checkout
    python benchmarks/solver_speed.py --targets --rounds 3  # the plan command per case and target

Per case: the search (``solvers.hybrid.search``, in this process) and the whole ``shardplan plan``
command (a fresh process: start-up, search, tie-break, writing the plan), medians of ``--rounds``.
``--against DIR`` runs every measurement in a fresh process per checkout (this one and DIR, a git
worktree of another commit), alternating which goes first, ``--rounds`` times, and prints the
medians and their ratio: the host's drift hits both alike.

Targets (full space, default memory): search <= 2.0 s and command <= 2.5 s for every case: Llama-3
70B on 1,024 H100 (and its shape with 16 layers: no slower than with 80), GPT-3 175B on 1,024
A100-80GB, Mixtral 8x22B on 256 H100, Llama-3.1 405B on 16,384 H100 and on 131,072 GB200 (on
1,048,576 GB200: search and command <= 4 s);
uniform-plan pricing >= 1,000,000 candidates/s for an 80-layer model; ``shardplan --help`` and
``shardplan models`` under 0.3 s (``--startup``: fresh processes, medians of ``--rounds``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costmodel.vectorized import price_grid  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.models import load_model  # noqa: E402
from solvers.hybrid import search  # noqa: E402
from solvers.space import SPACES, mesh_configs  # noqa: E402
from vocab.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Workload  # noqa: E402

CASES = {  # name: (model, cluster, seq_len, global batch, target seconds)
    "70b": ("llama3-70b", "1024xh100", 8192, 1024, 2.0),
    "70b-16l": (str(Path(__file__).resolve().parent / "data" / "llama3-70b-16-layers.json"), "1024xh100", 8192, 1024,
                2.0),
    "175b": ("gpt3-175b", "1024xa100-80gb", 2048, 1536, 2.0),
    "mixtral": ("mixtral-8x22b", "256xh100", 4096, 512, 2.0),
    "405b": ("llama3.1-405b", "16384xh100", 8192, 2048, 2.0),
    "405b-gb200": ("llama3.1-405b", "131072xgb200", 8192, 16384, 2.0),
    "405b-1m": ("llama3.1-405b", "1048576xgb200", 8192, 16384, 4.0),
}
COMMAND_TARGET = 2.5
#: cases whose whole command has another target (seconds)
COMMAND_TARGETS = {"405b-1m": 4.0}


def command_target(name: str) -> float:
    return COMMAND_TARGETS.get(name, COMMAND_TARGET)


def vectorized_throughput(n_configs: int = 4000) -> float:
    g, cl = load_model("llama3-70b", 8192), parse_cluster("1024xh100")
    w = Workload(seq_len=8192, global_batch=1024)
    configs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))[:n_configs]
    options = [
        LayerStrategy(sharding=a, recompute=b, offload=c)  # type: ignore[arg-type]
        for a, b, c in itertools.product(SHARDINGS, RECOMPUTES, OFFLOADS)
    ]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        gr = price_grid(g, cl, w, configs, options)
        best = min(best, time.perf_counter() - t0)
    rate = gr.size / best
    print(
        f"vectorized pricing, {g.model_id} ({g.num_blocks} layers): {gr.size:,} candidates in {best:.2f} s = "
        f"{rate:,.0f} candidates/s (target >= 1,000,000: {'met' if rate >= 1e6 else 'MISSED'})"
    )
    return rate


def run_case(name: str, space: str = "full", rounds: int = 1) -> float:
    model, cluster, seq, gb, target = CASES[name]
    g, cl = load_model(model, seq), parse_cluster(cluster)
    w = Workload(seq_len=seq, global_batch=gb)
    walls, cmds = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = search(g, cl, w, space, top_k=5)
        walls.append(time.perf_counter() - t0)
        cmds.append(_command(ROOT, CASES[name], space, default_limit=True))
    wall, cmd = statistics.median(walls), statistics.median(cmds)
    s = r.best.strategy
    mesh = " ".join(f"{k}={v}" for k, v in s.mesh.axes().items() if v > 1) + (
        f" ep={s.mesh.ep}" if s.mesh.ep > 1 else ""
    )
    met = "met" if wall <= target and cmd <= command_target(name) else "MISSED"
    print(
        f"{name:10s} {Path(model).stem if model.endswith('.json') else model} on {cluster} [{space}]: search {wall:5.2f} s, command {cmd:5.2f} s "
        f"(targets {target:g} / {command_target(name):g} s: {met})"
        f" | {r.status}, step {r.objective:.3f} s, MFU {r.best.report.mfu:.1%}, "
        f"{r.options['configurations']:,} meshes, {r.options['configurations_priced']:,} priced, "
        f"{r.candidates:,} candidates | {mesh} "
        f"mb={s.micro_batch} {s.schedule}{'/vpp' + str(s.vpp) if s.vpp > 1 else ''} {s.default.sharding} "
        f"recompute={s.default.recompute} (+{len(s.layers)} entries) [{r.solver}, {r.best.family}]"
    )
    return wall


ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import json, sys, time, itertools
sys.path.insert(0, {root!r})
from profiler.hardware import parse_cluster
from profiler.models import load_model
try:
    from vocab.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Workload
except ImportError:  # a checkout from before the vocab package
    from costmodel.strategy import OFFLOADS, RECOMPUTES, SHARDINGS, LayerStrategy, Workload
g, cl = load_model({model!r}, {seq}), parse_cluster({cluster!r})
w = Workload(seq_len={seq}, global_batch={gb})
if {space!r} == "grid":
    from costmodel.vectorized import price_grid
    from solvers.space import SPACES, mesh_configs
    configs = list(mesh_configs(g, cl, w, SPACES["hybrid"]))[:4000]
    options = [LayerStrategy(sharding=a, recompute=b, offload=c) for a, b, c in itertools.product(SHARDINGS, RECOMPUTES, OFFLOADS)]
    times = []
    for _ in range(3):
        t = time.perf_counter(); gr = price_grid(g, cl, w, configs, options); times.append(time.perf_counter() - t)
    print(json.dumps({{"seconds": min(times), "rate": gr.size / min(times), "objective": float(gr.step_time_s.min())}}))
else:
    from solvers.hybrid import search
    limit = cl.accelerator.hbm_gb * 1e9 / 2**30  # one limit for every checkout (defaults differ between them)
    t = time.perf_counter(); r = search(g, cl, w, {space!r}, limit, top_k=5); t = time.perf_counter() - t
    print(json.dumps({{"seconds": t, "objective": r.objective, "status": r.status}}))
"""


def _probe(root: Path, case: tuple, space: str) -> dict:
    model, cluster, seq, gb = case[:4]
    code = _PROBE.format(root=str(root), model=model, cluster=cluster, seq=seq, gb=gb, space=space)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _command(root: Path, case: tuple, space: str, default_limit: bool = False, target: str | None = None) -> float:
    """Wall seconds of the whole ``shardplan plan`` command (start-up, search, writing the plan);
    ``default_limit``: the command's own memory limit, else the accelerator's label (one limit for
    checkouts whose defaults differ); ``target``: ``--target`` (else the default)."""
    model, cluster, seq, gb = case[:4]
    limit = [] if default_limit else ["--memory-limit", str(parse_cluster(cluster).accelerator.hbm_gb * 1e9 / 2**30)]
    limit += ["--target", target] if target else []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--model", model, "--cluster", cluster,
                        "--seq-len", str(seq), "--global-batch", str(gb), "--space", space, *limit,
                        "-o", str(Path(tmp) / "p.json")], capture_output=True, cwd=root, check=True,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
        return time.perf_counter() - t


def compare(other: Path, names: list[str], space: str, rounds: int) -> None:
    """Every case and the pricing throughput in this checkout and ``other``, alternating."""
    cases = [("grid", CASES["70b"], "grid")] + [(n, CASES[n], space) for n in names]
    print(f"this checkout {ROOT} against {other}; {rounds} rounds, alternating; medians")
    print(f"{'case':10s} {'this':>9s} {'other':>9s} {'ratio':>7s}  {'this cmd':>9s} {'other cmd':>9s}  same result")
    for name, case, sp in cases:
        mine, theirs, cmd_mine, cmd_theirs = [], [], [], []
        for k in range(rounds):
            order = [(ROOT, mine, cmd_mine), (other, theirs, cmd_theirs)]
            for root, acc, cmds in (order if k % 2 == 0 else order[::-1]):
                res = _probe(root, case, sp)
                acc.append(res)
                if sp != "grid":
                    cmds.append(_command(root, case, sp))
        same = all(abs(a["objective"] - b["objective"]) <= 1e-9 * abs(b["objective"]) for a, b in zip(mine, theirs, strict=True))
        t_m = statistics.median(r["seconds"] for r in mine)
        t_o = statistics.median(r["seconds"] for r in theirs)
        if sp == "grid":
            rate_m = statistics.median(r["rate"] for r in mine)
            rate_o = statistics.median(r["rate"] for r in theirs)
            print(f"{'pricing':10s} {rate_m:9,.0f} {rate_o:9,.0f} {rate_m / rate_o:7.2f}  candidates/s (80 layers), "
                  f"cheapest step equal: {same}")
            continue
        c_m, c_o = statistics.median(cmd_mine), statistics.median(cmd_theirs)
        print(f"{name:10s} {t_m:8.2f}s {t_o:8.2f}s {t_m / t_o:7.2f}  {c_m:8.2f}s {c_o:8.2f}s  {same}")


STARTUP_TARGET = 0.3


def per_target(names: list[str], targets: list[str], rounds: int) -> None:
    """The whole ``plan`` command per case and target (medians of ``rounds`` fresh processes, the
    targets' order alternating round by round), as a markdown table; a case none of whose plans fits
    a target is ``no plan``."""
    print(f"| case | {' | '.join(targets)} |")
    print("|---|" + "---:|" * len(targets))
    for name in names:
        walls: dict[str, list[float]] = {t: [] for t in targets}
        for k in range(rounds):
            for t in (targets if k % 2 == 0 else targets[::-1]):
                try:
                    walls[t].append(_command(ROOT, CASES[name], "full", default_limit=True, target=t))
                except subprocess.CalledProcessError:
                    walls[t].append(float("nan"))
        cells = []
        for t in targets:
            w = statistics.median(walls[t])
            cells.append("no plan" if w != w else f"{w:.2f}" + ("" if w <= command_target(name) else " (over)"))
        print(f"| {name} | {' | '.join(cells)} |")


def startup(rounds: int) -> None:
    """Wall seconds of ``shardplan --help`` and ``shardplan models`` in fresh processes."""
    import shutil

    exe = shutil.which("shardplan")
    base = [exe] if exe else [sys.executable, "-m", "planner.cli"]
    for args in (["--help"], ["models"]):
        walls = []
        for _ in range(max(rounds, 3)):
            t0 = time.perf_counter()
            subprocess.run(base + args, cwd=ROOT, check=True, capture_output=True)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        print(f"shardplan {' '.join(args):8s}: {wall:.2f} s (median of {len(walls)}; target {STARTUP_TARGET:g} s: "
              f"{'met' if wall <= STARTUP_TARGET else 'MISSED'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--no-vectorized", action="store_true")
    ap.add_argument("--space", default="full", choices=list(SPACES), help="search space (targets are for full)")
    ap.add_argument("--against", type=Path, help="another checkout to compare with, side by side")
    ap.add_argument("--rounds", type=int, default=1, help="rounds (medians); with --against, alternating order")
    ap.add_argument("--startup", action="store_true", help="only the start-up of --help and models")
    ap.add_argument("--targets", nargs="*", help="only the whole plan command per case and target (a table)")
    a = ap.parse_args()
    if a.startup:
        startup(a.rounds)
        return
    if a.targets is not None:
        per_target(a.cases, a.targets or ["shardplan", "any", "torchtitan", "megatron", "deepspeed", "nanotron"],
                   a.rounds)
        return
    if a.against:
        compare(a.against.resolve(), a.cases, a.space, a.rounds)
        return
    if not a.no_vectorized:
        vectorized_throughput()
    for name in a.cases:
        run_case(name, a.space, a.rounds)


if __name__ == "__main__":
    main()
