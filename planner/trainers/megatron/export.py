"""Megatron-LM: the model-shape, parallelism, batch, precision and overlap flags of ``pretrain_gpt.py``,
one per line.

The output is shell words: flag names are Megatron-LM's, values are numbers or words of a closed
character set, and anything else is quoted by ``shlex.quote``; header lines are whole-line comments. It
parses with ``shlex.split(text, comments=True)``; in bash::

    eval "PLAN_ARGS=($(cat plan.args))"
    torchrun ... pretrain_gpt.py "${PLAN_ARGS[@]}" <optimizer, learning-rate and checkpoint flags>

The tokenizer and data flags are written as placeholders (``MEGATRON_PLACEHOLDERS``: ``SET-ME/...``
paths Megatron-LM's parser accepts and its start-up refuses while they name nothing), to be set.

The model's shape comes from the plan's model (its recorded layer graph, preset or config file). The
overlap flags are those the price assumes: the cost model hides the data-parallel gradient reduction
(``dp_overlap``) and the distributed optimizer's parameter all-gather (``fsdp_overlap``) under compute,
so ``--overlap-grad-reduce`` and, with the distributed optimizer or Megatron-FSDP (ZeRO-3: its
per-layer gathers), ``--overlap-param-gather`` are always set; ``--tp-comm-overlap`` only where the accelerator's cost constants hide TP collectives
(``tp_overlap`` > 0) and sequence parallelism is on.
"""

from __future__ import annotations

import math
import re
import shlex
from typing import Any

from costmodel.constants import constants_for
from costmodel.experts import overlap_runs
from planner.reprice import plan_graph
from planner.trainers.exporting import Nearest, header, runs_text
from planner.trainers.megatron.keys import (
    FSDP_OWN_GRAD_DTYPE,
    MEGATRON,
    MEGATRON_CP_COMM,
    MEGATRON_FP8_FORMAT,
    MEGATRON_FP8_RECIPE,
    MEGATRON_FSDP,
    MEGATRON_MXFP8,
    MEGATRON_NORM,
    MEGATRON_PLACEHOLDERS,
    MEGATRON_POSITION,
)
from vocab.errors import ShardplanError
from vocab.strategy import Strategy, Workload

SUFFIX = ".args"


def adjust(n: Nearest) -> None:
    _stages(n)
    _recompute(n)
    _overlap(n)
    _shape(n)
    _adam_states(n)
    if "zero3" in (n.values("sharding") if n.units else []):
        n.notes.append("Megatron-FSDP: leave CUDA_DEVICE_MAX_CONNECTIONS unset or above 1 (Megatron-LM asserts it)")


def _adam_states(n: Nearest) -> None:
    """Megatron's precision-aware optimizer (``adam_states = bf16``) runs with the distributed optimizer
    only (megatron-core 0.16.1 optimizer_config.py:375-381): under DDP it keeps fp32 states."""
    if n.workload["adam_states"] == "bf16" and "replicate" in (n.values("sharding") if n.units else []):
        n.behave("Adam's state", "bf16 → fp32 (Megatron's precision-aware optimizer needs the distributed optimizer)")
        n.workload["adam_states"] = "fp32"


def _rotary_and_norm_flags(n: Nearest, cfg: dict[str, Any]) -> list[tuple[str, Any]]:
    """``--rotary-base`` and ``--norm-epsilon`` where the model's config states them; a note for a
    rotary model whose base it does not state (Megatron-LM would train with its default, 10000)."""
    K, out = MEGATRON, []
    theta, eps = float(cfg.get("rope_theta") or 0.0), float(cfg.get("norm_eps") or 0.0)
    if cfg.get("position") == "rope":
        if theta.is_integer() and theta:
            out.append((K["rotary_base"], int(theta)))
        elif theta:  # Megatron-LM parses --rotary-base as an integer
            n.notes.append(f"the rotary base {theta:g} is not a whole number, which --rotary-base takes: set it in "
                           "the model's TransformerConfig (rotary_base)")
        else:
            n.notes.append("the model's config states no rotary base: set --rotary-base (Megatron-LM's default is 10000)")
    if eps:
        out.append((K["norm_eps"], eps))
    return out


