"""What DTensor tensor parallelism costs the host beyond the work itself, measured on one rank.

shardplan's runtime applies Megatron-style TP through DTensor ``parallelize_module``
(``runtime/tensor_parallel.py``): every column- or row-parallel ``Linear`` or vocabulary-parallel
``Embedding`` runs its forward and backward ops through DTensor's Python dispatch (sharding
propagation, input/output layout hooks), a ``SequenceParallel`` norm likewise, and the loss runs as
``loss_parallel``'s decomposed vocabulary-parallel cross-entropy. None of that is in the per-op
compute sweep. Measured here, on a one-rank device mesh so that no collective runs (the
collectives are the comm profile's):

* per module kind (``linear``, ``norm``, ``loss``), the forward and the backward host seconds of
  the DTensor version over the plain module, at tiny shapes where the work itself is negligible
  (``time.perf_counter`` around the calls: on a GPU, the time to issue them);
* ``loss_traffic_ratio``: the device time of ``loss_parallel`` cross-entropy per logit over plain
  ``F.cross_entropy``'s, from a large and a tiny size (its fixed part taken out).

On this CPU (one thread) a TP linear adds about 1.1 ms per forward and backward, a sequence-parallel
norm 0.45 ms, the vocabulary-parallel loss about 2 ms and 1.6–2.7 times plain cross-entropy's time
per logit (docs/costmodel.md). The cost model adds them to each TP operator's time on a CPU (one thread does
both) and takes the larger of device and host time on a GPU, whose host runs ahead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from profiler.profile_schema import DTensorOverhead
from vocab.errors import first_line

#: logits of the large cross-entropy case: (tokens, vocabulary)
LOSS_SHAPE = (512, 8192)
TINY = 16  # width of the tiny modules


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _host_times(run: Callable[[], tuple[float, float]], reps: int) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``run`` after two warm-up calls."""
    for _ in range(2):
        run()
    fw, bw = zip(*(run() for _ in range(reps)), strict=True)
    return statistics.median(fw), statistics.median(bw)


def _fwd_bwd(module: nn.Module, x: torch.Tensor, sync: Callable[[], None]) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        x.grad = None
        t0 = time.perf_counter()
        y = module(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        t1 = time.perf_counter()
        y.sum().backward()
        t2 = time.perf_counter()
        sync()
        return t1 - t0, t2 - t1
    return run


def _loss(logits: torch.Tensor, target: torch.Tensor, mesh: Any | None, sync: Callable[[], None]
          ) -> Callable[[], tuple[float, float]]:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    def run() -> tuple[float, float]:
        logits.grad = None
        sync()
        t0 = time.perf_counter()
        if mesh is None:
            loss = F.cross_entropy(logits, target)
            t1 = time.perf_counter()
            loss.backward()
        else:
            with loss_parallel():
                loss = F.cross_entropy(DTensor.from_local(logits, mesh, (Shard(-1),), run_check=False), target)
                t1 = time.perf_counter()
                loss.backward()
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1
    return run


def _extra(dt: tuple[float, float], plain: tuple[float, float]) -> tuple[float, float]:
    return max(0.0, dt[0] - plain[0]), max(0.0, dt[1] - plain[1])


def _measure(device: torch.device, reps: int) -> DTensorOverhead:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(1, 4, TINY, device=device, requires_grad=True)

    def pair(make: Callable[[], nn.Module], style: Any) -> tuple[float, float]:
        plain = _host_times(_fwd_bwd(make(), x, sync), reps)
        par = make()
        parallelize_module(par, mesh, style)
        return _extra(_host_times(_fwd_bwd(par, x, sync), reps), plain)

    linear = pair(lambda: nn.Linear(TINY, TINY, device=device), ColwiseParallel())
    norm = pair(lambda: nn.LayerNorm(TINY, device=device), SequenceParallel())

    def loss_times(tokens: int, vocab: int, on_mesh: bool, n: int) -> tuple[float, float]:
        logits = torch.randn(tokens, vocab, device=device, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,), device=device)
        return _host_times(_loss(logits, target, mesh if on_mesh else None, sync), n)

    tiny_plain, tiny_par = loss_times(4, TINY, False, reps), loss_times(4, TINY, True, reps)
    loss = _extra(tiny_par, tiny_plain)
    big_reps = max(5, reps // 3)
    big_plain, big_par = loss_times(*LOSS_SHAPE, False, big_reps), loss_times(*LOSS_SHAPE, True, big_reps)
    per_plain = sum(big_plain) - sum(tiny_plain)
    per_par = sum(big_par) - sum(tiny_par)
    ratio = max(1.0, per_par / per_plain) if per_plain > 0 else 1.0
    return DTensorOverhead(linear_fwd_s=linear[0], linear_bwd_s=linear[1], norm_fwd_s=norm[0],
                           norm_bwd_s=norm[1], loss_fwd_s=loss[0], loss_bwd_s=loss[1], loss_traffic_ratio=ratio)


def measure_dtensor_overhead(device: torch.device, reps: int = 30) -> tuple[DTensorOverhead | None, str]:
    """DTensor's host overhead per TP module kind on ``device``, and why it is ``None`` when it was
    not measured (no ``torch.distributed``, or this process already belongs to a process group,
    whose ranks would all have to join a new mesh)."""
    import torch.distributed as dist

    if not dist.is_available():
        return None, "torch.distributed is not available"
    if dist.is_initialized():
        return None, "this process already belongs to a process group"
    try:
        dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    except (RuntimeError, ValueError) as e:  # a backend this build lacks: the rest of the profile stands
        return None, f"no one-rank process group ({first_line(e)})"
    try:
        return _measure(device, reps), ""
    except RuntimeError as e:  # not run on a GPU here yet: a failure must not cost the whole sweep
        return None, f"the measurement failed: {first_line(e)}"
    finally:
        dist.destroy_process_group()
