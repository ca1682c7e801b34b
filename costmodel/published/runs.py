"""Published training runs (``costmodel/data/calibration/published_runs.csv``, a copy of shared/calibration) as cost-model inputs.

Each CSV row is one published number (``metric``, ``value``) of one training run. :func:`load_published`
maps it to what :func:`costmodel.estimate.estimate` takes — a :class:`TransformerConfig`, a
:class:`Cluster`, a :class:`Strategy` and a :class:`Workload` — or to a :class:`Skipped` row with the
reason. Settings a source does not state come from that source's documented defaults
(:data:`SOURCE_RULES`); every default a row relied on is listed in its ``assumptions``. Nothing here
depends on the published value: rows are never tuned one by one.
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from profiler.graph import LayerGraph
from profiler.hardware import Cluster, accelerator, parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import presets
from profiler.transformer import build_graph as _build_graph
from vocab.errors import ShardplanError
from vocab.io import read_text
from vocab.rules import batch_problem
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload
from vocab.targets import load_target

#: the calibration tables shipped in the package (copies of the project's shared/calibration, see its README)
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "data" / "calibration"
COLUMNS = ("source", "model", "params_B", "layers", "hidden", "heads", "ffn_hidden", "seq_len", "vocab",
           "global_batch", "micro_batch", "gpus", "gpu_type", "tp", "pp", "dp", "cp", "ep", "zero_stage/fsdp",
           "recompute", "metric", "value", "notes", "precision", "reliability")
TIME_METRICS = ("tokens_per_s_per_gpu", "iter_time_s", "mfu", "hfu", "tflops_per_gpu_model",
                "aggregate_pflops_model")
MEMORY_METRICS = ("memory_GiB_peak", "memory_GB_model_states_analytic")


@dataclass(frozen=True)
class SourceRules:
    """What a source leaves unstated, and how it counts model FLOPs.

    ``flops``: ``megatron`` — 6 FLOPs per GEMM weight per token (embedding lookup excluded, LM head
    included) plus attention ``12·L·h·s`` counted in full (Megatron-LM, NeMo); ``6n_total`` —
    ``6·N`` with N every parameter (embeddings included) plus the same attention term (PaLM /
    nanoGPT, llm-foundry, early torchtitan).
    """

    key: str
    #: the trainer's target (``vocab/targets/<name>.yaml``) whose behaviour prices the source's runs: its
    #: loss, kernels, gradient dtype, receive buffers, ZeRO-3 master, ring rotation, selective policy and
    #: MoE choices, as a plan for that target is priced; "" for a stack with no target (the fields below)
    target: str = ""
    flops: str = "megatron"
    sharding: str = ""  # when the zero_stage/fsdp column is blank
    recompute: str = "none"  # when not stated
    micro_batch: int = 1  # when not stated and no pipeline rule applies
    schedule: str = "1f1b"  # pipeline schedule when pp > 1 and not stated
    vpp: int = 1  # virtual stages per rank when interleaved and not stated
    microbatches_per_stage: bool = False  # micro-batches default to the pp degree (torchtitan)
    attention_kernel: str = "auto"  # flash2 for PyTorch stacks (flash_attn 2, SDPA's flash backend)
    # without a target: how the stack runs what the cost model has a knob for (vocab.strategy.Workload)
    cross_entropy: str = "eager"  # fused for a fused loss kernel (flash-attn's, Megatron's vocab-parallel one)
    kernels: str = "eager"  # memory-bound kernels; a row whose notes say torch.compile runs fused ones
    zero3_master: str = "parameter"  # FSDP's sharded parameter is the fp32 master (DeepSpeed: "optimizer")


SOURCE_RULES = (  # first match wins
    # README: MFU = (6·NumParams + 12·L·h·s)·tokens/s / peak; NumParams counts the embeddings.
    # MPT's loss_fn defaults to fused_crossentropy, flash-attn's kernel that writes the gradient in
    # place of the logits (llmfoundry/models/mpt/modeling_mpt.py, ComposerMPTCausalLM).
    SourceRules("mosaicml/llm-foundry", flops="6n_total", attention_kernel="flash2", cross_entropy="fused"),
    # "MFU per nanoGPT/PaLM method": 6·N (all parameters) + 12·L·h·s.
    SourceRules("PyTorch blog 'Maximizing training throughput", flops="6n_total", attention_kernel="flash2"),
    # torchtitan before 2024-10 counted every parameter (checked: 8B at 2904 tok/s -> MFU 0.568).
    SourceRules("torchtitan docs/performance.md @04133643", target="torchtitan", flops="6n_total",
                attention_kernel="flash2"),
    # torchtitan with PP: micro-batches default to the pp degree; interleaving splits each rank in 2.
    SourceRules("pytorch/torchtitan", target="torchtitan", microbatches_per_stage=True, vpp=2,
                attention_kernel="flash2"),
    # Megatron formula (checked: LLAMA2-7B 780 TFLOP/s at 16934 tok/s); mcore distributed optimizer.
    SourceRules("NVIDIA/NeMo", target="megatron", sharding="zero1"),
    # Megatron formula (checked: 1.7B 408.8 TFLOP/s = MFU 0.41 of 989); distributed optimizer implied,
    # interleaved pipeline (PP overlap is enabled, which Megatron implements for interleaving).
    SourceRules("NVIDIA/Megatron-LM", target="megatron", sharding="zero1", schedule="interleaved", vpp=2),
    # Table 4: BF16 MFU, formula not stated (Megatron's assumed); interleaved schedule per §3.3.2.
    # Section 3.3.2: all-gather based context parallelism (K/V gathered, then attention).
    SourceRules("Llama Team 'The Llama 3 Herd", schedule="interleaved", vpp=2, cross_entropy="fused",
                kernels="fused"),
)
DEFAULT_RULES = SourceRules("")
TDP_W = {"h100-sxm": 700.0, "h200": 700.0, "a100-80gb": 400.0, "a100-40gb": 400.0}  # NVIDIA datasheets


@cache
def build_graph(cfg: TransformerConfig, seq: int) -> LayerGraph:
    """The layer graph of ``cfg`` at ``seq`` tokens, built once."""
    return _build_graph(cfg, seq)


@dataclass(frozen=True)
class PublishedRow:
    """One usable CSV row, mapped to cost-model inputs."""

    row: int  # line in the CSV (the header is line 1)
    source: str
    model: str
    metric: str
    value: float
    reliability: str  # A, B, C or ? (unknown)
    config: TransformerConfig
    cluster: Cluster
    strategy: Strategy
    workload: Workload
    flops: str  # the source's model-FLOPs convention (see SourceRules)
    assumptions: tuple[str, ...] = ()
    target: str = ""  # the trainer's target it is priced as (SourceRules.target; "" none)

    @property
    def key(self) -> tuple:
        """Equal for rows that describe the same run (they share one estimate)."""
        return (self.source, repr(self.config), repr(self.cluster), self.strategy.model_dump_json(),
                self.workload.model_dump_json())


@dataclass(frozen=True)
class Skipped:
    row: int
    source: str
    model: str
    metric: str
    reason: str


@dataclass
class _Ctx:
    assumptions: list[str] = field(default_factory=list)
    op_sac: bool = False


def default_csv_path() -> Path:
    return CALIBRATION_DIR / "published_runs.csv"


def load_published(path: str | Path | None = None) -> tuple[list[PublishedRow], list[Skipped]]:
    """Map every row of the CSV at ``path`` (default: the shared calibration file)."""
    p = Path(path) if path is not None else default_csv_path()
    text = read_text(p, "published runs")
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        missing = [c for c in ("source", "model", "metric", "value") if c not in (reader.fieldnames or [])]
        if missing:
            raise ShardplanError(f"published runs '{p}': missing column(s) {missing}")
        raw = list(reader)
    except csv.Error as e:
        raise ShardplanError(f"cannot read published runs '{p}': {e}") from None
    rows: list[PublishedRow] = []
    skipped: list[Skipped] = []
    for i, r in enumerate(raw, start=2):
        r = {c: (r.get(c) or "").strip() for c in COLUMNS}
        out = map_row(i, r)
        (rows if isinstance(out, PublishedRow) else skipped).append(out)  # type: ignore[arg-type]
    return rows, skipped


def _float(s: str) -> float | None:
    """A finite number, else None (a blank, a word, NaN, an infinity or a value past a float's range)."""
    try:
        v = float(s)
    except (ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _int(s: str) -> int | None:
    v = _float(s)
    return int(v) if v is not None and v == int(v) else None


def map_row(line: int, r: dict[str, str]) -> PublishedRow | Skipped:
    """One CSV row (column -> text) to a :class:`PublishedRow`, or a :class:`Skipped` with why."""

    def skip(reason: str) -> Skipped:
        return Skipped(line, r["source"], r["model"], r["metric"], reason)

    metric, value = r["metric"], _float(r["value"])
    if metric not in TIME_METRICS + MEMORY_METRICS:
        return skip(f"metric '{metric}' is not a single comparable number")
    if value is None or value <= 0:
        return skip(f"value '{r['value']}' is not a positive number")
    if re.search(r"\b(SFT|LoRA)\b", r["model"]):
        return skip("fine-tuning run (SFT/LoRA): sequence lengths and FLOP accounting differ from pretraining")
    rules, ctx = next((x for x in SOURCE_RULES if x.key in r["source"]), DEFAULT_RULES), _Ctx()
    gpus = _int(r["gpus"])
    if not gpus or gpus <= 0:
        return skip(f"GPU count '{r['gpus']}' is not one number")
    analytic = metric == "memory_GB_model_states_analytic"
    seq = _int(r["seq_len"]) or (2048 if analytic else None)
    if not seq:
        return skip("sequence length not stated")
    cfg = _model(r, seq, analytic, ctx)
    if isinstance(cfg, str):
        return skip(cfg)
    cluster = _cluster(r, gpus, ctx)
    if isinstance(cluster, str):
        return skip(cluster)
    strat = _strategy(r, rules, cfg, gpus, ctx)
    if isinstance(strat, str):
        return skip(strat)
    strategy, global_batch = strat
    prec = "fp8" if "fp8" in r["precision"].lower() else "bf16"
    workload = Workload(seq_len=seq, global_batch=global_batch, precision=prec, attention_kernel=rules.attention_kernel,
                        **behaviour(rules, "compile" in r["notes"].lower(), ctx.op_sac, analytic))
    if analytic:
        ctx.assumptions.append("16-bit gradients (the ZeRO paper's 2 + 2 + K bytes per parameter)")
    if rules.attention_kernel != "auto":
        ctx.assumptions.append(f"attention kernel {rules.attention_kernel} (the source's stack)")
    try:
        from costmodel.estimate import check

        check(build_graph(cfg, seq), cluster, strategy, workload)
    except ShardplanError as e:
        return skip(f"mapped plan is invalid: {e}")
    rel = r["reliability"][:1].upper() if r["reliability"][:1].upper() in "ABC" else "?"
    return PublishedRow(line, r["source"], r["model"], metric, value, rel, cfg, cluster, strategy, workload,
                        rules.flops, tuple(ctx.assumptions), rules.target)


def behaviour(rules: SourceRules, compiled: bool, op_sac: bool, analytic: bool) -> dict[str, str]:
    """How the source's stack runs what the cost model has a knob for: its trainer's target's behaviour
    (``vocab.targets.Behaviour.workload``) where the rules name one, else the rules' own values; over
    either, what the row says (torch.compile: fused kernels; torchtitan's op-level selective policy)
    and, for the ZeRO paper's analytic memory, its formula (a 16-bit parameter shard beside the
    optimizer's master, 16-bit gradients)."""
    said = {"kernels": "fused" if compiled else None, "selective": "op" if op_sac else None}
    if rules.target:
        out = load_target(rules.target).behaviour.workload(**said)
    else:
        out = {"cross_entropy": rules.cross_entropy, "kernels": said["kernels"] or rules.kernels,
               "zero3_master": rules.zero3_master, "selective": said["selective"] or "attention"}
    if analytic:
        out.update(zero3_master="optimizer", grad_dtype="bf16")
    return out


def ring_rotation(rules: SourceRules) -> str:
    """How the source's context-parallel ring moves K/V: its target's (Megatron's p2p passes blocks
    round the ring: ``alltoall``), else all-gathered (torchtitan's default)."""
    return load_target(rules.target).behaviour.cp_rotate[0] if rules.target else "allgather"


# ---- model ---------------------------------------------------------------------------------

def _family(model: str) -> str:
    m = model.lower().replace(" ", "").replace("-", "")
    for fam, pat in (("mpt", "mpt"), ("llama3", "llama3"), ("llama2", "llama2"), ("gpt", "gpt")):
        if pat in m:
            return fam
    return ""


FAMILY_ARCH = {
    "llama2": dict(activation="swiglu", norm="rmsnorm", position="rope"),
    "llama3": dict(activation="swiglu", norm="rmsnorm", position="rope"),
    # llm-foundry benchmark configs: learned positions (NumParams grows with seq_len), biases,
    # LayerNorm with bias, GELU MLP of expansion 4, tied embeddings, vocab 50368.
    "mpt": dict(activation="gelu", norm="layernorm", position="learned", bias=True, tied_embeddings=True),
    # Megatron GPT: learned absolute positions, biases, GELU, tied embeddings.
    "gpt": dict(activation="gelu", norm="layernorm", position="learned", bias=True, tied_embeddings=True),
}


def _model(r: dict[str, str], seq: int, analytic: bool, ctx: _Ctx) -> TransformerConfig | str:
    fam = _family(r["model"])
    layers, hidden, heads = _int(r["layers"]), _int(r["hidden"]), _int(r["heads"])
    params_b = _float(r["params_B"])
    kv = re.search(r"kv_heads=(\d+)", r["notes"])
    if layers and hidden and heads:
        same = [c for c in presets().values() if (c.layers, c.hidden, c.heads) == (layers, hidden, heads)
                and _family(c.name) == fam]
        vocab = _int(r["vocab"]) or (50368 if fam == "mpt" else (same[0].vocab if same else 0))
        if not vocab:
            return "vocab not stated and no preset of the same shape"
        if not _int(r["vocab"]):
            ctx.assumptions.append(f"vocab {vocab} from preset {same[0].name if same else 'MPT'}")
        arch = FAMILY_ARCH.get(fam) or (
            {k: getattr(same[0], k) for k in ("activation", "norm", "position", "bias", "tied_embeddings")}
            if same else None)
        if arch is None:
            return f"unknown architecture family for '{r['model']}'"
        ffn = _int(r["ffn_hidden"]) or (same[0].ffn_hidden if same else 4 * hidden)
        try:
            cfg = TransformerConfig(name=r["model"], layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                                    kv_heads=int(kv.group(1)) if kv else (same[0].kv_heads if same else 0),
                                    ffn_hidden=ffn, max_seq=seq, **arch)
        except ShardplanError as e:
            return str(e)
        n_pub = re.search(r"NumParams=(\d+)", r["notes"])
        if n_pub:
            built = build_graph(cfg, seq).total_params
            if abs(built / int(n_pub.group(1)) - 1) > 0.01:
                return f"built architecture has {built} parameters, the source says {n_pub.group(1)}"
        return cfg
    if not params_b:
        return "architecture not given (no shapes, no parameter count)"
    tol = 0.015 if analytic else 0.03
    cands = [c for c in presets().values() if (analytic or _family(c.name) == fam)
             and abs(build_graph(c, seq).total_params / (params_b * 1e9) - 1) <= tol]
    if not cands:
        return f"architecture not given (only {params_b}B parameters) and no {fam or 'matching'} preset within {tol:.1%}"
    ctx.assumptions.append(f"architecture of preset {cands[0].name}")
    return cands[0]


# ---- cluster -------------------------------------------------------------------------------

def _cluster(r: dict[str, str], gpus: int, ctx: _Ctx) -> Cluster | str:
    t = r["gpu_type"].lower()
    # 'any (analytic)': model states only, the accelerator does not matter
    name = next((n for k, n in (("analytic", "h100-sxm"), ("h200", "h200"), ("h100", "h100-sxm"),
                                ("a100-40gb", "a100-40gb"), ("a100", "a100-80gb")) if k in t), "")
    if not name:
        return f"unknown accelerator '{r['gpu_type']}'"
    per = min(accelerator(name).gpus_per_node, gpus)
    if gpus % per:
        return f"{gpus} GPUs is not a multiple of {per} per node"
    spec: dict = {"accelerator": name, "nodes": gpus // per, "gpus_per_node": per}
    acc = accelerator(name).to_dict()
    mem = re.search(r"(\d+)\s*gb(?!\s*(?:/s|ps))", t)
    hbm = re.search(r"([\d.]+)\s*tb/s", t)
    cap = re.search(r"@\s*(\d+)\s*w\b", t)
    if hbm or cap or (mem and float(mem.group(1)) != acc["hbm_gb"]):
        if hbm:
            acc["hbm_tbps"] = float(hbm.group(1))
        if mem and float(mem.group(1)) != acc["hbm_gb"]:  # another SKU: its label is its size
            acc["hbm_gb"] = float(mem.group(1))
            acc["memory_reported_mib"] = 0.0
        spec["accelerator"] = acc
        ctx.assumptions.append(f"{name} with {acc['hbm_gb']:g} GB at {acc['hbm_tbps']:g} TB/s")
    if cap and name in TDP_W and float(cap.group(1)) < TDP_W[name]:
        # Under a power cap the sustained clock, and with it every compute peak, falls roughly as
        # the cube root of the power (dynamic power ~ f·V², V ~ f near the top of the DVFS curve).
        k = (float(cap.group(1)) / TDP_W[name]) ** (1 / 3)
        acc["peak_tflops"] = {d: v * k for d, v in acc["peak_tflops"].items()}
        ctx.assumptions.append(f"{cap.group(1)} W cap: compute peaks x{k:.3f} (cube root of power over the {TDP_W[name]:g} W TDP)")
    net = re.search(r"(\d+)\s*gb(?:ps|/s)", t)
    if net:
        gbit = float(net.group(1))
        per_node = "per gpu" not in t and ("inter-node" in t or "node-node" in r["source"].lower())
        gbps = gbit / 8 / (per if per_node else 1)
        spec["scale_out"] = {"gbps": gbps}
        ctx.assumptions.append(f"scale-out {gbps:g} GB/s per GPU ({gbit:g} Gb/s per {'node' if per_node else 'GPU'})")
    try:
        return parse_cluster(spec)
    except ShardplanError as e:
        return str(e)


# ---- strategy --------------------------------------------------------------------------------

def _sharding(text: str, rules: SourceRules, ctx: _Ctx) -> str | None:
    t = text.lower()
    if not t:
        if rules.sharding:
            ctx.assumptions.append(f"sharding {rules.sharding} (source default)")
        return rules.sharding or None
    for pat, s in (("baseline dp", "replicate"), ("zero-1", "zero1"), ("zero-2", "zero2"),
                   ("zero-3 (", "zero3"), ("not resharded", "zero3_keep"), ("distributed optimizer", "zero1"),
                   ("fsdp", "zero3")):
        if pat in t:
            if "float8 all-gather" in t:
                ctx.assumptions.append("float8 all-gather not modelled (gathers priced in bf16)")
            return s
    return None


def _recompute(text: str, rules: SourceRules, ctx: _Ctx) -> tuple[str, int]:
    t = text.lower()
    if not t or t.startswith("not stated"):
        ctx.assumptions.append(f"recompute {rules.recompute} (not stated)")
        return rules.recompute, 1
    if t.startswith("none"):
        return "none", 1
    if "full" in t:
        return "full", 1
    if "layer" in t or "every-n" in t:
        ctx.assumptions.append("block-level checkpointing of every 2nd block (torchtitan ac_freq default)")
        return "full", 2
    if " op" in t or (t == "selective" and "torchtitan" in rules.key):  # torchtitan's default policy is 'op'
        ctx.op_sac = True  # torchtitan's op-level policy (costmodel.recompute)
    return "selective", 1


def _strategy(r: dict[str, str], rules: SourceRules, cfg: TransformerConfig, gpus: int,
              ctx: _Ctx) -> tuple[Strategy, int] | str:
    tp, pp, cp = (_int(r[k]) for k in ("tp", "pp", "cp"))
    if tp is None or pp is None:
        return "tensor/pipeline parallel degrees not stated"
    cp = cp or 1
    dp = _int(r["dp"]) or gpus // max(tp * pp * cp, 1)
    if tp * pp * dp * cp != gpus:
        return f"tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} != {gpus} GPUs"
    sharding = _sharding(r["zero_stage/fsdp"], rules, ctx)
    if sharding is None:
        return f"sharding '{r['zero_stage/fsdp']}' not understood"
    recompute, every = _recompute(r["recompute"], rules, ctx)
    notes = r["notes"]
    gb = _int(r["global_batch"]) or (dp if r["metric"] == "memory_GB_model_states_analytic" else None)
    local = re.search(r"local batch(?: size)? (\d+)", notes)
    if not gb:
        if not local:
            return "global batch not stated (nor a local batch to derive it from)"
        gb = int(local.group(1)) * dp
        ctx.assumptions.append(f"global batch {gb} = local {local.group(1)} x dp {dp}")
    schedule, vpp = "1f1b", 1
    if pp > 1:
        vp = re.search(r"VP=(\d+)", notes)
        if vp:
            vpp = int(vp.group(1))
            schedule = "interleaved" if vpp > 1 else "1f1b"
        elif "interleaved 1f1b" in notes.lower():
            schedule, vpp = "interleaved", rules.vpp
            ctx.assumptions.append(f"interleaved with vpp={vpp} (not stated)")
        elif "1f1b" in notes.lower():
            schedule = "1f1b"
        else:
            schedule, vpp = rules.schedule, rules.vpp if rules.schedule == "interleaved" else 1
            ctx.assumptions.append(f"schedule {schedule}" + (f" vpp={vpp}" if vpp > 1 else "") + " (not stated)")
    mb = _int(r["micro_batch"])
    if not mb:
        per_rank = gb // dp
        if pp > 1 and rules.microbatches_per_stage and per_rank % pp == 0:
            mb = per_rank // pp
            ctx.assumptions.append(f"micro-batch {mb}: {pp} micro-batches (torchtitan default = pp)")
        else:
            mb = rules.micro_batch
            ctx.assumptions.append(f"micro-batch {mb} (not stated)")
    if problem := batch_problem(gb, dp, mb):
        return problem
    if pp > 1 and sharding in ("zero3", "zero3_keep"):
        # torch.distributed.pipelining (torchtitan) and Llama 3 keep FSDP parameters gathered over the
        # step's micro-batches and reduce gradients once per step: ZeRO-1's traffic and memory.
        sharding = "zero1"
        ctx.assumptions.append("FSDP under pipeline parallelism: gathered once and reduced once per step (zero1)")
    # Activation checkpointing wraps the transformer blocks, never the embedding or the head.
    blocks = range(every - 1, cfg.layers, every) if every > 1 else ()
    default = LayerStrategy(sharding=sharding, recompute=recompute if every == 1 else "none")  # type: ignore[arg-type]
    layers = [LayerStrategy(unit=u, sharding=sharding) for u in ("embedding", "head")]  # type: ignore[arg-type]
    layers += [LayerStrategy(unit=f"layers.{i}", sharding=sharding, recompute="full") for i in blocks]  # type: ignore[arg-type]
    try:
        return Strategy(mesh=Mesh(pp=pp, dp_shard=dp, cp=cp, tp=tp), micro_batch=mb, schedule=schedule,  # type: ignore[arg-type]
                        vpp=vpp, sequence_parallel=tp > 1, default=default, layers=layers,
                        cp_rotate=ring_rotation(rules)), gb  # type: ignore[arg-type]
    except ValueError as e:
        return f"strategy invalid: {e}"
