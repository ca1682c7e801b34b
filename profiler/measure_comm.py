"""Time collectives between N processes on this host and fit α (latency) and β (s/byte) to them.

``profile_comm`` hosts a TCP store on an OS-chosen port, spawns N workers that join one process
group (gloo on CPU, nccl with one GPU per rank), and times all_reduce, all_gather,
reduce_scatter, all_to_all and a send/recv ping-pong over message sizes and over every group size
2..N that fits. Each repeat is the slowest rank's time after a barrier; the min and the median of
the repeats are kept and ``time = α + β·bytes`` is fitted to one of them by least squares on the
relative error (every size counts alike). A worker that dies, fails to start its backend or hangs
stops the run: every child is terminated and a :class:`ShardplanError` says which rank and where.
"""

from __future__ import annotations

import math
import os
import queue
import re
import signal
import statistics
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import numpy as np

from profiler.profile_schema import COLLECTIVES, CommFit, DeviceInfo
from vocab.errors import ShardplanError

KIB, MIB = 1024, 1024**2
FULL_SIZES = [KIB * 4**i for i in range(10)]  # 1 KiB .. 256 MiB
QUICK_SIZES = [KIB * 4**i for i in range(8)]  # 1 KiB .. 16 MiB
#: the statistics of a point's repeats that the alpha-beta fit can take
STATS = ("median", "min")
_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


#: the largest message ``--sizes`` takes (bytes): far above any collective's bandwidth knee
MAX_MESSAGE = 16 * 1024**3


