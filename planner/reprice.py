"""A plan's context for analysis: its model, cluster and unit costs, and re-pricing variants of it.

``explain``, ``plot`` and ``export`` read a plan document alone where they can; what the document
does not record (per-unit costs for the timeline, the cost of the nearest plan an export target
can express) comes from the cost model, with the model and cluster the plan names.

A plan never runs code: its model is loaded from the preset it names, or from the layer graph it
records (checked against ``model_hash``), never by importing a ``package.module:factory``. Commands
import a factory only when the command line names it (``--model``), and pass the graph they built
as ``graph``.

A plan never chooses a file either: the profile and the model config path it names are for the
record. Re-pricing opens a model config path only where the command line names the same path, and
prices with a measured profile only where the command gives one (:class:`PlanFiles`, loaded by the
command from ``--profile PATH`` or, with ``--profile-from-plan``, from the path the plan names).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vocab.errors import ShardplanError, shown
from vocab.plan import Alternative, ClusterRef, ModelGraph, Plan, PlanInputs, Predicted, SolverInfo
from vocab.strategy import Strategy, Workload

if TYPE_CHECKING:
    from costmodel.report import Report
    from profiler.graph import LayerGraph
    from profiler.hardware import Cluster
    from profiler.profile_schema import Profile

GIB = 1024**3
_LAYER = re.compile(r"^layers\.(\d+)$")


def unit_key(name: str) -> tuple[int, int, str]:
    """Execution order of unit names: embedding, layers.0, layers.1, ..., head."""
    if name == "embedding":
        return (0, 0, "")
    m = _LAYER.match(name)
    if m:
        return (1, int(m.group(1)), "")
    return (2, 0, "") if name == "head" else (3, 0, name)


def block_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def predicted_dict(plan: Plan) -> dict[str, Any]:
    """The plan's predicted report as a dict (extra cost-model keys included)."""
    return plan.predicted.model_dump()


def memory_limit_gib(plan: Plan) -> float:
    """The per-GPU limit the plan was priced against."""
    pred = predicted_dict(plan)
    if pred.get("memory_limit_gib"):
        return float(pred["memory_limit_gib"])
    if plan.inputs.memory_limit_gib:
        return float(plan.inputs.memory_limit_gib)
    return plan.inputs.cluster.memory_gb * 1e9 / GIB


def device_gib(plan: Plan) -> float:
    """GiB of one of the plan's GPUs (what the driver reports, or the cluster's ``memory_gb``)."""
    return plan.inputs.cluster.memory_gb * 1e9 / GIB


def headroom_text(plan: Plan) -> str:
    """How the plan's memory limit sits in the device: ``device 79.65 GiB, 5% reserved``, and the
    headroom the search kept below the limit it was given (``solver.options.headroom_gib``):
    ``device 79.65 GiB, 5% reserved, 4 GiB headroom``."""
    device, limit = device_gib(plan), memory_limit_gib(plan)
    if limit > device * (1 + 1e-12):
        return f"above the device's {device:.2f} GiB"
    kept = float(plan.solver.options.get("headroom_gib", 0.0) or 0.0)
    if kept:
        return f"device {device:.2f} GiB, {1 - (limit + kept) / device:.0%} reserved, {kept:.4g} GiB headroom"
    return f"device {device:.2f} GiB, {1 - limit / device:.0%} reserved"


