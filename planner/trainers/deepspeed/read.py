"""DeepSpeed: a config JSON read back into a plan (the inverse of ``export --to deepspeed``).

It reads exactly these keys (every other key must be one DeepSpeed 0.19.8 knows, and is not priced):

- ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``: completed
  as DeepSpeed completes them (two give the third; one alone means one accumulation step), with
  DeepSpeed's rule that the batch is micro-batch x accumulation x data-parallel ranks;
- ``bf16.enabled`` (or its old name ``bfloat16``): true is bf16; false or no section is fp32, as in
  DeepSpeed; ``fp16.enabled`` true is refused (fp16 is not priced);
- ``zero_optimization.stage`` 0-3: replicate, zero1, zero2, zero3 for every unit, sharded over all
  ``dp = world / (tp x pp x cp)`` data-parallel ranks (``dp_shard``); ``offload_optimizer.device`` cpu
  offloads the optimizer, with ``offload_param.device`` cpu the parameters too (nvme is refused; the
  deprecated ``cpu_offload``/``cpu_offload_param`` switches count as these);
  ``zero_hpz_partition_size`` (ZeRO++ hpZ) is priced as plain ZeRO-3, as the exporter's nearest plan is;
- ``tensor_parallel.autotp_size``: tp (AutoTP has no sequence parallelism);
- ``sequence_parallel_size``: cp, Ulysses; ``data_parallel_size`` beside it must make the whole world with
  it (deepspeed.initialize builds that mesh), and is otherwise not read;
- ``pipeline.stages``: pp, 1F1B, the blocks split evenly (``partition`` uniform);
  ``pipeline.activation_checkpoint_interval`` 1: full recompute of every block;
- ``activation_checkpointing.number_checkpoints``: the JSON counts checkpointed modules, the model code
  picks them. A count equal to the transformer blocks is read as full recompute of every block, one
  equal to all units (embedding, blocks, head) as full recompute of every unit; any other count is
  refused, since which units recompute cannot be told from the JSON.

Not in the JSON: the model, the cluster and the sequence length (``--model``, ``--cluster``,
``--seq-len``), and expert parallelism, which the model code sets (``deepspeed.moe.layer.MoE(ep_size=)``):
it is ``--ep`` (``Context.ep``; 1 when not given).
"""

from __future__ import annotations

from typing import Any

from planner.trainers.deepspeed.keys import DEEPSPEED, DEEPSPEED_PARTITION, DEEPSPEED_ZERO_STAGE
from planner.trainers.reading import ConfigError, Context, count, refuse_unknown, unit_choices, unknown_keys
from vocab.io import decode_json
from vocab.targets import Target, key_snapshot

#: expert parallelism comes from the command line (``import --ep``): the JSON has no key for it
EP_FROM_COMMAND_LINE = True
SUFFIXES = (".json",)
K = {k: str(v) for k, v in DEEPSPEED.items() if v is not None}
BF16_OLD = "bfloat16"  # DeepSpeed's old name of the bf16 section (not in keys.py)
FP16 = "fp16"  # the fp16 section (not in keys.py)
OLD_OFFLOAD, OLD_OFFLOAD_PARAM = "cpu_offload", "cpu_offload_param"  # deprecated ZeRO switches (not in keys.py)
SHARDINGS = {v: k for k, v in DEEPSPEED_ZERO_STAGE.items()}


def parse(text: str, origin: str, t: Target) -> dict[str, Any]:
    doc = decode_json(text, origin, ConfigError)
    if not isinstance(doc, dict):
        raise ConfigError(f"{origin}: a DeepSpeed config is a JSON object, not {type(doc).__name__}")
    snap = key_snapshot(t)
    tree: dict[str, Any] = dict.fromkeys(snap["top_level"])
    for path, keys in sorted(snap["sections"].items()):  # "a" before "a.b"
        *parents, last = path.split(".")
        node = tree
        for p in parents:
            node = node[p]
        node[last] = dict.fromkeys(keys)
    tree[BF16_OLD] = tree[K["bf16"]]
    refuse_unknown(unknown_keys(doc, tree), t, origin)
    return doc


