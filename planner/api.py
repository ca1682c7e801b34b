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
from typing import Any

from costmodel.constants import error_band
from costmodel.device import DeviceModel
from costmodel.report import GIB
from planner.reprice import graph_record, model_name
from planner.request import MESH_AXES, Request, check_fields
from profiler.graph import LayerGraph
from profiler.hardware import Cluster, parse_cluster
from profiler.models import load_model
from solvers.hybrid import Progress, SearchControls, search
from solvers.mip import SOLVERS
from solvers.result import SearchResult, break_tie, finite_or_none, parallel_axes, simpler_runner_up
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
from vocab.strategy import WORKLOAD_CHOICES, Workload, check_precision, check_workload_choices
from vocab.targets import Target, load_target


@dataclass
class Planned:
    plan: Plan
    result: SearchResult
    graph: LayerGraph
    cluster: Cluster
    by_batch: dict[int, float]  # global batch -> samples/s of its best plan


@dataclass
class _Setting:
    """What the searches of one request share: its target, the space it bounds, the workload fields
    the target prices with, the model's graph, the cluster, the device model, the memory limit, and
    whether a measured profile prices it."""

    target: Target
    opts: SpaceOptions
    behaved: dict[str, str]
    graph: LayerGraph
    cluster: Cluster
    device: DeviceModel
    limit: float
    measured: bool
    headroom: float = 0.0  # GiB a plan leaves free below ``limit`` (the request's ``headroom_gib``)

    @property
    def fit_limit(self) -> float:
        """The memory a searched plan may use: the limit less the headroom."""
        return self.limit - self.headroom


@typed
def search_plan(request: Request, progress: Progress | None = None, device: DeviceModel | None = None) -> Planned:
    """Search and build the plan document of ``request`` (:class:`planner.request.Request`); with
    several global batches the one with the most samples per second wins (throughput, not time per
    step, is compared). The model is a preset name, a config path or dict, or a
    ``package.module:factory`` (imported and run: your call); the plan records the layer graph of a
    model that is not a preset or config file. The target bounds the search; ``cross_entropy``,
    ``grad_dtype`` and ``moe_dispatch`` default to how the target runs (and must be values it runs);
    ``moe_capacity_factor`` (dropless without) needs a target that drops tokens. Without
    ``memory_limit_gib`` a plan may use the GPU's memory less ``reserve`` (a fraction;
    :data:`profiler.hardware.DEFAULT_RESERVE` by default), and records that limit. The plan is the
    search's best; a runner-up within the published-sweeps band of it with fewer parallel axes is
    named in ``solver.options.simpler_alternative``. With ``tie_break`` the fastest plan of fewest
    axes within that band is the plan (:func:`solvers.result.break_tie`): ``solver.options.tie_break``
    records it, its status is ``feasible`` with its gap to the bound, and the fastest stays the first
    alternative.
    ``solver`` names the back-end of the integer programs (:data:`solvers.mip.SOLVERS`);
    ``degrees`` holds mesh axes at a degree (``{"tp": 4, "pp": 8}``), the rest of the space free;
    ``calibration`` is the user's cluster calibrated (``shardplan calibrate``) to price with, which
    the plan records (not with a measured profile). ``progress`` is told how the search goes;
    ``device``: a device model of this cluster to price with (a sweep shares one between its points)."""
    t, opts, behaved, batches = _checked(request)
    graph = load_model(request.model, request.seq_len)
    cl, limit = _cluster(request)
    dev, cl, measured = _device(request, cl, device)
    setting = _Setting(t, opts, behaved, graph, cl, dev, limit, measured, _headroom(request, limit))
    res, w, by_batch = _best(request, setting, batches, progress)
    chosen = _tie_break(request, setting, res, w)
    return Planned(_document(request, setting, res, w, chosen, by_batch), res, graph, cl, by_batch)


