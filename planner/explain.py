"""What a plan does and why (``shardplan explain``): as data, and as a rich terminal view.

:func:`explain_data` reads the plan document alone (plus the accelerator's scale-up domain and the
target files): the target the plan was searched for, the mesh and where its axes run (inside a scale-up domain or across nodes), schedule and micro-batching,
per-stage memory against the limit, the step-time breakdown, the solver, and how the plan differs
from its runner-up.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from costmodel.experts import overlap_runs
from planner.compare import describe_diff, describe_run, diff_strategies, label_units, runs
from planner.layout import fits, kv_table, literal, literal_lines, printable, styled
from planner.reprice import (
    band_text,
    device_gib,
    headroom_text,
    memory_limit_gib,
    plan_band,
    plan_cluster,
    predicted_dict,
    unit_key,
    units_of,
)
from vocab.errors import ShardplanError
from vocab.plan import Plan
from vocab.strategy import MESH_AXES
from vocab.targets import ANY, load_target

AXIS_ROLE = {"pp": "pipeline stages", "dp_replicate": "data-parallel replicas", "dp_shard": "ZeRO/FSDP shards",
             "cp": "context parallel (sequence split)", "tp": "tensor parallel", "ep": "expert parallel"}
TIME_PARTS = (("compute", "compute_s"), ("recompute", "recompute_s"), ("bubble", "bubble_s"),
              ("optimizer", "optimizer_s"), ("offload", "offload_s"))


def mesh_placement(plan: Plan) -> dict[str, Any]:
    """Each mesh axis: size, rank stride, and whether its groups stay inside a scale-up domain."""
    c = plan.inputs.cluster
    try:
        domain = plan_cluster(plan).scale_up_domain
    except ShardplanError:
        domain = c.gpus_per_node
    m = plan.strategy.mesh
    axes, stride = [], 1
    strides: dict[str, int] = {}
    for name in reversed(MESH_AXES):
        strides[name] = stride
        stride *= getattr(m, name)
    where = "node" if domain == c.gpus_per_node else "scale-up domain"
    for name in [*MESH_AXES, "ep"]:
        n = getattr(m, name)
        if n == 1:
            continue
        st = m.expert_tp if name == "ep" else strides[name]  # the experts' ranks: edp, ep, etp (innermost)
        k = 1 if st >= domain else math.gcd(min(n, domain // st), n)
        if k == n:
            place = f"inside one {where}"
        elif k == 1:
            place = f"across {n} {where}s (scale-out network)"
        else:
            place = f"{k} per {where} x {n // k} {where}s (hierarchical)"
        group = [i * st for i in range(min(n, 4))]
        axes.append({"axis": name, "size": n, "role": AXIS_ROLE[name], "stride": st, "per_domain": k,
                     "domains": n // k, "placement": place,
                     "example_group": ", ".join(map(str, group)) + (", ..." if n > 4 else "")})
    return {"world_size": m.world_size, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
            "scale_up_domain": domain, "axes": axes}


#: what each selective-recomputation policy keeps (costmodel.recompute), in a few words
SELECTIVE_KEEPS = {"attention": "all but the attention core", "op": "every other GEMM's output and attention's",
                   "gemms": "every GEMM's output"}


def schedule_info(plan: Plan) -> dict[str, Any]:
    s, w = plan.strategy, plan.inputs.workload
    n_mb = s.num_microbatches(w.global_batch)
    out = {"schedule": s.schedule if s.mesh.pp > 1 else "none (pp=1)", "pp": s.mesh.pp, "vpp": s.vpp,
           "micro_batch": s.micro_batch, "num_microbatches": n_mb, "dp": s.mesh.dp,
           "tokens_per_microbatch": s.micro_batch * w.seq_len, "stage_layers": s.stage_layers,
           "sequence_parallel": s.sequence_parallel, "tp": s.mesh.tp, "tp_mode": s.tp_mode, "cp": s.mesh.cp,
           "cp_mode": s.cp_mode}
    if s.mesh.ep > 1:  # how the experts' all-to-alls run, as priced
        full = s.default.recompute == "full" or any(x.recompute == "full" for x in s.layers)
        hidden = w.moe_overlap == "1f1b" and bool(overlap_runs(s.mesh.pp, s.vpp, full))
        out["moe"] = {"dispatch": w.moe_dispatch, "overlap": "1f1b" if hidden else "none",
                      "expert_tp": s.mesh.expert_tp, "folded": bool(s.mesh.etp and s.mesh.etp != s.mesh.tp)}
    if s.default.recompute == "selective" or any(x.recompute == "selective" for x in s.layers):
        out["selective"] = {"policy": w.selective, "keeps": SELECTIVE_KEEPS[w.selective]}
    return out


def stage_info(plan: Plan) -> list[dict[str, Any]]:
    limit = memory_limit_gib(plan)
    out = []
    for st in predicted_dict(plan).get("stages") or []:
        su = sorted(st.get("units") or [], key=unit_key)
        row = {"stage": st.get("stage"), "layers": label_units(su) if su else "-", "units": len(su),
               "strategies": [f"{r['units']}: {describe_run(r)}" for r in runs(plan.strategy, su)]}
        for k in ("params", "grads", "optimizer", "activations", "buffers", "overhead", "total"):
            row[f"{k}_gib"] = float(st.get(f"{k}_gib", 0.0))
        row["limit_gib"] = limit
        row["headroom_gib"] = limit - row["total_gib"]
        out.append(row)
    return out


def time_breakdown(pred: dict[str, Any]) -> dict[str, Any]:
    t = pred.get("time") or {}
    step = pred["step_time_s"]
    parts = [(name, float(t[k])) for name, k in TIME_PARTS[:2] if k in t]
    parts += [(f"exposed {a} comm", float(v)) for a, v in sorted((t.get("comm_s") or {}).items()) if v]
    parts += [(name, float(t[k])) for name, k in TIME_PARTS[2:] if k in t]
    other = step - sum(v for _, v in parts)
    if parts and abs(other) > 1e-6 * step:
        parts.append(("other", other))
    parts = [(n, v) for n, v in parts if v or n == "compute"]
    return {"step_time_s": step,
            "components": [{"name": n, "seconds": v, "share": v / step} for n, v in parts]}


def axes_text(n: int) -> str:
    """``1 parallel axis``, ``3 parallel axes``."""
    return f"{n} parallel {'axis' if n == 1 else 'axes'}"


def runner_up(plan: Plan, units: list[str]) -> dict[str, Any] | None:
    """Why the plan beats ``alternatives[0]``: what differs, and the predicted time and memory."""
    if not plan.alternatives:
        return None
    alt = plan.alternatives[0]
    a, b = predicted_dict(plan), alt.predicted.model_dump()
    limit = memory_limit_gib(plan)
    dt = b["step_time_s"] - a["step_time_s"]
    dm = b["memory_peak_gib"] - a["memory_peak_gib"]
    alt_fits = bool(b.get("fits", b["memory_peak_gib"] <= limit))
    ta, tb = time_breakdown(a)["components"], time_breakdown(b)["components"]
    names = list(dict.fromkeys([c["name"] for c in ta] + [c["name"] for c in tb]))
    va, vb = ({c["name"]: c["seconds"] for c in x} for x in (ta, tb))
    moves = sorted(({"component": n, "plan_s": va.get(n, 0.0), "runner_up_s": vb.get(n, 0.0),
                     "delta_s": vb.get(n, 0.0) - va.get(n, 0.0)} for n in names), key=lambda d: -abs(d["delta_s"]))
    moves = [m for m in moves if abs(m["delta_s"]) > 1e-9][:4]
    if not alt_fits:
        verdict = f"the runner-up needs {b['memory_peak_gib']:.1f} GiB per GPU, over the {limit:.1f} GiB limit"
    elif dt >= 0:
        verdict = f"this plan is faster by {dt:.4g} s per step ({dt / b['step_time_s']:.1%} of the runner-up's)"
        band = plan_band(plan)
        pair = band.get("pair", band["high"] - band["low"]) if band is not None else None
        if pair is not None and dt / a["step_time_s"] < pair:
            verdict += (f", closer than the model tells two configurations apart ({pair:.1%} on "
                        f"{band['slice']}'s published sweeps): the two are indistinguishable")
    elif plan.solver.options.get("tie_break"):
        tie = plan.solver.options["tie_break"]
        verdict = (f"the runner-up, the fastest plan, is {-dt:.4g} s per step faster ({-dt / b['step_time_s']:.1%}), "
                   f"closer than the model tells two configurations apart ({tie['pair_band']:.1%} on "
                   f"{tie['slice']}'s published sweeps): the two are indistinguishable, and this plan runs "
                   f"{axes_text(tie['axes'])} to its {tie['fastest_axes']}")
    else:
        verdict = (f"the runner-up is {-dt:.4g} s per step faster; the solver ranked this plan first "
                   f"(objective and status in 'solver')")
    if alt_fits and dm:
        verdict += f"; the runner-up uses {abs(dm):.2f} GiB {'more' if dm > 0 else 'less'} memory"
    return {"changes": diff_strategies(plan.strategy, alt.strategy, units), "step_time_delta_s": dt,
            "step_time_delta_pct": dt / a["step_time_s"], "memory_delta_gib": dm, "runner_up_fits": alt_fits,
            "runner_up_step_time_s": b["step_time_s"], "time_deltas": moves, "verdict": verdict}


def target_info(plan: Plan) -> dict[str, Any]:
    """The target the plan was searched for: name, pinned version, trainer, and whether this
    shardplan still pins that version (a plan of schema 1.0 or 1.1 reads as ``any``)."""
    ref = plan.inputs.target
    out: dict[str, Any] = {"name": ref.name, "version": ref.version, "trainer": None, "pinned_now": None}
    try:
        t = load_target(ref.name)
    except ShardplanError:
        return out
    return {**out, "trainer": t.trainer, "pinned_now": t.version or None}


def explain_data(plan: Plan) -> dict[str, Any]:
    from costmodel.published.validate import caveats  # published-runs machinery: only once explained

    units = units_of(plan)
    pred = predicted_dict(plan)
    limit = memory_limit_gib(plan)
    c, w = plan.inputs.cluster, plan.inputs.workload
    return {
        "model": plan.inputs.model,
        "target": target_info(plan),
        "cluster": {**c.model_dump(), "name": f"{c.world_size}x {c.accelerator}"},
        "workload": w.model_dump(),
        "predicted": {"step_time_s": pred["step_time_s"], "tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"],
                      "mfu": pred["mfu"], "hfu": pred["hfu"], "memory_peak_gib": pred["memory_peak_gib"],
                      "memory_limit_gib": limit, "fits": bool(pred.get("fits", pred["memory_peak_gib"] <= limit)),
                      "device_gib": device_gib(plan), "headroom": headroom_text(plan), "band": plan_band(plan),
                      "host_per_node_gib": pred.get("host_per_node_gib", 0.0),
                      "host_limit_per_node_gib": pred.get("host_limit_per_node_gib", 0.0)},
        "mesh": mesh_placement(plan),
        "schedule": schedule_info(plan),
        "layer_strategies": runs(plan.strategy, units),
        "stages": stage_info(plan),
        "time": time_breakdown(pred),
        "solver": plan.solver.model_dump(),
        "runner_up": runner_up(plan, units),
        "alternatives": len(plan.alternatives),
        "caveats": caveats(w.seq_len, plan.strategy.mesh.cp),
    }


# ---- terminal view -------------------------------------------------------------------------------

def _bar(frac: float, width: int = 20) -> str:
    n = max(0, min(width, round(frac * width)))
    return "█" * n + "·" * (width - n)


def target_line(tg: dict[str, Any]) -> str:
    """``torchtitan 0.2.2 (torchtitan)``; ``any`` says the search had no trainer's bounds."""
    if tg["name"] == ANY:
        return "any: searched over the whole plan vocabulary, for no particular trainer"
    line = f"{tg['name']} {tg['version'] or ''}".strip() + (f" ({tg['trainer']})" if tg["trainer"] else "")
    if tg["pinned_now"] and tg["version"] and tg["pinned_now"] != tg["version"]:
        line += f"; this shardplan pins {tg['pinned_now']}"
    elif tg["trainer"] is None:
        line += "; not a target this shardplan knows"
    return line


