"""Training loop, per-step metrics, and the single-process reference run.

Data is the same on every run: step ``k`` reads ``global_batch`` windows of ``seq_len + 1`` tokens
of a token file, or (without one) seed ``s`` draws them uniform from a generator seeded with
``(s, k)`` (:mod:`runtime.data`); data-parallel rank ``d``
trains rows ``[d·B/dp, (d+1)·B/dp)``, and of them, with context parallelism or TSP, the tokens of
:func:`runtime.context_parallel.shard_sequence` (:func:`local_batch`). Losses are next-token cross entropy, averaged over the global
batch, so a plan's losses are comparable with :func:`reference_losses` one step at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime import dcp
from runtime.adapters import adapt
from runtime.apply import applied, build_optimizer
from runtime.context_parallel import shard_sequence
from runtime.data import file_batch, synthetic_batch
from runtime.experts import rebalance
from runtime.memory import TensorPeak, peak_bytes, state_bytes
from runtime.model import MoE, build, lm_loss
from runtime.precision import Precision
from runtime.tensor_parallel import loss_context, plain

LR = 1e-3


@dataclass
class TrainSettings:
    """What to train: steps, batch, sequence length, seed, learning rate, precision."""

    steps: int = 3
    global_batch: int = 8
    seq_len: int = 32
    seed: int = 0
    lr: float = LR
    precision: str = "fp32"  # "bf16": every unit computes in bf16 beside fp32 masters (runtime.precision);
    # "fp8": bf16 with the blocks' Linear GEMMs in fp8 (runtime.fp8; CUDA only, else a note)
    grad_dtype: str = "fp32"  # under bf16/fp8: gradients accumulated and reduced in fp32 or bf16
    data: str | None = None  # a token file (runtime.data); None: seeded synthetic tokens
    resume: str | None = None  # a checkpoint directory to start from (runtime.dcp; any plan of the model)
    save: str | None = None  # a checkpoint directory to write after the last step

    def mixed(self) -> Precision:
        return Precision(self.precision, self.grad_dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parity_tolerance(precision: str, moe: bool = False) -> float:
    """The relative loss gap per step allowed between a plan's run and one process's training of the
    same model at the same precision (``--check-parity``): as tight as the arithmetic allows
    (measured over three steps of the 56 parity families and drawn combinations).

    * fp32, dense models: ``1e-6``. Sums run in another order (gradients reduced over ranks, TP's and
      TSP's partial products, attention merged over CP ranks) round differently in float32's last
      bits: measured gaps are at most 2.2e-7 (two ulp of a loss near 5.5).
    * fp32, models with MoE blocks (``moe``): ``2e-5``. The same roundings can flip a token's choice
      between two experts whose scores nearly tie (measured up to 3e-6, ZeRO-2's per-micro-batch
      reduction in an interleaved pipeline); an expert load counted twice (a 1e-4 drift) still fails.
    * bf16 and fp8 (bf16 where fp8 GEMMs do not run): ``1e-4``. Each rank rounds its own weight
      gradients — and under TP, TSP and CP its partial sums of activations — to bf16 before they
      are reduced or merged, where one process rounds the whole sum once; the loss itself is an
      fp32 mean: measured gaps are at most 6.1e-5 (Megatron TP+SP on Hugging Face Llama), 1.3e-5
      for ZeRO and FSDP alone.
    """
    if precision != "fp32":
        return 1e-4
    return 2e-5 if moe else 1e-6


def batch(step: int, s: TrainSettings, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of ``step``, each ``(global_batch, seq_len)``: read from the token file
    ``s.data``, or seeded synthetic tokens without one (:mod:`runtime.data`)."""
    if s.data:
        return file_batch(s.data, step, s.global_batch, s.seq_len, vocab)
    return synthetic_batch(step, s.seed, s.global_batch, s.seq_len, vocab)


def make_optimizer_kwargs(s: TrainSettings) -> dict[str, Any]:
    """AdamW as production trainers run it: fused (one kernel per parameter group, no temporaries
    the size of a parameter; on CPU and CUDA), as the cost model prices it."""
    return {"lr": s.lr, "weight_decay": 0.0, "fused": True}


def reference_losses(spec: dict[str, Any], s: TrainSettings, on_step: Callable[[int], None] | None = None,
                     start: int = 0) -> list[float]:
    """Losses of plain single-process training of model ``spec`` (whole batch per step) at the
    settings' precision: fp32, or bf16 parameters beside fp32 masters stepped by the optimizer, the
    gradients accumulated in ``grad_dtype`` (what every unit of a plan does, :mod:`runtime.precision`);
    ``on_step(k)`` is called after each step. With ``start`` (a resumed run's first step), it trains
    ``start + s.steps`` steps from scratch: element ``k`` is step ``k``'s loss, whichever step a run
    resumed at."""
    from runtime.zero import ReplicatedParams

    torch.manual_seed(s.seed)
    model, vocab = build(spec, seed=s.seed)
    fwd = adapt(model).forward_logits
    p = s.mixed()
    masters = ReplicatedParams(0, list(model.parameters()), None, None, 1, compute_dtype=p.compute,
                               reduce_dtype=p.reduce)
    opt = torch.optim.AdamW(masters.optimizer_params(), **make_optimizer_kwargs(s))
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    out = []
    for k in range(start + s.steps):
        x, y = batch(k, s, vocab)
        loss = lm_loss(fwd(model, x), y)
        loss.backward()
        masters.reduce_grads()
        opt.step()
        masters.gather_params()
        rebalance(moe, [])
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
        if on_step is not None:
            on_step(k)
    return out


def train_step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int = 1) -> torch.Tensor | None:
    """Forward and backward of this rank's batch; the mean loss where it is known, else None.

    Without pipeline parallelism the batch runs as ``n_microbatches`` accumulated micro-batches;
    with it, through the plan's schedule (only the last stage knows the loss). Call
    ``optimizer.step()`` afterwards (see :func:`runtime.build_optimizer`).
    """
    info = applied(model)
    if info.pipeline is not None:
        return info.pipeline.step(tokens, targets)
    fwd = info.adapter.forward_logits
    total = torch.zeros((), dtype=torch.float32, device=tokens.device)
    n = max(1, min(n_microbatches, tokens.shape[0]))
    for xs, ys in zip(tokens.chunk(n), targets.chunk(n), strict=True):
        with loss_context(1 if info.mesh.tsp else info.mesh.size("tp")):  # vocabulary-parallel loss under TP
            loss = lm_loss(fwd(model, xs), ys) * (xs.shape[0] / tokens.shape[0])
            loss.backward()
        total += plain(loss.detach())
    return total


