"""nanotron: a YAML config read back into a plan (the inverse of ``export --to nanotron``).

It reads exactly these keys (every other key must be one nanotron 0.4 knows, and is not priced):

- ``parallelism.dp``, ``pp``, ``tp`` (required, as nanotron requires them) and ``expert_parallel_size``
  (default 1): nanotron's world is dp x tp x pp x ep; the plan carves ep out of its data-parallel
  ranks, so ``dp_shard = dp x expert_parallel_size`` (the exporter writes ``dp`` = data-parallel ranks / ep);
- ``parallelism.pp_engine``: ``afab`` is GPipe, ``1f1b`` is 1F1B (nanotron's default is afab); the
  blocks split evenly;
- ``parallelism.tp_mode``: ``REDUCE_SCATTER`` is sequence parallelism (with tp > 1), ``ALL_REDUCE``
  (the default) is none, in either case; ``tp_linear_async_communication`` is not priced, and nanotron
  refuses it with ``ALL_REDUCE``;
- ``tokens.micro_batch_size`` and ``batch_accumulation_per_replica`` (required): the global batch is
  micro-batch x accumulation x ``dp_shard`` (as the exporter counts it); ``tokens.sequence_length``
  (else ``--seq-len``);
- ``optimizer.zero_stage`` (required): 0 is replicate, 1 is zero1;
- ``model.dtype``: ``bfloat16`` (the default) is bf16, ``float32`` is fp32;
- ``model.model_config`` of a Llama (``is_llama_config``): its layers, hidden size, heads, KV heads and
  FFN width must be the priced model's (``--model`` or the export's header), else the file is refused.

nanotron 0.4 has no keys for recomputation, context parallelism or offload: none of them is used.
The model and the cluster come from the export's ``shardplan-inputs`` line or ``--model``/``--cluster``.
"""

from __future__ import annotations

from typing import Any

from planner.trainers.nanotron.keys import NANOTRON, NANOTRON_LLAMA, NANOTRON_PP_ENGINES, NANOTRON_TP_MODES
from planner.trainers.reading import ConfigError, Context, count, refuse_unknown, unknown_keys
from vocab.io import decode_yaml
from vocab.targets import Target, key_snapshot

SUFFIXES = (".yaml", ".yml")
K = {k: str(v) for k, v in NANOTRON.items() if v is not None}
MODEL, DTYPE = "model", "dtype"  # model.dtype (not in keys.py)
ENGINES = {v: k for k, v in NANOTRON_PP_ENGINES.items()}
DEFAULT_ENGINE = NANOTRON_PP_ENGINES["gpipe"]  # ParallelismArgs: AllForwardAllBackwardPipelineEngine
TP_MODES = {v: k for k, v in NANOTRON_TP_MODES.items()}
DEFAULT_TP_MODE = NANOTRON_TP_MODES[False]
SHARDINGS = {0: "replicate", 1: "zero1"}
PRECISIONS = {"bfloat16": "bf16", "float32": "fp32"}


def parse(text: str, origin: str, t: Target) -> dict[str, Any]:
    doc = decode_yaml(text, origin, ConfigError)
    if not isinstance(doc, dict):
        raise ConfigError(f"{origin}: a nanotron config is a YAML mapping, not {type(doc).__name__}")
    refuse_unknown(unknown_keys(doc, key_snapshot(t)["tree"]), t, origin)
    return doc


def _section(doc: dict[str, Any], key: str, origin: str) -> dict[str, Any]:
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{origin}: {key} must be a mapping, got {value!r}")
    return value


def _required(doc: dict[str, Any], section: str, key: str, origin: str, minimum: int = 1) -> int:
    value = _section(doc, K[section], origin).get(K[key])
    if value is None:
        raise ConfigError(f"{origin} does not set {K[section]}.{K[key]} (nanotron requires it)")
    return count(value, f"{K[section]}.{K[key]}", origin, minimum)


