"""One ``shardplan train`` per strategy family on this machine's devices: predicted against measured
step time and peak memory.

    python benchmarks/gpu_train_families.py                 # every visible GPU (NCCL), bf16
    python benchmarks/gpu_train_families.py --device cpu --nproc 2 --model tiny-llama   # a dry run on CPU

Each family is a hand-made plan over all ``--nproc`` ranks (data parallelism with ZeRO-3, with
parameter offload, tensor parallelism with SP, TSP, OSDP splits with TP, a 1F1B pipeline, context
parallelism ring and Ulysses, expert parallelism on ``tiny-mixtral``; one rank gets the
recomputation variants; with ``--fp8`` also ZeRO-3 with fp8 Linear layers), trained for ``--steps`` steps by
``shardplan train --json``. Measured: the median step time after the first step, and rank 0's peak
(``max_memory_allocated`` on CUDA, the tracked tensor peak on CPU). Predicted: ``estimate`` of the
same plan on the matching accelerator file (``guess_accelerator``) at the run's precision.
``benchmarks/gpu_profile.sh`` runs it after the compute profile when a GPU is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodel.estimate import estimate  # noqa: E402
from profiler.hardware import parse_cluster  # noqa: E402
from profiler.measure_compute import guess_accelerator  # noqa: E402
from profiler.transformer import build_graph  # noqa: E402
from runtime.model import resolve_config  # noqa: E402
from runtime.plans import hand_plan  # noqa: E402
from vocab.strategy import LayerStrategy as L  # noqa: E402
from vocab.strategy import Mesh, Strategy, Workload  # noqa: E402


def families(n: int, model: str) -> dict[str, tuple[str, Strategy]]:
    """Plans over ``n`` ranks (or one rank's variants)."""
    if n == 1:
        return {"one rank": (model, Strategy()), "full recompute": (model, Strategy(default=L(recompute="full"))),
                "selective recompute": (model, Strategy(default=L(recompute="selective")))}
    return {
        "zero3": (model, Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3"))),
        "tp+sp": (model, Strategy(mesh=Mesh(tp=n), sequence_parallel=True)),
        "pp 1f1b": (model, Strategy(mesh=Mesh(pp=n), schedule="1f1b")),
        "cp ring": (model, Strategy(mesh=Mesh(cp=n), default=L(sharding="zero3"))),
        "cp ulysses": (model, Strategy(mesh=Mesh(cp=n), cp_mode="ulysses", default=L(sharding="zero3"))),
        "ep (tiny-mixtral)": ("tiny-mixtral", Strategy(mesh=Mesh(dp_shard=n, ep=n), default=L(sharding="zero3"))),
        "tsp": (model, Strategy(mesh=Mesh(tp=n), tp_mode="tsp")),
        "split=2 + tp+sp": (model, Strategy(mesh=Mesh(tp=n), sequence_parallel=True, default=L(split=2))),
        "zero3 offload": (model, Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3", offload="params"))),
    }


def accelerator(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    p = torch.cuda.get_device_properties(0)
    acc = guess_accelerator(p.name, p.total_memory / 1e9)
    if acc is None:
        raise SystemExit(f"no accelerator file matches '{p.name}'")
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every visible GPU)")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", default="", help="fp32 | bf16 (default: bf16 on two or more GPUs, else fp32)")
    ap.add_argument("--fp8", action="store_true", help="also ZeRO-3 with fp8 Linear layers (torchao; CUDA, sm89+)")
    a = ap.parse_args()
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible; --device cpu for a dry run")
    n = a.nproc or (__import__("torch").cuda.device_count() if a.device == "cuda" else 2)
    # the runtime's bf16 is FSDP2's mixed precision, which needs a shard group: one rank trains in fp32
    precision = a.precision or ("bf16" if a.device == "cuda" and n > 1 else "fp32")
    acc = accelerator(a.device)
    print(f"{n} x {acc}, seq {a.seq_len}, global batch {a.global_batch}, {precision}, {a.steps} steps")
    print("| family | model | predicted step | measured step | predicted peak GiB | measured peak GiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(name, model, s, precision) for name, (model, s) in families(n, a.model).items()]
        if a.fp8 and n > 1:
            runs.append(("zero3 fp8", a.model, Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3")), "fp8"))
        for name, model, s, prec in runs:
            s = s.model_copy(update={"micro_batch": max(1, a.global_batch // s.mesh.dp // (2 * s.mesh.pp))})
            plan = Path(tmp) / "plan.json"
            hand_plan(model, s, a.seq_len, a.global_batch, acc).save(plan)
            r = subprocess.run([sys.executable, "-m", "planner.cli", "train", "--model", model, "--plan", str(plan),
                                "--nproc", str(n), "--steps", str(a.steps), "--seq-len", str(a.seq_len),
                                "--global-batch", str(a.global_batch), "--precision", prec, "--json"],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                print(f"| {name} | {model} | failed: {(r.stderr or r.stdout).strip().splitlines()[-1][:150]} | | | |")
                continue
            rep = json.loads(r.stdout)
            steps = rep["steps"][1:] or rep["steps"]
            measured = statistics.median(x["step_time_s"] for x in steps)
            peaks = [x["ranks"][0]["tensor_peak_bytes"] for x in rep["steps"] if x["ranks"][0]["tensor_peak_bytes"]]
            w = Workload(seq_len=a.seq_len, global_batch=a.global_batch, precision=prec)  # type: ignore[arg-type]
            est = estimate(build_graph(resolve_config(model), a.seq_len), parse_cluster(f"{n}x{acc}"), s, w)
            peak = f"{max(peaks) / 2**30:.2f}" if peaks else "-"
            print(f"| {name} | {model} | {est.step_time_s:.4f} s | {measured:.4f} s | "
                  f"{est.memory_peak_gib:.2f} | {peak} |")


if __name__ == "__main__":
    main()
