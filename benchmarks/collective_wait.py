"""How long a blocking collective waits for its partner when ranks time-share cores, by the compute
between two collectives.

    python benchmarks/collective_wait.py [--nproc 4] [--repeats 3]

Runs ``profiler.measure_comm.wait_under_load`` (the loop ``shardplan profile comm`` runs under
gloo: pairs of ranks side by side alternate matmuls with a 64 KiB all-reduce, no barrier before
it) at several amounts of one rank's CPU time between collectives, and prints the loop's extra
wall time per collective and the same all-reduce timed after a barrier. The profile measures at
``LOAD_CHUNK_S`` (training computes a layer's forward or backward between two collectives); this
shows why: the wait grows with the interval towards the scheduler's time slice, so a loop with
short intervals under-measures what training sees.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from profiler.measure_comm import LOAD_CHUNK_S, wait_under_load
from runtime.launch import free_port

CHUNKS_S = (0.0005, 0.001, 0.002, 0.004, LOAD_CHUNK_S, 0.012, 0.024)


def _worker(rank: int, world: int, port: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for chunk in CHUNKS_S:
        runs = [wait_under_load(rank, world, max(8, round(0.1 / chunk)), chunk) for _ in range(repeats)]
        if rank == 0:
            extra = [e * 1e3 for e, _ in runs]
            synced = statistics.median(s for _, s in runs) * 1e3
            mark = "  <- profile comm" if chunk == LOAD_CHUNK_S else ""
            print(f"{chunk * 1e3:6.1f} ms CPU between collectives: extra per collective "
                  f"{statistics.median(extra):5.2f} ms (runs {', '.join(f'{x:.2f}' for x in extra)}), "
                  f"all-reduce after a barrier {synced:4.2f} ms{mark}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"{a.nproc} ranks (gloo, one thread each) on {os.cpu_count()} cores")
    mp.start_processes(_worker, args=(a.nproc, free_port(), a.repeats), nprocs=a.nproc, start_method="spawn")


if __name__ == "__main__":
    main()
