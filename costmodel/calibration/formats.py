"""The log formats of the trainers, read from the format strings of their pinned releases.

Each parser cites the lines that print what it reads (paths inside the installed wheels of
``tests/trainers.txt``: megatron-core 0.16.1, torchtitan 0.2.2, deepspeed 0.19.8, nanotron 0.4).
Every number a pattern captures is in ASCII digits; a line that does not match is not a record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from costmodel.calibration.logs import LogError, RunLog, StepRecord

MIB, GIB = 1024.0**2, 1024.0**3
_NUM = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Parser:
    """A log format: the lines it reads (``sources``), its marks, and its parser."""

    name: str
    sources: tuple[str, ...]
    mark: re.Pattern[str]
    parse: Callable[[str, str], RunLog]

    def recognises(self, text: str) -> bool:
        return self.mark.search(text) is not None


# ---- Megatron-LM -------------------------------------------------------------------------------
# megatron/training/training.py, training_log() of Megatron-LM (core_r0.16.0; the megatron-core wheel
# does not ship megatron/training): ' iteration {:8d}/{:8d} |', ' elapsed time per iteration (ms): {:.1f} |',
# ' global batch size: {:5d} |'; timers.log(timers_to_log, normalizer=args.log_interval), so the
# timers are per iteration. megatron/training/utils.py, report_memory(): '[Rank {}] {}' of
# name + ' memory (MB)' + ' | allocated: {}' + ' | max allocated: {}' + ' | reserved: {}' +
# ' | max reserved: {}' (MB = 1024**2 bytes), called with '(after {iteration} iterations)'.
# megatron/core/timers.py:346 '(min, max) time across ranks (ms):' and :352
# '\n    {}: ({:.2f}, {:.2f})' of (name + ' ').ljust(48, '.'); :344/:350 the max-only form.
_MEGA_ITER = re.compile(r"iteration\s+([0-9]+)/\s*([0-9]+)\s*\|(.*?)elapsed time per iteration \(ms\):\s*" + _NUM)
_MEGA_BATCH = re.compile(r"global batch size:\s*([0-9]+)\s*\|")
_MEGA_MEM = re.compile(r"\[Rank [0-9]+\] \(after [0-9]+ iterations\) memory \(MB\) \| allocated: " + _NUM
                       + r" \| max allocated: " + _NUM + r" \| reserved: " + _NUM + r" \| max reserved: " + _NUM)
_MEGA_TIMER = re.compile(r"^ {4}([a-z0-9-]+) \.*: (?:\(" + _NUM + r", " + _NUM + r"\)|" + _NUM + r")\s*$")
#: Megatron-LM's timers (training_log's timers_to_log) by the part of the step they time
MEGATRON_TIMERS = {"compute": ("forward-compute", "backward-compute"),
                   "dp": ("all-grads-sync", "params-all-gather"),
                   "optimizer": ("optimizer",)}


def parse_megatron(text: str, origin: str) -> RunLog:
    records: list[StepRecord] = []
    batch = None
    last = 0
    timers: dict[str, float] = {}

    def close_timers() -> None:
        if timers and records:
            records[-1] = _with(records[-1], terms=megatron_terms(timers))
        timers.clear()

    for line in text.splitlines():
        m = _MEGA_ITER.search(line)
        if m:
            close_timers()
            it = int(m.group(1))
            b = _MEGA_BATCH.search(line)
            batch = int(b.group(1)) if b else batch
            records.append(StepRecord(step=it, steps=max(it - last, 1), step_time_s=float(m.group(4)) / 1e3))
            last = it
            continue
        m = _MEGA_MEM.search(line)
        if m and records:
            peak = {"allocated": float(m.group(2)) * MIB, "reserved": float(m.group(4)) * MIB}
            old = records[-1].memory
            records[-1] = _with(records[-1], memory={k: max(v, old.get(k, 0.0)) for k, v in peak.items()})
            continue
        m = _MEGA_TIMER.match(line)
        if m:
            timers[m.group(1)] = float(m.group(3) or m.group(4)) / 1e3  # the max across ranks
    close_timers()
    return RunLog("megatron", origin, records, global_batch=batch)


def megatron_terms(timers: dict[str, float]) -> dict[str, float]:
    """The parts of a step Megatron-LM's timers give: compute (forward and backward compute), the
    pipeline (forward-backward less compute: send/receive and the bubble), the data-parallel
    reduction and the optimizer."""
    out = {part: sum(timers[n] for n in names if n in timers) for part, names in MEGATRON_TIMERS.items()
           if any(n in timers for n in names)}
    if "forward-backward" in timers and "compute" in out:
        out["pipeline"] = max(timers["forward-backward"] - out["compute"], 0.0)
    return out


# ---- torchtitan --------------------------------------------------------------------------------
# torchtitan/components/metrics.py:461-469 (MetricsProcessor.log): f"step: {step:2}  " ...
# f"memory: {device_mem_stats.max_reserved_gib:5.2f}GiB({...max_reserved_pct:.2f}%)  " f"tps: {round(tps):,}  "
# (ANSI colours around each field); :422 tps = tokens since the last log / (time * non-data-parallel
# size), tokens per second per GPU; :55 GiB = 1024**3 bytes; peak stats reset at every log (:475).
_TITAN = re.compile(r"(?<!validate )step:\s*([0-9]+)\s+loss:.*?memory:\s*" + _NUM + r"GiB\(" + _NUM
                    + r"%\)\s+tps:\s*([0-9][0-9,]*)")


def parse_torchtitan(text: str, origin: str) -> RunLog:
    records: list[StepRecord] = []
    last = 0
    for line in text.splitlines():
        m = _TITAN.search(_ANSI.sub("", line))
        if not m:
            continue
        step = int(m.group(1))
        tps = float(m.group(4).replace(",", ""))
        records.append(StepRecord(step=step, steps=max(step - last, 1), tokens_per_s_per_gpu=tps or None,
                                  memory={"reserved": float(m.group(2)) * GIB}))
        last = step
    return RunLog("torchtitan", origin, records)


# ---- DeepSpeed ---------------------------------------------------------------------------------
# deepspeed/utils/timer.py:264-273 (ThroughputTimer.stop): "epoch={}/micro_step={}/global_step={},
# RunningAvgSamplesPerSec={}, CurrSamplesPerSec={}, MemAllocated={}GB, MaxMemAllocated={}GB", with
# CurrSamplesPerSec = batch_size / the last step's time (batch_size = train_batch_size, the global
# batch: deepspeed/runtime/engine.py:637-640) and GB = 1024**3 bytes rounded to 2 digits.
# deepspeed/utils/timer.py:144-148 (SynchronizedWallClockTimer.log): "time (ms)" + " | {}: {:.2f}" per
# timer; the global timers 'fwd', 'bwd', 'bwd_inner', 'bwd_allreduce', 'step' (:12-20) are logged
# once per optimizer step with wall_clock_breakdown (deepspeed/runtime/engine.py:3677).
_DS_TPUT = re.compile(r"epoch=([0-9]+)/micro_step=([0-9]+)/global_step=([0-9]+), RunningAvgSamplesPerSec=\S+, "
                      r"CurrSamplesPerSec=" + _NUM + r", MemAllocated=" + _NUM + r"GB, MaxMemAllocated=" + _NUM + "GB")
_DS_TIMES = re.compile(r"time \(ms\)((?: \| [a-z_]+: [0-9.]+)+)")


def parse_deepspeed(text: str, origin: str) -> RunLog:
    records: list[StepRecord] = []
    breakdowns = 0
    for line in text.splitlines():
        m = _DS_TPUT.search(line)
        if m:
            step = int(m.group(3))
            records.append(StepRecord(step=step, samples_per_s=float(m.group(4)) or None,
                                      memory={"allocated": float(m.group(6)) * GIB}))
            continue
        m = _DS_TIMES.search(line)
        if m:
            t = dict(part.split(": ") for part in m.group(1).strip(" |").split(" | "))
            if "fwd" not in t:  # the micro-step timers' line
                continue
            ms = {k: float(v) / 1e3 for k, v in t.items()}
            breakdowns += 1
            records.append(StepRecord(step=breakdowns, terms={
                "compute": ms.get("fwd", 0.0) + ms.get("bwd_inner", ms.get("bwd", 0.0)),
                "dp": ms.get("bwd_allreduce", 0.0), "optimizer": ms.get("step", 0.0)}))
    return RunLog("deepspeed", origin, records)


# ---- nanotron ----------------------------------------------------------------------------------
# nanotron/logging.py:279-283 (LoggerWriter.add_scalars_from_list): "iteration: {step} / {total}" and
# " | ".join of :273 f"{tag}: {human_format(value)}"; :234-245 human_format: 3 significant digits and
# a suffix K, M, G, T, P, E of 1000 each. nanotron/trainer.py:443 elapsed_time_per_iteration_ms,
# :446 tokens_per_sec_per_gpu, :467 cuda_max_memory_reserved (bytes), each LogItem "human_format".
_NANO = re.compile(r"iteration: ([0-9]+) / ([0-9]+) \| (.*)$")
_HUMAN = re.compile(r"^(-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)([KMGTPE]?)$")
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def human_value(text: str) -> float | None:
    """A number nanotron's ``human_format`` printed (``1.23K``), or None."""
    m = _HUMAN.match(text.strip())
    return float(m.group(1)) * _SUFFIX[m.group(2)] if m else None