def _section(doc: dict[str, Any], key: str, origin: str) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{origin}: {key} must be an object, got {value!r}")
    return value


def _enabled(doc: dict[str, Any], key: str, origin: str) -> bool:
    value = _section(doc, key, origin).get(K["enabled"], False)
    if not isinstance(value, bool):
        raise ConfigError(f"{origin}: {key}.{K['enabled']} must be true or false, got {value!r}")
    return value


def workload(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    if _enabled(doc, FP16, origin):
        raise ConfigError(f"{origin}: fp16 training (fp16.enabled) is not priced; bf16 or fp32 are")
    bf16 = K["bf16"] if K["bf16"] in doc else BF16_OLD
    out: dict[str, Any] = {"precision": "bf16" if _enabled(doc, bf16, origin) else "fp32"}
    if doc.get(K["train_batch"]) is not None:
        out["global_batch"] = count(doc[K["train_batch"]], K["train_batch"], origin)
    return out


def strategy(doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
    o = ctx.origin
    tp = count(_section(doc, K["tensor_parallel"], o).get(K["autotp_size"], 1),
               f"{K['tensor_parallel']}.{K['autotp_size']}", o)
    cp = count(doc.get(K["sequence_parallel_size"], 1), K["sequence_parallel_size"], o)
    pipe = _section(doc, K["pipeline"], o)
    pp = count(pipe.get(K["pipe_stages"], 1), f"{K['pipeline']}.{K['pipe_stages']} (a number: DeepSpeed's "
               "'auto' leaves the stage count to the model code)", o)
    partition = pipe.get(K["pipe_partition"], DEEPSPEED_PARTITION)
    if pp > 1 and partition != DEEPSPEED_PARTITION:
        raise ConfigError(f"{o}: {K['pipeline']}.{K['pipe_partition']} {partition!r} is not priced; accepted: "
                          f"{DEEPSPEED_PARTITION} (even layer counts)")
    if ctx.world % (tp * pp * cp):
        raise ConfigError(f"{o}: autotp_size {tp} x pipeline stages {pp} x sequence_parallel_size {cp} does not "
                          f"divide {ctx.world} GPUs")
    dp = ctx.world // (tp * pp * cp)
    given = doc.get(K["data_parallel_size"])
    if given is not None and cp > 1 and count(given, K["data_parallel_size"], o) * cp != ctx.world:
        raise ConfigError(f"{o}: {K['data_parallel_size']} {given} x {K['sequence_parallel_size']} {cp} is not the "
                          f"{ctx.world} GPUs, which deepspeed.initialize's mesh must cover")
    fields: dict[str, Any] = {"mesh": {"pp": pp, "dp_shard": dp, "cp": cp, "tp": tp, "ep": ctx.ep or 1},
                              "schedule": "1f1b", "sequence_parallel": False,
                              "cp_mode": "ulysses" if cp > 1 else "ring"}
    _batch(doc, dp, fields, o)
    zero = _section(doc, K["zero"], o)
    stage = zero.get(K["stage"], 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in SHARDINGS:
        raise ConfigError(f"{o}: {K['zero']}.{K['stage']} {stage!r} is not one of {', '.join(map(str, SHARDINGS))}")
    if pp > 1 and stage > 1:
        raise ConfigError(f"{o}: DeepSpeed's pipeline engine runs ZeRO stage 0 or 1, not {stage}")
    offload = _offload(zero, stage, o)
    fields.update(unit_choices(ctx.units, _recompute(doc, pipe, ctx), SHARDINGS[stage], offload))
    return fields


def _batch(doc: dict[str, Any], dp: int, fields: dict[str, Any], o: str) -> None:
    """The micro-batch (and the global batch when the file leaves it out), as DeepSpeed completes them."""
    names = (K["train_batch"], K["micro_batch"], K["grad_accum"])
    tb, mb, ga = (None if doc.get(k) is None else count(doc[k], k, o) for k in names)
    if tb is None:
        if mb is None:
            raise ConfigError(f"{o}: DeepSpeed needs {names[0]} or {names[1]}; the file has neither")
        fields["global_batch"] = mb * (ga or 1) * dp
    else:
        if mb is None:  # DeepSpeed: train_batch // dp // accumulation (one step when it is not given)
            mb = tb // dp // (ga or 1)
        accum = ga if ga is not None else tb // mb // dp if mb else 0
        if mb < 1 or accum < 1 or tb != mb * accum * dp:
            raise ConfigError(f"{o}: {names[0]} {tb} is not {names[1]} {mb} x {names[2]} {accum} x {dp} "
                              f"data-parallel ranks (= {mb * accum * dp}); DeepSpeed refuses a batch that does "
                              "not add up")
    fields["micro_batch"] = mb


def _offload(zero: dict[str, Any], stage: int, o: str) -> str:
    """What ZeRO offloads to the CPU: ``none``, ``optimizer`` or ``params`` (the optimizer too)."""
    devices = {}
    for key, old in ((K["offload_optimizer"], OLD_OFFLOAD), (K["offload_param"], OLD_OFFLOAD_PARAM)):
        sub = zero.get(key)
        if sub is None:
            sub = {K["device"]: "cpu"} if zero.get(old) is True else {}  # the deprecated switch
        if not isinstance(sub, dict):
            raise ConfigError(f"{o}: {K['zero']}.{key} must be an object, got {sub!r}")
        dev = sub.get(K["device"], "none")
        if dev not in ("none", "cpu"):
            raise ConfigError(f"{o}: {K['zero']}.{key}.{K['device']} {dev!r} is not priced; accepted: none, cpu")
        devices[key] = dev
    opt, par = devices[K["offload_optimizer"]] == "cpu", devices[K["offload_param"]] == "cpu"
    if par and not opt:
        raise ConfigError(f"{o}: {K['offload_param']} without {K['offload_optimizer']} is not priced (offloading "
                          "parameters is priced with the optimizer offloaded too)")
    if par and stage != 3:
        raise ConfigError(f"{o}: DeepSpeed offloads parameters ({K['offload_param']}) under ZeRO stage 3 only")
    if opt and stage == 0:
        raise ConfigError(f"{o}: DeepSpeed offloads the optimizer ({K['offload_optimizer']}) under ZeRO stages 1-3 only")
    return "params" if par else "optimizer" if opt else "none"


def _recompute(doc: dict[str, Any], pipe: dict[str, Any], ctx: Context) -> dict[str, str]:
    """Each unit's recompute, from what the JSON says unambiguously (see the module docstring)."""
    o, blocks, units = ctx.origin, ctx.blocks, len(ctx.units)
    where = f"{K['pipeline']}.{K['pipe_ac_interval']}"
    interval = count(pipe.get(K["pipe_ac_interval"], 0), where, o, 0)
    if interval > 1:
        raise ConfigError(f"{o}: {where} {interval} (checkpoints of {interval} layers each) is not priced; "
                          "accepted: 0, 1")
    ac = _section(doc, K["ac"], o)
    number = ac.get(K["ac_number"])
    if number is None:
        number = blocks if interval == 1 else 0
    what = f"{K['ac']}.{K['ac_number']}"
    number = count(number, what, o, 0)
    if number == 0 and interval == 0:
        return dict.fromkeys(ctx.units, "none")
    explicit_zero = K["pipe_ac_interval"] in pipe and interval == 0
    if number not in (blocks, units) or explicit_zero:
        why = (f"{where} 0 says not every block recomputes fully, yet {what} counts {number}" if explicit_zero
               and number in (blocks, units) else f"{what} is {number}")
        raise ConfigError(f"{o}: which units recompute cannot be told from the JSON ({why}; the model code "
                          f"picks the checkpointed modules): only 0, {blocks} (every transformer block) or "
                          f"{units} (every unit) is read")
    return {u: "full" if number == units or u.startswith("layers.") else "none" for u in ctx.units}