def _shape(n: Nearest) -> None:
    """The model-shape flags of the plan's model (``n.extra["shape"]``), with a note for what has none."""
    try:
        cfg: dict[str, Any] = dict(plan_graph(n.plan).config)
    except (ShardplanError, ImportError, OSError) as err:
        n.notes.append(f"the model's shape flags are not written (its config is not loadable: {err})")
        return
    K, out = MEGATRON, []
    heads, hidden = cfg.get("heads", 0), cfg.get("hidden", 0)
    out += [(K["hidden"], hidden), (K["ffn_hidden"], cfg.get("ffn_hidden")), (K["heads"], heads)]
    if cfg.get("kv_lora_rank"):  # multi-head latent attention: its own head widths, no kv-channels
        out += [(K["mla"], True), (K["q_lora_rank"], cfg.get("q_lora_rank") or None),
                (K["kv_lora_rank"], cfg["kv_lora_rank"]), (K["qk_head_dim"], cfg["head_dim"]),
                (K["qk_rope_head_dim"], cfg.get("qk_rope_head_dim")), (K["v_head_dim"], cfg.get("v_head_dim"))]
    elif cfg.get("head_dim") and heads and cfg["head_dim"] * heads != hidden:
        out.append((K["head_dim"], cfg["head_dim"]))
    if cfg.get("mtp_layers"):  # blocks after the decoder's, on the last stage: not in --num-layers
        out.append((K["mtp_layers"], cfg["mtp_layers"]))
        n.extra["mtp_layers"] = int(cfg["mtp_layers"])
    if cfg.get("sliding_window"):
        n.notes.append(f"the sliding window ({cfg['sliding_window']} tokens) has no Megatron-LM flag: set "
                       "window_size in the model's TransformerConfig")
    if cfg.get("sandwich_norm"):
        n.notes.append("the norms after the attention and the MLP have no Megatron-LM flag")
    if cfg.get("kv_heads") and cfg["kv_heads"] != heads:
        out += [(K["gqa"], True), (K["kv_heads"], cfg["kv_heads"])]
    act, norm, pos = cfg.get("activation", "gelu"), cfg.get("norm", "layernorm"), cfg.get("position", "learned")
    if act == "swiglu":
        out.append((K["swiglu"], True))
    elif act != "gelu":
        n.notes.append(f"activation {act!r} has no Megatron-LM flag (gelu is its default)")
    if norm in MEGATRON_NORM:
        out.append((K["norm"], MEGATRON_NORM[norm]))
    else:
        n.notes.append(f"normalization {norm!r} has no Megatron-LM flag")
    if pos in MEGATRON_POSITION:
        out.append((K["position"], MEGATRON_POSITION[pos]))
    else:
        n.notes.append(f"position embedding {pos!r} has no Megatron-LM flag")
    out += _rotary_and_norm_flags(n, cfg)
    out.append((K["max_seq"], max(cfg.get("max_seq") or 0, n.workload_model().seq_len)))
    out += [(K["untie"], True if not cfg.get("tied_embeddings", True) else None),
            (K["no_bias"], True if not cfg.get("bias", True) else None),
            (K["qkv_bias"], True if cfg.get("qkv_bias") and not cfg.get("bias", True) else None),
            (K["qk_norm"], True if cfg.get("qk_norm") else None),
            (K["attention_dropout"], float(cfg.get("dropout", 0.0))), (K["hidden_dropout"], float(cfg.get("dropout", 0.0)))]
    experts = cfg.get("experts", 0)
    if experts:
        moe_ffn = cfg.get("moe_ffn_hidden") or cfg.get("ffn_hidden")
        out += [(K["experts"], experts), (K["top_k"], cfg.get("top_k") or 1), (K["moe_ffn_hidden"], moe_ffn)]
        if cfg.get("shared_experts"):
            out.append((K["shared_expert_hidden"], cfg["shared_experts"] * moe_ffn))
        dense, layers = cfg.get("dense_layers", 0), cfg.get("layers", len(n.blocks))
        if dense:
            out.append((K["moe_layer_freq"], f"[0]*{dense}+[1]*{layers - dense}"))
        if cfg.get("expert_groups"):
            out += [(K["router_groups"], cfg["expert_groups"]), (K["router_group_topk"], cfg["group_top_k"])]
        # the experts as priced: grouped GEMMs and fused permutations (Transformer Engine)
        out += [(K["moe_grouped_gemm"], True), (K["moe_permute_fusion"], True)]
    n.extra["shape"] = out


