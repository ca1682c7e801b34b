"""NVIDIA's published performance recipes (Megatron-Bridge / NeMo) on the ``megatron`` target.

    python benchmarks/recipes.py                   # every row, the table and the summary
    python benchmarks/recipes.py --rows 0-9,75     # some rows (0-based, as the table numbers them)
    python benchmarks/recipes.py --model 405b      # rows whose model name holds this text
    python benchmarks/recipes.py --write-docs      # the summary into docs/validation.md
    python benchmarks/recipes.py --plan --write-docs  # and the plans searched against them

Each row of ``costmodel/data/calibration/recipes.csv`` (configurations only, no step times) is mapped
to a model (a preset of the same shape, a preset with fewer layers for the scaled-down 405B rows, or a
config built for a model with no preset), a cluster (``gpu_type`` to an accelerator file), a strategy
(tp, pp, cp, ep, virtual stages, micro and global batch, sharding, recomputation) and a workload priced
as the megatron target runs it. Then, per row:

- **expressible**: what the megatron target (megatron-core 0.16.1) lacks to run it, as ``shardplan
  export --to megatron`` names it (:func:`planner.trainers.lacks`: the nearest-plan mapping and the
  Megatron exporter's own adjustments), or the validity rule the row breaks
  (:func:`costmodel.estimate.check`), or what the row asks that the plan vocabulary has no word for
  (a model with no preset), or cannot price (NVFP4: no FP4 throughput in the hardware data);
- **fits**: the predicted peak memory against the whole device (the planner's 5% reserve is a policy,
  not physics);
- **step**: the predicted step time.

MXFP8 rows are priced as ``mxfp8`` (fp8 GEMMs, block-scale bytes in the casts); NVFP4 rows are not
priced. Megatron-FSDP rows are ZeRO-3 (``--use-megatron-fsdp``, optim_grads_params).
What a recipe leaves unstated is assumed and listed: the distributed optimizer (ZeRO-1) where
Megatron-FSDP is not used, no recomputation, sequence parallelism with tp > 1, dropless routing, the
experts folded over tp (etp 1) where ep does not divide dp x cp, and the MoE dispatcher Megatron-Bridge's
recipe applies (:data:`FLEX_DISPATCH`).
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import ValidationError  # noqa: E402

from costmodel.estimate import check, estimate  # noqa: E402
from costmodel.published.runs import CALIBRATION_DIR  # noqa: E402
from planner.reprice import price  # noqa: E402
from planner.trainers import lacks  # noqa: E402
from profiler.hardware import Cluster, parse_cluster  # noqa: E402
from profiler.models import load_model, presets  # noqa: E402
from vocab.errors import ShardplanError, first_line  # noqa: E402
from vocab.strategy import (  # noqa: E402
    UNPRICED_PRECISIONS,
    LayerStrategy,
    Mesh,
    Strategy,
    Workload,
    first_blocks_offloaded,
)
from vocab.targets import load_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CSV = CALIBRATION_DIR / "recipes.csv"
DOC = ROOT / "docs" / "validation.md"
SECTION = "## NVIDIA recipes on the megatron target"
TARGET = "megatron"
GIB = 1024**3

#: the recipe's model name (lower case, spaces and punctuation dropped) -> the preset of that model
PRESETS = {"llama38b": "llama3-8b", "llama370b": "llama3-70b", "llama3.18b": "llama3.1-8b",
           "llama3.170b": "llama3.1-70b", "llama3.1405b": "llama3.1-405b", "deepseekv3": "deepseek-v3",
           "gptoss120b": "gpt-oss-120b", "qwen3235ba22b": "qwen3-235b-a22b", "kimik2": "kimi-k2"}
#: models with no preset, built from their Hugging Face config.json values (as recalled, not read from
#: a file in this repository): a dict of :class:`profiler.model_config.TransformerConfig` fields
BUILT: dict[str, dict[str, Any]] = {
    "qwen330ba3b": {"name": "qwen3-30b-a3b", "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
                    "head_dim": 128, "ffn_hidden": 6144, "moe_ffn_hidden": 768, "experts": 128, "top_k": 8,
                    "vocab": 151936, "max_seq": 40960, "activation": "swiglu", "norm": "rmsnorm",
                    "position": "rope", "qk_norm": True},
}
#: models the layer graph cannot build, and why
NO_MODEL = {"nemotron3nano": "Nemotron-3 Nano is a hybrid Mamba-Transformer MoE: no Mamba layers in the graph",
            "nemotron3super": "Nemotron-3 Super is a hybrid Mamba-Transformer MoE: no Mamba layers in the graph"}
#: the recipe's gpu_type (its first word, lower case) -> the accelerator file
ACCELERATORS = {"h100-sxm5-80gb": "h100-sxm", "gb200": "gb200", "gb300": "gb300", "b200": "b200", "b300": "b300"}
#: the recipe's model -> (Megatron-Bridge's flex-dispatcher backend, the accelerators its
#: ``apply_flex_dispatcher_backend`` turns it on for, the recipe's source line). Megatron-Bridge 0.3.1
#: (``training/flex_dispatcher_backend.py:46-66``): DeepEP on Ampere, Hopper, B200 and B300, HybridEP on
#: every Hopper and Blackwell GPU, else the all-to-all. Both de-duplicate a token's copies across
#: nodes (``moe_dispatch = dedup``). GPT-OSS and Kimi-K2 name DeepEP but never apply it
#: (``recipes/gpt_oss/gpt_oss.py:184-185``, ``recipes/kimi/kimi_k2.py:99-100``): the all-to-all.
FLEX_DISPATCH = {
    "deepseekv3": ("hybridep", ("h100-sxm", "b200", "b300", "gb200", "gb300"), "recipes/deepseek/deepseek_v3.py:106,196"),
    "qwen3235ba22b": ("deepep", ("h100-sxm", "b200", "b300"), "recipes/qwen/qwen3_moe.py:172,241"),
    "qwen330ba3b": ("deepep", ("h100-sxm", "b200", "b300"), "recipes/qwen/qwen3_moe.py:59,128"),
}
#: the recipe's model -> Adam's state where Megatron-Bridge's recipe turns on the precision-aware optimizer
#: (both moments bf16, an fp32 master: ``adam_states`` bf16), with the recipe's source lines (0.3.1)
ADAM_STATES = {"deepseekv3": ("bf16", "recipes/deepseek/deepseek_v3.py:160-165,305-310")}
#: activations in host memory where the Megatron-Bridge performance recipe of the same job offloads them
#: (``cpu_offloading_num_layers``; recipes.csv does not state it): (model, accelerator, precision, tp, pp,
#: cp, micro-batch, Megatron-FSDP) -> (the first N layers, the recipe in Megatron-Bridge 0.6.2's wheel)
ACTIVATION_OFFLOAD = {
    ("llama370b", "gb300", "fp8", 1, 1, 1, 2, True): (20, "perf_recipes/llama/gb300/llama3.py:258-285"),
    ("llama370b", "gb300", "bf16", 1, 1, 1, 2, True): (30, "perf_recipes/llama/gb300/llama3.py:202-231"),
    ("llama370b", "gb200", "fp8", 1, 1, 1, 2, True): (40, "perf_recipes/llama/gb200/llama3.py:251-278"),
    ("llama370b", "gb200", "bf16", 1, 1, 1, 1, True): (20, "perf_recipes/llama/gb200/llama3.py:198-225"),
    ("llama370b", "b200", "fp8", 1, 1, 1, 1, True): (5, "perf_recipes/llama/b200/llama3.py:237-264"),
}
#: the recipe's precision -> the workload's ("": not priced, for the reason given)
PRECISIONS = {"bf16": ("bf16", ""), "fp8": ("fp8", ""), "fp8-cs": ("fp8", ""),
              "mxfp8": ("mxfp8", ""), "fp8-mx": ("mxfp8", ""),
              "nvfp4": ("", f"nvfp4: {UNPRICED_PRECISIONS['nvfp4']}")}


@dataclass
class Mapped:
    """A recipe row as cost-model inputs, with what the vocabulary has no word for and what was assumed."""

    index: int
    row: dict[str, str]
    model: str = ""  # the preset, or the built config's name
    spec: str | dict[str, Any] | None = None  # what load_model takes
    cluster: Cluster | None = None
    strategy: Strategy | None = None
    workload: Workload | None = None
    reasons: list[str] = field(default_factory=list)  # why the megatron target does not run it as written
    assumptions: list[str] = field(default_factory=list)
    error: str = ""  # why it could not be priced at all


@dataclass
class Result:
    mapped: Mapped
    reasons: list[str]
    peak_gib: float | None = None
    device_gib: float | None = None
    step_s: float | None = None
    fits_with: str = ""  # the least recomputation of the blocks with which it fits the device ("" when none does)
    predicted: dict[str, Any] = field(default_factory=dict)  # the report's step and time breakdown

    @property
    def expressible(self) -> bool:
        return not self.reasons

    @property
    def fits(self) -> bool | None:
        return None if self.peak_gib is None or self.device_gib is None else self.peak_gib <= self.device_gib


def load_rows(path: Path = CSV) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", name.lower().split("(")[0])


def _int(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


def _model(m: Mapped) -> None:
    r, key = m.row, _key(m.row["model"])
    if key in NO_MODEL:
        m.error = f"no model: {NO_MODEL[key]}"
        return
    if key in BUILT:
        m.spec, m.model = dict(BUILT[key]), BUILT[key]["name"]
        m.assumptions.append(f"{m.model}: built from its config.json values (as recalled)")
        return
    name = PRESETS.get(key)
    if name is None:
        m.error = f"no model: '{r['model']}' matches no preset"
        return
    cfg = presets()[name]
    shape = {k: _int(r[k]) for k in ("layers", "hidden", "heads", "ffn_hidden", "vocab")}
    if not any(shape.values()):  # an MoE row states no shape: the preset's
        m.spec, m.model = name, name
        if "mtp" not in r["model"].lower() and cfg.mtp_layers:
            m.assumptions.append(f"{name}: {cfg.mtp_layers} MTP layer as the preset (not stated)")
        if "w/o mtp" in r["model"].lower() and cfg.mtp_layers:
            data = {**cfg.to_dict(), "mtp_layers": 0}
            data.pop("hf_ids", None)
            m.spec, m.model = data, f"{name} (no MTP)"
        return
    differs = {k: v for k, v in shape.items() if v is not None and v != getattr(cfg, k)}
    if set(differs) - {"layers"}:
        m.error = f"no model: the row's shape {differs} is not {name}'s"
        return
    if differs:  # the scaled-down runs of fewer layers
        data = {**cfg.to_dict(), "layers": differs["layers"], "name": f"{name}-{differs['layers']}l"}
        data.pop("hf_ids", None)
        m.spec, m.model = data, data["name"]
        return
    m.spec, m.model = name, name


def _cluster(m: Mapped) -> None:
    r = m.row
    acc = ACCELERATORS.get(r["gpu_type"].split()[0].lower())
    if acc is None:
        m.error = f"no accelerator file for '{r['gpu_type']}'"
        return
    m.cluster = parse_cluster(f"{int(r['gpus'])}x{acc}")


def _strategy(m: Mapped) -> None:
    r = m.row
    gpus = int(r["gpus"])
    tp, pp, cp, ep = (_int(r[k]) or 1 for k in ("tp", "pp", "cp", "ep"))
    vp = _int(r["vp"]) or 1
    mb, gb = int(r["micro_batch"]), int(r["global_batch"])
    if gpus % (tp * pp * cp):
        m.error = f"tp*pp*cp = {tp * pp * cp} does not divide {gpus} GPUs"
        return
    dp = gpus // (tp * pp * cp)
    ga = _int(r["grad_accum"])
    if ga is not None and ga * dp * mb != gb:
        m.assumptions.append(f"grad_accum {ga} != global batch / (dp x micro-batch) = {gb / (dp * mb):g}")
    sharding_text = r["sharding"]
    if sharding_text.lower().startswith("megatron-fsdp"):
        sharding = "zero3"
        m.assumptions.append("Megatron-FSDP (ZeRO-3, optim_grads_params)")
    else:
        sharding = "zero1"
        m.assumptions.append("distributed optimizer (ZeRO-1; not stated)")
    m.assumptions.append("no recomputation (not stated)")
    etp = 0
    if ep > 1 and (dp * cp) % ep and tp > 1:  # Megatron's default etp = tp cannot place ep: folded over tp
        etp = 1
        m.assumptions.append("expert-tensor parallelism 1, the expert ranks folded over tp (not stated; ep does "
                             "not divide dp x cp)")
    default = LayerStrategy(sharding=sharding, recompute="none")  # type: ignore[arg-type]
    offloaded = _activation_offload(m, (tp, pp, cp, mb, sharding == "zero3"))
    layers = first_blocks_offloaded(default, offloaded)
    try:
        m.strategy = Strategy(mesh=Mesh(pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep, etp=etp), micro_batch=mb,
                              schedule="interleaved" if pp > 1 and vp > 1 else "1f1b", vpp=vp if pp > 1 else 1,
                              sequence_parallel=tp > 1, default=default, layers=layers)
    except ValidationError as e:
        m.error = "invalid: " + "; ".join(str(x["msg"]).removeprefix("Value error, ") for x in e.errors()[:2])
    except ShardplanError as e:
        m.error = f"invalid: {first_line(e)}"


def _activation_offload(m: Mapped, mesh: tuple[int, int, int, int, bool]) -> int:
    """The layers whose activations the row's Megatron-Bridge recipe offloads (:data:`ACTIVATION_OFFLOAD`)."""
    r = m.row
    acc = ACCELERATORS.get(r["gpu_type"].split()[0].lower(), "")
    precision = PRECISIONS.get(r["precision"].lower(), ("", ""))[0]
    hit = ACTIVATION_OFFLOAD.get((_key(r["model"]), acc, precision, *mesh))
    if hit is None:
        return 0
    m.assumptions.append(f"the activations of the first {hit[0]} layers in host memory (Megatron-Bridge 0.6.2 "
                         f"{hit[1]})")
    return hit[0]