def solver_time_text(seconds: float | None) -> str:
    """`` in 0.85 s``; where the plan document records 0 (it does, to stay byte-identical from run to
    run) or nothing: `` (time not recorded)``, never a made-up 0.00 s."""
    return f" in {seconds:.2f} s" if seconds else " (time not recorded)"


def _rule(console: Console, title: Text) -> None:
    """A titled rule; a title too long for the width goes on its own line(s) above a plain rule,
    never cut short with an ellipsis."""
    if title.cell_len + 4 <= console.width:
        console.rule(title)
    else:
        console.print(title, justify="center")
        console.rule()


def _line(console: Console, parts: list[Text]) -> None:
    """Parts on one line (``a  |  b  |  c``) when it fits, else one part a line."""
    one = Text("  |  ").join(parts)
    if one.cell_len <= console.width:
        console.print(one)
    else:
        for part in parts:
            console.print(part)


def _mesh_tables(mesh: dict[str, Any]) -> tuple[Table, Table]:
    """The mesh's axes: a table of six columns, and the narrow one with the role, placement and first
    group stacked in one cell."""
    title = f"mesh: {mesh['world_size']} GPUs, scale-up domain {mesh['scale_up_domain']} GPUs"
    axes = mesh["axes"] or [{"axis": "-", "size": 1, "role": "single GPU", "stride": "-", "placement": "-",
                             "example_group": "0"}]
    t = Table(title=title)
    for col in ("axis", "size", "role", "rank stride", "placement", "first group"):
        t.add_column(col, justify="right" if col in ("size", "rank stride") else "left")
    n = Table(title=title, show_lines=True, expand=True)
    n.add_column("axis", no_wrap=True)
    n.add_column("size", justify="right", no_wrap=True)
    n.add_column("role, placement, first group", overflow="fold", ratio=1)
    for a in axes:
        t.add_row(*(literal(a[k]) for k in ("axis", "size", "role", "stride", "placement", "example_group")))
        n.add_row(literal(a["axis"]), literal(a["size"]), literal_lines(
            [f"{a['role']}, rank stride {a['stride']}", a["placement"], f"first group {a['example_group']}"]))
    return t, n


