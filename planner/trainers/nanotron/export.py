"""nanotron: the YAML ``parallelism`` block, with the ``tokens`` batch keys, the optimizer's ZeRO stage
and, for a model nanotron 0.4's Llama builds, the ``model`` section (merge them into a full nanotron
config: general, tokenizer, data, checkpoints and the optimizer's learning rate are the user's)."""

from __future__ import annotations

from typing import Any

import yaml

from planner.reprice import plan_graph
from planner.trainers.exporting import Nearest, header
from planner.trainers.nanotron.keys import (
    NANOTRON,
    NANOTRON_DTYPES,
    NANOTRON_LLAMA,
    NANOTRON_PP_ENGINES,
    NANOTRON_TOKENIZER_PLACEHOLDER,
    NANOTRON_TP_MODES,
)
from vocab.errors import ShardplanError
from vocab.strategy import Strategy

#: nanotron 0.4's Llama: its rotary base (models/llama.py:57, RotaryEmbedding(theta=10000.0), built at :318
#: without one) and what its LlamaConfig cannot describe
NANOTRON_ROPE_THETA = 10000.0

SUFFIX = ".yaml"


def adjust(n: Nearest) -> None:
    if n.mesh["ep"] > 1:
        n.notes.append(f"nanotron counts expert parallelism as its own axis: dp = data-parallel ranks / ep = "
                       f"{n.mesh['dp_replicate'] * n.mesh['dp_shard'] // n.mesh['ep']}")
    n.extra["model"] = _llama_model(n)


def _llama_model(n: Nearest) -> dict[str, Any] | None:
    """The ``model_config`` of nanotron 0.4's LlamaConfig for the plan's model, or None with a note where
    its Llama cannot build the model (nanotron 0.4's models are Llama and StarCoder2)."""
    try:
        cfg = dict(plan_graph(n.plan).config)
    except (ShardplanError, ImportError, OSError) as err:
        n.notes.append(f"the model section is not written (the model's config is not loadable: {err})")
        return None
    unlike = [what for what, differs in (
        ("a gated SiLU MLP", cfg.get("activation") != "swiglu"), ("RMSNorm", cfg.get("norm") != "rmsnorm"),
        ("rotary positions", cfg.get("position") != "rope"), ("no biases", bool(cfg.get("bias") or cfg.get("qkv_bias"))),
        ("no experts", bool(cfg.get("experts"))), ("no sliding window", bool(cfg.get("sliding_window"))),
        ("no QK norm", bool(cfg.get("qk_norm"))), ("norms before each sublayer only", bool(cfg.get("sandwich_norm"))),
        ("standard attention heads", bool(cfg.get("kv_lora_rank"))),
        ("head width = hidden / heads", bool(cfg.get("head_dim")) and cfg["head_dim"] * cfg["heads"] != cfg["hidden"]),
    ) if differs]
    if unlike:
        n.notes.append(f"the model section is not written: nanotron 0.4's Llama has {', '.join(unlike)}, unlike "
                       f"{n.plan.inputs.model}; give model.model_config for your own model class")
        return None
    theta = float(cfg.get("rope_theta") or 0.0)
    if theta and theta != NANOTRON_ROPE_THETA:
        n.notes.append(f"nanotron 0.4's Llama fixes the rotary base at {NANOTRON_ROPE_THETA:g}; the model's "
                       f"{theta:g} cannot be set (models/llama.py:57,318)")
    out: dict[str, Any] = {"is_llama_config": True}
    for fact, key in NANOTRON_LLAMA.items():
        value = cfg.get(fact)
        if fact == "kv_heads":
            value = value or cfg.get("heads")
        if fact == "max_seq":
            value = max(int(value or 0), n.workload_model().seq_len)
        if value is not None and value != 0 or fact == "tied_embeddings":
            out[key] = bool(value) if fact == "tied_embeddings" else value
    return out


def render(n: Nearest, s: Strategy, cost: str) -> str:
    K, m, w = NANOTRON, s.mesh, n.workload_model()
    shard = n.values("sharding")[0] if n.units else s.default.sharding
    par = {K["dp"]: m.dp // m.ep, K["pp"]: m.pp, K["tp"]: m.tp,
           K["pp_engine"]: NANOTRON_PP_ENGINES.get(s.schedule, "1f1b"),
           K["tp_mode"]: NANOTRON_TP_MODES[s.sequence_parallel], K["tp_async"]: s.sequence_parallel,
           K["ep"]: m.ep}
    doc = {
        K["parallelism"]: par,
        K["tokens"]: {K["micro_batch"]: s.micro_batch, K["grad_accum"]: s.num_microbatches(w.global_batch),
                      K["seq_len"]: w.seq_len},
        K["optimizer"]: {K["zero_stage"]: 1 if shard == "zero1" else 0},
    }
    if n.extra.get("model"):
        doc[K["model"]] = {K["dtype"]: NANOTRON_DTYPES[w.precision], K["init_method"]: {"std": 0.02},
                           K["model_config"]: n.extra["model"]}
    doc[K["tokenizer"]] = {K["tokenizer_path"]: NANOTRON_TOKENIZER_PLACEHOLDER}
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    unset = ("# a fragment of a nanotron config: merge it into yours (general, data_stages, checkpoints and the "
             "optimizer's learning rate are the run's); tokenizer_name_or_path is a placeholder to set\n")
    return header(n.plan, n.label, n.losses, cost) + unset + body
