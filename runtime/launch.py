"""Launch N local training processes (``torch.multiprocessing`` spawn) and collect their results.

One launch runs one or more *jobs* (a plan to apply to a freshly built model, then K steps) in
the same process group, so that tests pay the start-up once for several plans. Rank 0 writes the
results with :func:`vocab.io.write_atomic`; the parent reads them. A rank that raises or
dies ends the launch: ``torch.multiprocessing`` terminates the other ranks, and the parent raises a
:class:`LaunchError` with one line saying which rank failed and why.

Fault injection for tests: ``SHARDPLAN_FAIL_RANK=<r>`` makes rank ``r`` raise before training,
``SHARDPLAN_FAIL_RANK=<r>:exit`` makes it exit at once (like a rank killed by the OOM killer),
``SHARDPLAN_FAIL_RANK=<r>:teardown`` makes it abort after its work is complete (which the launch
forgives: every rank has finished and the results are written), ``SHARDPLAN_FAIL_RANK=<r>:stop``
makes it SIGSTOP itself after its first training step (a frozen rank, for the watchdog).

Watchdog: each rank pulses (a thread bumps a shared counter every :data:`PULSE_S`) and reports
progress (after setting up the process group, building and planning the model, and each step). The
parent ends the launch when a rank's pulse has been silent for the watchdog time (its process is
stopped or stuck), or when no rank has made progress for that long (:func:`stale_rank` decides).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from profiler.measure_comm import end_processes
from vocab.errors import ShardplanError
from vocab.io import write_atomic
from vocab.plan import parse_plan
from vocab.strategy import Strategy

FAIL_ENV = "SHARDPLAN_FAIL_RANK"
SEP = "\n--- traceback ---\n"
DONE = "done"  # marker file a rank writes once its work is complete
WATCHDOG_S = 300.0  # default silence (s) after which the watchdog ends a launch
STARTUP_S = 120.0  # the least time (s) a rank has to start (spawn, import torch) before its first pulse
PULSE_S = 0.5  # a rank's pulse interval (s)
POLL_S = 0.25  # the parent's polling interval (s)


class LaunchError(ShardplanError):
    """A rank failed; the message names it and the error."""


def free_port() -> int:
    """A TCP port the OS says is free (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """One plan to train: the model, the plan (JSON text of a Plan or a Strategy), the settings."""

    model: dict[str, Any]  # runtime.model.spec_for(...)
    plan_json: str
    settings: dict[str, Any]  # TrainSettings fields
    name: str = ""
    reference: bool = False  # rank 0 also trains the model in one process (``reference_losses``)


def _load_plan(text: str) -> Any:
    """A plan document's :class:`Plan`, or the :class:`Strategy` a bare strategy's JSON holds."""
    data = json.loads(text)
    if "strategy" in data and "inputs" in data:
        return parse_plan(data)
    return Strategy.model_validate(data)


def _microbatches(plan: Any, rows: int) -> int:
    strategy = getattr(plan, "strategy", plan)
    return max(1, rows // strategy.micro_batch)


_MESHES: dict[tuple, Any] = {}
_REFS: dict[str, list[float]] = {}


@dataclass(frozen=True)
class Stale:
    """The rank the watchdog blames, how long it was silent, and whether its process stopped
    responding (else it is alive but no rank made progress)."""

    rank: int
    silent_s: float
    unresponsive: bool

    def message(self, limit_s: float) -> str:
        why = "its process stopped responding" if self.unresponsive else "no rank made progress"
        return (f"rank {self.rank} was silent for {self.silent_s:.1f} s ({why}; watchdog {limit_s:g} s); "
                "every rank was ended")


def stale_rank(pulse_at: Mapping[int, float | None], progress_at: Mapping[int, float | None], now: float,
               started: float, limit_s: float, startup_s: float = STARTUP_S) -> Stale | None:
    """The rank to blame when the launch must end, else None.

    Keys are the live ranks; values are when the parent saw the rank's pulse (``pulse_at``) and its
    progress (``progress_at``) last change, ``None`` before the first; ``started`` is when the ranks
    were started. A rank whose pulse has been silent for ``limit_s`` (before its first pulse: for
    ``max(limit_s, startup_s)`` since ``started``) stopped responding: the one silent longest is
    blamed (the lowest of equals). Otherwise, once every rank has made progress, if none has made
    progress for ``limit_s`` the one whose progress is oldest is blamed (the lowest of equals).
    """
    silent = {r: now - (started if t is None else t) for r, t in pulse_at.items()}
    frozen = [r for r, t in pulse_at.items() if silent[r] >= (limit_s if t is not None else max(limit_s, startup_s))]
    if frozen:
        r = min(frozen, key=lambda r: (-silent[r], r))
        return Stale(r, silent[r], True)
    last = [(t, r) for r, t in progress_at.items() if t is not None]
    if not last or len(last) < len(progress_at) or max(last)[0] > now - limit_s:
        return None
    t, r = min(last)
    return Stale(r, now - t, False)


class _Watch:
    """The parent's view of the ranks' counters (``[pulse 0..n-1, progress 0..n-1]``): when it saw
    each change, on its own monotonic clock."""

    def __init__(self, counters: Sequence[int], nproc: int, started: float):
        self.counters, self.nproc, self.started = counters, nproc, started
        self.seen = [0] * (2 * nproc)
        self.pulse_at: list[float | None] = [None] * nproc
        self.progress_at: list[float | None] = [None] * nproc

    def check(self, now: float, live: Sequence[int], limit_s: float) -> Stale | None:
        n = self.nproc
        for r in range(n):
            pulse, progress = self.counters[r], self.counters[n + r]
            if pulse != self.seen[r]:
                self.seen[r], self.pulse_at[r] = pulse, now
            if progress != self.seen[n + r]:
                self.seen[n + r], self.progress_at[r] = progress, now
        return stale_rank({r: self.pulse_at[r] for r in live}, {r: self.progress_at[r] for r in live}, now,
                          self.started, limit_s)


def _pulse(counters: Any, rank: int) -> None:
    while True:
        counters[rank] += 1
        time.sleep(PULSE_S)


def _run_job(job: Job, progress: Callable[[], None], on_step: Callable[[int], None]) -> dict[str, Any]:
    from runtime.apply import apply_plan
    from runtime.mesh import build_mesh
    from runtime.model import build, initializer
    from runtime.train import TrainSettings, run

    s = TrainSettings(**job.settings)
    plan = _load_plan(job.plan_json)
    strategy = getattr(plan, "strategy", plan)
    rows = s.global_batch // strategy.mesh.dp
    n_mb = _microbatches(plan, rows)
    torch.manual_seed(s.seed)
    init = initializer(job.model, s.seed)  # seeded or from weights: built on meta, each rank filling its shards
    model, vocab = build(job.model, seed=s.seed, meta=init is not None)
    progress()
    key = (*strategy.mesh.axes().items(), ("ep", strategy.mesh.ep))
    if key not in _MESHES:  # jobs of one launch share meshes (process groups are costly)
        _MESHES[key] = build_mesh(strategy.mesh)
    # bf16 (fp8: the Linear GEMMs in fp8, everything else in bf16): every unit, runtime.precision
    mp = s.mixed().fsdp_policy() if s.mixed().low else None
    model = apply_plan(model, plan, mesh=_MESHES[key], mixed_precision=mp, n_microbatches=n_mb,
                       fp8_linears=s.precision == "fp8", init=init)
    progress()
    steps = run(model, vocab, s, n_microbatches=n_mb, on_step=on_step)
    out = {"name": job.name, "steps": steps, "fsdp_units": model._shardplan.fsdp_units,
           "notes": model._shardplan.notes}
    if job.reference and torch.distributed.get_rank() == 0:
        from runtime.train import parity_tolerance, reference_losses

        out["parity_rtol"] = parity_tolerance(s.precision, moe=bool(job.model["config"].get("experts")))

        start = steps[0]["step"]  # a resumed run compares with the same steps of a run from scratch
        key = json.dumps([job.model, job.settings, start], sort_keys=True)
        if key not in _REFS:
            _REFS[key] = reference_losses(job.model, s, on_step=lambda _k: progress(), start=start)
        out["reference_losses"] = _REFS[key]
    return out


def _worker(rank: int, world: int, port: int, jobs: list[Job], out_dir: str, counters: Any) -> None:
    import warnings

    import torch.distributed as dist

    from runtime.mesh import backend_for, device_type

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")  # split slices: cat
    faulthandler.enable()  # a rank killed by a signal (an abort in C++) prints where it was
    threading.Thread(target=_pulse, args=(counters, rank), name="shardplan-pulse", daemon=True).start()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dev = device_type()
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        import runtime.apply  # noqa: F401  (imported before the first progress report: slow on a busy host)
        import runtime.train  # noqa: F401

        dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank % torch.cuda.device_count()) if dev == "cuda" else None)
        fail = os.environ.get(FAIL_ENV, "").split(":")
        if fail[0] == str(rank) and fail[1:] not in (["teardown"], ["stop"]):
            if fail[1:] == ["exit"]:
                os._exit(3)  # die without a word, as an OOM-killed rank would
            raise RuntimeError(f"injected failure ({FAIL_ENV}={rank})")

        def progress() -> None:
            counters[world + rank] += 1

        def on_step(k: int) -> None:
            progress()
            if k == 0 and fail == [str(rank), "stop"]:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as a stopped or swapped-out rank

        progress()
        results = []
        for j in jobs:
            try:
                results.append(_run_job(j, progress, on_step))
            except Exception as e:
                if len(jobs) == 1:
                    raise
                raise type(e)(f"job '{j.name}': {e}") if isinstance(e, ShardplanError) else \
                    RuntimeError(f"job '{j.name}': {type(e).__name__}: {e}") from e
        if rank == 0:
            write_atomic(Path(out_dir) / "results.json", json.dumps(results))
        dist.barrier()
        (Path(out_dir) / f"{DONE}.{rank}").touch()  # this rank's work is complete; teardown follows
        if fail == [str(rank), "teardown"]:
            os.abort()  # a rank that dies in torch's C++ teardown, after its work
    except BaseException as e:
        detail = "" if isinstance(e, ShardplanError) else traceback.format_exc()
        write_atomic(Path(out_dir) / f"error.{rank}", f"{type(e).__name__}: {e}{SEP}{detail}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # skip the interpreter's teardown of torch's C++ state (gloo threads, stores), which can abort
    # after every rank has finished; nothing is left to flush but stdio
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """While the ranks run, SIGTERM to this process raises a :class:`LaunchError` (so the ranks
    are ended and the scratch directory removed); the previous handler comes back after. Only the
    main thread can set handlers: elsewhere nothing changes."""
    def stop(signum: int, frame: Any) -> None:
        raise LaunchError("training stopped by SIGTERM; every rank was ended")

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _all_done(out_dir: Path, nproc: int) -> bool:
    """Every rank passed the final barrier (and rank 0 wrote the results)."""
    return all((out_dir / f"{DONE}.{r}").exists() for r in range(nproc))


def _failure(out_dir: Path, rank: int, fallback: str) -> str:
    """Why ``rank`` ended: when it raised, the message of the rank that raised first (its error file
    is the oldest: the others fail after it, on the broken connection, and whichever the join sees
    first is a race); else ``fallback`` (a rank killed without a word)."""
    if not (out_dir / f"error.{rank}").exists():
        return fallback
    first = min(out_dir.glob("error.*"), key=lambda f: (f.stat().st_mtime_ns, f.name))
    return f"rank {first.name.split('.')[1]} failed: {first.read_text().split(SEP)[0]}"


def _kill(procs: list[Any]) -> None:
    """SIGKILL every live process (stopped ones too) and reap them."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def launch(jobs: list[Job], nproc: int, start_method: str = "spawn",
           watchdog_s: float = WATCHDOG_S) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``nproc`` local processes; one result dict per job (from rank 0).

    Raises :class:`LaunchError` when a rank fails, when the watchdog finds a rank silent for
    ``watchdog_s`` seconds (0: no watchdog; see :func:`stale_rank`), and when the launching process
    is told to stop (SIGTERM; Ctrl-C raises ``KeyboardInterrupt``); all ranks have ended by then.
    """
    if nproc < 1:
        raise ShardplanError(f"--nproc must be at least 1, got {nproc}")
    if not watchdog_s >= 0:
        raise ShardplanError(f"--watchdog-s must be at least 0 (0: no watchdog), got {watchdog_s}")
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report failures ourselves
    try:
        scratch = tempfile.TemporaryDirectory(prefix="shardplan-train-")
    except OSError as e:
        raise LaunchError(f"cannot create a scratch directory for the ranks: {e}") from None
    with scratch as tmp, _stop_on_sigterm():
        out = Path(tmp)
        port = free_port()
        counters = mp.get_context(start_method).RawArray("Q", 2 * nproc)
        watch = _Watch(counters, nproc, time.monotonic())
        ctx = mp.start_processes(_worker, args=(nproc, port, jobs, tmp, counters), nprocs=nproc, join=False,
                                 start_method=start_method)
        try:
            while not ctx.join(timeout=POLL_S):
                if not watchdog_s:
                    continue
                live = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                stale = watch.check(time.monotonic(), live, watchdog_s)
                if stale is not None:
                    _kill(ctx.processes)
                    if _all_done(out, nproc):  # stuck in teardown after every rank finished: no harm
                        break
                    raise LaunchError(stale.message(watchdog_s))
        except mp.ProcessRaisedException as e:
            if not _all_done(out, nproc):  # a rank that failed in teardown after all had finished did no harm
                raise LaunchError(_failure(out, e.error_index, f"rank {e.error_index} failed")) from None
        except mp.ProcessExitedException as e:
            if not _all_done(out, nproc):  # nor one that died there
                how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
                raise LaunchError(_failure(out, e.error_index, f"rank {e.error_index} died ({how})")) from None
        finally:
            end_processes(ctx.processes)
        res = out / "results.json"
        if not res.exists():
            raise LaunchError("training ended without results (rank 0 wrote nothing)")
        return json.loads(res.read_text())
