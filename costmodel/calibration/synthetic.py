"""Training logs written in each trainer's format from known numbers: test data with known answers.

Each writer prints the lines its trainer prints (the format strings cited in
:mod:`costmodel.calibration.formats`), for a run of ``global_batch`` samples of ``seq_len`` tokens on
``world`` GPUs whose steps took ``times`` seconds, with its peak memory (``memory``: kind -> bytes) and,
where the trainer times them, the parts of the step (``terms``: part -> seconds). The first step is
the warm-up: :func:`step_times` makes it slower, and the others jitter symmetrically around the
steady time, so that their median is that time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

GIB, MIB = 1024.0**3, 1024.0**2
#: the steady steps' jitter around the steady time (symmetric: the median is 1)
JITTER = (1.0, 1.012, 0.988, 1.006, 0.994, 1.018, 0.982, 1.003, 0.997)
WARMUP_FACTOR = 3.0


@dataclass(frozen=True)
class SynthRun:
    """A run to write: its size, its step times, its memory and the parts of its steps."""

    global_batch: int
    seq_len: int
    world: int
    times: list[float]
    memory: dict[str, float] = field(default_factory=dict)
    terms: dict[str, float] = field(default_factory=dict)


def step_times(steady_s: float, steps: int = 9) -> list[float]:
    """A warm-up step, then ``steps`` steady ones jittered by :data:`JITTER`."""
    return [steady_s * WARMUP_FACTOR] + [steady_s * JITTER[i % len(JITTER)] for i in range(steps)]


def _terms_scaled(run: SynthRun, t: float) -> dict[str, float]:
    """The parts of a step of ``t`` seconds: ``terms`` (the steady step's) scaled to it."""
    steady = sorted(run.times[1:])[len(run.times[1:]) // 2]
    return {k: v * t / steady for k, v in run.terms.items()}


def megatron(run: SynthRun, interval: int = 1) -> str:
    """Megatron-LM's training_log lines, report_memory after the first interval, and its timers."""
    lines, total = [], len(run.times) * interval
    for i, t in enumerate(run.times):
        it = (i + 1) * interval
        lines.append(f" [2026-12-04 10:{i // 60:02d}:{i % 60:02d}] iteration {it:8d}/{total:8d} | consumed samples: "
                     f"{it * run.global_batch:12d} | elapsed time per iteration (ms): {t * 1000.0:.1f} | learning rate: "
                     f"{3e-4:.6E} | global batch size: {run.global_batch:5d} | lm loss: {10.0 - i * 0.01:.6E} | "
                     f"loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan "
                     "iterations:   0 |")
        if i == 0 and run.memory:
            alloc, res = run.memory.get("allocated", 0.0) / MIB, run.memory.get("reserved", 0.0) / MIB
            lines.append(f"[Rank 0] (after {it} iterations) memory (MB) | allocated: {alloc * 0.6} | max allocated: "
                         f"{alloc} | reserved: {res} | max reserved: {res}")
        if run.terms:
            parts = _terms_scaled(run, t)
            timers = {"forward-backward": parts.get("compute", 0.0) + parts.get("pipeline", 0.0),
                      "forward-compute": parts.get("compute", 0.0) / 3, "backward-compute": parts.get("compute", 0.0) * 2 / 3,
                      "all-grads-sync": parts.get("dp", 0.0), "optimizer": parts.get("optimizer", 0.0)}
            lines.append("(min, max) time across ranks (ms):")
            lines += [f"    {(n + ' ').ljust(48, '.')}: ({v * 1000 * 0.98:.2f}, {v * 1000:.2f})" for n, v in timers.items()]
    return "\n".join(lines) + "\n"


def torchtitan(run: SynthRun, log_freq: int = 1) -> str:
    """torchtitan's MetricsProcessor.log lines (colours included) behind its logger's prefix."""
    red, green, orange, turq, blue, cyan, mag, reset = ("\033[31m", "\033[32m", "\033[33m", "\033[36m", "\033[34m",
                                                        "\033[36m", "\033[35m", "\033[39m")
    lines = []
    for i, t in enumerate(run.times):
        step = 1 if i == 0 else max(i * log_freq, i + 1)
        tps = run.global_batch * run.seq_len / (t * run.world)
        mem = run.memory.get("reserved", 0.0) / GIB
        lines.append(f"[titan] 2026-12-04 10:00:{i:02d},000 - root - INFO - {red}step: {step:2}  {green}loss: "
                     f"{10.0 - i * 0.01:8.5f}  {orange}grad_norm: {1.2345:7.4f}  {turq}memory: {mem:5.2f}GiB"
                     f"({mem / 80 * 100:.2f}%)  {blue}tps: {round(tps):,}  {cyan}tflops: {123.45:,.2f}  {mag}mfu: "
                     f"{40.0:.2f}%{reset}")
    return "\n".join(lines) + "\n"


def deepspeed(run: SynthRun, steps_per_print: int = 1) -> str:
    """DeepSpeed's ThroughputTimer lines and, with parts, its wall_clock_breakdown global timers."""
    lines = []
    for i, t in enumerate(run.times):
        step = (i + 1) * steps_per_print
        if run.terms:
            p = _terms_scaled(run, t)
            fwd, inner = p.get("compute", 0.0) / 3, p.get("compute", 0.0) * 2 / 3
            red, opt = p.get("dp", 0.0), p.get("optimizer", 0.0)
            lines.append(f"[Rank 0] time (ms) | fwd: {fwd * 1e3:.2f} | bwd: {(inner + red) * 1e3:.2f} | bwd_inner: "
                         f"{inner * 1e3:.2f} | bwd_allreduce: {red * 1e3:.2f} | step: {opt * 1e3:.2f}")
        alloc = round(run.memory.get("allocated", 0.0) / GIB, 2)
        lines.append(f"[2026-12-04 10:00:{i:02d},000] [INFO] [timer.py:264:stop] epoch=0/micro_step={step}/global_step="
                     f"{step}, RunningAvgSamplesPerSec={run.global_batch / t}, CurrSamplesPerSec={run.global_batch / t}, "
                     f"MemAllocated={round(alloc * 0.6, 2)}GB, MaxMemAllocated={alloc}GB")
    return "\n".join(lines) + "\n"


def human_format(num: float) -> str:
    """nanotron's human_format (nanotron/logging.py:234-245): 3 significant digits, K/M/G/... of 1000."""
    if abs(num) < 1:
        return f"{num:.3g}"
    num = float(f"{num:.3g}")
    i = 0
    while abs(num) >= 1000 and i < 6:
        num /= 1000.0
        i += 1
    return "{}{}".format(f"{num:f}".rstrip("0").rstrip("."), ["", "K", "M", "G", "T", "P", "E"][i])


def nanotron(run: SynthRun) -> str:
    """nanotron's train_step_logs lines (memory on the first iterations only, as nanotron logs it)."""
    lines = []
    for i, t in enumerate(run.times):
        step = i + 1
        tokens = run.global_batch * run.seq_len / t
        fields = [f"consumed_tokens: {human_format(step * run.global_batch * run.seq_len)}",
                  f"elapsed_time_per_iteration_ms: {human_format(t * 1000)}", f"tokens_per_sec: {human_format(tokens)}",
                  f"tokens_per_sec_per_gpu: {human_format(tokens / run.world)}",
                  f"global_batch_size: {human_format(run.global_batch)}", f"lm_loss: {human_format(10.0 - i * 0.01)}",
                  f"lr: {human_format(3e-4)}", f"model_tflops_per_gpu: {human_format(123.4)}",
                  f"hardware_tflops_per_gpu: {human_format(130.2)}", f"grad_norm: {human_format(1.23)}"]
        if step < 5 and "reserved" in run.memory:
            fields += [f"cuda_memory_allocated: {human_format(run.memory['reserved'] * 0.5)}",
                       f"cuda_max_memory_reserved: {human_format(run.memory['reserved'])}",
                       "hd_total_memory_tb: 1.97T", "hd_used_memory_tb: 1.2T", "hd_free_memory_tb: 770G"]
        lines.append(f"12/04/2026 10:00:{i:02d} [INFO|DP=0|PP=0|TP=0]: iteration: {step} / {len(run.times)} | "
                     + " | ".join(fields))
    return "\n".join(lines) + "\n"


def shardplan(run: SynthRun, device: str = "cpu") -> str:
    """A report of 'shardplan train --output': per step the slowest rank's time, per rank memory."""
    steps = []
    for i, t in enumerate(run.times):
        rank = {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0, "cpu_time_s": t,
                "peak_bytes": int(run.memory.get("process" if device == "cpu" else "allocated", 0)),
                "tensor_peak_bytes": int(run.memory["allocated"]) if "allocated" in run.memory and i == 1 else None,
                "step_time_s": t}
        steps.append({"step": i, "loss": 10.0 - i * 0.01, "step_time_s": t, "memory_tracked": i == 1,
                      "ranks": [{**rank, "rank": r} for r in range(run.world)]})
    return json.dumps({"model": "synthetic", "plan": "plan.json", "nproc": run.world, "device": device,
                       "precision": "fp32", "settings": {"steps": len(run.times), "global_batch": run.global_batch,
                                                         "seq_len": run.seq_len, "seed": 0},
                       "steps": steps}, indent=1) + "\n"


WRITERS = {"megatron": megatron, "torchtitan": torchtitan, "deepspeed": deepspeed, "nanotron": nanotron,
           "shardplan": shardplan}