def step_band(step_s: float, accelerator: str, precision: str, measured: bool = False,
              calibration: dict[str, Any] | None = None, moe: bool = False) -> dict[str, Any] | None:
    """Where the real step time likely lies: ``step_s`` scaled by the band of the calibration it was
    priced with (``calibration``: a plan's ``inputs.calibration``), else by the error band of the
    published runs on the accelerator at the precision (:func:`costmodel.constants.error_band`), with
    the slice and its rows; None for a plan priced from a measured profile (its own numbers), without
    bands, or on a CPU (the published runs are GPU runs); ``moe``: the model has experts (the band
    widened to the published MoE runs' errors)."""
    from costmodel.constants import error_band
    from profiler.hardware import accelerator as find_accelerator

    b = None if measured else error_band(accelerator, precision, moe)
    if b is not None and b["slice"] == "all" and _is_cpu(accelerator, find_accelerator):
        b = None
    if calibration is not None:
        band = calibration["band"]
        # two plans' difference is still told apart by the published sweeps' pair band, where there is one
        pair = {"slice": b["slice"], "pair": b["pair"]} if b is not None and "pair" in b else {
            "slice": f"calibration {calibration['path']}"}
        return {**pair, "calibration": calibration["path"], "rows": band["runs"], "low": band["low"],
                "high": band["high"], "range_s": [step_s * (1 + band["low"]), step_s * (1 + band["high"])]}
    if b is None:
        return None
    return {**b, "range_s": [step_s * (1 + b["low"]), step_s * (1 + b["high"])]}


def _is_cpu(name: str, find: Any) -> bool:
    try:
        return find(name).kind == "cpu"
    except ShardplanError:
        return False


def band_text(band: dict[str, Any] | None) -> str:
    """``likely 7.4-8.2 s (published runs on h100-sxm/bf16, each source held out of the fit:
    10th-90th percentile, 120 rows)``, naming the slice the band is from and, where it is wider than
    the plan's accelerator and precision, why (too few rows there, or no run there was fitted: the
    band is then other accelerators', not widened); for a calibrated plan ``likely 7.4-8.2 s
    (calibration cluster.yaml: its 5 runs, after the fit)``."""
    if band is None:
        return ""
    lo, hi = band["range_s"]
    if "calibration" in band:
        return f"likely {lo:.4g}-{hi:.4g} s (calibration {band['calibration']}: its {band['rows']} runs, after the fit)"
    where = "all accelerators" if band["slice"] == "all" else band["slice"]
    why = ""
    if "asked" in band:
        acc = band["asked"].split("/")[0]
        if not band.get("accelerator_rows"):
            why = f"; no run on {acc} was fitted: other accelerators' band, not widened"
        elif not band.get("asked_rows"):
            why = f"; no run on {band['asked']} was fitted"
        else:
            why = f"; {band['asked_rows']} on {band['asked']}, too few for a band"
    if "moe" in band:
        why += (f"; widened to the errors of {band['moe']['rows']} published MoE runs on "
                f"{', '.join(band['moe']['accelerators'])}, none fitted")
    return (f"likely {lo:.4g}-{hi:.4g} s (published runs on {where}, each source held out of the fit: "
            f"10th-90th percentile, {band['rows']} rows{why})")


def plan_band(plan: Plan) -> dict[str, Any] | None:
    """:func:`step_band` of a plan's predicted step time (with the calibration it records)."""
    cal = plan.inputs.calibration
    try:
        moe = plan_graph(plan).has_experts
    except ShardplanError:  # a model that cannot be loaded here: its band as a dense model's
        moe = False
    return step_band(plan.predicted.step_time_s, plan.inputs.cluster.accelerator, plan.inputs.workload.precision,
                     measured=plan.inputs.profile is not None, calibration=cal.model_dump() if cal else None, moe=moe)


# ---- the files a plan names ---------------------------------------------------------------------

@dataclass(frozen=True)
class PlanFiles:
    """What the command line lets re-pricing use of the files a plan names: the measured profile the
    command loaded (``--profile PATH``, or the plan's with ``--profile-from-plan``), and the model
    config paths the command line names (``--model PATH``)."""

    profile: Profile | None = None
    models: frozenset[str] = frozenset()


_FILES: ContextVar[PlanFiles] = ContextVar("plan_files", default=PlanFiles())  # noqa: B039 (frozen)


@contextmanager
def opening(files: PlanFiles) -> Iterator[None]:
    """Inside the block, re-pricing uses ``files`` (outside it: no profile, no model config path)."""
    token = _FILES.set(files)
    try:
        yield
    finally:
        _FILES.reset(token)