def _dispatch(w: Workload, pp: int, vpp: int, recompute: list[str]) -> list[tuple[str, object]]:
    """The token dispatcher the price assumes (an all-to-all, or DeepEP's de-duplicating one), and
    the all-to-all overlap where Megatron runs it (``costmodel.experts.overlap_runs``, which the
    price uses too)."""
    K = MEGATRON
    out: list[tuple[str, object]] = [(K["moe_dispatcher"], "flex" if w.moe_dispatch == "dedup" else "alltoall")]
    if w.moe_dispatch == "dedup":
        out.append((K["moe_flex_backend"], "deepep"))
    if w.moe_overlap == "1f1b" and bool(overlap_runs(pp, vpp, "full" in recompute)):
        out.append((K["moe_overlap"], True))
    return out


def _overlap(n: Nearest) -> None:
    """Megatron refuses the all-to-all overlap once any block recomputes fully: a plan priced with
    it on the blocks that do not is priced again without it."""
    rec = n.values("recompute", n.blocks)
    if (n.workload.get("moe_overlap") == "1f1b" and n.mesh["ep"] > 1 and "full" in rec and set(rec) != {"full"}
            and bool(overlap_runs(n.mesh["pp"], n.fields["vpp"], False))):
        n.behave("MoE all-to-all overlap", "1f1b → none (Megatron refuses it with full recomputation of any block)")
        n.workload["moe_overlap"] = "none"


def _mtp(n: Nearest) -> int:
    """The plan's model's multi-token-prediction layers (its last blocks; 0 where its config is not loadable)."""
    try:
        return int(plan_graph(n.plan).config.get("mtp_layers", 0) or 0)
    except (ShardplanError, ImportError, OSError):
        return 0


def _stages(n: Nearest) -> None:
    """Megatron places any number of layers on each virtual stage (the target's layer-split rule,
    :func:`vocab.targets.split_problem`, which the search asks too); the MTP layers it refuses elsewhere
    than together in the last virtual stage of a rank are moved into the last virtual stage."""
    p = n.mesh["pp"]
    if p == 1:
        return
    rule, tail, sizes = n.target.pipeline, _mtp(n), n.stage_sizes()
    problem = rule.split_problem(sizes, p, tail)
    if problem is None:
        return
    new, short = list(sizes), tail - sizes[-1]
    new[-1] = max(tail, sizes[-1])
    for k in range(len(new) - 2, -1, -1):  # the blocks the last stage takes, from the stages before it
        take = min(short, new[k]) if short > 0 else 0
        new[k], short = new[k] - take, short - take
    n.lose("pipeline stages", f"{sizes} → {new} (Megatron's pipeline layout keeps the MTP layers together in "
                              "the last virtual stage of a rank)", problem)
    n.fields["stage_layers"] = new


#: the counting flags' forms: (embedding counted, loss counted)
_ACCOUNTED = ((1, 1), (1, 0), (0, 1))


def split_flags(sizes: list[int], pp: int, vpp: int, mtp: int = 0) -> list[tuple[str | None, object]]:
    """Megatron-LM's flags for ``sizes`` transformer blocks per virtual stage (the last ``mtp`` of them MTP
    layers), the narrowest that place them: none (an even split), ``--num-layers-per-virtual-pipeline-stage``
    (equal virtual stages), ``--decoder-first/last-pipeline-num-layers`` (one stage per rank, the middle
    ones equal), ``--account-for-embedding/loss-in-pipeline-split`` (the embedding and the loss counted as
    layers, with ``--num-layers-per-virtual-pipeline-stage`` counting them too: Megatron-LM
    arguments.py:921-941), else ``--pipeline-model-parallel-layout`` (any split)."""
    K, n = MEGATRON, len(sizes)
    dec = [*sizes[:-1], sizes[-1] - mtp] if sizes[-1] >= mtp else None  # the decoder's layers (MTP on the last)
    if dec is not None and len(set(dec)) == 1:
        return [(K["vpp_layers"], dec[0])] if vpp > 1 else []
    if dec is not None and vpp == 1 and min(dec[0], dec[-1]) > 0 and len(set(dec[1:-1])) <= 1:
        return [(K["first_stage_layers"], dec[0])] + ([(K["last_stage_layers"], dec[-1])] if pp > 2 else [])
    for e, loss in _ACCOUNTED if dec is not None else ():
        k, rest = divmod(sum(dec) + e + loss, n)
        if not rest and dec == [k - e] + [k] * (n - 2) + [k - loss]:
            return [(K["account_embedding"], True if e else None), (K["account_loss"], True if loss else None),
                    (K["vpp_layers"], k if vpp > 1 else None)]
    return [(K["layout"], layout_text(sizes, mtp))]


