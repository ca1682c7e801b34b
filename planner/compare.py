"""Differences between strategies and side-by-side comparison of plans (``shardplan compare``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.layout import fits, literal, printable, styled
from planner.reprice import block_index, memory_limit_gib, predicted_dict, unit_split, units_of
from vocab.plan import Plan
from vocab.strategy import Strategy

GLOBAL_FIELDS = (
    "mesh.pp", "mesh.dp_replicate", "mesh.dp_shard", "mesh.cp", "mesh.tp", "mesh.ep", "micro_batch",
    "schedule", "vpp", "stage_layers", "sequence_parallel", "tp_mode", "cp_mode",
)
UNIT_FIELDS = ("sharding", "recompute", "offload", "split")


def strategy_fields(s: Strategy) -> dict[str, Any]:
    """The strategy's global choices, flat (``mesh.tp`` ...)."""
    out: dict[str, Any] = {}
    for f in GLOBAL_FIELDS:
        obj: Any = s
        for part in f.split("."):
            obj = getattr(obj, part)
        out[f] = list(obj) if isinstance(obj, list) else obj
    return out


def unit_choices(s: Strategy, unit: str) -> dict[str, Any]:
    ls = s.for_unit(unit)
    return {"sharding": ls.sharding, "recompute": ls.recompute, "offload": ls.offload, "split": unit_split(s, unit)}


def label_units(units: Sequence[str]) -> str:
    """``layers.0-15``, ``embedding + layers.0-3``, ``layers.0-3,16-19 + head``."""
    blocks = sorted(b for b in (block_index(u) for u in units) if b is not None)
    ranges: list[list[int]] = []
    for b in blocks:
        if ranges and b == ranges[-1][1] + 1:
            ranges[-1][1] = b
        else:
            ranges.append([b, b])
    rng = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)
    specials = [u for u in units if block_index(u) is None]
    pre = [u for u in specials if u == "embedding"]
    post = [u for u in specials if u != "embedding"]
    return " + ".join(pre + ([f"layers.{rng}"] if rng else []) + post)


def runs(s: Strategy, units: Sequence[str]) -> list[dict[str, Any]]:
    """Consecutive units sharing one set of choices: ``[{units, n, sharding, recompute, offload, split}]``."""
    out: list[dict[str, Any]] = []
    group: list[str] = []
    prev: dict[str, Any] | None = None
    for u in units:
        ch = unit_choices(s, u)
        if prev is not None and ch != prev:
            out.append({"units": label_units(group), "n": len(group), **prev})
            group = []
        group.append(u)
        prev = ch
    if prev is not None:
        out.append({"units": label_units(group), "n": len(group), **prev})
    return out


def describe_run(r: dict[str, Any]) -> str:
    extra = [f"offload {r['offload']}"] if r["offload"] != "none" else []
    extra += [f"split {r['split']}"] if r["split"] > 1 else []
    rec = "no recompute" if r["recompute"] == "none" else f"{r['recompute']} recompute"
    return ", ".join([r["sharding"], rec, *extra])


def diff_strategies(a: Strategy, b: Strategy, units: Sequence[str]) -> list[dict[str, Any]]:
    """What differs from ``a`` to ``b``: global fields, then per-unit choices grouped into ranges."""
    fa, fb = strategy_fields(a), strategy_fields(b)
    out: list[dict[str, Any]] = [{"field": f, "units": None, "a": fa[f], "b": fb[f]} for f in GLOBAL_FIELDS
                                 if fa[f] != fb[f]]
    for f in UNIT_FIELDS:
        group: list[str] = []
        prev: tuple[Any, Any] | None = None
        for u in [*units, None]:
            cur = None if u is None else (unit_choices(a, u)[f], unit_choices(b, u)[f])
            if cur != prev and group and prev is not None and prev[0] != prev[1]:
                out.append({"field": f, "units": label_units(group), "a": prev[0], "b": prev[1]})
            if cur != prev:
                group = []
            if u is not None:
                group.append(u)
            prev = cur
    return out