def command_line_files(plan: Plan, profile: str | Path | None = None, profile_from_plan: bool = False,
                       model: str | None = None) -> tuple[PlanFiles, list[str]]:
    """The files a command may use for ``plan`` (the profile loaded here: a bad one raises
    ShardplanError before any work), and the note to print when the plan names a profile that is
    not loaded."""
    from profiler.profile_schema import load_profile

    if profile is not None and profile_from_plan:
        raise ShardplanError("give --profile PATH or --profile-from-plan, not both")
    path = profile if profile is not None else plan.inputs.profile if profile_from_plan else None
    notes = []
    if plan.inputs.profile is not None and path is None:
        notes.append(f"the plan names profile {plan.inputs.profile} (not loaded: pass --profile-from-plan or "
                     "--profile PATH)")
    files = PlanFiles(load_profile(path) if path else None, frozenset([model] if model else []))
    return files, notes


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def loadable_by_name(spec: str) -> bool:
    """Whether a document's model name loads without opening a file the document chose: a preset, or
    a Hugging Face id a preset lists; a config path (or a Hugging Face cache entry) only where the
    command line names it (:class:`PlanFiles`)."""
    from profiler.models import preset

    try:
        preset(spec)
        return True
    except ShardplanError:
        return any(_same_file(spec, m) for m in _FILES.get().models)


# ---- model and cluster --------------------------------------------------------------------------

FACTORY_REFUSED = "factories are imported only from the command line --model"


def is_factory(spec: Any) -> bool:
    """Whether ``profiler.models.load_model`` would import ``spec`` as ``package.module:factory``."""
    if not isinstance(spec, str) or ":" not in spec:
        return False
    try:
        return not Path(spec).exists()
    except (OSError, ValueError):
        return True


def load_named_model(spec: str | dict[str, Any], seq_len: int | None = None) -> LayerGraph:
    """The layer graph of a preset, a config file or a dict of config keys; a ``package.module:factory``
    raises :class:`ShardplanError` and is never imported (``profiler.models.load_model`` imports it)."""
    from profiler.models import load_model, resolve_config
    from profiler.transformer import build_graph

    if is_factory(spec):
        raise ShardplanError(f"model '{spec}' is a package.module:factory: {FACTORY_REFUSED}")
    if isinstance(spec, str) and ":" in spec:  # a config file with a colon in its name: read as a file, whatever
        return build_graph(resolve_config(spec), seq_len)  # happens to the path meanwhile
    return load_model(spec, seq_len)


def recorded_graph(plan: Plan) -> LayerGraph | None:
    """The layer graph the plan records (``inputs.model_graph``), checked against ``model_hash``."""
    from profiler.graph import graph_from_dict

    rec = plan.inputs.model_graph
    if rec is None:
        return None
    try:
        graph = graph_from_dict({**rec.model_dump(), "model_id": plan.inputs.model})
    except ValueError as e:
        raise ShardplanError(f"the plan's inputs.model_graph is not a layer graph: {e}") from None
    if graph.content_hash() != plan.inputs.model_hash:
        raise ShardplanError("the plan's inputs.model_graph does not match its inputs.model_hash "
                             f"({graph.content_hash()} != {plan.inputs.model_hash})")
    return graph


def plan_graph(plan: Plan, seq_len: int | None = None) -> LayerGraph:
    """The layer graph of the plan's model at its sequence length (or ``seq_len``): the graph the plan
    records, else its preset (a config path only where the command line names it); never an import
    (raises ShardplanError)."""
    seq = seq_len or plan.inputs.workload.seq_len
    graph = recorded_graph(plan)
    if graph is not None:
        if graph.seq_len != seq:
            raise ShardplanError(f"the plan records its model's layer graph at seq_len {graph.seq_len}, not {seq}: "
                                 "give --model to price the model at another length")
        return graph
    if is_factory(plan.inputs.model):
        raise ShardplanError(f"the plan's model '{plan.inputs.model}' is a package.module:factory and the plan "
                             f"records no layer graph: {FACTORY_REFUSED}")
    if not loadable_by_name(plan.inputs.model):
        raise ShardplanError(f"plan model {shown(plan.inputs.model)} is a file path, not a preset; pass --model PATH "
                             "to load it")
    return load_named_model(plan.inputs.model, seq)