#: the gradient dtype the rows are priced with (``--grad-dtype``): NVIDIA's performance recipes reduce
#: gradients in bf16 (megatron-core's own default, grad_reduce_in_fp32=False)
GRAD_DTYPE = {"value": "bf16"}


def _workload(m: Mapped) -> None:
    r = m.row
    precision, reason = PRECISIONS.get(r["precision"].lower(), ("", f"precision {r['precision']} (unknown)"))
    if not precision:
        m.error = reason
        return
    behaviour = load_target(TARGET).behaviour.workload(grad_dtype=GRAD_DTYPE["value"])
    flex = FLEX_DISPATCH.get(_key(r["model"]))
    if flex and m.cluster is not None and m.cluster.accelerator.name in flex[1]:
        behaviour["moe_dispatch"] = "dedup"
        m.assumptions.append(f"{flex[0]} dispatch (de-duplicated; Megatron-Bridge 0.3.1 {flex[2]})")
    adam = ADAM_STATES.get(_key(r["model"]))
    if adam:
        behaviour["adam_states"] = adam[0]
        m.assumptions.append(f"Adam's moments in {adam[0]}, the master as 16-bit remainders (the precision-aware "
                             f"optimizer; Megatron-Bridge 0.3.1 {adam[1]})")
    m.workload = Workload(seq_len=int(r["seq_len"]), global_batch=int(r["global_batch"]), precision=precision,
                          **behaviour)  # type: ignore[arg-type]


