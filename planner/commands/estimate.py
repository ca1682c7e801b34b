"""``shardplan estimate``: price one plan (degree flags or a plan file), or a JSON-lines batch of them.

Degrees: give ``--tp --pp --cp --ep`` (``--etp 1`` folds the expert ranks over tp) and either
``--dp-shard``/``--dp-replicate`` or nothing: the data-parallel degree is then ``GPUs / (pp·cp·tp)``
(or ``--dp``) and goes to ``dp_shard`` with ZeRO 1-3, to ``dp_replicate`` with ``--zero 0`` (plain
data parallelism: ``dp_shard = 1``). Given only one of ``--dp-shard``/``--dp-replicate``, the other
is whatever makes the product match the cluster.

Batch mode (``--batch FILE.jsonl``): one JSON object per line with the same keys, underscored
(``dp_shard``, ``global_batch``, ``memory_limit``, ...), plus ``model`` (preset name, config path or
an object of Hugging Face config keys; never a ``package.module:factory``: factories are imported
only from the command line ``--model``) and ``cluster`` (``64xh100`` or an object). Exactly one
JSON line out per line in, in order, whatever the line holds: the report, ``{"error": "line N:
..."}`` for a line that cannot be priced, or ``{"error": "line N: internal error: ... -- this is a
bug"}`` for an unexpected exception; with any such line the command ends with ``error: N of M
lines failed`` and exit code 2. ``--batch -`` reads standard input.

A plan file (``--plan``, or ``plan`` in a batch line) is priced with the preset it names or the layer
graph it records, never by importing code, and never opens a file the plan names: a model config
path needs ``--model``, and the profile the plan names is used only with ``--profile-from-plan``
(else a note says it is not loaded; see :mod:`planner.reprice`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, guard
from planner.layout import literal
from planner.options import Opt, Values, command
from planner.price_values import KEYS, check_values, stage_layers
from planner.request import PriceRequest, option
from vocab.arguments import typed
from vocab.errors import ShardplanError, first_line
from vocab.io import MAX_DEPTH, check_depth

GIB = 1024**3
#: the workload options a user may set; the others of WORKLOAD_BEHAVIOUR follow the target
ASKED = ("cross_entropy", "grad_dtype", "adam_states", "moe_dispatch", "moe_overlap", "selective")


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


def _precheck(cfg: dict[str, Any], r: PriceRequest, blocks: int) -> None:
    """The constraints a flag can break on its own, named with their values (before any arithmetic)."""
    from typing import get_args

    from vocab.strategy import OFFLOADS, RECOMPUTES, SCHEDULES, Strategy

    modes = {k: get_args(Strategy.model_fields[k].annotation) for k in ("tp_mode", "cp_mode", "cp_rotate")}
    for key, known in (("schedule", SCHEDULES), ("recompute", RECOMPUTES), *modes.items(), ("offload", OFFLOADS)):
        value = getattr(r, key)
        if value is not None and value not in known:
            raise ShardplanError(f"unknown {key.replace('_', ' ')} '{value}'; known: {', '.join(known)}")
    tp, ep, pp = (int(getattr(r, k) or 1) for k in ("tp", "ep", "pp"))
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


def _degrees(world: int, r: PriceRequest) -> dict[str, int]:
    """Mesh degrees from the flags, data parallelism filled in to match the cluster."""
    pp, cp, tp, ep = (int(getattr(r, k) or 1) for k in ("pp", "cp", "tp", "ep"))
    for k, v in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if v < 1:
            raise ShardplanError(f"--{k} must be >= 1, got {v}")
    inner = pp * cp * tp
    zero = int(r.zero or 0)
    dps, dpr, dp = r.dp_shard, r.dp_replicate, r.dp
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
    etp = int(r.etp or 0)  # unset: as tp
    return {"pp": pp, "dp_replicate": int(dpr), "dp_shard": int(dps), "cp": cp, "tp": tp, "ep": ep,
            "etp": 0 if etp == tp else etp}


@typed
def price_args(a: dict[str, Any], *, model_from_cli: bool = False, profile_from_plan: bool = False) -> dict[str, Any]:
    """The report of one plan given as a batch line's keys (raises ShardplanError; see :func:`price`)."""
    return price(line_request(a), model_from_cli=model_from_cli, profile_from_plan=profile_from_plan)