def _checked(r: Request) -> tuple[Target, SpaceOptions, dict[str, str], list[int]]:
    """The request's target, the space it searches, the workload fields the target prices with, and
    its global batches, each value checked before any model is loaded."""
    if r.solver not in SOLVERS:
        raise ShardplanError(f"unknown MIP solver '{r.solver}'; known: {', '.join(SOLVERS)}")
    if r.space not in SPACES:
        raise ShardplanError(f"unknown search space '{r.space}'; known: {', '.join(SPACES)}")
    check_precision(r.precision)
    asked = {"cross_entropy": r.cross_entropy, "grad_dtype": r.grad_dtype, "moe_dispatch": r.moe_dispatch,
             "moe_overlap": r.moe_overlap, "adam_states": r.adam_states}
    check_workload_choices(attention_kernel=r.attention_kernel, **{k: v for k, v in asked.items() if v is not None})
    t = load_target(r.target)
    behaved = target_behaviour(t, r.precision, **asked)
    check_capacity(t, r.moe_capacity_factor)
    opts = restrict(SPACES[r.space], t)
    if r.degrees:
        bad = [a for a in r.degrees if a not in MESH_AXES]
        if bad:
            raise ShardplanError(f"unknown mesh axis '{bad[0]}'; known: {', '.join(MESH_AXES)}")
        opts = opts.with_(degrees=tuple(sorted((a, int(d)) for a, d in r.degrees.items())))
    if not 0 < r.seq_len <= MAX_SEQ_LEN:
        raise ShardplanError(f"seq_len must be in 1..{MAX_SEQ_LEN:,}, got {shown(r.seq_len)}")
    batches = [r.global_batch] if isinstance(r.global_batch, int) else list(r.global_batch)
    if not batches or any(not 0 < int(b) <= MAX_GLOBAL_BATCH for b in batches):
        raise ShardplanError(f"global batch must be in 1..{MAX_GLOBAL_BATCH:,}, got {shown(r.global_batch)}")
    limit = r.memory_limit_gib
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ShardplanError(f"memory limit must be a positive finite number, got {limit} GiB")
    if r.time_limit is not None and not (math.isfinite(r.time_limit) and r.time_limit > 0):
        raise ShardplanError(f"time limit must be a positive finite number, got {r.time_limit} s")
    if r.top_k < 0:
        raise ShardplanError(f"top-k must be >= 0, got {r.top_k}")
    return t, opts, behaved, batches


def _cluster(r: Request) -> tuple[Cluster, float]:
    """The request's cluster (its memory less ``reserve``) and the per-GPU memory limit in GiB."""
    cl = parse_cluster(r.cluster)
    why = cl.accelerator.precision_problem(r.precision)
    if why:
        raise ShardplanError(why)
    if r.reserve is not None:
        if r.memory_limit_gib is not None:
            raise ShardplanError("give a memory limit or a reserve, not both")
        cl = replace(cl, reserve=r.reserve)
    return cl, r.memory_limit_gib if r.memory_limit_gib is not None else cl.memory_bytes / GIB


def _headroom(r: Request, limit: float) -> float:
    """The request's headroom in GiB (0 without one): at least 0 and below the memory limit."""
    h = r.headroom_gib
    if h is None:
        return 0.0
    if not (math.isfinite(h) and 0 <= h < limit):
        raise ShardplanError(f"headroom must be at least 0 GiB and below the {limit:.2f} GiB memory limit, "
                             f"got {shown(h)} GiB")
    return float(h)


def _device(r: Request, cl: Cluster, device: DeviceModel | None) -> tuple[DeviceModel, Cluster, bool]:
    """The device model to price with (a calibration's, a measured profile's, ``device`` where it is
    of this cluster, else the spec sheet's), the cluster it prices, and whether a profile was measured."""
    prof = None
    if r.profile is not None:
        from profiler.profile_schema import load_profile

        prof = load_profile(r.profile)
    if r.calibration is not None:
        if prof is not None:
            raise ShardplanError("give a calibration or a profile, not both: a calibration moves the spec sheet's "
                                 "constants, a profile replaces them")
        dev = r.calibration.device(cl)
        return dev, dev.cluster, False
    dev = device if device is not None and prof is None and device.cluster == cl else DeviceModel(cl, prof)
    return dev, cl, prof is not None