def map_row(index: int, row: dict[str, str]) -> Mapped:
    """The cost-model inputs of recipe row ``index`` (``m.error`` where it has none)."""
    m = Mapped(index, row)
    for step in (_model, _cluster, _strategy, _workload):
        step(m)
        if m.error:
            break
    return m


def assess(m: Mapped) -> Result:
    """What the megatron target lacks to run the mapped row, its predicted peak memory and step time."""
    if m.error:
        return Result(m, [m.error])
    assert m.spec is not None and m.cluster is not None and m.strategy is not None and m.workload is not None
    reasons = list(m.reasons)
    try:
        graph = load_model(m.spec, m.workload.seq_len)
        check(graph, m.cluster, m.strategy, m.workload)
        rep = estimate(graph, m.cluster, m.strategy, m.workload).to_dict()
    except ShardplanError as e:
        return Result(m, [*reasons, f"invalid: {first_line(e)}"])
    doc = price(graph, m.cluster, m.strategy, m.workload, model=m.model if isinstance(m.spec, str) else None,
                report=rep)
    reasons += list(dict.fromkeys(x.lacks for x in lacks(doc, TARGET) if not x.behaviour))
    device = m.cluster.device_bytes / GIB
    return Result(m, reasons, rep["memory_peak_gib"], device, rep["step_time_s"],
                  _fits_with(graph, m, rep["memory_peak_gib"], device),
                  {"step_time_s": rep["step_time_s"], "time": rep["time"]})


