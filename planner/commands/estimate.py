"""``shardplan estimate``: price one plan (degree flags or a plan file), or a JSON-lines batch of them.

Degrees: give ``--tp --pp --cp --ep`` and either ``--dp-shard``/``--dp-replicate`` or nothing: the
data-parallel degree is then ``GPUs / (pp·cp·tp)`` (or ``--dp``) and goes to ``dp_shard`` with ZeRO
1-3, to ``dp_replicate`` with ``--zero 0`` (plain data parallelism: ``dp_shard = 1``). Given only one
of ``--dp-shard``/``--dp-replicate``, the other is whatever makes the product match the cluster.

Batch mode (``--batch FILE.jsonl``): one JSON object per line with the same keys, underscored
(``dp_shard``, ``global_batch``, ``memory_limit``, ...), plus ``model`` (preset name, config path or
an object of Hugging Face config keys) and ``cluster`` (``64xh100`` or an object); one JSON line
out per line in, in order: the report, or ``{"error": "..."}`` for a line that cannot be priced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, guard, print_json
from vocab.errors import ShardplanError

GIB = 1024**3
KEYS = (
    "model",
    "cluster",
    "seq_len",
    "global_batch",
    "micro_batch",
    "tp",
    "pp",
    "cp",
    "ep",
    "dp",
    "dp_shard",
    "dp_replicate",
    "zero",
    "recompute",
    "schedule",
    "vpp",
    "precision",
    "attention_kernel",
    "cross_entropy",
    "grad_dtype",
    "sequence_parallel",
    "profile",
    "memory_limit",
    "memory_limit_gib",
    "plan",
    "tp_mode",
    "cp_mode",
)


def _pydantic_message(e: Exception) -> str:
    errs = getattr(e, "errors", None)
    if not callable(errs):
        return str(e)
    parts = []
    for err in errs()[:3]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "strategy"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc != "strategy" else msg)
    return "; ".join(parts)


def _precheck(cfg: dict[str, Any], a: dict[str, Any], blocks: int) -> None:
    """The constraints a flag can break on its own, named with their values (before any arithmetic)."""
    from vocab.strategy import RECOMPUTES, SCHEDULES

    for key, known in (
        ("schedule", SCHEDULES),
        ("recompute", RECOMPUTES),
        ("precision", ("bf16", "fp8", "fp32")),
        ("tp_mode", ("megatron", "tsp")),
        ("cp_mode", ("ring", "ulysses")),
    ):
        if a.get(key) is not None and a[key] not in known:
            raise ShardplanError(f"unknown {key.replace('_', ' ')} '{a[key]}'; known: {', '.join(known)}")
    tp, ep, pp = (int(a.get(k) or 1) for k in ("tp", "ep", "pp"))
    heads, kv, experts = (int(cfg.get(k, 0) or 0) for k in ("heads", "kv_heads", "experts"))
    if heads and heads % tp:
        raise ShardplanError(f"tp={tp} does not divide the {heads} attention heads")
    if kv and kv % tp and tp % kv:
        raise ShardplanError(f"tp={tp} and the {kv} KV heads: one must divide the other")
    if ep > 1 and not experts:
        raise ShardplanError(f"ep={ep} needs a mixture-of-experts model; this one has no experts")
    if experts and experts % ep:
        raise ShardplanError(f"ep={ep} does not divide the {experts} experts")
    if pp > max(blocks, 1):
        raise ShardplanError(f"pp={pp} stages for only {blocks} layers")


def _degrees(world: int, a: dict[str, Any]) -> dict[str, int]:
    """Mesh degrees from the flags, data parallelism filled in to match the cluster."""
    pp, cp, tp, ep = (int(a.get(k) or 1) for k in ("pp", "cp", "tp", "ep"))
    for k, v in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if v < 1:
            raise ShardplanError(f"--{k} must be >= 1, got {v}")
    inner = pp * cp * tp
    zero = int(a.get("zero") or 0)
    dps, dpr, dp = a.get("dp_shard"), a.get("dp_replicate"), a.get("dp")
    if dps is None or dpr is None:
        if world % inner and (dp is None or dps is None and dpr is None):
            raise ShardplanError(
                f"pp*cp*tp = {pp}*{cp}*{tp} = {inner} does not divide the cluster's {world} GPUs"
            )
        total = int(dp) if dp is not None else world // inner
        if dps is None and dpr is None:
            dps, dpr = (1, total) if zero == 0 else (total, 1)
        elif dps is None:
            if total % int(dpr):
                raise ShardplanError(f"dp_replicate={dpr} does not divide the data-parallel degree {total}")
            dps = total // int(dpr)
        else:
            if total % int(dps):
                raise ShardplanError(f"dp_shard={dps} does not divide the data-parallel degree {total}")
            dpr = total // int(dps)
    return {"pp": pp, "dp_replicate": int(dpr), "dp_shard": int(dps), "cp": cp, "tp": tp, "ep": ep}


def price_args(a: dict[str, Any]) -> dict[str, Any]:
    """The report of one plan given as flags / a batch line (raises ShardplanError)."""
    from pydantic import ValidationError

    from costmodel.estimate import estimate
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from vocab.strategy import (
        ZERO_TO_SHARDING,
        LayerStrategy,
        Mesh,
        Strategy,
        Workload,
        check_workload_choices,
    )

    unknown = sorted(set(a) - set(KEYS))
    if unknown:
        raise ShardplanError(f"unknown key(s) {unknown}; known: {', '.join(KEYS)}")
    plan = None
    if a.get("plan"):
        from vocab.plan import load_plan

        plan = load_plan(a["plan"])
    model = a.get("model") or (plan.inputs.model if plan else None)
    cluster_spec = a.get("cluster") or (plan.inputs.cluster.model_dump() if plan else None)
    if not model or not cluster_spec:
        raise ShardplanError("give --model and --cluster (or --plan)")
    cluster = parse_cluster(cluster_spec)
    wl = plan.inputs.workload if plan else None
    seq = a.get("seq_len") or (wl.seq_len if wl else None)
    gb = a.get("global_batch") or (wl.global_batch if wl else None)
    if not seq or not gb:
        raise ShardplanError("give --seq-len and --global-batch (or --plan)")
    precision = a.get("precision") or (wl.precision if wl else "bf16")
    kernel = a.get("attention_kernel") or (wl.attention_kernel if wl else "auto")
    ce = a.get("cross_entropy") or (wl.cross_entropy if wl else "eager")
    grad = a.get("grad_dtype") or (wl.grad_dtype if wl else "fp32")
    check_workload_choices(attention_kernel=kernel, cross_entropy=ce, grad_dtype=grad)
    graph = load_model(model, int(seq))
    try:
        w = Workload(seq_len=int(seq), global_batch=int(gb), precision=precision, attention_kernel=kernel,
                     cross_entropy=ce, grad_dtype=grad)
        if plan is not None:
            s = plan.strategy
        else:
            _precheck(graph.config, a, graph.num_blocks)
            zero = int(a.get("zero") or 0)
            if zero not in ZERO_TO_SHARDING:
                raise ShardplanError(f"--zero must be 0, 1, 2 or 3, got {zero}")
            ls = LayerStrategy(sharding=ZERO_TO_SHARDING[zero], recompute=a.get("recompute") or "none")
            s = Strategy(
                mesh=Mesh(**_degrees(cluster.world_size, a)),
                micro_batch=int(a.get("micro_batch") or 1),
                schedule=a.get("schedule") or "1f1b",
                vpp=int(a.get("vpp") or 1),
                sequence_parallel=bool(a.get("sequence_parallel")),
                tp_mode=a.get("tp_mode") or "megatron",
                cp_mode=a.get("cp_mode") or "ring",
                default=ls,
            )
    except ValidationError as e:
        raise ShardplanError(f"invalid plan: {_pydantic_message(e)}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ShardplanError):
            raise
        raise ShardplanError(f"invalid value: {e}") from None
    prof = None
    profile = a.get("profile") or (plan.inputs.profile if plan else None)
    if profile:
        from profiler.profile_schema import load_profile

        prof = load_profile(profile)
    limit = a.get("memory_limit", a.get("memory_limit_gib"))
    if limit is None and plan is not None:
        limit = plan.inputs.memory_limit_gib
    return estimate(graph, cluster, s, w, prof, float(limit) if limit is not None else None).to_dict()


def run_batch(path: Path) -> list[str]:
    """One JSON line per input line: the report or ``{"error": ...}``."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ShardplanError(f"cannot read batch file '{path}': {e.strerror}") from None
    if not any(line.strip() for line in lines):
        raise ShardplanError(f"batch file '{path}' holds no plans (one JSON object per line)")
    out = []
    for i, line in enumerate(lines, 1):
        try:
            if not line.strip():
                raise ShardplanError("empty line")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ShardplanError(f"not valid JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(obj, dict):
                raise ShardplanError("each line must be a JSON object")
            rep = price_args(obj)
        except ShardplanError as e:
            rep = {"error": f"line {i}: {e}"}
        out.append(json.dumps(rep, sort_keys=True, default=str))
    return out


def _table(rep: dict[str, Any]) -> Table:
    t = Table(title="estimate", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("step time", f"{rep['step_time_s']:.4g} s ({rep['num_microbatches']} micro-batches)")
    t.add_row("tokens/s/GPU", f"{rep['tokens_per_s_per_gpu']:,.0f}")
    t.add_row("MFU / HFU", f"{rep['mfu']:.1%} / {rep['hfu']:.1%}")
    fits = "fits" if rep["fits"] else "[red]does not fit[/]"
    t.add_row("peak memory", f"{rep['memory_peak_gib']:.2f} GiB of {rep['memory_limit_gib']:.2f} GiB: {fits}")
    tm = rep["time"]
    comm = ", ".join(f"{k} {v:.3g}" for k, v in sorted(tm["comm_s"].items()) if v)
    t.add_row(
        "time (s)",
        f"compute {tm['compute_s']:.3g}, recompute {tm['recompute_s']:.3g}, bubble "
        f"{tm['bubble_s']:.3g}, optimizer {tm['optimizer_s']:.3g}" + (f", comm {comm}" if comm else ""),
    )
    for st in rep["stages"]:
        t.add_row(
            f"stage {st['stage']}",
            f"{st['total_gib']:.2f} GiB: params {st['params_gib']:.2f}, grads "
            f"{st['grads_gib']:.2f}, optimizer {st['optimizer_gib']:.2f}, activations "
            f"{st['activations_gib']:.2f}, buffers {st['buffers_gib']:.2f}",
        )
    return t


@app.command("estimate")
@guard
def estimate_cmd(
    model: str = typer.Option(
        None, "--model", "-m", help="preset name, config.json path or pkg.module:factory"
    ),
    cluster: str = typer.Option(None, "--cluster", "-c", help="'64xh100' or a cluster YAML/JSON file"),
    seq_len: int = typer.Option(None, "--seq-len", help="tokens per sample"),
    global_batch: int = typer.Option(None, "--global-batch", help="samples per optimizer step"),
    micro_batch: int = typer.Option(1, "--micro-batch", help="samples per micro-batch"),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    cp: int = typer.Option(1, "--cp"),
    ep: int = typer.Option(1, "--ep"),
    dp: int = typer.Option(None, "--dp", help="data-parallel degree (default: GPUs / (pp*cp*tp))"),
    dp_shard: int = typer.Option(None, "--dp-shard", help="ranks ZeRO/FSDP shards over"),
    dp_replicate: int = typer.Option(None, "--dp-replicate", help="plain data-parallel replicas"),
    zero: int = typer.Option(0, "--zero", help="0 (DDP, dp_shard 1), 1, 2 or 3"),
    recompute: str = typer.Option("none", "--recompute", help="none | selective | full"),
    schedule: str = typer.Option("1f1b", "--schedule", help="gpipe | 1f1b | interleaved | zb"),
    vpp: int = typer.Option(1, "--vpp", help="virtual stages per rank (interleaved)"),
    precision: str = typer.Option(None, "--precision", help="bf16 | fp8"),
    attention_kernel: str = typer.Option(
        None, "--attention-kernel", help="auto | flash2 (FlashAttention-2, SDPA) | flash3 (Hopper-native)"
    ),
    cross_entropy: str = typer.Option(
        None, "--cross-entropy", help="eager (PyTorch F.cross_entropy, the default) | fused (Megatron)"
    ),
    grad_dtype: str = typer.Option(None, "--grad-dtype", help="gradient buffers: fp32 (default) | bf16"),
    sequence_parallel: bool = typer.Option(
        False, "--sequence-parallel", help="Megatron sequence parallelism"
    ),
    profile: Path = typer.Option(None, "--profile", help="measured profile to price with"),
    memory_limit: float = typer.Option(None, "--memory-limit", help="per-GPU limit in GiB"),
    plan: Path = typer.Option(None, "--plan", help="price this plan file instead of the degree flags"),
    batch: Path = typer.Option(None, "--batch", help="JSON-lines file of plans to price"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Price one plan: step time, tokens/s/GPU, MFU and per-stage memory."""
    if batch is not None:
        for line in run_batch(batch):
            sys.stdout.write(line + "\n")
        return
    args: dict[str, Any] = {
        "model": model,
        "cluster": cluster,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "precision": precision,
        "attention_kernel": attention_kernel,
        "cross_entropy": cross_entropy,
        "grad_dtype": grad_dtype,
        "profile": str(profile) if profile else None,
        "memory_limit": memory_limit,
    }
    if plan is not None:
        args["plan"] = str(plan)
    else:
        args.update(
            micro_batch=micro_batch,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            dp=dp,
            dp_shard=dp_shard,
            dp_replicate=dp_replicate,
            zero=zero,
            recompute=recompute,
            schedule=schedule,
            vpp=vpp,
            sequence_parallel=sequence_parallel,
        )
    rep = price_args(args)
    if as_json:
        print_json(rep)
    else:
        console.print(_table(rep))
