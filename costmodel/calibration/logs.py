"""A training log as measured rows: per logged step its time (or throughput), memory and timed
parts, and the steady state of the run (warm-up dropped, the median and spread).

A log is read by the parser of its trainer (:mod:`costmodel.calibration.formats`), named or told
from its text. What a trainer prints varies: a step time (Megatron-LM, nanotron, shardplan's
runtime), tokens per second per GPU (torchtitan) or samples per second (DeepSpeed); memory as the
peak of live tensors (``allocated``), of the caching allocator's reservation (``reserved``) or of
the process (``process``: RSS on a CPU); and, where the trainer times them, parts of the step
(``terms``: ``compute``, ``pipeline``, ``dp``, ``optimizer``; each format says which of the cost
model's terms each covers, :data:`TERM_PARTS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vocab.errors import ShardplanError

#: the log formats, by the trainer that writes them
FORMATS = ("megatron", "torchtitan", "deepspeed", "nanotron", "shardplan")
#: memory figures a log may report, and what each holds of the cost model's peak
MEMORY_KINDS = {
    "allocated": "the peak of live tensors (torch.cuda.max_memory_allocated)",
    "reserved": "the caching allocator's peak reservation (torch.cuda.max_memory_reserved): tensors and slack",
    "process": "the process's peak (RSS on a CPU): tensors, slack and the context",
}
#: the parts of a step a log may time, and the cost model's terms (``Report.time``) each covers
TERM_PARTS: dict[str, tuple[str, ...]] = {
    "compute": ("compute", "recompute", "tp", "cp", "ep"),
    "pipeline": ("pp", "bubble"),
    "dp": ("dp",),
    "optimizer": ("optimizer", "offload"),
}
#: a record after the first whose time exceeds this multiple of the later half's median is warm-up
WARMUP_FACTOR = 1.2
MIN_RECORDS = 2


class LogError(ShardplanError):
    """A training log that cannot be read as measured steps."""


@dataclass(frozen=True)
class StepRecord:
    """One logged line of steps: ``step`` (the last iteration it covers), ``steps`` (how many
    iterations its figures average), and what it measured (None: not printed)."""

    step: int
    steps: int = 1
    step_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    samples_per_s: float | None = None
    memory: dict[str, float] = field(default_factory=dict)  # kind -> bytes
    terms: dict[str, float] = field(default_factory=dict)  # part -> seconds per step
    states: dict[str, float] = field(default_factory=dict)  # params/grads/optimizer -> bytes (worst rank)

    def seconds(self, tokens_per_step: float, samples_per_step: float, world: int) -> float | None:
        """The step time, from the time printed or from the throughput and the step's size."""
        if self.step_time_s is not None:
            return self.step_time_s
        if self.tokens_per_s_per_gpu:
            return tokens_per_step / (self.tokens_per_s_per_gpu * world)
        if self.samples_per_s:
            return samples_per_step / self.samples_per_s
        return None


@dataclass
class RunLog:
    """A parsed log: its format, where it came from, its step records, and what it says of the
    run's size (to check against the configuration)."""

    format: str
    origin: str
    records: list[StepRecord]
    global_batch: int | None = None
    seq_len: int | None = None


@dataclass(frozen=True)
class Steady:
    """The steady state of a run: the median step time and its 10th-90th percentile spread over
    the records kept, how many were logged and dropped as warm-up, the memory (kind -> bytes, the
    worst rank), the parts of the step (median seconds) and the states' bytes."""

    step_time_s: float
    low_s: float
    high_s: float
    records: int
    warmup: int
    memory: dict[str, float]
    terms: dict[str, float]
    states: dict[str, float]

    @property
    def used(self) -> int:
        return self.records - self.warmup

    @property
    def spread(self) -> float:
        """The 10th-90th percentile range over the median."""
        return (self.high_s - self.low_s) / self.step_time_s