def _fits_with(graph: Any, m: Mapped, peak: float, device: float) -> str:
    """The least recomputation of the transformer blocks (none, selective, full; the embedding and head
    recompute nothing, as Megatron runs it) with which the row fits the device, or ""."""
    assert m.strategy is not None and m.workload is not None and m.cluster is not None
    if peak <= device:
        return "none"
    s = m.strategy
    outside = [u for u, _ in graph.blocks() if not u.startswith("layers.")]
    for mode in ("selective", "full"):
        d = s.default.model_copy(update={"recompute": mode})
        layers = [LayerStrategy(unit=u, sharding=d.sharding, recompute="none", offload=d.offload) for u in outside]
        rep = estimate(graph, m.cluster, s.model_copy(update={"default": d, "layers": layers}), m.workload)
        if rep.memory_peak_gib <= device:
            return mode
    return ""


def run(indices: list[int] | None = None, model: str | None = None) -> list[Result]:
    rows = load_rows()
    chosen = range(len(rows)) if indices is None else indices
    return [assess(map_row(i, rows[i])) for i in chosen if not model or model.lower() in rows[i]["model"].lower()]


@dataclass
class Planned:
    """The plan searched for a recipe's job: its step, its mesh, and where the recipe's step differs
    from it (``explain --compare-with``'s parts: what the plan saves and spends)."""

    result: Result
    step_s: float
    mesh: str
    where: str

    @property
    def ratio(self) -> float:
        return self.result.step_s / self.step_s  # type: ignore[operator]


