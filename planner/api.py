"""``plan()``: model + cluster + workload → the fastest plan that fits, as a plan document.

    from planner.api import plan
    p = plan("llama3-8b", "64xh100", seq_len=8192, global_batch=256)
    p.save("plan.json")

The search is for a target (``target=``, default ``shardplan``, the project's runtime; see
:mod:`vocab.targets`): its space is what the target runs (:func:`solvers.space.restrict`), its
price uses the target's behaviour (cross-entropy kernel, gradient dtype), and the plan records it.

The document is reproducible: the same inputs give byte-identical JSON (the solver's wall time
is therefore not stored; :func:`search_plan` returns it next to the plan). With a time limit the
best plan found so far comes back with status ``time_limit`` and its proven gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.calibration.document import Calibration
from costmodel.constants import error_band
from costmodel.device import DeviceModel
from costmodel.report import GIB
from planner.reprice import graph_record, model_name
from profiler.graph import LayerGraph
from profiler.hardware import Cluster, parse_cluster
from profiler.models import load_model
from solvers.hybrid import Progress, search
from solvers.mip import DEFAULT_SOLVER, SOLVERS
from solvers.result import SearchResult, break_tie, finite_or_none, parallel_axes
from solvers.space import SPACES, SpaceOptions, restrict
from vocab.arguments import typed
from vocab.errors import ShardplanError, shown
from vocab.limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN
from vocab.plan import (
    Alternative,
    CalibrationRef,
    ClusterRef,
    Plan,
    PlanInputs,
    Predicted,
    SolverInfo,
    TargetRef,
)
from vocab.strategy import WORKLOAD_CHOICES, Workload, check_workload_choices
from vocab.targets import DEFAULT_TARGET, Target, load_target

PRECISIONS = ("bf16", "fp8", "fp32")


@dataclass
class Planned:
    plan: Plan
    result: SearchResult
    graph: LayerGraph
    cluster: Cluster
    by_batch: dict[int, float]  # global batch -> samples/s of its best plan


@typed
def search_plan(
    model: Any,
    cluster: str | dict[str, Any] | Cluster,
    seq_len: int,
    global_batch: int | Sequence[int],
    memory_limit_gib: float | None = None,
    space: str = "full",
    precision: str = "bf16",
    profile: str | Path | None = None,
    time_limit: float | None = None,
    top_k: int = 5,
    progress: Progress | None = None,
    attention_kernel: str = "auto",
    cross_entropy: str | None = None,
    target: str = DEFAULT_TARGET,
    grad_dtype: str | None = None,
    reserve: float | None = None,
    moe_dispatch: str | None = None,
    tie_break: bool = True,
    moe_capacity_factor: float | None = None,
    solver: str = DEFAULT_SOLVER,
    device: DeviceModel | None = None,
    degrees: dict[str, int] | None = None,
    calibration: Calibration | None = None,
) -> Planned:
    """Search and build the plan document; with several global batches the one with the most
    samples per second wins (throughput, not time per step, is compared). ``model`` is a preset
    name, a config path or dict, or a ``package.module:factory`` (imported and run: your call); the
    plan records the layer graph of a model that is not a preset or config file. ``target`` bounds
    the search; ``cross_entropy``, ``grad_dtype`` and ``moe_dispatch`` default to how the target
    runs (and must be values it runs); ``moe_capacity_factor`` (dropless without) needs a target that
    drops tokens. Without ``memory_limit_gib`` a plan may use the GPU's memory less ``reserve``
    (a fraction; :data:`profiler.hardware.DEFAULT_RESERVE` by default), and records that limit.
    With ``tie_break`` (and a published-sweeps band for the accelerator), a runner-up within that
    band of the fastest plan and with fewer parallel axes is the plan (:func:`solvers.result.break_tie`;
    ``solver.options.tie_break`` records it, and the fastest stays the first alternative).
    ``solver`` names the back-end of the integer programs (:data:`solvers.mip.SOLVERS`). ``device``:
    a device model of this cluster to price with (a sweep shares one between its points);
    ``degrees``: mesh axes held at a degree (``{"tp": 4, "pp": 8}``), the rest of the space free;
    ``calibration``: the user's cluster calibrated (``shardplan calibrate``) to price with, which the
    plan records (not with a measured profile)."""
    if solver not in SOLVERS:
        raise ShardplanError(f"unknown MIP solver '{solver}'; known: {', '.join(SOLVERS)}")
    if space not in SPACES:
        raise ShardplanError(f"unknown search space '{space}'; known: {', '.join(SPACES)}")
    if precision not in PRECISIONS:
        raise ShardplanError(f"unknown precision '{precision}'; known: {', '.join(PRECISIONS)}")
    asked = {"cross_entropy": cross_entropy, "grad_dtype": grad_dtype, "moe_dispatch": moe_dispatch}
    check_workload_choices(attention_kernel=attention_kernel, **{k: v for k, v in asked.items() if v is not None})
    t = load_target(target)
    behaved = target_behaviour(t, precision, **asked)
    check_capacity(t, moe_capacity_factor)
    opts = restrict(SPACES[space], t)
    if degrees:
        axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
        bad = [a for a in degrees if a not in axes]
        if bad:
            raise ShardplanError(f"unknown mesh axis '{bad[0]}'; known: {', '.join(axes)}")
        opts = opts.with_(degrees=tuple(sorted((a, int(d)) for a, d in degrees.items())))
    if not 0 < seq_len <= MAX_SEQ_LEN:
        raise ShardplanError(f"seq_len must be in 1..{MAX_SEQ_LEN:,}, got {shown(seq_len)}")
    batches = [global_batch] if isinstance(global_batch, int) else list(global_batch)
    if not batches or any(not 0 < int(b) <= MAX_GLOBAL_BATCH for b in batches):
        raise ShardplanError(f"global batch must be in 1..{MAX_GLOBAL_BATCH:,}, got {shown(global_batch)}")
    if memory_limit_gib is not None and not (math.isfinite(memory_limit_gib) and memory_limit_gib > 0):
        raise ShardplanError(f"memory limit must be a positive finite number, got {memory_limit_gib} GiB")
    if time_limit is not None and not (math.isfinite(time_limit) and time_limit > 0):
        raise ShardplanError(f"time limit must be a positive finite number, got {time_limit} s")
    if top_k < 0:
        raise ShardplanError(f"top-k must be >= 0, got {top_k}")
    graph = load_model(model, seq_len)
    cl = parse_cluster(cluster)
    if reserve is not None:
        if memory_limit_gib is not None:
            raise ShardplanError("give a memory limit or a reserve, not both")
        cl = replace(cl, reserve=reserve)
    if memory_limit_gib is None:
        memory_limit_gib = cl.memory_bytes / GIB
    prof = None
    if profile is not None:
        from profiler.profile_schema import load_profile

        prof = load_profile(profile)
    if calibration is not None:
        if prof is not None:
            raise ShardplanError("give a calibration or a profile, not both: a calibration moves the spec sheet's "
                                 "constants, a profile replaces them")
        dev = calibration.device(cl)
        cl = dev.cluster
    else:
        dev = device if device is not None and prof is None and device.cluster == cl else DeviceModel(cl, prof)
    best: tuple[float, SearchResult, Workload] | None = None
    by_batch: dict[int, float] = {}
    errors = []
    for b in sorted({int(x) for x in batches}):
        w = Workload(seq_len=seq_len, global_batch=b, precision=precision,  # type: ignore[arg-type]
                     attention_kernel=attention_kernel,  # type: ignore[arg-type]
                     moe_capacity_factor=moe_capacity_factor, **behaved)
        try:
            res = search(graph, cl, w, opts, memory_limit_gib, dev, time_limit, top_k, progress, solver=solver)
        except ShardplanError as e:
            if len(batches) == 1:
                raise ShardplanError(f"{e} (target {t.name}: {t.label})") from None
            errors.append(f"global batch {b}: {e}")
            continue
        by_batch[b] = b / res.objective
        if best is None or by_batch[b] > best[0]:
            best = (by_batch[b], res, w)
    if best is None:
        raise ShardplanError("; ".join(errors) + f" (target {t.name}: {t.label})")
    _, res, w = best
    chosen = res.best
    band = None if prof is not None else error_band(cl.accelerator.name, precision)
    if tie_break and band is not None and "pair" in band:
        def search_axes(axes: int, cutoff: float) -> Any:
            try:
                return search(graph, cl, w, opts.with_(max_axes=axes), memory_limit_gib, dev, time_limit, 0,
                              cutoff=cutoff, solver=solver, frontier_plans=False).best
            except ShardplanError:
                return None

        chosen = break_tie(res.best, band["pair"], search_axes)
        if chosen is not res.best:
            res.options["tie_break"] = {
                "fastest_step_time_s": res.best.step_time_s, "pair_band": band["pair"], "slice": band["slice"],
                "axes": parallel_axes(chosen.strategy), "fastest_axes": parallel_axes(res.best.strategy)}
    runners_up = [f for f in [res.best, *res.alternatives] if f.strategy != chosen.strategy]
    exact_osdp = space == "osdp" and opts.per_layer  # the OSDP chain, solved twice
    if exact_osdp:
        res.options.update(_dp_check(graph, dev, res, w, memory_limit_gib, opts))
    if len(by_batch) > 1:
        res.options["samples_per_s_by_global_batch"] = {str(k): v for k, v in sorted(by_batch.items())}
    doc = Plan(
        inputs=PlanInputs(
            model=model_name(model, graph),
            model_hash=graph.content_hash(),
            model_graph=graph_record(model, graph),
            cluster=ClusterRef(**cl.to_dict()),
            workload=w,
            memory_limit_gib=memory_limit_gib,
            profile=str(profile) if profile is not None else None,
            target=TargetRef(name=t.name, version=t.version or None),
            calibration=CalibrationRef(**calibration.ref()) if calibration is not None else None,
        ),
        strategy=chosen.strategy,
        predicted=Predicted(**chosen.report.to_dict()),
        solver=SolverInfo(
            name="ilp" if exact_osdp else "hybrid",
            status=res.status,  # type: ignore[arg-type]
            space=res.space,
            objective=res.objective,
            bound=res.bound,
            gap=res.gap,
            time_s=0.0,
            candidates=res.candidates,
            options={
                **res.options,
                "settled_by": res.solver,
                "family": chosen.family,
                "alternative_families": [a.family for a in runners_up],
                "time_limit_s": time_limit,
                "top_k": top_k,
                "mip_solver": solver,
                **({"degrees": dict(opts.degrees)} if degrees else {}),
            },
        ),
        alternatives=[
            Alternative(strategy=a.strategy, predicted=Predicted(**a.report.to_dict()))
            for a in runners_up
        ],
    )
    return Planned(doc, res, graph, cl, by_batch)


@typed
def plan(
    model: Any,
    cluster: str | dict[str, Any] | Cluster,
    seq_len: int,
    global_batch: int | Sequence[int],
    memory_limit_gib: float | None = None,
    space: str = "full",
    precision: str = "bf16",
    profile: str | Path | None = None,
    time_limit: float | None = None,
    top_k: int = 5,
    attention_kernel: str = "auto",
    cross_entropy: str | None = None,
    target: str = DEFAULT_TARGET,
    reserve: float | None = None,
    tie_break: bool = True,
    solver: str = DEFAULT_SOLVER,
) -> Plan:
    """The fastest plan of ``space`` that ``target`` runs for ``model`` on ``cluster`` that fits
    ``memory_limit_gib`` per GPU (by default the GPU's memory less ``reserve``, a fraction). Raises
    :class:`ShardplanError` when nothing fits, naming the least memory any plan of the space needs
    and what dominates it."""
    return search_plan(
        model, cluster, seq_len, global_batch, memory_limit_gib, space, precision, profile, time_limit, top_k,
        attention_kernel=attention_kernel, cross_entropy=cross_entropy, target=target, reserve=reserve,
        tie_break=tie_break, solver=solver,
    ).plan


@typed
def target_behaviour(t: Target, precision: str, **asked: str | None) -> dict[str, str]:
    """The workload fields a search for ``t`` prices with (:data:`vocab.targets.WORKLOAD_BEHAVIOUR`):
    the values asked for (``cross_entropy``, ``grad_dtype``, ``moe_dispatch``...), which ``t`` must
    run, or the target's own; fp8 needs a target that trains in fp8."""
    if precision == "fp8" and not t.fp8:
        raise ShardplanError(f"the {t.name} target ({t.label}) has no fp8 training; use --precision bf16 or "
                             "another --target")
    for field, value in asked.items():
        allowed = getattr(t.behaviour, field)
        if value is not None and value not in allowed:
            what = WORKLOAD_CHOICES[field][0]
            raise ShardplanError(f"the {t.name} target ({t.label}) runs {what} {' or '.join(allowed)}, not '{value}'")
    return t.behaviour.workload(**asked)


@typed
def check_capacity(t: Target, capacity: float | None) -> None:
    """A capacity factor needs a target that drops tokens, and a positive finite value."""
    if capacity is None:
        return
    if not math.isfinite(capacity) or capacity <= 0:
        raise ShardplanError(f"the MoE capacity factor must be a positive number, got {capacity}")
    if not t.moe_capacity:
        raise ShardplanError(f"the {t.name} target ({t.label}) runs dropless MoE only: it takes no capacity factor")


def _dp_check(
    graph: LayerGraph, dev: DeviceModel, res: SearchResult, w: Workload, limit: float | None, opts: SpaceOptions
) -> dict[str, Any]:
    """OSDP: solve the winning mesh again with the DP (the second, independent exact solver)."""
    from costmodel.report import GIB
    from solvers.chain import mesh_problem
    from solvers.osdp_dp import solve_dp
    from solvers.osdp_ilp import solve_ilp
    from solvers.space import for_device
    from vocab.strategy import MeshConfig

    s = res.best.strategy
    cfg = MeshConfig.of(s)
    lim = limit if limit is not None else dev.cluster.memory_bytes / GIB
    prob = mesh_problem(graph, dev, cfg, w, for_device(opts, dev.acc.kind), lim)
    ilp, dp = solve_ilp(prob), solve_dp(prob)
    agree = (
        ilp.choice is not None
        and dp.choice is not None
        and dp.bound <= ilp.objective * (1 + 1e-9)
        and dp.objective >= ilp.objective * (1 - 1e-9)
    )
    return {
        "dp_objective": finite_or_none(dp.objective),
        "dp_bound": finite_or_none(dp.bound),
        "dp_status": dp.status,
        "dp_gap": finite_or_none(dp.gap),
        "ilp_objective": finite_or_none(ilp.objective),
        "dp_ilp_agree": bool(agree),
        "dp_memory_grid_bytes": dp.info.get("mem_grid_bytes"),
        "dp_memory_error_bound_gib": dp.info.get("mem_error_bound", 0.0) / GIB,
    }