def line_request(a: dict[str, Any]) -> PriceRequest:
    """The request of a batch line's keys, each value checked (a line's JSON can hold anything);
    ``memory_limit_gib`` is the other name of ``memory_limit``."""
    unknown = sorted(set(a) - set(KEYS))
    if unknown:
        raise ShardplanError(f"unknown key(s) {unknown}; known: {', '.join(KEYS)}")
    check_values(a)
    return PriceRequest(**{**a, "memory_limit": a.get("memory_limit", a.get("memory_limit_gib"))})


def price(r: PriceRequest, *, model_from_cli: bool = False, profile_from_plan: bool = False) -> dict[str, Any]:
    """The report of one plan (raises ShardplanError). A ``package.module:factory`` model is
    imported only with ``model_from_cli`` (the command line); the profile a plan names is loaded only
    with ``profile_from_plan`` (else a note in the report says so)."""
    from costmodel.estimate import estimate
    from planner.reprice import step_band

    plan = None
    if r.plan:
        from vocab.plan import load_plan

        plan = load_plan(r.plan)
    cluster = _cluster(r, plan)
    w, target = _workload(r, plan)
    graph = _graph(r, plan, w.seq_len, model_from_cli)
    s = plan.strategy if plan is not None else _strategy(r, graph, cluster)
    prof, notes = _profile(r.profile, plan, profile_from_plan)
    if plan is None and target is not None:
        s, scoped = blocks_scope(s, graph, target[0])
        notes += scoped
    limit = r.memory_limit
    if limit is None and plan is not None:
        limit = plan.inputs.memory_limit_gib
    cal = _calibration(r.calibration, plan, prof)
    dev = cal.device(cluster) if cal is not None else None
    rep = estimate(graph, cluster, s, w, prof, float(limit) if limit is not None else None, dev).to_dict()
    from planner.low_precision import low_precision_notes

    rep["notes"] = [*rep.get("notes", []), *notes, *low_precision_notes(graph, cluster, s, w, rep["step_time_s"], prof, dev)]
    rep["error_band"] = step_band(rep["step_time_s"], cluster.accelerator.name, w.precision, measured=prof is not None,
                                  calibration=cal.ref() if cal is not None else None, moe=graph.has_experts)
    if cal is not None:
        rep["calibration"] = cal.ref()
    if target is not None:
        _check_expressible(target[0], graph, cluster, s, w, r.model or (plan.inputs.model if plan else ""), rep)
        rep["target"] = target[0].name
    return rep


def blocks_scope(s: Any, graph: Any, t: Any) -> tuple[Any, list[str]]:
    """``s`` as target ``t`` runs its ``--recompute``: where the target recomputes the transformer blocks
    only (``recompute.scope: blocks``), the embedding and head recompute nothing, as a searched plan
    (:func:`solvers.space.blocks_recompute`); and the note saying so (none where nothing changes)."""
    from solvers.space import blocks_recompute

    if t.recompute.scope != "blocks" or s.layers:
        return s, []
    scoped = blocks_recompute(s, [u for u, _ in graph.blocks()])
    if scoped is s:
        return s, []
    outside = [x.unit for x in scoped.layers]
    note = (f"--recompute {s.default.recompute} on {t.name} recomputes the transformer blocks; the "
            f"{' and '.join(outside)} recompute nothing ({t.name} checkpoints transformer blocks only)")
    return scoped, [note]


def _cluster(r: PriceRequest, plan: Any) -> Any:
    """The cluster the request names, else the one ``plan`` records."""
    from profiler.hardware import parse_cluster

    cluster_spec = r.cluster or (plan.inputs.cluster.model_dump() if plan else None)
    if ((r.model or None) is None and plan is None) or not cluster_spec:
        raise ShardplanError("give --model and --cluster (or --plan)")
    try:
        return parse_cluster(cluster_spec)
    except (TypeError, ValueError, KeyError) as e:
        if isinstance(e, ShardplanError):
            raise
        raise ShardplanError(f"invalid cluster: {first_line(e)}") from None