STAGE_PARTS = (("params", "params"), ("grads", "grads"), ("optim", "optimizer"), ("acts", "activations"),
               ("buffers", "buffers"), ("overhead", "overhead"))


def _stage_tables(stages: list[dict[str, Any]]) -> tuple[Table, Table]:
    """Memory per stage: a table of eleven columns, and the narrow one with a few lines per stage."""
    title = "per pipeline stage: memory per GPU (GiB)"
    t = Table(title=title)
    for col in ("stage", "layers", "strategies", *(c for c, _ in STAGE_PARTS), "total", "of limit"):
        t.add_column(col, justify="left" if col in ("layers", "strategies", "of limit") else "right",
                     overflow="fold")
    n = kv_table(title)
    for i, s in enumerate(stages):
        frac = s["total_gib"] / s["limit_gib"] if s["limit_gib"] else 0.0
        of_limit = Text(f"{_bar(frac, 12)} {frac:.0%}", style="red" if frac > 1 else "green")
        t.add_row(literal(s["stage"]), literal(s["layers"]), literal_lines(s["strategies"]),
                  *(f"{s[k + '_gib']:.2f}" for _, k in STAGE_PARTS), f"{s['total_gib']:.2f}", of_limit)
        if i:
            n.add_section()
        parts = [f"{c} {s[k + '_gib']:.2f}" for c, k in STAGE_PARTS]
        n.add_row(literal(f"stage {s['stage']}"), literal(s["layers"]))
        n.add_row("strategies", literal_lines(s["strategies"]))
        n.add_row("memory", ", ".join(parts[:3]) + "\n" + ", ".join(parts[3:]))
        n.add_row("total", styled(f"{s['total_gib']:.2f} of {s['limit_gib']:.2f} GiB ", of_limit))
    return t, n


