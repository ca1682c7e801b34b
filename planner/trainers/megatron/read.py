"""Megatron-LM: ``pretrain_gpt.py`` flags (``export --to megatron``'s ``.args``) read back into a plan.

The text is split as ``shlex.split(text, comments=True)``: ``--flag value`` or a bare ``--flag``; a flag
neither Megatron-LM's parser (:mod:`planner.trainers.megatron.parser`) nor megatron-core's pinned
release knows is an error, and the flags the parser defines are parsed by it (value types, choices);
those not listed here are accepted and not read (data, logging, checkpoints, optimizer settings), and
:func:`unread` names them. Read: ``--seq-length``, ``--global-batch-size``
(required) and ``--micro-batch-size`` (required); precision fp8 with ``--fp8-format e4m3|hybrid`` (mxfp8 with
``--fp8-recipe mxfp8``; ``--fp4-format``, NVFP4, is refused: no FP4 throughput to price it with), else
bf16 with ``--bf16`` or ``--fp16``, else fp32; gradients reduced in bf16 with ``--grad-reduce-in-bf16``, else
fp32 (Megatron-LM's ``--bf16`` sets ``grad_reduce_in_fp32``). The mesh: ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--context-parallel-size``, ``--expert-model-parallel-size``, the
data-parallel ranks ``world / (tp*pp*cp)`` all sharded, or ``--num-distributed-optimizer-instances N``
replicas of ``dp / N``. ``--sequence-parallel`` (off when tp = 1); ``--cp-comm-type`` p2p (ring, K/V passed round
it: ``cp_rotate`` alltoall), all_gather (ring, K/V all-gathered) or a2a (Ulysses). Interleaved 1F1B with ``--num-layers-per-virtual-pipeline-stage L``: ``vpp = layers / (pp*L)``;
else 1F1B, with ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` (the
other stages share the rest evenly); ``--account-for-embedding-in-pipeline-split`` /
``--account-for-loss-in-pipeline-split`` count the embedding and the loss as layers (the first and last
virtual stage one fewer); ``--pipeline-model-parallel-layout`` gives each virtual stage's layers. ZeRO-3 with ``--use-megatron-fsdp``
(``--data-parallel-sharding-strategy optim_grads_params``, its default; other strategies are refused), ZeRO-1 with
``--use-distributed-optimizer``, DDP otherwise;
``--optimizer-cpu-offload`` (fraction 1.0) offloads the optimizer. Blocks only recompute:
``--recompute-granularity selective`` (all; ``--recompute-activations`` alike), ``full`` with ``--recompute-method uniform`` (all) or
``block`` with ``--recompute-num-layers k`` (the first k of every virtual stage). With expert
parallelism, ``--moe-token-dispatcher-type`` alltoall or flex (DeepEP or HybridEP: ``moe_dispatch``
dedup; the default allgather is refused) and ``--overlap-moe-expert-parallel-comm``; ``--moe-expert-capacity-factor``. ``--num-layers`` must
be the model's block count; other shape and overlap flags are accepted and not read.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from planner.trainers.megatron.keys import (
    FSDP_OWN_GRAD_DTYPE,
    MEGATRON_CP_COMM,
    MEGATRON_FP8_RECIPES,
    MEGATRON_FSDP,
    MEGATRON_MXFP8,
)
from planner.trainers.megatron.keys import MEGATRON as K
from planner.trainers.megatron.parser import check_flags, lm_flags
from planner.trainers.reading import ConfigError, Context, refuse_unknown, unit_choices
from vocab.digits import read_float, read_int
from vocab.strategy import UNPRICED_PRECISIONS, LayerStrategy, first_blocks_offloaded
from vocab.targets import Target, key_snapshot

SUFFIXES = (".args",)
CP_MODES = {v: k for k, v in MEGATRON_CP_COMM.items()}
FP8_FORMATS = ("e4m3", "hybrid")
RECOMPUTE_METHODS = ("uniform", "block")
FP16 = "--fp16"  # not in keys.MEGATRON: the exporter never writes it
RECOMPUTE_ACTIVATIONS = "--recompute-activations"  # Megatron-LM's selective recomputation, older spelling
#: flags the pinned release knows whose plans are not priced here
UNPRICED = ("--use-custom-fsdp", "--virtual-pipeline-model-parallel-size")

class Doc(dict[str, list[str]]):
    """Flag -> the values after it ([] for a bare flag), recording the flags the reader looks at."""

    def __init__(self, flags: dict[str, list[str]] | None = None, release: str = "") -> None:
        super().__init__(flags or {})
        self.read: set[str] = set()
        self.release = release  # the megatron-core release the file is read for (its target's version)

    def __contains__(self, flag: object) -> bool:
        self.read.add(str(flag))
        return super().__contains__(flag)

    def __getitem__(self, flag: str) -> list[str]:
        self.read.add(flag)
        return super().__getitem__(flag)

    def get(self, flag: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(flag)
        return super().get(flag, default)


def unread(doc: Doc) -> list[str]:
    """The flags of ``doc`` no price depends on: accepted (Megatron-LM's parser knows them) and not read."""
    return [f for f in dict.keys(doc) if f not in doc.read]


def _key(name: str) -> str:
    return str(K[name])


def parse(text: str, origin: str, t: Target) -> Doc:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:
        raise ConfigError(f"{origin} is not a list of command-line flags: {e}") from None
    doc: dict[str, list[str]] = {}
    flag = None
    for tok in tokens:
        if tok.startswith("--"):
            flag = tok
            doc[flag] = []  # given twice: the last one counts, as argparse reads it
        elif flag is None:
            raise ConfigError(f"{origin}: {tok!r} follows no --flag")
        else:
            doc[flag].append(tok)
    if _key("fp4") in doc:  # a flag of the release (TransformerConfig.fp4) the snapshot's table lacks
        raise ConfigError(f"{origin}: {_key('fp4')}: nvfp4: {UNPRICED_PRECISIONS['nvfp4']}")
    snap = key_snapshot(t)
    fields = {f for names in snap["classes"].values() for f in names}
    parsed = lm_flags()
    refuse_unknown([f for f in doc if f not in parsed and f not in snap["lm_flags"]
                    and f[2:].replace("-", "_") not in fields], t, origin)
    check_flags(doc, origin)
    unpriced = [f for f in UNPRICED if f in doc]
    if unpriced:
        raise ConfigError(f"{origin}: {', '.join(unpriced)} is not priced by shardplan")
    return Doc(doc, t.version)


def _on(doc: Doc, name: str, origin: str) -> bool:
    flag = _key(name)
    if doc.get(flag):
        raise ConfigError(f"{origin}: {flag} takes no value, got {' '.join(doc[flag])!r}")
    return flag in doc


def _str(doc: Doc, name: str, origin: str) -> str | None:
    flag = _key(name)
    if flag not in doc:
        return None
    if len(doc[flag]) != 1:
        raise ConfigError(f"{origin}: {flag} takes one value, got {len(doc[flag])}")
    return doc[flag][0]


def _int(doc: Doc, name: str, origin: str, default: int | None = None, minimum: int = 1,
         required: bool = False) -> int | None:
    raw = _str(doc, name, origin)
    if raw is None and required:
        raise ConfigError(f"{origin} has no {_key(name)}: Megatron-LM needs it")
    if raw is None:
        return default
    try:
        value = read_int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{origin}: {_key(name)} must be an integer >= {minimum}, got {raw!r}")
    return value


def workload(doc: Doc, origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {"global_batch": _int(doc, "global_batch", origin, required=True)}
    seq = _int(doc, "seq_len", origin)
    if seq is not None:
        out["seq_len"] = seq
    fp8 = _str(doc, "fp8", origin)
    if fp8 is not None and fp8 not in FP8_FORMATS:
        raise ConfigError(f"{origin}: {_key('fp8')} {fp8!r} is not one of {', '.join(FP8_FORMATS)}")
    recipe = _str(doc, "fp8_recipe", origin)
    if recipe is not None and recipe not in MEGATRON_FP8_RECIPES:
        raise ConfigError(f"{origin}: {_key('fp8_recipe')} {recipe!r} is not one of {', '.join(MEGATRON_FP8_RECIPES)}")
    half = _on(doc, "bf16", origin) or FP16 in doc  # fp16 is priced as bf16: two bytes a value
    mx = recipe == MEGATRON_MXFP8["recipe"]  # the recipe without --fp8-format trains in 16 bits
    out["precision"] = ("mxfp8" if mx else "fp8") if fp8 is not None else "bf16" if half else "fp32"
    if doc.release in FSDP_OWN_GRAD_DTYPE and _on(doc, "megatron_fsdp", origin):
        grads = _str(doc, "fsdp_main_grads", origin) or "auto"  # auto: the parameters' dtype
        if half and grads != "fp32":
            out["grad_dtype"] = "bf16"
    elif half and _on(doc, "grad_bf16", origin):  # else Megatron-LM's --bf16 reduces gradients in fp32
        out["grad_dtype"] = "bf16"
    adam = _adam_states(doc, origin)
    if adam:
        out["adam_states"] = adam
    capacity = _str(doc, "moe_capacity", origin)
    if capacity is not None:
        try:
            out["moe_capacity_factor"] = read_float(capacity)
        except ValueError:
            raise ConfigError(f"{origin}: {_key('moe_capacity')} must be a number, got {capacity!r}") from None
    return out | _moe(doc, origin)


#: the flex dispatcher's backends, both DeepEP's de-duplicating dispatch (``moe_dispatch`` dedup): ``deepep``,
#: and ``hybridep``, DeepEP's hierarchical NVLink/RDMA buffer (megatron-core 0.16.1
#: ``transformer/moe/fused_a2a.py:269``, ``from deep_ep import HybridEPBuffer``)
FLEX_BACKENDS = ("deepep", "hybridep")


def _moe(doc: Doc, origin: str) -> dict[str, str]:
    """How expert parallelism runs: the token dispatcher (Megatron's default, ``allgather``, is not
    priced) and the 1F1B all-to-all overlap, on only where the flag is."""
    if (_int(doc, "ep", origin, 1) or 1) == 1:
        return {}
    dispatcher = _str(doc, "moe_dispatcher", origin) or "allgather"
    backend = _str(doc, "moe_flex_backend", origin) or "deepep"
    if dispatcher not in ("alltoall", "flex") or (dispatcher == "flex" and backend not in FLEX_BACKENDS):
        raise ConfigError(f"{origin}: the {dispatcher} token dispatcher"
                          f"{' with ' + backend if dispatcher == 'flex' else ''} is not priced by shardplan: "
                          f"give {_key('moe_dispatcher')} alltoall, or flex with {' or '.join(FLEX_BACKENDS)}")
    return {"moe_dispatch": "dedup" if dispatcher == "flex" else "alltoall",
            "moe_overlap": "1f1b" if _on(doc, "moe_overlap", origin) else "none"}


#: model-shape flags and the model config key each must equal (when both are there)
SHAPE = {"hidden": "hidden", "ffn_hidden": "ffn_hidden", "heads": "heads", "kv_heads": "kv_heads",
         "experts": "experts", "top_k": "top_k"}


def _check_shape(doc: Doc, ctx: Context) -> None:
    """The flags' model shape is the model's: a file for another model is refused, naming the flag."""
    for flag, key in SHAPE.items():
        value, want = _int(doc, flag, ctx.origin), ctx.config.get(key)
        if value is not None and want and value != want:
            raise ConfigError(f"{ctx.origin}: {_key(flag)} {value} is not the model's {key} {want}: the flags are "
                              "for another model (give --model)")


def strategy(doc: Doc, ctx: Context) -> dict[str, Any]:
    o = ctx.origin
    layers = _int(doc, "num_layers", o, ctx.blocks)
    if layers != ctx.blocks:
        raise ConfigError(f"{o}: {_key('num_layers')} {layers} is not the model's {ctx.blocks} layers")
    _check_shape(doc, ctx)
    tp, pp, cp, ep = (_int(doc, a, o, 1) or 1 for a in ("tp", "pp", "cp", "ep"))
    dp, rest = divmod(ctx.world, tp * pp * cp)
    if rest or not dp:
        raise ConfigError(f"{o}: tp {tp} x pp {pp} x cp {cp} does not divide the cluster's {ctx.world} GPUs")
    fsdp = _megatron_fsdp(doc, o)
    dist_opt = _on(doc, "dist_opt", o) or fsdp  # Megatron-LM turns the distributed optimizer on with it
    replicas = _int(doc, "dist_opt_instances", o, 1) or 1
    if replicas > 1 and not dist_opt:
        raise ConfigError(f"{o}: {_key('dist_opt_instances')} needs {_key('dist_opt')}")
    if dp % replicas:
        raise ConfigError(f"{o}: {_key('dist_opt_instances')} {replicas} does not divide {dp} data-parallel ranks")
    fields: dict[str, Any] = {
        "mesh": {"pp": pp, "dp_replicate": replicas, "dp_shard": dp // replicas, "cp": cp, "tp": tp, "ep": ep},
        "micro_batch": _int(doc, "micro_batch", o, required=True),
        "sequence_parallel": _on(doc, "sp", o) and tp > 1}
    etp = _int(doc, "etp", o, tp) or tp
    if etp != tp:  # the expert ranks folded over the tensor-parallel ones
        fields["mesh"]["etp"] = etp
    comm = _str(doc, "cp_comm", o) or "p2p"
    if comm not in CP_MODES:
        raise ConfigError(f"{o}: {_key('cp_comm')} {comm!r} is not priced; accepted: {', '.join(CP_MODES)}")
    fields["cp_mode"], fields["cp_rotate"] = CP_MODES[comm]
    _pipeline(doc, fields, ctx)
    offload = _on(doc, "optimizer_offload", o)
    if offload and not dist_opt:
        raise ConfigError(f"{o}: {_key('optimizer_offload')} needs {_key('dist_opt')}")
    if offload and not _on(doc, "precision_aware", o):  # Megatron-LM arguments.py:1803-1806 (0.19.2 wheel)
        raise ConfigError(f"{o}: {_key('optimizer_offload')} needs {_key('precision_aware')} (Megatron-LM asserts it)")
    fraction = _str(doc, "optimizer_offload_fraction", o) or "1"
    try:
        whole = read_float(fraction) == 1.0
    except ValueError:
        whole = False
    if offload and not whole:
        raise ConfigError(f"{o}: {_key('optimizer_offload_fraction')} {fraction!r} is not priced (1.0 is)")
    recompute = dict(zip([u for u in ctx.units if u.startswith("layers.")], _recompute(doc, fields, ctx), strict=True))
    sharding = "zero3" if fsdp else "zero1" if dist_opt else "replicate"
    fields.update(unit_choices(ctx.units, recompute, sharding, "optimizer" if offload else "none"))
    _activation_offload(doc, fields, ctx, set(recompute.values()) != {"none"})
    return fields


def _activation_offload(doc: Doc, fields: dict[str, Any], ctx: Context, recomputes: bool) -> None:
    """``--cpu-offloading-num-layers N``: the first N layers' activations in host memory, within Megatron's
    limits (megatron-core 0.16.1 transformer_config.py:1137-1152)."""
    o = ctx.origin
    k = _int(doc, "activation_offload_layers", o, 0, minimum=0) or 0
    if not k:
        return
    if k >= ctx.blocks:
        raise ConfigError(f"{o}: {_key('activation_offload_layers')} {k} must be below the model's {ctx.blocks} layers")
    if fields["mesh"]["pp"] > 1 or recomputes:
        raise ConfigError(f"{o}: {_key('activation_offload_layers')} runs without pipeline parallelism and "
                          "recomputation only (Megatron raises ValueError)")
    default = LayerStrategy.model_validate(fields["default"])
    fields["layers"] += [ls.model_dump() for ls in first_blocks_offloaded(default, k)]


def _adam_states(doc: Doc, o: str) -> str | None:
    """``--use-precision-aware-optimizer`` with both moments bf16 and an fp32 master (``adam_states`` bf16);
    moments of another dtype are not priced; without it the dtypes must stay fp32, and it needs the
    distributed optimizer (megatron-core 0.16.1 optimizer_config.py:375-425 asserts both)."""
    dtypes = {k: _str(doc, k, o) for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")}
    if not _on(doc, "precision_aware", o):
        given = [_key(k) for k, v in dtypes.items() if v not in (None, "fp32")]
        if given:
            raise ConfigError(f"{o}: {', '.join(given)} needs {_key('precision_aware')} (Megatron asserts it)")
        return None
    if not (_on(doc, "dist_opt", o) or _on(doc, "megatron_fsdp", o)):
        raise ConfigError(f"{o}: {_key('precision_aware')} needs {_key('dist_opt')} (Megatron asserts it)")
    moments = (dtypes["exp_avg_dtype"] or "fp32", dtypes["exp_avg_sq_dtype"] or "fp32")
    if moments == ("fp32", "fp32") and dtypes["main_params_dtype"] in (None, "fp32"):
        return "fp32"
    if moments != ("bf16", "bf16") or dtypes["main_params_dtype"] not in (None, "fp32"):
        raise ConfigError(f"{o}: Adam's moments {moments[0]}/{moments[1]} with a {dtypes['main_params_dtype'] or 'fp32'} "
                          "master are not priced (both moments bf16 with an fp32 master, or all fp32, are)")
    return "bf16"


def _megatron_fsdp(doc: Doc, o: str) -> bool:
    """Whether the flags ask for Megatron-FSDP, in the one strategy priced (ZeRO-3: ``optim_grads_params``,
    Megatron-LM's default)."""
    strategy = _str(doc, "fsdp_strategy", o)
    if not _on(doc, "megatron_fsdp", o):
        return False
    if strategy not in (None, MEGATRON_FSDP["strategy"]):
        raise ConfigError(f"{o}: {_key('fsdp_strategy')} {strategy!r} is not priced; accepted: "
                          f"{MEGATRON_FSDP['strategy']} (ZeRO-3)")
    return True


def _pipeline(doc: Doc, fields: dict[str, Any], ctx: Context) -> None:
    o, pp, blocks = ctx.origin, fields["mesh"]["pp"], ctx.blocks
    per_virtual = _int(doc, "vpp_layers", o)
    first, last = _int(doc, "first_stage_layers", o, minimum=0), _int(doc, "last_stage_layers", o, minimum=0)
    ends = (int(_on(doc, "account_embedding", o)), int(_on(doc, "account_loss", o)))
    layout = _str(doc, "layout", o)
    if pp == 1:
        given = [_key(k) for k, v in (("vpp_layers", per_virtual), ("first_stage_layers", first),
                                      ("last_stage_layers", last), ("layout", layout)) if v is not None]
        if given:
            raise ConfigError(f"{o}: {', '.join(given)} needs {_key('pp')} > 1")
        return
    if layout is not None:  # every other split flag is refused beside it (transformer_config.py:1307-1324)
        given = [_key(k) for k, v in (("vpp_layers", per_virtual), ("first_stage_layers", first),
                                      ("last_stage_layers", last), ("account_embedding", ends[0] or None),
                                      ("account_loss", ends[1] or None)) if v is not None]
        if given:
            raise ConfigError(f"{o}: {_key('layout')} cannot be combined with {', '.join(given)}")
        sizes = layout_sizes(layout, pp, blocks, o)
        vpp = len(sizes) // pp
        fields.update(schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp, stage_layers=sizes)
        return
    if any(ends) and (first is not None or last is not None):  # transformer_config.py:1294-1304
        raise ConfigError(f"{o}: {_key('account_embedding')} / {_key('account_loss')} cannot be combined with "
                          "uneven first/last stages")
    counted = blocks + sum(ends)  # the embedding and the loss counted as layers (arguments.py:928-933)
    if per_virtual is not None:
        if first is not None or last is not None:
            raise ConfigError(f"{o}: {_key('vpp_layers')} cannot be combined with uneven first/last stages")
        if counted % (pp * per_virtual):
            raise ConfigError(f"{o}: {counted} layers do not split into {_key('vpp_layers')} {per_virtual} "
                              f"over {pp} pipeline ranks")
        vpp = counted // (pp * per_virtual)
        fields.update(schedule="interleaved" if vpp > 1 else "1f1b", vpp=vpp)
        _accounted(fields, ends, per_virtual, pp * vpp, o)
        return
    if first is None and last is None:
        if counted % pp:
            raise ConfigError(f"{o}: {counted} layers do not split evenly over {_key('pp')} {pp} (give "
                              f"{_key('first_stage_layers')} or {_key('last_stage_layers')})")
        _accounted(fields, ends, counted // pp, pp, o)
        return
    ends_given = [n for n in (first, last) if n is not None]
    others, rest = pp - len(ends_given), blocks - sum(ends_given)
    if rest < 0 or (others == 0 and rest) or (others and rest % others):
        raise ConfigError(f"{o}: {blocks} layers do not split over {pp} stages with {'-' if first is None else first} on "
                          f"the first and {'-' if last is None else last} on the last, the others equal")
    mid = rest // others if others else 0
    fields["stage_layers"] = [first if first is not None else mid, *[mid] * (pp - 2),
                              last if last is not None else mid]


def _accounted(fields: dict[str, Any], ends: tuple[int, int], k: int, n: int, origin: str) -> None:
    """``k`` layers on each of ``n`` virtual stages, the embedding and the loss among them where
    counted: the first and last stage that many blocks fewer (transformer_block.py:187-200)."""
    if not any(ends):
        return
    if k - max(ends) < 0 or n == 1 and k < sum(ends):
        raise ConfigError(f"{origin}: not enough layers in the first or last virtual pipeline stage")
    sizes = [k] * n
    sizes[0] -= ends[0]
    sizes[-1] -= ends[1]
    fields["stage_layers"] = sizes


#: Megatron's layout string: ``(s)*n`` and ``x*n`` unrolled, commas cosmetic
#: (megatron-core 0.16.1 transformer/pipeline_parallel_layer_layout.py:283-320)
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
_LAYOUT_MAX = 1 << 16


def layout_sizes(text: str, pp: int, blocks: int, origin: str) -> list[int]:
    """Transformer blocks (decoder and MTP layers) per virtual stage of a ``--pipeline-model-parallel-layout``:
    the embedding first in the first stage and the loss last in the last, as the cost model places them
    (pipeline_parallel_layer_layout.py:85-150)."""
    flag, s = _key("layout"), text.replace(",", "")
    for pattern in _REPEATS:
        for m in pattern.finditer(s):
            if len(m.group(2)) > 6 or len(m.group(1)) * int(m.group(2)) > _LAYOUT_MAX:
                raise ConfigError(f"{origin}: {flag} {text!r} unrolls to more than {_LAYOUT_MAX} layers")
        s = pattern.sub(lambda m: m.group(1) * int(m.group(2)), s)
        if len(s) > _LAYOUT_MAX:
            raise ConfigError(f"{origin}: {flag} {text!r} unrolls to more than {_LAYOUT_MAX} layers")
    stages = s.split("|")
    bad = sorted(set(s) - set("ELtm|"))
    if bad:
        raise ConfigError(f"{origin}: {flag} {text!r} has {', '.join(map(repr, bad))}: E, L, t, m and | are known")
    if len(stages) % pp:
        raise ConfigError(f"{origin}: {flag} has {len(stages)} stages, not a multiple of {_key('pp')} {pp}")
    if s.count("E") != 1 or not stages[0].startswith("E") or s.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{origin}: {flag} {text!r}: the embedding (E) must open the first stage and the loss (L) "
                          "close the last, once each, as shardplan prices them")
    if "m" in s and "t" in s[s.index("m"):]:
        raise ConfigError(f"{origin}: {flag} {text!r}: decoder layers must be placed before MTP layers")
    sizes = [st.count("t") + st.count("m") for st in stages]
    if sum(sizes) != blocks:
        raise ConfigError(f"{origin}: {flag} places {sum(sizes)} layers, not the model's {blocks}")
    return sizes


def _recompute(doc: Doc, fields: dict[str, Any], ctx: Context) -> list[str]:
    """Each block's recompute, in order."""
    o = ctx.origin
    granularity = _str(doc, "recompute_granularity", o)
    if granularity is None and RECOMPUTE_ACTIVATIONS in doc:  # Megatron-LM: selective (arguments.py:589-590)
        granularity = "selective"
    if granularity is None:
        return ["none"] * ctx.blocks
    if granularity == "selective":
        return ["selective"] * ctx.blocks
    if granularity != "full":
        raise ConfigError(f"{o}: {_key('recompute_granularity')} {granularity!r} is not one of full, selective")
    method = _str(doc, "recompute_method", o)
    if method not in RECOMPUTE_METHODS:
        raise ConfigError(f"{o}: {_key('recompute_granularity')} full needs {_key('recompute_method')} "
                          f"{' or '.join(RECOMPUTE_METHODS)}, got {method!r}")
    if method == "uniform":
        return ["full"] * ctx.blocks
    k = _int(doc, "recompute_num_layers", o, required=True) or 1
    n = fields["mesh"]["pp"] * fields.get("vpp", 1)
    stages = fields.get("stage_layers") or [ctx.blocks // n] * n  # Megatron's stages are even unless given
    return ["full" if j < k else "none" for size in stages for j in range(size)]