def local_batch(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global ``(batch, seq)`` tensor: its data-parallel rows and, with context
    parallelism or TSP, its tokens of each sequence (head-tail load balancing)."""
    rt = applied(model).mesh
    rows = batch.shape[0] // rt.dp_size
    mine = batch[rt.dp_rank * rows : (rt.dp_rank + 1) * rows]
    return shard_sequence(mine, rt.seq_rank, rt.seq_size) if rt.seq_size > 1 else mine


def global_loss(model: nn.Module, loss: torch.Tensor | None) -> float:
    """The step's loss averaged over data parallelism and the ranks that hold other tokens (context
    parallelism, TSP; every one holds as many), the same number on every rank."""
    info = applied(model)
    rt = info.mesh
    reporter = (rt.tsp or rt.coord("tp") == 0) and (info.pipeline is None or info.pipeline.has_last)
    dev = torch.device(rt.device_type, torch.cuda.current_device()) if rt.device_type == "cuda" else torch.device("cpu")
    t = torch.zeros((), dtype=torch.float64, device=dev)
    if reporter and loss is not None:
        t += loss.double()
    dist.all_reduce(t)
    return float(t) / (rt.dp_size * rt.seq_size)


def run(model: nn.Module, vocab: int, s: TrainSettings, n_microbatches: int = 1,
        on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Train ``s.steps`` steps of an ``apply_plan``-ed model; per-step metrics (same on all ranks).
    ``on_step(k)`` is called after step ``k`` (e.g. to report progress to a watchdog).

    Each step reports ``loss``, ``step_time_s`` (slowest rank) and ``ranks``: per rank
    ``param_bytes`` and ``grad_bytes`` (before the optimizer step, after gradient reduction),
    ``optim_bytes`` (after the step), ``peak_bytes`` (process peak: ``max_memory_allocated`` on GPU,
    RSS on CPU) and ``tensor_peak_bytes`` (the peak of live tensor bytes: ``max_memory_allocated``
    on GPU; on CPU measured by :class:`TensorPeak` on one step — the second, when there is one —,
    which is then marked ``memory_tracked`` and runs slower for the bookkeeping; ``None`` on the others),
    ``step_time_s`` (its own wall-clock time) and ``cpu_time_s`` (its process's CPU time over the
    step: where ranks time-share cores, their sum over the wall time is how busy the cores were).
    """
    info = applied(model)
    rt = info.mesh
    opt = build_optimizer(model, torch.optim.AdamW, **make_optimizer_kwargs(s))
    seen: dict[str, int] = {}

    def measure(_o: Any, _a: Any, _k: Any) -> None:
        seen.update(state_bytes(model, opt))

    opt.register_step_pre_hook(measure)
    dev = torch.device(rt.device_type, torch.cuda.current_device()) if rt.device_type == "cuda" else torch.device("cpu")
    tracked = min(1, s.steps - 1) if rt.device_type != "cuda" else -1
    start = dcp.load(model, opt, s.resume) if s.resume else 0
    out = []
    for k in range(start, start + s.steps):
        x, y = batch(k, s, vocab)
        x, y = local_batch(model, x).to(dev), local_batch(model, y).to(dev)
        if rt.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        tracker = TensorPeak() if k - start == tracked else nullcontext()
        t0, c0 = time.perf_counter(), time.process_time()
        with tracker:
            loss = train_step(model, x, y, n_microbatches)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rt.device_type == "cuda":
            torch.cuda.synchronize()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        after = state_bytes(model, opt)
        peak = peak_bytes(rt.device_type)
        tensor_peak = peak if rt.device_type == "cuda" else (tracker.peak if isinstance(tracker, TensorPeak) else None)
        mine = {"rank": dist.get_rank(), "param_bytes": seen["param_bytes"], "grad_bytes": seen["grad_bytes"],
                "optim_bytes": after["optim_bytes"], "peak_bytes": peak, "tensor_peak_bytes": tensor_peak,
                "step_time_s": dt, "cpu_time_s": cpu}
        if isinstance(tracker, TensorPeak):
            mine["tensor_peak_op"] = tracker.peak_op  # the op whose outputs set the peak
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        times = torch.tensor([dt], dtype=torch.float64, device=dev)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out.append({"step": k, "loss": global_loss(model, loss), "step_time_s": float(times), "ranks": ranks,
                    "memory_tracked": k - start == tracked})
        if on_step is not None:
            on_step(k)
    if s.save:
        dcp.save(model, opt, s.save, start + s.steps)
    return out