def mesh_text(s: Strategy) -> str:
    """The mesh as ``plan`` shows it: ``pp=2 dp_shard=8 tp=4 (SP)`` (degrees above 1, then sequence
    parallelism and the TP and CP modes that are not the defaults)."""
    m = s.mesh
    parts = [f"{k}={v}" for k, v in m.shown_degrees().items()]
    extra = []
    if s.sequence_parallel:
        extra.append("SP")
    if m.tp > 1 and s.tp_mode != "megatron":
        extra.append(s.tp_mode.upper())
    if m.cp > 1 and s.cp_mode != "ring":
        extra.append(s.cp_mode)
    return " ".join(parts or ["1 GPU"]) + (f" ({', '.join(extra)})" if extra else "")


def short_strategy(s: Strategy) -> str:
    """One line: ``pp2 dp4 tp2 | zero3 selective | mb1 1f1b`` (``mixed`` where units differ)."""
    m = s.mesh
    axes = " ".join(f"{k}{v}" for k, v in (("pp", m.pp), ("dpr", m.dp_replicate), ("dp", m.dp_shard),
                                             ("cp", m.cp), ("tp", m.tp), ("ep", m.ep)) if v > 1) or "1 GPU"
    axes += f" etp{m.etp}" if m.etp else ""
    mixed = any(ls.unit != "*" for ls in s.layers)
    d = s.default
    choice = "mixed" if mixed else f"{d.sharding} {d.recompute}" + (f" off:{d.offload}" if d.offload != "none" else "")
    sched = f" {s.schedule}" + (f"x{s.vpp}" if s.vpp > 1 else "") if m.pp > 1 else ""
    return f"{axes} | {choice} | mb{s.micro_batch}{sched}"


def describe_diff(d: dict[str, Any]) -> str:
    where = f" on {d['units']}" if d["units"] else ""
    return f"{d['field']}{where}: {_fmt(d['a'])} → {_fmt(d['b'])}"


# ---- plans side by side -------------------------------------------------------------------------

