"""Step time and per-rank state bytes of each strategy family, measured by the runtime on CPU.

    python benchmarks/runtime_families.py --model tiny-llama --nproc 2 --steps 5 --out runtime_families.json

All families run in one launch (one process group); each reports its median step time over the
steps after the first, its loss gap to single-process training, and rank 0's parameter, gradient
and optimizer-state bytes — numbers to hold the cost model's predictions against.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from runtime.launch import Job, launch
from runtime.model import spec_for
from runtime.train import TrainSettings
from vocab.io import write_atomic
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy


def families(n: int) -> dict[str, Strategy]:
    out = {
        "ddp": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="replicate")),
        "zero1": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero1")),
        "zero2": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero2")),
        "zero3": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3")),
        "zero3_keep": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3_keep")),
        "zero3_split2": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3", split=2)),
        "zero3_full_ckpt": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3", recompute="full")),
        "zero3_selective": Strategy(mesh=Mesh(dp_shard=n), default=L(sharding="zero3", recompute="selective")),
        "tp_sp": Strategy(mesh=Mesh(tp=n), sequence_parallel=True),
        "pp_1f1b": Strategy(mesh=Mesh(pp=n), schedule="1f1b"),
        "pp_gpipe": Strategy(mesh=Mesh(pp=n), schedule="gpipe"),
    }
    if n % 4 == 0:
        out["hsdp"] = Strategy(mesh=Mesh(dp_replicate=2, dp_shard=n // 2), default=L(sharding="zero3"))
        out["tp_fsdp"] = Strategy(mesh=Mesh(dp_shard=n // 2, tp=2), default=L(sharding="zero3"), sequence_parallel=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    s = TrainSettings(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len)
    fams = families(args.nproc)
    jobs = [Job(model=spec_for(args.model), plan_json=st.model_dump_json(), settings=s.to_dict(), name=k,
                reference=True) for k, st in fams.items()]
    rows = []
    for r in launch(jobs, args.nproc):
        times = [x["step_time_s"] for x in r["steps"][1:]] or [r["steps"][0]["step_time_s"]]
        gap = max(abs(x["loss"] - y) for x, y in zip(r["steps"], r["reference_losses"], strict=True))
        r0 = r["steps"][-1]["ranks"][0]
        rows.append({"family": r["name"], "step_time_s": statistics.median(times), "max_loss_diff": gap,
                     **{k: r0[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")}})
    print(f"{'family':18s} {'step s':>8s} {'loss gap':>9s} {'params B':>10s} {'grads B':>10s} {'optim B':>10s}")
    for x in rows:
        print(f"{x['family']:18s} {x['step_time_s']:8.4f} {x['max_loss_diff']:9.2e} {x['param_bytes']:10d} "
              f"{x['grad_bytes']:10d} {x['optim_bytes']:10d}")
    if args.out:
        write_atomic(args.out, json.dumps({"model": args.model, "nproc": args.nproc, "settings": s.to_dict(),
                                           "families": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