def layout_text(sizes: list[int], mtp: int = 0) -> str:
    """``--pipeline-model-parallel-layout``: ``E`` the embedding, ``t`` a transformer layer, ``m`` an MTP
    layer, ``L`` the loss, ``|`` between virtual stages (in order: rank 0's first, rank 1's first, ...),
    ``(s|)*n`` a stage repeated, ``t*n`` a layer repeated (megatron-core 0.16.1
    transformer/pipeline_parallel_layer_layout.py:283-320)."""
    blocks, start, stages = sum(sizes), 0, []
    for i, size in enumerate(sizes):
        dec = max(0, min(start + size, blocks - mtp) - start)
        text = "".join(c if k == 1 else f"{c}*{k}" for c, k in (("t", dec), ("m", size - dec)) if k)
        stages.append(("E" if i == 0 else "") + text + ("L" if i == len(sizes) - 1 else ""))
        start += size
    out, i = "", 0
    while i < len(stages) - 1:
        j = i
        while j + 1 < len(stages) - 1 and stages[j + 1] == stages[i]:
            j += 1
        out += f"({stages[i]}|)*{j - i + 1}" if j > i else f"{stages[i]}|"
        i = j + 1
    return out + stages[-1]


def _recompute(n: Nearest) -> None:
    """One granularity for all blocks; ``full`` may cover the first N blocks of every (virtual) stage."""
    vals = n.values("recompute", n.blocks)
    if len(set(vals)) <= 1:
        return
    chunks, i = [], 0
    for size in n.stage_sizes():
        chunks.append(n.blocks[i:i + size])
        i += size
    if "full" not in vals:  # selective on some blocks only: selective on all of them
        before = ", ".join(sorted(set(vals)))
        n.lose("per-layer recompute", f"{before} → selective on every layer (one granularity in Megatron)",
               "per-layer selective recompute")
        n.set_all("recompute", "selective", n.blocks)
        return
    k = max(sum(1 for u in ch if n.choice[u]["recompute"] != "none") for ch in chunks)
    target = {u: ("full" if j < k else "none") for ch in chunks for j, u in enumerate(ch)}
    if any(n.choice[u]["recompute"] != target[u] for u in n.blocks):
        what = "full on every layer" if k >= max(map(len, chunks)) else f"full on the first {k} layer(s) of every stage"
        n.lose("per-layer recompute", f"{runs_text(n, 'recompute')} → {what} (Megatron recomputes one "
                                      "granularity; full may cover the first N layers of each stage)",
               "per-layer recompute other than full on the first N layers of every stage")
    for u in n.blocks:
        n.choice[u]["recompute"] = target[u]
    if k < max(map(len, chunks)):
        n.extra["recompute_block"] = k


def _sharding(shard: str, replicas: int) -> list[tuple[str, object]]:
    """The data-parallel flags: DDP, the distributed optimizer (ZeRO-1) or Megatron-FSDP (ZeRO-3), the
    last two sharded within an instance of ``replicas`` (HSDP); the overlaps the price assumes."""
    K = MEGATRON
    if shard == "replicate":
        return [(K["overlap_grad"], True)]
    out: list[tuple[str, object]] = [(K["dist_opt"], True)]
    if shard == "zero3":
        out += [(K["megatron_fsdp"], True), (K["fsdp_strategy"], MEGATRON_FSDP["strategy"]),
                (K["ckpt_format"], MEGATRON_FSDP["ckpt_format"])]
    out += [(K["overlap_grad"], True), (K["overlap_param"], True)]
    if replicas > 1:
        out.append((K["dist_opt_instances"], replicas))
    return out