def planned(x: Result) -> Planned | None:
    """``plan --target megatron`` for the row's job (same model, GPUs, sequence length, global batch,
    precision, gradient dtype, Adam's state and dispatcher; the whole device as the limit, where the row fits); None
    where the row does not run as written or does not fit."""
    from planner.api import search_plan
    from planner.compare import mesh_text
    from planner.compare_config import differences_text, time_differences
    from planner.request import Request

    m = x.mapped
    if not x.expressible or not x.fits or m.workload is None or m.cluster is None:
        return None
    w = m.workload
    p = search_plan(Request(m.spec, m.cluster, w.seq_len, w.global_batch, memory_limit_gib=x.device_gib,
                            precision=w.precision, grad_dtype=w.grad_dtype, adam_states=w.adam_states,
                            moe_dispatch=w.moe_dispatch,
                            target=TARGET, top_k=0)).plan
    s = p.strategy
    mesh = f"{mesh_text(s)} mb{s.micro_batch} {s.schedule}" + (f"/vpp{s.vpp}" if s.vpp > 1 else "")
    where = differences_text(time_differences(p.predicted.model_dump(), x.predicted))
    return Planned(x, p.predicted.step_time_s, mesh, where)


def plan_rows(results: list[Result]) -> list[Planned]:
    """Each row that runs as written and fits, with the plan searched for its job."""
    return [got for x in results if x.step_s is not None and (got := planned(x)) is not None]


def plan_table(rows: list[Planned], top: int | None = None) -> str:
    """The rows against their plans (the ``top`` largest recipe / planned ratios, or all), then the count
    of rows the plan is no slower than, and the ratios."""
    out = ["| # | model | GPUs | recipe step (s) | planned step (s) | recipe / planned | plan | the plan's step against "
           "the recipe's |", "|---:|---|---|---:|---:|---:|---|---|"]
    shown = sorted(rows, key=lambda r: -r.ratio)[:top] if top else rows
    for q in shown:
        x, r = q.result, q.result.mapped.row
        out.append(f"| {x.mapped.index} | {x.mapped.model} | {r['gpus']}x {r['gpu_type'].split()[0]} | {x.step_s:.3f} | "
                   f"{q.step_s:.3f} | {q.ratio:.3f} | {q.mesh} | {q.where} |")
    ratios = sorted(q.ratio for q in rows)
    if ratios:
        out.append(f"\n{len(ratios)} recipes planned; the plan is no slower in {sum(q >= 1 - 1e-9 for q in ratios)}; "
                   f"recipe / planned: min {ratios[0]:.3f}, median {ratios[len(ratios) // 2]:.3f}, max {ratios[-1]:.3f}")
    return "\n".join(out)