def _choice(value: Any, where: str, known: dict[Any, Any], origin: str) -> Any:
    if not isinstance(value, str | int) or isinstance(value, bool) or value not in known:
        raise ConfigError(f"{origin}: {where} {value!r} is not one of {', '.join(map(str, known))}")
    return known[value]


def workload(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    dtype = _section(doc, MODEL, origin).get(DTYPE, "bfloat16")
    out: dict[str, Any] = {"precision": _choice(dtype, f"{MODEL}.{DTYPE}", PRECISIONS, origin)}
    seq = _section(doc, K["tokens"], origin).get(K["seq_len"])
    if seq is not None:
        out["seq_len"] = count(seq, f"{K['tokens']}.{K['seq_len']}", origin)
    return out


#: the model facts a Llama model_config must share with the priced model
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden")


def check_model(doc: dict[str, Any], ctx: Context) -> None:
    """Refuse a Llama ``model.model_config`` whose shape (:data:`SHAPE`) is not the priced model's."""
    cfg = doc.get(MODEL, {}).get(K["model_config"]) if isinstance(doc.get(MODEL), dict) else None
    if not isinstance(cfg, dict) or not cfg.get("is_llama_config") or not all(k in ctx.config for k in SHAPE):
        return  # no Llama config, or a traced model without these facts: unchecked
    heads = cfg.get(NANOTRON_LLAMA["heads"])
    theirs = {k: cfg.get(NANOTRON_LLAMA[k], heads if k == "kv_heads" else None) for k in SHAPE}
    mine = {k: ctx.config[k] or (ctx.config["heads"] if k == "kv_heads" else 0) for k in SHAPE}
    differ = [f"{NANOTRON_LLAMA[k]} {theirs[k]} (the priced model's {mine[k]})" for k in SHAPE if theirs[k] != mine[k]]
    if differ:
        priced = ctx.config.get("name") or "the model given"
        raise ConfigError(f"{ctx.origin}: {MODEL}.{K['model_config']} is not {priced}: {'; '.join(differ)}; give "
                          "--model for the model the file trains")


def strategy(doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
    o = ctx.origin
    check_model(doc, ctx)
    if K["parallelism"] not in doc:
        raise ConfigError(f"{o} has no {K['parallelism']} section")
    par = _section(doc, K["parallelism"], o)
    dp, pp, tp = (_required(doc, "parallelism", k, o) for k in ("dp", "pp", "tp"))
    ep = count(par.get(K["ep"], 1), f"{K['parallelism']}.{K['ep']}", o)
    engine = par.get(K["pp_engine"], DEFAULT_ENGINE)
    schedule = _choice(engine, f"{K['parallelism']}.{K['pp_engine']}", ENGINES, o)
    mode = par.get(K["tp_mode"], DEFAULT_TP_MODE)
    mode = mode.upper() if isinstance(mode, str) else mode  # nanotron upper-cases it
    sp = _choice(mode, f"{K['parallelism']}.{K['tp_mode']}", TP_MODES, o)
    is_async = par.get(K["tp_async"], False)
    if not isinstance(is_async, bool):
        raise ConfigError(f"{o}: {K['parallelism']}.{K['tp_async']} must be true or false, got {is_async!r}")
    if is_async and not sp:
        raise ConfigError(f"{o}: nanotron refuses {K['parallelism']}.{K['tp_async']} with tp_mode {mode}; it needs "
                          f"{NANOTRON_TP_MODES[True]}")
    stage = _required(doc, "optimizer", "zero_stage", o, minimum=0)
    sharding = _choice(stage, f"{K['optimizer']}.{K['zero_stage']}", SHARDINGS, o)
    micro = _required(doc, "tokens", "micro_batch", o)
    accum = _required(doc, "tokens", "grad_accum", o)
    fields: dict[str, Any] = {
        "mesh": {"pp": pp, "dp_shard": dp * ep, "tp": tp, "ep": ep},
        "micro_batch": micro, "schedule": schedule, "sequence_parallel": sp and tp > 1,
        "default": {"sharding": sharding, "recompute": "none", "offload": "none"}, "layers": [],
        "global_batch": micro * accum * dp * ep,
    }
    return fields