def warmup_count(times: list[float]) -> int:
    """Leading records that are warm-up: the first (compilation, allocation, the first batch), and
    every one after it while it is more than :data:`WARMUP_FACTOR` times the median of the later
    half (at least one record is kept)."""
    if len(times) < MIN_RECORDS:
        return 0
    settled = float(np.median(times[len(times) // 2:]))
    n = 1
    while n < len(times) - 1 and times[n] > WARMUP_FACTOR * settled:
        n += 1
    return n


def _median_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: float(np.median([d[k] for d in dicts if k in d])) for k in keys}


def steady(log: RunLog, global_batch: int, seq_len: int, world: int) -> Steady:
    """The steady state of ``log`` for a run of ``global_batch`` samples of ``seq_len`` tokens on
    ``world`` GPUs (what converts a throughput into a step time)."""
    timed = [(r, r.seconds(global_batch * seq_len, global_batch, world)) for r in log.records]
    timed = [(r, t) for r, t in timed if t is not None and math.isfinite(t) and t > 0]
    if len(timed) < MIN_RECORDS:
        raise LogError(f"{log.origin}: {len(timed)} timed step record(s) in this {log.format} log; the steady state "
                       f"needs at least {MIN_RECORDS} (the first is warm-up)")
    times = [t for _, t in timed]
    n = warmup_count(times)
    kept = times[n:]
    # iterations each record averages weigh its figure (a log interval of 100 is 100 steps)
    weights = [max(r.steps, 1) for r, _ in timed[n:]]
    med = _weighted_median(kept, weights)
    first_kept = timed[n][0].step - timed[n][0].steps
    later = [r for r in log.records if r.step > first_kept]
    terms = [r.terms for r in later if r.terms] or [r.terms for r in log.records if r.terms][1:]
    states = [r.states for r in log.records if r.states]
    return Steady(step_time_s=med, low_s=float(np.percentile(kept, 10)), high_s=float(np.percentile(kept, 90)),
                  records=len(times), warmup=n, memory=_memory(log.records, later), terms=_median_of(terms),
                  states=_median_of(states))


def _memory(records: list[StepRecord], later: list[StepRecord]) -> dict[str, float]:
    """Each memory figure's median over the steady records that print it, else its last value (a
    trainer that prints memory once, after its first steps: Megatron-LM, nanotron; a peak counted on
    one step: shardplan's runtime on a CPU)."""
    out = {}
    for kind in sorted({k for r in records for k in r.memory}):
        steady_values = [r.memory[kind] for r in later if kind in r.memory]
        out[kind] = float(np.median(steady_values)) if steady_values else [
            r.memory[kind] for r in records if kind in r.memory][-1]
    return out


def _weighted_median(values: list[float], weights: list[int]) -> float:
    order = np.argsort(values, kind="mergesort")
    v, w = np.asarray(values)[order], np.asarray(weights, dtype=float)[order]
    cum = np.cumsum(w)
    half = cum[-1] / 2
    i = int(np.searchsorted(cum, half))
    if math.isclose(cum[i], half) and i + 1 < len(v):
        return float((v[i] + v[i + 1]) / 2)
    return float(v[i])


def detect(text: str) -> str | None:
    """The format whose marks ``text`` carries, or None."""
    from costmodel.calibration.formats import PARSERS

    for name in FORMATS:
        if PARSERS[name].recognises(text):
            return name
    return None


def read_log(path: str | Path, fmt: str | None = None) -> RunLog:
    """The log at ``path``, read by the parser of ``fmt`` or of the format its text shows."""
    from costmodel.calibration.formats import PARSERS
    from vocab.errors import UnknownNameError
    from vocab.io import read_text

    p = Path(path)
    text = read_text(p, "training log", LogError)
    origin = f"'{p.name}'"
    if fmt is None:
        fmt = detect(text)
        if fmt is None:
            raise LogError(f"{origin}: not a training log of {', '.join(FORMATS)} that this shardplan reads "
                           "(give --log-format if it is one)")
    elif fmt not in FORMATS:
        raise UnknownNameError("log format", fmt, FORMATS)
    log = PARSERS[fmt].parse(text, origin)
    if not log.records:
        raise LogError(f"{origin}: no step records of the {fmt} format")
    return log