def planned_section(rows: list[Planned], seconds: float) -> str:
    """The docs subsection of ``--plan``: what was planned, and the six largest ratios."""
    offloaded = sum(any("in host memory" in a for a in p.result.mapped.assumptions) for p in rows)
    intro = (f"`python benchmarks/recipes.py --plan --write-docs` (commit {_commit()}, {seconds:.0f} s): for each "
             "recipe that runs as written and fits the device, `plan --target megatron` for the same job (model, "
             "GPUs, sequence length, global batch, precision, bf16 gradients, and the Adam state and MoE dispatcher "
             "the Megatron-Bridge recipe applies; the whole device as the limit, so the recipe is inside the space "
             f"but where it offloads activations, which the search does not offer: {offloaded} of the rows planned). "
             "The last column names the parts of the cost model's step where the recipe's differs from the plan's, "
             "largest first, as `explain --compare-with` prints them. The largest ratios are mixture-of-experts "
             "jobs, where the plan drops or shrinks expert parallelism and saves exposed all-to-all time: the MoE "
             "terms (grouped GEMMs with few rows per expert, permutation, router, load imbalance) are not yet "
             "validated on held-out runs, so read those wins as the model's, not as measured:")
    wrapped = textwrap.fill(intro, width=100, break_long_words=False, break_on_hyphens=False)
    return f"### Planned against the recipes\n\n{wrapped}\n\n{plan_table(rows, top=6)}\n"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"


# ---- tables ---------------------------------------------------------------------------------------

def _mesh(r: dict[str, str]) -> str:
    parts = [f"{k}{r[k]}" for k in ("tp", "pp", "cp", "ep") if (_int(r[k]) or 1) > 1]
    if (_int(r["vp"]) or 1) > 1:
        parts.append(f"vp{r['vp']}")
    return " ".join(parts) or "dp only"


def row_table(results: list[Result]) -> str:
    out = ["| # | recipe | model | GPUs | precision | mesh | mb/gb | megatron runs it? | peak / device (GiB) | fits | fits with recompute | step (s) |",
           "|---:|---|---|---|---|---|---|---|---:|---|---|---:|"]
    for x in results:
        r, m = x.mapped.row, x.mapped
        acc = r["gpu_type"].split()[0]
        mem = f"{x.peak_gib:.1f} / {x.device_gib:.1f}" if x.peak_gib is not None else ""
        fits = "" if x.fits is None else ("yes" if x.fits else "NO")
        step = f"{x.step_s:.3f}" if x.step_s is not None else ""
        out.append(f"| {m.index} | {r['model']} ({r['release']}) | {m.model or '-'} | {r['gpus']}x {acc} | "
                   f"{r['precision']} | {_mesh(r)} | {r['micro_batch']}/{r['global_batch']} | "
                   f"{'yes' if x.expressible else '; '.join(x.reasons)} | {mem} | {fits} | "
                   f"{x.fits_with or ('' if x.peak_gib is None else 'no')} | {step} |")
    return "\n".join(out)


def _category(reason: str) -> str:
    """A reason with its row-specific numbers taken out, for counting (not those of names: ZeRO-3, bf16)."""
    return re.sub(r"(?<![-\w.])\d+\b", "N", reason)