def _time_tables(time: dict[str, Any]) -> tuple[Table, Table]:
    """The step time's parts, with a bar, and without one (narrow)."""
    tables = []
    for bar in (True, False):
        tt = Table(title=f"step time {time['step_time_s']:.4g} s")
        for col in ("part", "seconds", "share", *([""] if bar else [])):
            tt.add_column(col, justify="right" if col in ("seconds", "share") else "left")
        for comp in time["components"]:
            tt.add_row(literal(comp["name"]), f"{comp['seconds']:.4g}", f"{comp['share']:.1%}",
                       *([_bar(comp["share"])] if bar else []))
        tables.append(tt)
    return tables[0], tables[1]


def _print_fitting(console: Console, wide: Table, narrow: Table) -> None:
    """``wide`` where it fits the console's width, else ``narrow``."""
    console.print(wide if fits(console, wide) else narrow)


def _schedule_text(sc: dict[str, Any]) -> str:
    return (f"{sc['schedule']}, pp={sc['pp']}, vpp={sc['vpp']}: {sc['num_microbatches']} micro-batches of "
            f"{sc['micro_batch']} sample(s) ({sc['tokens_per_microbatch']:,} tokens) per data-parallel rank "
            f"(dp={sc['dp']})"
            + (f"; tp_mode {sc['tp_mode']}{', sequence parallel' if sc['sequence_parallel'] else ''}"
               if sc.get("tp", 1) > 1 else "")
            + (f"; cp_mode {sc['cp_mode']}" if sc.get("cp", 1) > 1 else "")
            + (f"; MoE dispatch {sc['moe']['dispatch']}, all-to-all overlap {sc['moe']['overlap']}"
               + (f", experts folded over tp (etp={sc['moe']['expert_tp']})" if sc["moe"]["folded"] else "")
               if "moe" in sc else "")
            + (f"; selective recomputation '{sc['selective']['policy']}': {sc['selective']['keeps']}"
               if "selective" in sc else ""))