def graph_record(model: Any, graph: LayerGraph) -> ModelGraph | None:
    """What a plan records of its model's layer graph: nothing for a preset or config file named by a
    string (re-pricing loads it by name); the graph for anything else (a factory, a config dict or
    object, or with ``model`` None a graph its name does not rebuild)."""
    from profiler.graph import graph_to_dict

    if isinstance(model, str) and not is_factory(model):
        return None
    if model is None and not is_factory(graph.model_id):
        try:
            if load_named_model(graph.model_id, graph.seq_len).content_hash() == graph.content_hash():
                return None
        except (ShardplanError, ImportError, OSError):
            pass
    data = graph_to_dict(graph)
    data.pop("model_id")
    data["config"] = json.loads(json.dumps(data["config"], default=str))
    return ModelGraph.model_validate(data)


def plan_cluster(plan: Plan) -> Cluster:
    from profiler.hardware import parse_cluster

    return parse_cluster(plan.inputs.cluster.model_dump())


def try_graph(plan: Plan) -> LayerGraph | None:
    """The plan's layer graph (:func:`plan_graph`), or None when it cannot be had without an import."""
    try:
        return plan_graph(plan)
    except (ShardplanError, ImportError, OSError):
        return None


def units_of(plan: Plan, graph: LayerGraph | None = None) -> list[str]:
    """The plan's units in execution order: from the graph, the predicted stages, or the model."""
    if graph is None:
        names: set[str] = set()
        for st in predicted_dict(plan).get("stages") or []:
            names.update(st.get("units") or [])
        if names:
            return sorted(names, key=unit_key)
        graph = try_graph(plan)
    if graph is not None:
        return [u for u, _ in graph.blocks()]
    names = {_unit_of(ls.unit) for ls in plan.strategy.layers}
    return sorted(names, key=unit_key)