def _best(r: Request, s: _Setting, batches: list[int], progress: Progress | None,
          ) -> tuple[SearchResult, Workload, dict[int, float]]:
    """The search of the global batch with the most samples per second, its workload, and the
    samples per second of each batch that has a plan."""
    best: tuple[float, SearchResult, Workload] | None = None
    by_batch: dict[int, float] = {}
    errors = []
    for b in sorted({int(x) for x in batches}):
        w = Workload(seq_len=r.seq_len, global_batch=b, precision=r.precision,  # type: ignore[arg-type]
                     attention_kernel=r.attention_kernel,  # type: ignore[arg-type]
                     moe_capacity_factor=r.moe_capacity_factor, **s.behaved)
        try:
            res = search(s.graph, s.cluster, w, s.opts, s.fit_limit, s.device, r.time_limit, r.top_k, progress,
                         SearchControls(solver=r.solver))
        except ShardplanError as e:
            if len(batches) == 1:
                raise ShardplanError(f"{e} (target {s.target.name}: {s.target.label})") from None
            errors.append(f"global batch {b}: {e}")
            continue
        by_batch[b] = b / res.objective
        if best is None or by_batch[b] > best[0]:
            best = (by_batch[b], res, w)
    if best is None:
        raise ShardplanError("; ".join(errors) + f" (target {s.target.name}: {s.target.label})")
    return best[1], best[2], by_batch


def _tie_break(r: Request, s: _Setting, res: SearchResult, w: Workload) -> Any:
    """The plan to recommend: the fastest (naming a runner-up within the published pair band of it
    with fewer parallel axes, if there is one), or with ``tie_break`` the fastest plan of fewest axes
    within that band (recorded in ``res.options``)."""
    band = None if s.measured else error_band(s.cluster.accelerator.name, r.precision)
    if band is None or "pair" not in band:
        return res.best
    if not r.tie_break:
        listed = [f for f in res.alternatives if f.strategy != res.best.strategy]  # the plan's alternatives
        simpler = simpler_runner_up(res.best, listed, band["pair"])
        if simpler is not None:
            i, found = simpler
            res.options["simpler_alternative"] = {
                "alternative": i, "step_time_s": found.step_time_s, "pair_band": band["pair"], "slice": band["slice"],
                "axes": parallel_axes(found.strategy), "fastest_axes": parallel_axes(res.best.strategy)}
        return res.best

    def search_axes(axes: int, cutoff: float) -> Any:
        try:
            return search(s.graph, s.cluster, w, s.opts.with_(max_axes=axes), s.fit_limit, s.device, r.time_limit, 0,
                          controls=SearchControls(cutoff=cutoff, solver=r.solver, frontier_plans=False)).best
        except ShardplanError:
            return None

    chosen = break_tie(res.best, band["pair"], search_axes)
    if chosen is not res.best:
        res.options["tie_break"] = {
            "fastest_step_time_s": res.best.step_time_s, "pair_band": band["pair"], "slice": band["slice"],
            "axes": parallel_axes(chosen.strategy), "fastest_axes": parallel_axes(res.best.strategy),
            "fastest_status": res.status}
    return chosen