def render(n: Nearest, s: Strategy, cost: str) -> str:
    K, m, w = MEGATRON, s.mesh, n.workload_model()
    mtp = n.extra.get("mtp_layers", 0)
    flags: list[tuple[str | None, object]] = [(K["num_layers"], len(n.blocks) - mtp or None),
                                             *n.extra.get("shape", []), (K["tp"], m.tp), (K["pp"], m.pp)]
    if m.pp > 1:
        flags += split_flags(s.stage_layout(len(n.blocks)), m.pp, s.vpp, mtp)
    flags += [(K["cp"], m.cp)]
    if m.cp > 1:
        flags.append((K["cp_comm"], MEGATRON_CP_COMM[(s.cp_mode, s.cp_rotate if s.cp_mode == "ring" else "allgather")]))
    flags += [(K["ep"], m.ep), (K["etp"], m.etp or None), (K["sp"], True if s.sequence_parallel else None)]
    if m.ep > 1:
        flags += _dispatch(w, m.pp, s.vpp, n.values("recompute", n.blocks))
    flags.append((K["moe_capacity"], w.moe_capacity_factor))
    shard = n.values("sharding")[0] if n.units else s.default.sharding
    flags += _sharding(shard, m.dp_replicate)
    if shard == "zero3" and n.target.version in FSDP_OWN_GRAD_DTYPE:
        flags.append((K["fsdp_main_grads"], "bf16" if w.grad_dtype == "bf16" and w.precision != "fp32" else "fp32"))
    if m.tp > 1 and s.sequence_parallel and constants_for(n.plan.inputs.cluster.accelerator).tp_overlap > 0:
        flags.append((K["tp_overlap"], True))
    rec = {n.choice[u]["recompute"] for u in n.blocks} - {"none"}
    if rec == {"selective"}:
        flags.append((K["recompute_granularity"], "selective"))
    elif rec == {"full"}:
        k = n.extra.get("recompute_block")
        flags += [(K["recompute_granularity"], "full"), (K["recompute_method"], "block" if k else "uniform"),
                  (K["recompute_num_layers"], k or 1)]
    if w.adam_states == "bf16":
        flags += [(K["precision_aware"], True), (K["exp_avg_dtype"], "bf16"), (K["exp_avg_sq_dtype"], "bf16")]
    if any(v == "optimizer" for v in n.values("offload")):  # Megatron-LM asserts the precision-aware optimizer
        # beside it (arguments.py:1803-1806 of the 0.19.2 wheel); its moments stay fp32 unless set above
        flags += [(K["optimizer_offload"], True), (K["optimizer_offload_fraction"], 1.0)]
        flags += [] if w.adam_states == "bf16" else [(K["precision_aware"], True)]
    flags.append((K["activation_offload_layers"], n.values("offload", n.blocks).count("activations") or None))
    flags += [(K["micro_batch"], s.micro_batch), (K["global_batch"], w.global_batch), (K["seq_len"], w.seq_len),
              (K["bf16"], True if w.precision != "fp32" else None),
              (K["grad_bf16"], True if w.precision != "fp32" and w.grad_dtype == "bf16" else None)]
    if w.precision == "fp8":
        flags += [(K["fp8"], MEGATRON_FP8_FORMAT), (K["fp8_recipe"], MEGATRON_FP8_RECIPE)]
    elif w.precision == "mxfp8":
        flags += [(K["fp8"], MEGATRON_MXFP8["format"]), (K["fp8_recipe"], MEGATRON_MXFP8["recipe"])]
    lines = [flag_line(f, v) for f, v in flags if f is not None and v is not None]
    unset = ["# placeholders: set these to the run's tokenizer and data (Megatron-LM stops at start-up while they "
             "name nothing); add the optimizer, learning-rate and checkpoint flags",
             *(flag_line(f, v) for f, v in MEGATRON_PLACEHOLDERS)]
    return header(n.plan, n.label, n.losses, cost) + "\n".join(lines + unset) + "\n"


#: a flag value written as it is: letters, digits and ``_ . , : + = / @ % -`` (no quote, space, glob
#: or shell character); any other string is quoted
_WORD = re.compile(r"^[A-Za-z0-9_.,:+=/@%-]+$")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


def flag_line(flag: str, value: object) -> str:
    """``--flag value`` as shell words: ``True`` is the bare flag, a number its decimal form, a string
    a closed-set word or ``shlex.quote``d."""
    if not _FLAG.match(flag):
        raise ShardplanError(f"'{flag}' is not a Megatron-LM flag name")
    if value is True:
        return flag
    if isinstance(value, bool):
        raise ShardplanError(f"{flag}: a flag is written or left out, not set to false")
    if isinstance(value, int):
        return f"{flag} {value}"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ShardplanError(f"{flag}: {value} is not a finite number")
        return f"{flag} {value!r}"
    if isinstance(value, str):
        return f"{flag} {value if _WORD.match(value) else shlex.quote(value)}"
    raise ShardplanError(f"{flag}: a {type(value).__name__} is not a flag value")