def plan_rows(plan: Plan) -> dict[str, Any]:
    """One plan flattened to ``label -> value`` in display order."""
    inp, pred = plan.inputs, predicted_dict(plan)
    c = inp.cluster
    rows: dict[str, Any] = {
        "model": inp.model, "cluster": f"{c.world_size}x {c.accelerator} ({c.nodes} nodes x {c.gpus_per_node})",
        "seq_len": inp.workload.seq_len, "global_batch": inp.workload.global_batch,
        "precision": inp.workload.precision, "memory limit (GiB)": memory_limit_gib(plan),
        "target": f"{inp.target.name} {inp.target.version or ''}".strip(),
        "cross-entropy": inp.workload.cross_entropy, "gradient dtype": inp.workload.grad_dtype,
    }
    rows.update(strategy_fields(plan.strategy))
    rows["micro-batches"] = plan.strategy.num_microbatches(inp.workload.global_batch)
    rows["layer strategies"] = "; ".join(f"{r['units']}: {describe_run(r)}" for r in runs(plan.strategy, units_of(plan)))
    rows["solver"] = f"{plan.solver.name} ({plan.solver.status})"
    rows["step time (s)"] = pred["step_time_s"]
    rows["tokens/s per GPU"] = pred["tokens_per_s_per_gpu"]
    rows["MFU"] = pred["mfu"]
    rows["peak memory (GiB)"] = pred["memory_peak_gib"]
    if "fits" in pred:
        rows["fits"] = pred["fits"]
    t = pred.get("time") or {}
    for k in ("compute_s", "recompute_s", "bubble_s", "optimizer_s", "offload_s"):
        if k in t:
            rows[f"time.{k[:-2]} (s)"] = t[k]
    comm = t.get("comm_s") or {}
    for axis in sorted({"dp", "tp", "cp", "ep", "pp"} | set(comm)):
        rows[f"time.comm.{axis} (s)"] = float(comm.get(axis, 0.0))
    return rows


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _same(vals: Sequence[Any]) -> bool:
    first = vals[0]
    for v in vals[1:]:
        if _number(first) and _number(v):  # 2 and 2.0 are one number
            if not math.isclose(first, v, rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif v != first:
            return False
    return True


def compare(plans: Sequence[Plan], names: Sequence[str]) -> dict[str, Any]:
    """Plans side by side: rows that differ first, then rows equal in all, then a verdict."""
    flat = [plan_rows(p) for p in plans]
    labels = list(dict.fromkeys(k for f in flat for k in f))
    diff, same = [], []
    for k in labels:
        vals = [f.get(k) for f in flat]
        (same if _same(vals) else diff).append({"field": k, "values": vals})
    preds = [predicted_dict(p) for p in plans]
    fitting = [i for i, p in enumerate(preds) if p.get("fits", True)] or list(range(len(plans)))
    best = min(fitting, key=lambda i: preds[i]["step_time_s"])
    base = preds[best]
    summary = []
    for i, p in enumerate(preds):
        if i == best:
            summary.append(f"{names[i]}: fastest{' that fits' if len(fitting) < len(plans) else ''} "
                           f"({p['step_time_s']:.4g} s/step)")
            continue
        dt = p["step_time_s"] / base["step_time_s"] - 1
        dm = p["memory_peak_gib"] - base["memory_peak_gib"]
        fits = "" if p.get("fits", True) else ", does not fit"
        summary.append(f"{names[i]}: {dt:+.1%} step time, {dm:+.2f} GiB peak memory vs {names[best]}{fits}")
    strat = [{"a": names[0], "b": names[i], "changes": diff_strategies(plans[0].strategy, plans[i].strategy,
                                                                    units_of(plans[0]))}
             for i in range(1, len(plans))]
    return {"plans": list(names), "best": names[best], "differences": diff, "same": same,
            "summary": summary, "strategy_changes": strat}


#: rows of :func:`plan_rows` that hold a fraction, shown as a percentage
PERCENT_ROWS = frozenset({"MFU", "HFU"})


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def fmt_row(field: str, v: Any) -> str:
    """A value of :func:`plan_rows` as shown: ``MFU`` (a fraction) as ``51.3%``, the rest by :func:`_fmt`."""
    if field in PERCENT_ROWS and isinstance(v, float) and math.isfinite(v):
        return f"{v:.1%}"
    return _fmt(v)


# ---- terminal layout ----------------------------------------------------------------------------

def _compare_wide(data: dict[str, Any]) -> Table:
    t = Table(title=f"{len(data['plans'])} plans side by side (differences first)", show_lines=False)
    t.add_column("", style="bold")
    for n in data["plans"]:
        t.add_column(literal(n), overflow="fold", max_width=48)
    for row in data["differences"]:
        t.add_row(literal(f"≠ {row['field']}"), *(literal(fmt_row(row["field"], v)) for v in row["values"]),
                  style="yellow")
    if data["same"]:
        t.add_section()
        for row in data["same"]:
            t.add_row(literal(f"  {row['field']}"), *(literal(fmt_row(row["field"], v)) for v in row["values"]),
                      style="dim")
    return t


def _compare_narrow(data: dict[str, Any]) -> Table:
    """One row per plan and field that differs (the field named once), one row per field equal in all."""
    t = Table(title=f"{len(data['plans'])} plans side by side (differences first)", expand=True)
    t.add_column("field", style="bold", no_wrap=True)
    t.add_column("plan", no_wrap=max(len(printable(n)) for n in data["plans"]) <= 16, overflow="fold")
    t.add_column("value", overflow="fold", ratio=1)
    for row in data["differences"]:
        for i, (name, v) in enumerate(zip(data["plans"], row["values"], strict=True)):
            t.add_row(literal(f"≠ {row['field']}" if i == 0 else ""), literal(name),
                      literal(fmt_row(row["field"], v)), style="yellow")
    if data["same"]:
        t.add_section()
        for row in data["same"]:
            t.add_row(literal(f"  {row['field']}"), "all", literal(fmt_row(row["field"], row["values"][0])),
                      style="dim")
    return t


def render_compare(data: dict[str, Any], console: Console) -> None:
    """The comparison on ``console``; every string of the plans is shown literally (:func:`literal`)."""
    wide = _compare_wide(data)
    console.print(wide if fits(console, wide) else _compare_narrow(data))
    for line in data["summary"]:
        console.print(styled("  ", literal(line)))
    for sc in data["strategy_changes"]:
        if sc["changes"]:
            console.print(styled("\n", (printable(f"{sc['a']} → {sc['b']}"), "bold")))
            for d in sc["changes"]:
                console.print(styled("  • ", literal(describe_diff(d))))