def _workload(r: PriceRequest, plan: Any) -> tuple[Any, tuple[Any, dict[str, str]] | None]:
    """The workload to price (each value as asked; else as the target runs it; else the plan's; else
    the default) and the target with the workload fields it prices with (None without ``--target``)."""
    from pydantic import ValidationError

    from vocab.strategy import Workload, check_precision, check_workload_choices
    from vocab.targets import WORKLOAD_BEHAVIOUR

    wl = plan.inputs.workload if plan else None
    seq = r.seq_len or (wl.seq_len if wl else None)
    gb = r.global_batch or (wl.global_batch if wl else None)
    if not seq or not gb:
        raise ShardplanError("give --seq-len and --global-batch (or --plan)")
    precision = r.precision or (wl.precision if wl else "bf16")
    check_precision(precision)
    kernel = r.attention_kernel or (wl.attention_kernel if wl else "auto")
    asked = {f: getattr(r, f) for f in ASKED}
    check_workload_choices(attention_kernel=kernel, **{f: v for f, v in asked.items() if v is not None})
    target = _target(r.target, precision, asked)
    behaved = target[1] if target else {
        f: asked.get(f) or (getattr(wl, f) if wl else Workload.model_fields[f].default) for f in WORKLOAD_BEHAVIOUR}
    capacity = r.moe_capacity_factor or (wl.moe_capacity_factor if wl else None)
    if target:
        from planner.api import check_capacity

        check_capacity(target[0], capacity)
    try:
        w = Workload(seq_len=seq, global_batch=gb, precision=precision, attention_kernel=kernel,
                     moe_capacity_factor=capacity, **behaved)
    except ValidationError as e:
        raise ShardplanError(f"invalid workload: {_pydantic_message(e)}") from None
    return w, target


def _graph(r: PriceRequest, plan: Any, seq: int, model_from_cli: bool) -> Any:
    """The layer graph to price: the model asked for (a factory only from the command line), else
    the plan's (its preset or the graph it records)."""
    from planner.reprice import load_named_model, plan_graph
    from profiler.models import load_model

    if (r.model or None) is None:
        return plan_graph(plan, seq)
    if model_from_cli:
        return load_model(r.model, seq)
    return load_named_model(r.model, seq)


def _target_rotate(target: str | None) -> str:
    """How the target's ring moves K/V (its first ``behaviour.cp_rotate``), allgather without one."""
    from vocab.targets import load_target

    return load_target(target).behaviour.cp_rotate[0] if target else "allgather"


def _offloaded_layers(ls: Any, count: int | None, blocks: int) -> tuple[Any, list[Any]]:
    """``--offload-layers N``: the first N blocks offload their activations, every other unit keeps them
    (the default strategy without the offload, and N layer entries)."""
    from vocab.strategy import first_blocks_offloaded

    if count is None:
        return ls, []
    if ls.offload != "activations":
        raise ShardplanError("--offload-layers needs --offload activations")
    if not 1 <= count <= blocks:
        raise ShardplanError(f"--offload-layers must be between 1 and the model's {blocks} blocks, got {count}")
    return ls.model_copy(update={"offload": "none"}), first_blocks_offloaded(ls, count)