def parse_sizes(text: str) -> list[int]:
    """``1K,64K,1M`` → bytes (binary units); sorted, unique."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*([a-zA-Z]*)[ \t]*", part)
        if not m or m.group(2).lower() not in _UNITS:
            raise ShardplanError(f"--sizes: cannot read '{part.strip()}' (use sizes like 1K, 64K, 1M, 256M)")
        x = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not x <= MAX_MESSAGE:
            raise ShardplanError(f"--sizes: '{part.strip()[:40]}' is over the largest message, {fmt_bytes(MAX_MESSAGE)}")
        n = int(x)
        if n < 4:
            raise ShardplanError(f"--sizes: '{part.strip()}' is below 4 bytes (one float)")
        out.append(n)
    return sorted(set(out))


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(α, β, median relative error) of ``t = α + β·x`` by least squares on relative error,
    both constrained to be non-negative."""
    if not points:
        raise ShardplanError("no points to fit")
    x = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    if len(set(x.tolist())) == 1:
        a, b = 0.0, float(np.median(t / x))
    else:
        A = np.stack([1.0 / t, x / t], axis=1)
        (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
        if a < 0:
            a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
        if b < 0:
            a, b = float(np.sum(1 / t) / np.sum(1 / t**2)), 0.0
    err = float(np.median(np.abs(a + b * x - t) / t))
    return float(a), float(b), err


def _reps(nbytes: int, quick: bool) -> int:
    """Repeats from the size alone (every rank must run the same number)."""
    est = 2e-4 + nbytes / 5e8  # a pessimistic loopback guess
    lo, hi, target = (3, 10, 0.1) if quick else (5, 30, 0.5)
    return int(min(hi, max(lo, math.ceil(target / est))))


# ---- the worker ----------------------------------------------------------------------------------

def _watch_parent(ppid: int) -> None:
    while True:  # the parent was killed: leave no orphan behind
        if os.getppid() != ppid:
            os._exit(3)
        time.sleep(0.5)


def _numel(nbytes: int, world: int) -> int:
    return max(world, nbytes // 4 // world * world)


def _time_collective(coll: str, nbytes: int, world: int, rank: int, group: Any, device: Any,
                     reps: int, warmup: int, base: int = 0) -> list[float]:
    """Seconds of each repeat of ``coll`` in ``group`` (``rank``: this process's rank in it; the
    group is global ranks ``base .. base + world - 1``), each as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    n = _numel(nbytes, world)
    big = torch.ones(n, device=device)
    small = torch.ones(n // world, device=device)
    out = torch.empty_like(big)
    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    ops = {
        "all_reduce": lambda: dist.all_reduce(big, group=group),
        "all_gather": lambda: ag(big, small, group=group),
        "reduce_scatter": lambda: rs(small, big, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, big, group=group),
    }

    def ping_pong() -> None:  # peers by global rank
        if rank == 0:
            dist.send(big, base + 1, group=group)
            dist.recv(big, base + 1, group=group)
        else:
            dist.recv(big, base, group=group)
            dist.send(big, base, group=group)

    op = ping_pong if coll == "send_recv" else ops[coll]
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + reps):
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        op()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt / 2 if coll == "send_recv" else dt)
    # each repeat takes as long as its slowest rank
    tt = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=group)
    return tt.cpu().tolist()


LOAD_CHUNK_S = 0.006  # one rank's CPU seconds of matmuls between two collectives in the under-load loop
LOAD_BYTES = 64 * 1024  # the all-reduce the under-load loop issues
LOAD_REPEATS = 15  # (plain, loaded) loop pairs; their median difference counts


def wait_under_load(rank: int, world: int, iters: int, chunk_s: float = LOAD_CHUNK_S) -> tuple[float, float]:
    """Seconds a collective adds to a rank's loop beyond its own time when every rank computes
    between collectives, as in training: pairs of ranks side by side alternate matmuls with a
    64 KiB all-reduce (no barrier before it, so a partner descheduled by a time-shared core is
    waited for). Returns the loop's extra time per collective and the same all-reduce timed after
    a barrier (the slowest pair's); :func:`wait_beyond` takes the collective's own time from the
    first. Ranks outside a full pair only compute.

    The wait grows with the compute between collectives towards the scheduler's time slice
    (``benchmarks/collective_wait.py`` prints the curve; docs/costmodel.md). Training computes a layer's
    forward or backward between two blocking collectives, on a CPU ~10 ms or more, so the loop
    computes ``chunk_s`` of one rank's CPU time (~12 ms of wall time with two ranks per core)
    between its collectives."""
    import torch
    import torch.distributed as dist

    groups = [dist.new_group([s, s + 1]) for s in range(0, world - 1, 2)]
    g = groups[rank // 2] if rank < 2 * len(groups) else None
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = torch.ones(LOAD_BYTES // 4)
    t0 = time.thread_time()
    for _ in range(8):
        a @ b
    per = torch.tensor([(time.thread_time() - t0) / 8], dtype=torch.float64)
    dist.all_reduce(per, op=dist.ReduceOp.MIN)  # every rank runs the same count
    matmuls = max(1, round(chunk_s / max(float(per), 1e-6)))

    def loop(comm: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(matmuls):
                a @ b
            if comm and g is not None:
                dist.all_reduce(x, group=g)
        return time.perf_counter() - t0

    loop(True)  # warm-up
    diffs = [-loop(False) + loop(True) for _ in range(LOAD_REPEATS)]  # the host's noise: a median of pairs
    synced = _time_collective("all_reduce", LOAD_BYTES, 2, rank % 2, g, torch.device("cpu"), 10, 2) \
        if g is not None else [0.0]
    extra = torch.tensor([statistics.median(diffs) / iters, statistics.median(synced)] if g is not None
                         else [0.0, 0.0], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)
    return float(extra[0]), float(extra[1])


def sharing_efficiency(rank: int, world: int, seconds: float = 0.1, trials: int = 15) -> float:
    """The fraction of its fair share of the cores (``cores / world``) rank 0's compute gets while
    every rank computes at once: a small MLP block's forward and backward (linear 512 -> 2048,
    GELU, linear back, LayerNorm, 512 tokens: GEMMs and memory-bound ops as in training), timed
    alone (the other ranks wait in a barrier) and together. Each loaded window is set against the
    mean of the alone windows just before and after it, which cancels a drift of the host's speed
    over the three; the median of ``trials`` such ratios. Many short windows rather than a few long
    ones: repeated on this host, 3 unbracketed windows of 0.3 s gave 0.88–1.10 (sd 0.09), 15
    bracketed ones of 0.1 s 0.89–0.97 (sd 0.03). 1 when the ranks do not outnumber the cores."""
    import torch
    import torch.distributed as dist

    fair = min(1.0, (os.cpu_count() or 1) / (world * torch.get_num_threads()))
    if fair >= 1.0:
        return 1.0
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512))
    x = torch.randn(512, 512)

    def step() -> None:
        block(x).sum().backward()

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    reps = torch.tensor([max(3, round(seconds * fair / ((time.perf_counter() - t0) / 3)))])
    dist.all_reduce(reps, op=dist.ReduceOp.MIN)  # every rank the same count

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(int(reps)):
            step()
        return time.perf_counter() - t0

    def alone() -> float:
        dist.barrier()
        t = timed() if rank == 0 else 0.0
        dist.barrier()
        return t

    ratios = []
    before = alone()
    for _ in range(trials):
        loaded = torch.tensor([timed()], dtype=torch.float64)
        dist.all_reduce(loaded)  # the ranks' mean: what each got of the cores
        after = alone()
        ratios.append((before + after) / 2 / (float(loaded) / world))
        before = after
    eff = torch.tensor([statistics.median(ratios) / fair if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(eff, 0)
    return float(eff)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    threading.Thread(target=_watch_parent, args=(cfg["ppid"],), daemon=True).start()
    warnings.filterwarnings("ignore")
    code = 0
    where = "starting"
    try:
        import torch
        import torch.distributed as dist

        backend = cfg["backend"]
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)
        where = f"starting the {backend} process group"
        if rank == 0:
            q.put(("start", where))
        store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                              timeout=timedelta(seconds=cfg["timeout_s"]))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg["timeout_s"]),
                                device_id=device if backend == "nccl" else None)
        results: list[dict[str, Any]] = []
        for w in cfg["groups"]:
            # groups smaller than the launch run side by side, every rank busy, as the TP (or
            # pipeline) groups of a node communicate at once in training; rank 0's group reports
            groups = [dist.new_group(list(range(s, s + w))) for s in range(0, world - w + 1, w)]
            mine = rank // w if rank < len(groups) * w else None
            if mine is not None:
                group, base = groups[mine], mine * w
                for coll in cfg["collectives"]:
                    if coll == "send_recv" and w != 2:
                        continue
                    for nbytes in cfg["sizes"]:
                        where = f"{coll} of {fmt_bytes(nbytes)} at world {w}"
                        if cfg.get("fail_at") == [rank, coll, nbytes]:
                            os._exit(7)  # fault injection for the tests
                        if rank == 0:
                            q.put(("start", where))
                        ts = _time_collective(coll, nbytes, w, rank - base, group, device,
                                              _reps(nbytes, cfg["quick"]), 1 if cfg["quick"] else 2, base)
                        if rank == 0:
                            results.append({"collective": coll, "world": w, "bytes": nbytes, "times": ts})
                            q.put(("done_point", where))
            where = f"the barrier after world {w}"
            dist.barrier()
        if backend == "gloo" and world >= 2:  # CPU ranks time-share cores: measure the wait
            where = "collectives under load"
            extra, synced = wait_under_load(rank, world, 16 if cfg["quick"] else 24)
            where = "compute shared by every rank"
            eff = sharing_efficiency(rank, world)
            if rank == 0:
                results.append({"collective": "_wait", "world": 2, "bytes": LOAD_BYTES, "times": [extra, synced]})
                results.append({"collective": "_share", "world": world, "bytes": 0, "times": [eff]})
        if rank == 0:
            q.put(("result", results))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001  (report anything, then exit non-zero)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        q.put(("error", rank, where, f"{type(e).__name__}: {msg}"[:500]))
        code = 1
    finally:
        q.close()
        q.join_thread()
        os._exit(code)


# ---- the parent ----------------------------------------------------------------------------------

def check_stat(stat: str) -> None:
    """``stat`` names a statistic of the repeats the fit takes (:data:`STATS`)."""
    if stat not in STATS:
        raise ShardplanError(f"--stat must be {' or '.join(STATS)}, got '{stat}'")


def check_backend(backend: str, nproc: int) -> None:
    """``backend`` is one this host can start ``nproc`` processes of (names checked before torch loads)."""
    if backend not in ("gloo", "nccl"):
        raise ShardplanError(f"backend '{backend}' is not gloo or nccl")
    if nproc < 2:
        raise ShardplanError(f"--nproc must be at least 2 to time collectives, got {nproc}")
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        if not dist.is_available() or not dist.is_gloo_available():
            raise ShardplanError("backend 'gloo' cannot start: this torch build has no gloo support")
    elif backend == "nccl":
        if not torch.cuda.is_available():
            raise ShardplanError("backend 'nccl' cannot start: no CUDA device is visible "
                                 f"(torch {torch.__version__}); use --backend gloo")
        if not dist.is_nccl_available():
            raise ShardplanError("backend 'nccl' cannot start: this torch build has no NCCL")
        if torch.cuda.device_count() < nproc:
            raise ShardplanError(f"backend 'nccl' needs one GPU per process: {nproc} processes but "
                                 f"{torch.cuda.device_count()} GPU(s) visible")


def end_processes(procs: list[Any], grace_s: float = 5.0) -> None:
    """Terminate the processes still alive, then kill what outlives ``grace_s`` (all together)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "hung"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def profile_comm(
    nproc: int = 2, backend: str = "gloo", sizes: list[int] | None = None, quick: bool = False, *,
    collectives: list[str] | None = None, groups: list[int] | None = None, stat: str = "median",
    progress: bool = True, timeout_s: float = 120.0, fail_at: tuple[int, str, int] | None = None,
) -> tuple[DeviceInfo, list[CommFit]]:
    """Spawn ``nproc`` workers, time the collectives and fit α/β per (collective, group size)."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from profiler.measure_compute import device_info, host_load

    check_stat(stat)
    check_backend(backend, nproc)
    cfg = _sweep(nproc, backend, sizes, quick, collectives, groups)
    cfg.update(timeout_s=timeout_s, ppid=os.getpid(), fail_at=list(fail_at) if fail_at else None)
    load = host_load()
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, store.port, cfg, q), daemon=True,
                         name=f"shardplan-comm-{r}") for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        results = _collect(q, procs, cfg, progress)
    finally:
        end_processes(procs)
        q.close()
        del store
    fits = _fit_points(results, cfg, stat)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    return device_info(dev, load), fits


def _sweep(nproc: int, backend: str, sizes: list[int] | None, quick: bool, collectives: list[str] | None,
           groups: list[int] | None) -> dict[str, Any]:
    """The workers' sweep: backend, message sizes, collectives and group sizes (checked)."""
    colls = list(collectives or COLLECTIVES)
    bad = [c for c in colls if c not in COLLECTIVES]
    if bad:
        raise ShardplanError(f"unknown collective(s) {bad}; known: {', '.join(COLLECTIVES)}")
    sizes = sorted(set(sizes or (QUICK_SIZES if quick else FULL_SIZES)))
    groups = sorted(set(groups or range(2, nproc + 1)))
    if any(w < 2 or w > nproc for w in groups):
        raise ShardplanError(f"group sizes must be in 2..{nproc}, got {groups}")
    return {"backend": backend, "sizes": sizes, "collectives": colls, "groups": groups, "quick": quick}


def _collect(q: Any, procs: list[Any], cfg: dict[str, Any], progress: bool) -> list[dict[str, Any]]:
    """The workers' results, read off ``q`` while a progress bar follows their points; a worker
    that reports an error, dies or stays silent past ``cfg["timeout_s"]`` raises :class:`ShardplanError`."""
    from profiler.measure_compute import sweep_progress

    backend, timeout_s = cfg["backend"], cfg["timeout_s"]
    total = sum(len(cfg["sizes"]) for w in cfg["groups"] for c in cfg["collectives"] if c != "send_recv" or w == 2)
    results: list[dict[str, Any]] | None = None
    errors: dict[int, tuple[str, str]] = {}
    where = "starting the workers"
    last = time.monotonic()
    with sweep_progress(progress) as new_task:
        adv = new_task(f"comm {backend} x{len(procs)}", total)
        while True:
            try:
                msg = q.get(timeout=0.2)
                last = time.monotonic()
            except queue.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "start":
                    where = msg[1]
                elif msg[0] == "done_point":
                    adv()
                elif msg[0] == "result":
                    results = msg[1]
                elif msg[0] == "error":
                    errors[msg[1]] = (msg[2], msg[3])
                continue
            if _finished(procs, results is not None, bool(errors)) or time.monotonic() - last > timeout_s:
                break
    if results is not None and not errors and all(p.exitcode == 0 for p in procs):
        return results
    time.sleep(0.5)  # let the other ranks report what they saw
    while True:
        try:
            msg = q.get_nowait()
        except queue.Empty:
            break
        if msg[0] == "error":
            errors[msg[1]] = (msg[2], msg[3])
    raise ShardplanError(_failure(procs, errors, where, backend, timeout_s))


def _finished(procs: list[Any], have_results: bool, have_errors: bool) -> bool:
    """Whether to stop listening: results and every worker gone, an error reported, a worker that
    failed, or every worker exited cleanly."""
    codes = [p.exitcode for p in procs]
    if have_results and all(c is not None for c in codes) or have_errors:
        return True
    return any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes)


def _fit_points(results: list[dict[str, Any]], cfg: dict[str, Any], stat: str) -> list[CommFit]:
    """α/β fits per (collective, group size) of the workers' points, with the wait under load and
    the sharing efficiency the workers measured."""
    fits = []
    for coll in cfg["collectives"]:
        for w in cfg["groups"]:
            pts = [r for r in results if r["collective"] == coll and r["world"] == w]
            if not pts:
                continue
            med = [(float(r["bytes"]), statistics.median(r["times"])) for r in pts]
            mins = [(float(r["bytes"]), min(r["times"])) for r in pts]
            a, b, err = fit_alpha_beta(med if stat == "median" else mins)
            fits.append(CommFit(collective=coll, world=w, backend=cfg["backend"], alpha_s=a, beta_s_per_byte=b,
                                median_rel_error=err, stat=stat, points=med, min_points=mins, wait_s=0.0))
    wait = wait_beyond(next((r["times"] for r in results if r["collective"] == "_wait"), None), fits)
    eff = next((r["times"][0] for r in results if r["collective"] == "_share"), 1.0)
    eff = min(2.0, max(0.05, eff))  # the schema's bounds; a wild value from a noisy host stays sane
    return [f.model_copy(update={"wait_s": wait, "sharing_efficiency": eff}) for f in fits]


def wait_beyond(loaded: list[float] | None, fits: list[CommFit]) -> float:
    """The wait under load that the cost model adds to each collective: the under-load loop's
    extra time per collective (``loaded[0]``) less what the model already prices for that
    all-reduce (the world-2 all-reduce fit at ``LOAD_BYTES``; without that fit, the barrier-synced
    all-reduce ``loaded[1]``). 0 when no loop ran (NCCL, one rank)."""
    if not loaded:
        return 0.0
    own = next((f.alpha_s + f.beta_s_per_byte * LOAD_BYTES for f in fits
                if f.collective == "all_reduce" and f.world == 2), loaded[1])
    return max(0.0, loaded[0] - own)


def _failure(procs: list[Any], errors: dict[int, tuple[str, str]], where: str, backend: str,
             timeout_s: float) -> str:
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    dead = [r for r, c in codes.items() if c not in (None, 0) and r not in errors]
    if dead:  # a rank that died without a word is the cause; the others only saw its absence
        r = dead[0]
        msg = f"rank {r} {_describe_exit(codes[r])} during {where}"
    elif errors:
        r = min(errors)
        if any("starting" in w for w, _ in errors.values()):
            r = next(r for r, (w, _) in sorted(errors.items()) if "starting" in w)
            return f"backend '{backend}' cannot start on rank {r}: {errors[r][1]}; all workers were stopped"
        msg = f"rank {r} failed during {errors[r][0]}: {errors[r][1]}"
    elif all(c == 0 for c in codes.values()):
        msg = "the workers exited without reporting results"
    else:
        msg = f"no progress for {timeout_s:g} s during {where} (a rank hung)"
    return f"communication sweep failed: {msg}; all workers were stopped and nothing was written"
