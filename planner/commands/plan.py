"""``shardplan plan``: search a space for the fastest plan a target runs that fits, show it, write it.

Nothing is written unless a plan is found: an impossible request (no plan fits, bad input) is
one line on stderr and exit code 2, and ``-o`` is not created.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from planner.cli import app, console, err_console, guard, print_json
from planner.layout import literal, literal_lines
from planner.options import Opt, Values, command, number_option
from planner.request import Request, option
from vocab.digits import read_int
from vocab.errors import ShardplanError
from vocab.io import check_writable

GIB = 1024**3


def _batches(text: str) -> list[int]:
    try:
        out = [read_int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ShardplanError(
            f"--global-batch must be an integer or a comma-separated list, got '{text}'"
        ) from None
    if not out:
        raise ShardplanError("--global-batch is empty")
    from vocab.limits import MAX_GLOBAL_BATCH

    bad = [b for b in out if not 1 <= b <= MAX_GLOBAL_BATCH]
    if bad:
        raise ShardplanError(f"--global-batch {bad[0]} is out of range: 1 to {MAX_GLOBAL_BATCH:,} samples")
    if len(out) > 64:
        raise ShardplanError(f"--global-batch lists {len(out)} values; compare at most 64")
    return out


#: at most this many lines of per-unit exceptions in the summary; the rest are counted (explain lists them)
MAX_EXCEPTION_LINES = 4


def _layers_text(s: Any) -> str:
    """The default per-layer choices, then the units (or operators) that differ from them, grouped by
    what differs and named as ranges: ``zero2, recompute none`` / ``embedding + layers.0-4 + head: zero1``."""
    from planner.compare import label_units
    from planner.reprice import block_index

    d = s.default
    text = f"{d.sharding}, recompute {d.recompute}" + (f", offload {d.offload}" if d.offload != "none" else "")
    groups: dict[str, list[str]] = {}
    for ls in s.layers:
        diff = [ls.sharding] if ls.sharding != d.sharding else []
        diff += [f"recompute {ls.recompute}"] if ls.recompute != d.recompute else []
        diff += [f"offload {ls.offload}"] if ls.offload != d.offload else []
        diff += [f"split {ls.split}"] if ls.split != d.split else []
        groups.setdefault(", ".join(diff) or "as the default", []).append(ls.unit)
    lines = []
    for what, names in groups.items():
        units = [u for u in names if u in ("embedding", "head") or block_index(u) is not None]
        ops: dict[str, list[int]] = {}  # operators inside blocks, by their path within the block
        other = []
        for u in names:
            if u in units:
                continue
            head, _, rest = u.partition(".")
            idx, _, op = rest.partition(".")
            if head == "layers" and idx.isdigit() and op:
                ops.setdefault(op, []).append(int(idx))
            else:
                other.append(u)
        where = ([label_units(units)] if units else []) + [
            label_units([f"layers.{i}" for i in idx]) + f".{op}" for op, idx in ops.items()] + other
        lines.append(f"{' + '.join(where)}: {what}")
    if len(lines) > MAX_EXCEPTION_LINES:
        rest = len(lines) - MAX_EXCEPTION_LINES + 1
        lines = lines[:MAX_EXCEPTION_LINES - 1] + [f"and {rest} more groups of units (shardplan explain lists them)"]
    return "\n".join([text, *lines])


def summary_table(planned: Any, wall_s: float) -> Table:
    """Mesh, schedule, micro-batching, predicted step time, tokens/s/GPU, MFU, memory, solver."""
    from planner.compare import mesh_text

    p = planned.plan
    s, pred = p.strategy, p.predicted
    w = p.inputs.workload
    n_mb = w.global_batch // (s.mesh.dp * s.micro_batch)
    t = Table(
        title=literal(f"plan for {p.inputs.model} on {planned.cluster.name} (seq {w.seq_len}, global batch "
                      f"{w.global_batch}, {w.precision})"),
        show_header=False,
    )
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")

    def row(what: str, value: str) -> None:  # the values shown literally, line by line
        t.add_row(what, literal_lines(value.split("\n")))

    tg = p.inputs.target
    row("target", f"{tg.name} {tg.version or ''}".strip())
    row("mesh", mesh_text(s))
    sched = s.schedule if s.mesh.pp > 1 else "no pipeline"
    if s.vpp > 1:
        sched += f", {s.vpp} virtual stages per rank"
    if s.stage_layers:
        sched += f", stages of {s.stage_layers} blocks"
    row("schedule", sched)
    row("micro-batching", f"{n_mb} micro-batch{'es' if n_mb != 1 else ''} of {s.micro_batch}")
    row("layers", _layers_text(s))
    from planner.reprice import band_text, plan_band

    band = band_text(plan_band(p))
    row("step time", f"{pred.step_time_s:.4g} s" + (f"; {band}" if band else ""))
    if p.inputs.calibration is not None:
        c = p.inputs.calibration
        row("calibration", f"{c.path}: fitted on {c.band.runs} runs of {c.accelerator}")
    row("tokens/s/GPU", f"{pred.tokens_per_s_per_gpu:,.0f}")
    row("MFU / HFU", f"{pred.mfu:.1%} / {pred.hfu:.1%}")
    from planner.reprice import headroom_text

    stages = pred.model_dump().get("stages", [])
    per = ", ".join(f"{st['total_gib']:.1f}" for st in stages)
    limit = pred.model_dump().get("memory_limit_gib")
    row(
        "peak memory",
        f"{pred.memory_peak_gib:.2f} GiB of {limit:.2f} GiB ({headroom_text(p)})"
        + (f"; stages: {per}" if len(stages) > 1 else ""),
    )
    sol = p.solver
    gap = f", gap {sol.gap:.2%}" if sol.gap else (", no bound proven" if sol.bound is None else "")
    row(
        "solver",
        f"{sol.name} ({sol.options.get('settled_by')}) on '{sol.space}': {sol.status}{gap}, "
        f"{sol.candidates:,} candidates, {wall_s:.2f} s",
    )
    tie = sol.options.get("tie_break")
    if tie:
        from planner.explain import axes_text

        row("tie-break", f"{axes_text(tie['axes'])} where the fastest plan has {tie['fastest_axes']}, "
                  f"within {tie['pair_band']:.1%} of its {tie['fastest_step_time_s']:.4g} s (the model cannot "
                  f"order two plans closer than that on {tie['slice']}); the fastest is the runner-up")
    simpler = sol.options.get("simpler_alternative")
    if simpler:
        from planner.explain import axes_text

        slower, fewer = simpler["step_time_s"] / pred.step_time_s - 1, simpler["fastest_axes"] - simpler["axes"]
        row("simpler", f"alternative {simpler['alternative'] + 1}: {slower:.1%} slower with {fewer} parallel "
                       f"ax{'i' if fewer == 1 else 'e'}s fewer, within the {simpler['pair_band']:.1%} pair band of "
                       f"{simpler['slice']} (--tie-break searches for the fastest plan of fewest axes)")
    if p.alternatives:
        r = p.alternatives[0]
        family = sol.options.get("alternative_families", [None])[0]
        row(
            "runner-up", f"{mesh_text(r.strategy)}: {r.predicted.step_time_s:.4g} s, {r.predicted.memory_peak_gib:.1f} GiB"
            + (f" ({family})" if family else "")
        )
    return t


#: ``shardplan plan``'s options: the fields of a request (:mod:`planner.request`), then where the plan goes
PLAN_OPTIONS = (
    *(option(name) for name in ("model", "cluster", "seq_len", "global_batch", "memory_limit_gib", "headroom_gib")),
    Opt("reserve", float, number_option(
        None, "--reserve", minimum=0.0, maximum=90.0,
        help="percent of each GPU's memory no plan may use (default 5: workspaces and allocator slack the "
        "cost model does not price)")),
    *(option(name) for name in ("space", "precision", "attention_kernel", "target", "cross_entropy", "grad_dtype",
                                "adam_states", "moe_dispatch", "moe_overlap",
                                "moe_capacity_factor", "profile", "calibration", "time_limit", "top_k", "solver",
                                "tie_break")),
    Opt("output", Path, typer.Option(None, "--output", "-o", help="write the plan JSON here")),
    Opt("as_json", bool, typer.Option(False, "--json", help="print the plan JSON instead of the summary")),
)
#: the fields of a request the command line gives as they are (the others are read: see :func:`cli_request`)
AS_GIVEN = ("model", "cluster", "seq_len", "memory_limit_gib", "headroom_gib", "space", "precision", "attention_kernel", "target",
            "cross_entropy", "grad_dtype", "adam_states", "moe_dispatch", "moe_overlap", "moe_capacity_factor", "profile",
            "time_limit", "top_k", "solver", "tie_break")


def cli_request(o: Values, batches: list[int]) -> Request:
    """The request of ``shardplan plan``'s options ``o`` (``batches``: its ``--global-batch`` read):
    ``--reserve`` in percent, the calibration file loaded."""
    cal = None
    if o.calibration is not None:
        from costmodel.calibration.document import load_calibration

        cal = load_calibration(o.calibration)
    return Request(**{k: o[k] for k in AS_GIVEN}, global_batch=batches[0] if len(batches) == 1 else batches,
                   reserve=o.reserve / 100 if o.reserve is not None else None, calibration=cal)


@contextmanager
def search_bar() -> Iterator[Any]:
    """The progress callback of a search: a bar on stderr where that is a terminal (a bar is for a
    person: no stray line in logs and pipes)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as bar:
        task = bar.add_task("enumerating meshes", total=None, count="")  # no count until the search has one

        def progress(what: str, done: int, total: int | None) -> None:
            count = f"{done:,}/{total:,}" if total else (f"{done:,}" if done else "")
            bar.update(task, description=what, completed=done, total=total or None, count=count)

        yield progress


@app.command("plan")
@guard
@command(PLAN_OPTIONS)
def plan_cmd(o: Values) -> None:
    """Find the fastest plan that fits: mesh, schedule, micro-batching, per-layer strategy."""
    from planner.api import search_plan

    batches = _batches(o.global_batch)
    output = o.output
    if output is not None and output.suffix.lower() != ".json":
        raise ShardplanError(f"-o must name a .json file, got '{output}'")
    if output is not None:
        check_writable(output, "-o")
    request = cli_request(o, batches)
    t0 = time.perf_counter()
    with search_bar() as progress:
        planned = search_plan(request, progress)
    wall = time.perf_counter() - t0
    if output is not None:
        planned.plan.save(output)
    if o.as_json:
        print_json(planned.plan.model_dump(mode="json"))
        return
    console.print(summary_table(planned, wall))
    if len(planned.by_batch) > 1:
        console.print(
            "samples/s by global batch: "
            + ", ".join(f"{b}: {v:,.1f}" for b, v in sorted(planned.by_batch.items())),
            highlight=False,
        )
    if output is not None:
        console.print(literal(f"wrote {output}"), soft_wrap=True)
