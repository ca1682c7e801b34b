"""What a replicated (DDP) gradient sync costs on CPU ranks when it is cut into one collective per
gradient tensor, as shardplan's runtime issues it, against the same bytes in one collective.

    python benchmarks/grad_sync_collectives.py [--nproc 4] [--repeats 8]

Builds the runtime's own model for close_the_loop's GPT (4 layers, hidden 512, 8 heads, vocabulary
8192, seq 128: 16.9M parameters), gives every parameter a gradient, and times
``runtime.zero.ReplicatedParams.reduce_grads`` (one all-reduce per gradient of at least
``COALESCE_BYTES``, the smaller ones together in flat buffers of at most that size, then the
average) against one all-reduce and average of a flat buffer of all the gradients' bytes. The difference per
extra collective is what the cost model prices as α per collective (back to back, they wait for
their partners once: ``DeviceModel.collective_latency``; ``grad_coalesce_bytes`` in ``cpu.yaml``;
docs/costmodel.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.launch import free_port
from runtime.model import build, resolve_config, spec_for
from runtime.zero import COALESCE_BYTES, ReplicatedParams

GPT = {"model_type": "gpt2", "n_layer": 4, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 128,
       "resid_pdrop": 0.0}


def _timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    runs = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])


def _worker(rank: int, world: int, port: int, spec: dict, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, _ = build(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    sync = ReplicatedParams(0, params, dist.group.WORLD, None, world)

    for p in params:
        p.grad = torch.ones_like(p)
    nbytes = [p.numel() * p.element_size() for p in params]
    flat = torch.ones(sum(nbytes) // 4)

    def one_flat() -> None:  # the same bytes and the same average
        dist.all_reduce(flat)
        flat.div_(world)

    t_tensor = _timed(sync.reduce_grads, repeats)
    t_flat = _timed(one_flat, repeats)
    if rank == 0:
        big = sum(b >= COALESCE_BYTES for b in nbytes)
        small = sum(b for b in nbytes if b < COALESCE_BYTES)
        n = big + math.ceil(small / COALESCE_BYTES)
        print(f"{world} ranks (gloo, one thread each) on {os.cpu_count()} cores; {sum(p.numel() for p in params) / 1e6:.1f}M "
              f"parameters, {sum(nbytes) / 1e6:.1f} MB of fp32 gradients")
        print(f"runtime's sync: {n} collectives ({big} tensors of >= {COALESCE_BYTES >> 20} MiB, {small / 1e3:.0f} kB "
              f"of small ones coalesced), median {t_tensor:.3f} s")
        print(f"one flat all-reduce of the same bytes: median {t_flat:.3f} s")
        print(f"extra per collective: {(t_tensor - t_flat) / max(n - 1, 1) * 1e3:.1f} ms")
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "gpt-small.json"
        cfg.write_text(json.dumps(GPT))
        spec = spec_for(resolve_config(str(cfg)))
    mp.start_processes(_worker, args=(a.nproc, free_port(), spec, a.repeats), nprocs=a.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