def parse_nanotron(text: str, origin: str) -> RunLog:
    records: list[StepRecord] = []
    batch = None
    last = 0
    for line in text.splitlines():
        m = _NANO.search(line)
        if not m:
            continue
        fields = {}
        for part in m.group(3).split(" | "):
            tag, _, value = part.partition(": ")
            v = human_value(value)
            if v is not None:
                fields[tag.strip()] = v
        if "elapsed_time_per_iteration_ms" not in fields:
            continue
        step = int(m.group(1))
        batch = int(fields["global_batch_size"]) if "global_batch_size" in fields else batch
        mem = {"reserved": fields["cuda_max_memory_reserved"]} if "cuda_max_memory_reserved" in fields else {}
        records.append(StepRecord(step=step, steps=max(step - last, 1),
                                  step_time_s=fields["elapsed_time_per_iteration_ms"] / 1e3, memory=mem))
        last = step
    return RunLog("nanotron", origin, records, global_batch=batch)


# ---- shardplan's runtime -----------------------------------------------------------------------
# runtime/train.py, run(): per step "step", "step_time_s" (the slowest rank), "memory_tracked" (the
# step whose live tensors were counted, slower for it), and per rank "peak_bytes" (max_memory_allocated
# on a GPU, RSS on a CPU), "tensor_peak_bytes", "param_bytes", "grad_bytes", "optim_bytes";
# planner/commands/train.py writes them under "steps" with "device" and "settings".
_SHARDPLAN = re.compile(r'"steps"\s*:\s*\[')