def render_explain(d: dict[str, Any], console: Console) -> None:
    """The explanation on ``console``; every string of the plan is shown literally (:func:`literal`)."""
    p, w, c = d["predicted"], d["workload"], d["cluster"]
    _rule(console, styled((printable(d["model"]), "bold"),
                          literal(f" on {c['name']} ({c['nodes']} nodes x {c['gpus_per_node']} GPUs)")))
    fit = Text("fits", style="green") if p["fits"] else Text("DOES NOT FIT", style="bold red")
    _line(console, [literal(f"seq_len {w['seq_len']}, global batch {w['global_batch']}, {w['precision']}"),
                    styled("step ", (f"{p['step_time_s']:.4g} s", "bold"),
                           f", {p['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {p['mfu']:.1%}"),
                    styled(f"peak {p['memory_peak_gib']:.1f} / {p['memory_limit_gib']:.1f} GiB ", fit,
                           literal(f" ({p['headroom']})"))])
    console.print(styled(("target", "bold"), " ", literal(target_line(d["target"]))))
    if p.get("host_per_node_gib"):
        cap = p["host_limit_per_node_gib"]
        console.print(styled(("host memory", "bold"), f" offloaded {p['host_per_node_gib']:,.0f} GiB per node "
                             + (f"of the {cap:,.0f} GiB they may use" if cap else "(the node's host memory is not "
                                "recorded: not checked)")))
    if p.get("band"):
        console.print(styled(("step time", "bold"), " ", literal(band_text(p["band"]))))
    for note in d["caveats"]:
        console.print(styled(("caveat", "yellow"), " ", literal(note)))
    _print_fitting(console, *_mesh_tables(d["mesh"]))
    console.print(styled(("schedule", "bold"), " ", literal(_schedule_text(d["schedule"]))))
    if d["stages"]:
        _print_fitting(console, *_stage_tables(d["stages"]))
    else:
        console.print("per-stage memory: not recorded in this plan")
    _print_fitting(console, *_time_tables(d["time"]))
    so = d["solver"]
    extra = "".join(f", {k} {so[k]:.4g}" for k in ("objective", "bound", "gap") if so.get(k) is not None)
    console.print(styled(("solver", "bold"), " ", literal(
        f"{so['name']} ({so['status']}, space {so['space']}{extra}), {so['candidates']:,} candidates"
        f"{solver_time_text(so.get('time_s'))}; {d['alternatives']} alternative(s) kept")))
    ru = d["runner_up"]
    if ru is None:
        console.print("no runner-up recorded: nothing to compare against")
        return
    console.print(styled(("vs runner-up", "bold"), f" ({ru['runner_up_step_time_s']:.4g} s/step): ",
                         literal(ru["verdict"])))
    for ch in ru["changes"]:
        console.print(styled("  • ", literal(describe_diff(ch))))
    for m in ru["time_deltas"]:
        console.print(styled("    ", literal(m["component"]), f": {m['plan_s']:.4g} s here, {m['runner_up_s']:.4g} "
                             f"s there ({m['delta_s']:+.4g} s)"))