def _unit_of(op: str) -> str:
    """The unit an operator path belongs to (``layers.3.mlp.up`` -> ``layers.3``)."""
    parts = op.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def unit_stages(strategy: Strategy, units: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``unit -> (virtual stage, pipeline rank)``; embedding on the first stage, head on the last."""
    blocks = [u for u in units if block_index(u) is not None]
    stages = strategy.stage_blocks(len(blocks))
    p, last = strategy.mesh.pp, len(stages) - 1
    out = {blocks[i]: (k, k % p) for k, held in enumerate(stages) for i in held}
    for u in units:
        if u not in out:
            k = 0 if unit_key(u)[0] == 0 else last
            out[u] = (k, k % p)
    return out


def unit_split(strategy: Strategy, unit: str) -> int:
    """The largest OSDP split of the unit or any operator inside it."""
    splits = [ls.split for ls in strategy.layers if ls.unit == unit or ls.unit.startswith(unit + ".")]
    return max([strategy.for_unit(unit).split, *splits])


# ---- pricing ------------------------------------------------------------------------------------

def model_name(model: Any, graph: LayerGraph) -> str:
    """What a plan calls its model: the name or path given, else (a config dict, a module, nothing)
    the layer graph's id; the plan then records the graph (:func:`graph_record`). A name a plan cannot
    hold (:data:`vocab.names.MODEL_REF`) is refused before any work."""
    from vocab.names import MODEL_REF, matches

    name = model if isinstance(model, str) and model else graph.model_id
    if not matches(MODEL_REF, name):
        raise ShardplanError(f"model name {shown(name)} cannot be recorded in a plan: use letters, "
                             "digits and _ . / ~ @ + : = , - (inner spaces allowed), at most 256 characters")
    return name


def price(
    graph: LayerGraph, cluster: Cluster, strategy: Strategy, workload: Workload,
    memory_limit_gib: float | None = None, model: str | dict[str, Any] | None = None, profile: str | None = None,
    alternatives: Iterable[Strategy] = (), report: dict[str, Any] | None = None,
) -> Plan:
    """Price ``strategy`` with the cost model and wrap it into a plan document (solver ``user``);
    ``report``, the strategy's estimate (``Report.to_dict``) when it is already made."""
    from costmodel.estimate import estimate
    from profiler.profile_schema import load_profile

    prof = load_profile(profile) if profile else None

    def predicted(s: Strategy) -> Predicted:
        return Predicted(**estimate(graph, cluster, s, workload, prof, memory_limit_gib).to_dict())

    inputs = PlanInputs(
        model=model_name(model, graph), model_hash=graph.content_hash(), model_graph=graph_record(model, graph),
        cluster=ClusterRef(**cluster.to_dict()), workload=workload, memory_limit_gib=memory_limit_gib,
        profile=profile,
    )
    alts = [Alternative(strategy=a, predicted=predicted(a)) for a in alternatives]
    return Plan(inputs=inputs, strategy=strategy,
                predicted=Predicted(**report) if report is not None else predicted(strategy),
                solver=SolverInfo(name="user"), alternatives=alts)


def plan_from_strategy(
    model: str, cluster: str | dict[str, Any], strategy: Strategy | dict[str, Any], seq_len: int,
    global_batch: int, precision: str = "bf16", memory_limit_gib: float | None = None,
    alternatives: Iterable[Strategy | dict[str, Any]] = (),
) -> Plan:
    """A plan for a strategy you give (no search): ``plan_from_strategy("llama3-8b", "16xh100", {...}, 4096, 64)``.
    A ``package.module:factory`` model is imported (your call in Python); the plan records its graph."""
    from profiler.hardware import parse_cluster
    from profiler.models import load_model

    def as_strategy(s: Strategy | dict[str, Any]) -> Strategy:
        return s if isinstance(s, Strategy) else Strategy.model_validate(s)

    w = Workload(seq_len=seq_len, global_batch=global_batch, precision=precision)  # type: ignore[arg-type]
    return price(load_model(model, seq_len), parse_cluster(cluster), as_strategy(strategy), w, memory_limit_gib,
                 model=model, alternatives=[as_strategy(a) for a in alternatives])


@dataclass
class Repriced:
    """A variant of a plan priced next to the plan itself (both re-estimated, same inputs)."""

    original: dict[str, Any] | None = None
    variant: dict[str, Any] | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def delta_s(self) -> float | None:
        if self.original is None or self.variant is None:
            return None
        return self.variant["step_time_s"] - self.original["step_time_s"]


def reprice(plan: Plan, strategy: Strategy, workload: Workload | None = None,
            graph: LayerGraph | None = None) -> Repriced:
    """Re-estimate the plan and ``strategy`` (on ``workload``) with the plan's model (or ``graph``) and cluster,
    and the profile of :class:`PlanFiles` (none outside :func:`opening`)."""
    from costmodel.estimate import estimate

    out = Repriced()
    prof = _FILES.get().profile
    try:
        graph, cluster = graph if graph is not None else plan_graph(plan), plan_cluster(plan)
    except ShardplanError as e:
        out.error = f"cannot load the plan's model or cluster: {e}"
        return out
    if graph.content_hash() != plan.inputs.model_hash:
        out.notes.append(f"model '{plan.inputs.model}' changed since the plan was made (hash differs)")
    limit = plan.inputs.memory_limit_gib
    try:
        dev = plan_device(plan, cluster, prof)
        out.original = _report(estimate(graph, cluster, plan.strategy, plan.inputs.workload, prof, limit, dev))
    except ShardplanError as e:
        out.error = f"the plan itself no longer prices: {e}"
        return out
    try:
        out.variant = _report(estimate(graph, cluster, strategy, workload or plan.inputs.workload, prof, limit, dev))
    except ShardplanError as e:
        out.error = f"the nearest plan does not price: {e}"
    return out


def _report(r: Report) -> dict[str, Any]:
    return r.to_dict()


# ---- per-stage times for the timeline ----------------------------------------------------------

@dataclass
class StageTimes:
    """Per *virtual* stage, one micro-batch: forward, backward (incl. recompute), weight-gradient part
    of backward, exposed communication; ``p2p`` per stage boundary (one direction). Once per step:
    the exposed gradient synchronisation, the optimizer step (with the fixed step overhead) and
    host transfers. ``exact`` is False when the times are spread evenly from the prediction."""

    fwd: list[float]
    bwd: list[float]
    wgt: list[float]
    comm: list[float]
    p2p: list[float]
    grad_sync: float = 0.0
    optimizer: float = 0.0
    offload: float = 0.0
    exact: bool = True


def stage_times(plan: Plan, graph: LayerGraph | None = None) -> StageTimes:
    """Per-virtual-stage times from the cost model (with the plan's model, or ``graph``); evenly split
    from the prediction if the model cannot be had."""
    s = plan.strategy
    try:
        return _stage_times_model(plan, graph)
    except (ShardplanError, ImportError, OSError):
        pass
    pred = predicted_dict(plan)
    t = pred.get("time") or {}
    n_mb = int(pred.get("num_microbatches") or s.num_microbatches(plan.inputs.workload.global_batch) or 1)
    k = s.mesh.pp * s.vpp
    per_rank = s.vpp * n_mb
    comm = t.get("comm_s") or {}
    fb = (t.get("compute_s", plan.predicted.step_time_s * 0.8)) / per_rank
    rc = t.get("recompute_s", 0.0) / per_rank
    cm = sum(v for a, v in comm.items() if a in ("tp", "cp", "ep")) / per_rank
    pp = comm.get("pp", 0.0) / per_rank / 2
    return StageTimes([fb / 3] * k, [2 * fb / 3 + rc] * k, [fb / 3] * k, [cm] * k, [pp] * max(k - 1, 0),
                      grad_sync=comm.get("dp", 0.0), optimizer=t.get("optimizer_s", 0.0),
                      offload=t.get("offload_s", 0.0), exact=False)


def priced_plan(plan: Plan, graph: LayerGraph | None = None) -> Any:
    """The plan priced by the cost model (:class:`costmodel.estimate.PricedPlan`), with the plan's
    model or ``graph`` and the profile of :class:`PlanFiles` (none outside :func:`opening`)."""
    from costmodel.estimate import price_plan

    cluster, prof = plan_cluster(plan), _FILES.get().profile
    return price_plan(graph if graph is not None else plan_graph(plan), cluster, plan.strategy,
                      plan.inputs.workload, prof, plan_device(plan, cluster, prof))


def plan_device(plan: Plan, cluster: Cluster, profile: Profile | None = None) -> Any:
    """The device model that re-prices ``plan``: with the calibration it records (the values in the
    plan; no file opened), else None (the cost model's default); a measured profile replaces both."""
    cal = plan.inputs.calibration
    if cal is None or profile is not None:
        return None
    from costmodel.calibration.document import Calibration

    return Calibration.from_ref(cal.model_dump()).device(cluster)


def priced_units(plan: Plan, graph: LayerGraph | None = None) -> list[list[Any]]:
    """Unit costs per virtual stage (``costmodel.units.UnitCost``, as floats)."""
    return priced_plan(plan, graph).units


def _stage_times_model(plan: Plan, graph: LayerGraph | None = None) -> StageTimes:
    from costmodel.assemble import boundary_time

    pp = priced_plan(plan, graph)
    costs, a, dev = pp.units, pp.assembled, pp.pricer.dev
    fwd = [sum(u.fwd for u in st) for st in costs]
    bwd = [sum(u.bwd + u.recompute + u.accumulate for u in st) for st in costs]
    wgt = [sum(u.bwd_weight for u in st) for st in costs]
    comm = [sum(sum(u.comm.values()) for u in st) for st in costs]
    p2p = [float(boundary_time(dev, np.array([st[-1].out_bytes if st else 0.0]), pp.pricer.cfg, plan.strategy.mesh.pp)[0]) / 2
           for st in costs[:-1]]  # one way
    return StageTimes(fwd, bwd, wgt, comm, p2p, grad_sync=float(a.dp_exposed[0, 0]),
                      optimizer=float(a.optim[0, 0]) + dev.c.step_overhead_s, offload=float(a.offload[0, 0]))