def _strategy(r: PriceRequest, graph: Any, cluster: Any) -> Any:
    """The strategy of the request's degrees, micro-batching, schedule and per-layer choices."""
    from pydantic import ValidationError

    from vocab.strategy import ZERO_TO_SHARDING, LayerStrategy, Mesh, Strategy

    try:
        _precheck(graph.config, r, graph.num_blocks)
        zero = int(r.zero or 0)
        if zero not in ZERO_TO_SHARDING:
            raise ShardplanError(f"--zero must be 0, 1, 2 or 3, got {zero}")
        ls = LayerStrategy(sharding=ZERO_TO_SHARDING[zero], recompute=r.recompute or "none", offload=r.offload or "none")
        ls, layers = _offloaded_layers(ls, r.offload_layers, graph.num_blocks)
        return Strategy(
            mesh=Mesh(**_degrees(cluster.world_size, r)),
            micro_batch=r.micro_batch or 1,
            schedule=r.schedule or "1f1b",
            vpp=r.vpp or 1,
            stage_layers=stage_layers(r.stage_layers) if r.stage_layers is not None else None,
            sequence_parallel=bool(r.sequence_parallel),
            tp_mode=r.tp_mode or "megatron",
            cp_mode=r.cp_mode or "ring",
            cp_rotate=r.cp_rotate or _target_rotate(r.target),
            default=ls,
            layers=layers,
        )
    except ValidationError as e:
        raise ShardplanError(f"invalid plan: {_pydantic_message(e)}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ShardplanError):
            raise
        raise ShardplanError(f"invalid value: {e}") from None


def _calibration(path: str | None, plan: Any, prof: Any) -> Any:
    """The calibration to price with: the file ``path`` names, else the one ``plan`` records (its
    values: no file opened); none with a measured profile, which replaces what a calibration moves."""
    if path and prof is not None:
        raise ShardplanError("give --calibration or a profile, not both: a calibration moves the spec sheet's "
                             "constants, a profile replaces them")
    if path:
        from costmodel.calibration.document import load_calibration

        return load_calibration(path)
    if plan is not None and prof is None:
        from planner.calibration import recorded

        return recorded(plan)
    return None


def _profile(path: str | None, plan: Any, from_plan: bool) -> tuple[Any, list[str]]:
    """The measured profile to price with (``path``, or with ``from_plan`` the one ``plan`` names) and the
    note of a plan's profile left unloaded."""
    if plan is not None:
        from planner.reprice import command_line_files

        files, notes = command_line_files(plan, path, from_plan)
        return files.profile, notes
    if not path:
        return None, []
    from profiler.profile_schema import load_profile

    return load_profile(path), []


def _target(name: str | None, precision: str, asked: dict[str, Any]) -> tuple[Any, dict[str, str]] | None:
    """The target ``--target`` names, with the workload fields it prices with (those ``asked``,
    which it must run, else its own)."""
    if not name:
        return None
    from planner.api import target_behaviour
    from vocab.targets import load_target

    t = load_target(name)
    return t, target_behaviour(t, precision, **asked)


def _check_expressible(t: Any, graph: Any, cluster: Any, s: Any, w: Any, model: str | dict[str, Any],
                       rep: dict[str, Any]) -> None:
    """One line naming what target ``t`` cannot express of strategy ``s``, priced ``rep`` (nothing for ``any``)."""
    from planner.reprice import price
    from planner.trainers import lacks
    from vocab.targets import ANY

    if t.name == ANY or not t.exporter:
        return
    doc = price(graph, cluster, s, w, model=model or graph.model_id, report=rep)
    missing = list(dict.fromkeys(x.lacks for x in lacks(doc, t.exporter) if not x.behaviour))
    if missing:
        raise ShardplanError(f"{t.label} cannot express: {'; '.join(missing)}")


def report_json(rep: dict[str, Any], indent: int | None = None) -> str:
    """A report as JSON: keys sorted; NaN and infinities refused (``ValueError``), never printed."""
    return json.dumps(rep, indent=indent, sort_keys=True, default=str, allow_nan=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def batch_line(line: str, number: int) -> str:
    """The one JSON line out for input line ``number``: the report or ``{"error": ...}``, whatever the
    line holds (an unexpected exception is named as a bug; ``SHARDPLAN_DEBUG=1`` re-raises it)."""
    try:
        if not line.strip():
            raise ShardplanError("empty line")
        try:
            obj = json.loads(line, parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise ShardplanError(f"not valid JSON: {e.msg} at column {e.colno}") from None
        except ValueError as e:  # NaN or Infinity, an integer of thousands of digits
            raise ShardplanError(f"not valid JSON: {first_line(e)}") from None
        check_depth(obj, "the line")
        if not isinstance(obj, dict):
            raise ShardplanError("each line must be a JSON object")
        return report_json(price_args(obj))
    except ShardplanError as e:
        rep = {"error": f"line {number}: {first_line(e)}"}
    except RecursionError:
        rep = {"error": f"line {number}: the line nests deeper than {MAX_DEPTH} levels"}
    except MemoryError:
        rep = {"error": f"line {number}: out of memory: the line is too large"}
    except Exception as e:
        if os.environ.get("SHARDPLAN_DEBUG"):
            raise
        rep = {"error": f"line {number}: internal error: {type(e).__name__}: {first_line(e)} -- this is a bug"}
    return json.dumps(rep, sort_keys=True)


def is_error_line(line: str) -> bool:
    """Whether a line of :func:`batch_line` is an error (``{"error": ...}``, a report has no such key)."""
    return line.startswith('{"error": ')


def iter_batch(path: Path) -> Iterator[str]:
    """One JSON line per input line (lines end at ``\\n``), in order. The file (``-``: standard
    input) is read whole first (UTF-8 under the size limit); a file that cannot be read, or holds no
    plans, raises ShardplanError before any line comes out."""
    from vocab.io import read_stream, read_text

    stdin = str(path) == "-"
    text = (read_stream(sys.stdin.buffer, "batch file", "-") if stdin else read_text(path, "batch file"))
    text = text.removeprefix("\ufeff")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not any(line.strip() for line in lines):
        raise ShardplanError(f"batch file '{path}' holds no plans (one JSON object per line)")
    for i, line in enumerate(lines, 1):
        yield batch_line(line.removesuffix("\r"), i)


def run_batch(path: Path) -> list[str]:
    """One JSON line per input line: the report or ``{"error": ...}`` (see :func:`iter_batch`)."""
    return list(iter_batch(path))


def _table(rep: dict[str, Any]) -> Table:
    t = Table(title="estimate", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    from planner.reprice import band_text

    band = band_text(rep.get("error_band"))
    n_mb = rep["num_microbatches"]
    t.add_row("step time", f"{rep['step_time_s']:.4g} s ({n_mb} micro-batch{'es' if n_mb != 1 else ''})"
              + (f"; {band}" if band else ""))
    t.add_row("tokens/s/GPU", f"{rep['tokens_per_s_per_gpu']:,.0f}")
    t.add_row("MFU / HFU", f"{rep['mfu']:.1%} / {rep['hfu']:.1%}")
    fits = "fits" if rep["fits"] else "[red]does not fit[/]"
    t.add_row("peak memory", f"{rep['memory_peak_gib']:.2f} GiB of {rep['memory_limit_gib']:.2f} GiB: {fits}")
    tm = rep["time"]
    comm = ", ".join(f"{k} {v:.3g}" for k, v in sorted(tm["comm_s"].items()) if v)
    t.add_row(
        "time (s)",
        f"compute {tm['compute_s']:.3g}, recompute {tm['recompute_s']:.3g}, bubble "
        f"{tm['bubble_s']:.3g}, optimizer {tm['optimizer_s']:.3g}" + (f", comm {comm}" if comm else "")
        + (f", host transfers {tm['offload_s']:.3g}" if tm.get("offload_s") else ""),
    )
    if rep.get("host_per_node_gib"):
        cap = rep.get("host_limit_per_node_gib") or 0.0
        t.add_row("host memory", f"{rep['host_per_node_gib']:,.1f} GiB per node offloaded" + (
            f" of the {cap:,.0f} GiB it may use" if cap else " (the node's host memory is not recorded: not checked)"))
    for st in rep["stages"]:
        t.add_row(
            f"stage {st['stage']}",
            f"{st['total_gib']:.2f} GiB: params {st['params_gib']:.2f}, grads "
            f"{st['grads_gib']:.2f}, optimizer {st['optimizer_gib']:.2f}, activations "
            f"{st['activations_gib']:.2f}, buffers {st['buffers_gib']:.2f}",
        )
    for note in rep.get("notes") or []:
        t.add_row("note", literal(note))
    return t


#: ``shardplan estimate``'s options: the fields of :class:`planner.request.PriceRequest`, then the modes
ESTIMATE_OPTIONS = (
    *(option(name, cls=PriceRequest) for name in (
        "model", "cluster", "seq_len", "global_batch", "micro_batch", "tp", "pp", "cp", "ep", "etp", "dp", "dp_shard",
        "dp_replicate", "zero", "recompute", "schedule", "vpp", "precision", "attention_kernel", "cross_entropy",
        "grad_dtype", "adam_states", "moe_dispatch", "moe_overlap", "moe_capacity_factor", "selective", "tp_mode",
        "cp_mode", "cp_rotate", "offload", "offload_layers", "stage_layers", "target", "sequence_parallel", "profile")),
    Opt("profile_from_plan", bool, typer.Option(False, "--profile-from-plan", help="with --plan: price with the "
                                                "profile the plan names (not loaded otherwise)")),
    *(option(name, cls=PriceRequest) for name in ("calibration", "memory_limit", "plan")),
    Opt("batch", Path, typer.Option(None, "--batch", help="JSON-lines file of plans to price ('-': standard input)")),
    Opt("as_json", bool, typer.Option(False, "--json", help="machine-readable output")),
)


def cli_request(o: Values) -> PriceRequest:
    """The request of ``shardplan estimate``'s options (files by their paths' names)."""
    return PriceRequest(**{k: str(v) if isinstance(v, Path) else v for k, v in o.items() if k in KEYS})


@app.command("estimate")
@guard
@command(ESTIMATE_OPTIONS)
def estimate_cmd(o: Values) -> None:
    """Price one plan: step time, tokens/s/GPU, MFU and per-stage memory."""
    if o.batch is not None:
        lines = failed = 0
        for line in iter_batch(o.batch):
            sys.stdout.write(line + "\n")
            lines, failed = lines + 1, failed + is_error_line(line)
        if failed:
            raise ShardplanError(f"{failed} of {lines} lines failed")
        return
    if o.profile_from_plan and o.plan is None:
        raise ShardplanError("--profile-from-plan needs --plan")
    rep = price(cli_request(o), model_from_cli=True, profile_from_plan=o.profile_from_plan)
    if o.as_json:
        sys.stdout.write(report_json(rep, indent=2) + "\n")
    else:
        console.print(_table(rep))