def parse_shardplan(text: str, origin: str) -> RunLog:
    from vocab.io import decode_json

    doc = decode_json(text, origin, LogError)
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
        raise LogError(f"{origin}: not a report of 'shardplan train --output' (no list of steps)")
    gpu = doc.get("device") == "cuda"
    settings = doc.get("settings") if isinstance(doc.get("settings"), dict) else {}
    records = [_shardplan_step(st, gpu, origin) for st in doc["steps"]]
    return RunLog("shardplan", origin, records, global_batch=_count(settings.get("global_batch")),
                  seq_len=_count(settings.get("seq_len")))


def _shardplan_step(st: object, gpu: bool, origin: str) -> StepRecord:
    if not isinstance(st, dict) or not isinstance(st.get("ranks"), list) or not _number(st.get("step_time_s")):
        raise LogError(f"{origin}: a step without its step_time_s and ranks: {json.dumps(st)[:60]}")
    ranks = [r for r in st["ranks"] if isinstance(r, dict)]

    def worst(key: str) -> float | None:
        vals = [float(r[key]) for r in ranks if _number(r.get(key))]
        return max(vals) if vals else None

    mem = {}
    peak, tensors = worst("peak_bytes"), worst("tensor_peak_bytes")
    if peak is not None:
        mem["allocated" if gpu else "process"] = peak
    if tensors is not None:
        mem["allocated"] = tensors
    states = {k: v for k, v in (("params", worst("param_bytes")), ("grads", worst("grad_bytes")),
                                ("optimizer", worst("optim_bytes"))) if v is not None}
    tracked = bool(st.get("memory_tracked"))
    step = st.get("step") if isinstance(st.get("step"), int) else 0
    return StepRecord(step=int(step) + 1, step_time_s=None if tracked else float(st["step_time_s"]),
                      memory=mem, states=states)


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v and v >= 0


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _with(r: StepRecord, **changes: object) -> StepRecord:
    from dataclasses import replace

    return replace(r, **changes)


PARSERS: dict[str, Parser] = {
    "megatron": Parser("megatron", ("megatron/training/training.py training_log (Megatron-LM core_r0.16.0)",
                                    "megatron/training/utils.py report_memory", "megatron/core/timers.py:344-352"),
                       re.compile(r"elapsed time per iteration \(ms\):"), parse_megatron),
    "torchtitan": Parser("torchtitan", ("torchtitan/components/metrics.py:461-469",), re.compile(r"tps:\s*[0-9]"),
                         parse_torchtitan),
    "deepspeed": Parser("deepspeed", ("deepspeed/utils/timer.py:264-273", "deepspeed/utils/timer.py:144-148"),
                        re.compile(r"CurrSamplesPerSec="), parse_deepspeed),
    "nanotron": Parser("nanotron", ("nanotron/logging.py:273-283", "nanotron/trainer.py:443-467"),
                       re.compile(r"elapsed_time_per_iteration_ms: "), parse_nanotron),
    "shardplan": Parser("shardplan", ("runtime/train.py run", "planner/commands/train.py"), _SHARDPLAN,
                        parse_shardplan),
}