def _document(r: Request, s: _Setting, res: SearchResult, w: Workload, chosen: Any, by_batch: dict[int, float],
              ) -> Plan:
    """The plan document of the search ``res``: ``chosen`` its plan, the other plans its alternatives."""
    runners_up = [f for f in [res.best, *res.alternatives] if f.strategy != chosen.strategy]
    exact_osdp = r.space == "osdp" and s.opts.per_layer  # the OSDP chain, solved twice
    if exact_osdp:
        res.options.update(_dp_check(s.graph, s.device, res, w, s.fit_limit, s.opts))
    if s.headroom:
        res.options["headroom_gib"] = s.headroom
    if len(by_batch) > 1:
        res.options["samples_per_s_by_global_batch"] = {str(k): v for k, v in sorted(by_batch.items())}
    return Plan(
        inputs=PlanInputs(
            model=model_name(r.model, s.graph),
            model_hash=s.graph.content_hash(),
            model_graph=graph_record(r.model, s.graph),
            cluster=ClusterRef(**s.cluster.to_dict()),
            workload=w,
            memory_limit_gib=s.fit_limit,
            profile=str(r.profile) if r.profile is not None else None,
            target=TargetRef(name=s.target.name, version=s.target.version or None),
            calibration=CalibrationRef(**r.calibration.ref()) if r.calibration is not None else None,
        ),
        strategy=chosen.strategy,
        predicted=Predicted(**_predicted(s, chosen, w)),
        solver=SolverInfo(
            name="ilp" if exact_osdp else "hybrid",
            space=res.space,
            **_standing(res, chosen),
            time_s=0.0,
            candidates=res.candidates,
            options={
                **res.options,
                "settled_by": res.solver,
                "family": chosen.family,
                "alternative_families": [a.family for a in runners_up],
                "time_limit_s": r.time_limit,
                "top_k": r.top_k,
                "mip_solver": r.solver,
                **({"degrees": dict(s.opts.degrees)} if r.degrees else {}),
            },
        ),
        alternatives=[
            Alternative(strategy=a.strategy, predicted=Predicted(**a.report.to_dict()))
            for a in runners_up
        ],
    )


def _predicted(s: _Setting, chosen: Any, w: Workload) -> dict[str, Any]:
    """The plan's report, with the notes of an fp8 or MXFP8 plan (:func:`planner.low_precision.low_precision_notes`)."""
    from planner.low_precision import low_precision_notes

    rep = chosen.report.to_dict()
    notes = low_precision_notes(s.graph, s.cluster, chosen.strategy, w, rep["step_time_s"], device=s.device)
    if notes:
        rep["notes"] = [*rep.get("notes", []), *notes]
    return rep


def _standing(res: SearchResult, chosen: Any) -> dict[str, Any]:
    """The solver's status, objective, bound and gap as they describe ``chosen``: the search's own
    where it is the best plan; else (a tie-break's simpler plan) ``feasible``, its own step time,
    and its gap to the search's bound."""
    if chosen is res.best:
        return {"status": res.status, "objective": res.objective, "bound": res.bound, "gap": res.gap}
    step = chosen.step_time_s
    gap = None if res.bound is None else max(0.0, (step - res.bound) / step)
    return {"status": "feasible", "objective": step, "bound": res.bound, "gap": gap}


@typed
def plan(model: Any, cluster: str | dict[str, Any] | Cluster, seq_len: int, global_batch: int | Sequence[int],
         **options: Any) -> Plan:
    """The fastest plan that the target runs for ``model`` on ``cluster`` that fits the memory limit
    per GPU (by default the GPU's memory less ``reserve``, a fraction); ``options`` are the other
    fields of :class:`planner.request.Request` (``space``, ``target``, ``memory_limit_gib``,
    ``top_k``...). Raises :class:`ShardplanError` when nothing fits, naming the least memory any plan
    of the space needs and what dominates it."""
    check_fields("plan", options)
    return search_plan(Request(model, cluster, seq_len, global_batch, **options)).plan


@typed
def target_behaviour(t: Target, precision: str, **asked: str | None) -> dict[str, str]:
    """The workload fields a search for ``t`` prices with (:data:`vocab.targets.WORKLOAD_BEHAVIOUR`):
    the values asked for (``cross_entropy``, ``grad_dtype``, ``moe_dispatch``...), which ``t`` must
    run, or the target's own; fp8 needs a target that trains in fp8, mxfp8 one that trains in MXFP8."""
    trains = {"fp8": t.fp8, "mxfp8": t.mxfp8}
    if not trains.get(precision, True):
        instead = [p for p in ("fp8", "bf16") if p != precision and trains.get(p, True)]
        raise ShardplanError(f"the {t.name} target ({t.label}) has no {precision} training; use --precision "
                             f"{' or '.join(instead)}, or another --target")
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