def summary(results: list[Result]) -> str:
    n = len(results)
    priced = [x for x in results if x.peak_gib is not None]
    ok = [x for x in results if x.expressible]
    fit = [x for x in priced if x.fits]
    both = [x for x in ok if x.fits]
    rec = Counter(x.fits_with or "no" for x in priced)
    lines = ["| rows | priced | runs on megatron as written | fits the device | both | fits with selective / full "
             "recompute / not at all |", "|---:|---:|---:|---:|---:|---|",
             f"| {n} | {len(priced)} | {len(ok)} | {len(fit)} | {len(both)} | {rec['selective']} / {rec['full']} / "
             f"{rec['no']} |", "",
             "| why megatron does not run the row as written (N: a row's number) | rows |", "|---|---:|"]
    counts = Counter(_category(r) for x in results for r in dict.fromkeys(x.reasons))
    lines += [f"| {k} | {v} |" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    nofit = [x for x in priced if not x.fits]
    if nofit:
        lines += ["", "| does not fit the device as mapped (no recomputation) | rows |", "|---|---:|"]
        by = Counter(f"{x.mapped.model} on {x.mapped.row['gpu_type'].split()[0]}" for x in nofit)
        lines += [f"| {k} | {v} |" for k, v in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(lines)


def counts_line(results: list[Result]) -> str:
    priced = [x for x in results if x.peak_gib is not None]
    return (f"{sum(1 for x in priced if x.fits)} rows fit the device, "
            f"{sum(1 for x in results if x.expressible and x.fits)} both run as written and fit")


def doc_section(results: list[Result], other: list[Result] | None = None) -> str:
    offloaded = sum(any("in host memory" in a for a in x.mapped.assumptions) for x in results)
    aware = sum(any("precision-aware" in a for a in x.mapped.assumptions) for x in results)
    intro = (f"`python benchmarks/recipes.py --write-docs` (commit {_commit()}): each row of "
            "`costmodel/data/calibration/recipes.csv` (NVIDIA's Megatron-Bridge / NeMo performance configurations, "
            "no step times) priced as the megatron target (megatron-core 0.16.1) runs it. \"Runs as written\": "
            "nothing in the row is refused by `export --to megatron`'s nearest-plan check, the validity rules or "
            "the vocabulary; \"fits\": the predicted peak within the whole device. Unstated settings are assumed: "
            f"the distributed optimizer unless Megatron-FSDP, no recomputation, sequence parallelism with tp > 1, "
            f"gradients reduced in {GRAD_DTYPE['value']}, the experts folded over tp (etp 1) where ep does not "
            "divide dp x cp, the MoE dispatcher Megatron-Bridge 0.3.1's recipe applies (DeepEP/HybridEP priced "
            "as the de-duplicating dispatch), the activations of the first N layers in host memory where "
            f"Megatron-Bridge 0.6.2's performance recipe of the same job offloads them ({offloaded} rows), Adam's "
            "moments in bf16 with the master as 16-bit remainders where the Megatron-Bridge 0.3.1 recipe turns on "
            f"the precision-aware optimizer ({aware} rows: DeepSeek-V3); fp8 and "
            "MXFP8 linears keep the fp8 copy of their inputs for backward (Transformer Engine); "
            "MXFP8 is priced as mxfp8 (fp8 GEMMs, the block scales' bytes in the casts), NVFP4 is not priced "
            "(no FP4 throughput in the hardware data), Megatron-FSDP is ZeRO-3 (optim_grads_params). "
            "`tests/test_recipes.py` checks the mapping of a few rows."
            + (f" With fp32 gradients (`--grad-dtype fp32`, what a search for megatron prices) "
               f"{counts_line(other)}." if other is not None else ""))
    wrapped = textwrap.fill(intro, width=100, break_long_words=False, break_on_hyphens=False)
    return f"{SECTION}\n\n{wrapped}\n\n{summary(results)}\n"


def write_docs(results: list[Result], other: list[Result] | None = None, planned: str = "") -> None:
    text = DOC.read_text(encoding="utf-8")
    new = doc_section(results, other) + (f"\n{planned}" if planned else "")
    start = text.find(SECTION)
    if start < 0:
        anchor = text.find("\n## Other benchmarks")
        text = text[:anchor + 1] + new + "\n" + text[anchor + 1:] if anchor >= 0 else text.rstrip() + "\n\n" + new
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + new + (text[end:] if end >= 0 else "")
    DOC.write_text(text, encoding="utf-8")


def _indices(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="0-based rows, e.g. 0-9,75")
    ap.add_argument("--model", help="rows whose model name holds this text (any case)")
    ap.add_argument("--grad-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="gradient buffers and their reduction (default bf16, as the performance recipes run)")
    ap.add_argument("--write-docs", action="store_true", help="put the summary into docs/validation.md")
    ap.add_argument("--plan", action="store_true", help="also plan each job for megatron and compare (minutes)")
    a = ap.parse_args(argv)
    GRAD_DTYPE["value"] = a.grad_dtype
    t0 = time.perf_counter()
    results = run(_indices(a.rows) if a.rows else None, a.model)
    rows = plan_rows(results) if a.plan else []
    print(plan_table(rows) if a.plan else f"{row_table(results)}\n\n{summary(results)}")
    if a.write_docs:
        other = None
        if a.grad_dtype == "bf16" and a.rows is None and a.model is None:
            GRAD_DTYPE["value"] = "fp32"
            other = run()
            GRAD_DTYPE["value"] = "bf16"
        write_docs(results, other, planned_section(rows, time.perf_counter() - t0) if a.plan else "")
        print(f"\nwrote {SECTION!r} into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
