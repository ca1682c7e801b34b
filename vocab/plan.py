"""The plan document: versioned JSON that solvers write and explain/export/runtime read.

``vocab/plan.schema.json`` is generated from these models (``python -m vocab.plan``) and a test
keeps it in step. A document that does not validate raises :class:`PlanError` naming the field and
the reason.

A plan's notebook conveniences (``to_dataframe``, ``plot``, ``export``, the HTML view) delegate to
the view that :func:`vocab.viewers.register_viewer` installs; importing ``planner`` installs
``planner.notebook.PlanView``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from vocab.arguments import typed
from vocab.errors import ShardplanError, describe_validation_error
from vocab.io import canonical_json, decode_json, document_schema, read_text, validate_document, write_atomic
from vocab.names import ACCELERATOR, HASH, MODEL_REF, RELEASE, SOLVER, unprintable_string
from vocab.rules import batch_problem
from vocab.strategy import Strategy, Workload
from vocab.viewers import register_viewer, registered  # noqa: F401  (register_viewer: re-exported)

SCHEMA_VERSION = "1.12"
#: versions this shardplan reads: 1.1 added ``inputs.model_graph`` (a 1.0 document is a 1.1 one without
#: it); 1.2 added ``inputs.target`` (a 1.0 or 1.1 document is one searched for the target ``any``); 1.3
#: added ``workload.recv_buffers`` (older documents keep torch's per-micro-batch buffers); 1.4 added
#: ``workload.kernels`` and ``workload.zero3_master`` (older documents were priced with eager kernels
#: and the master weights in the optimizer); 1.5 added ``workload.moe_dispatch``, ``workload.moe_overlap`` and
#: ``workload.moe_capacity_factor`` (older documents were priced with an all-to-all, not overlapped, dropless);
#: 1.6 added ``workload.selective`` (older documents were priced with the attention core recomputed); 1.7 added
#: ``inputs.calibration`` (older documents were priced without a calibration of the user's cluster); 1.8
#: added the precision ``mxfp8`` to ``workload.precision`` (older documents name bf16, fp8 or fp32); 1.9 added
#: ``workload.low_precision_experts`` (older documents were priced with an fp8 run's experts in fp8 on every mesh);
#: 1.10 added ``strategy.mesh.etp`` (older documents split every expert over the tensor-parallel ranks) and
#: ``workload.moe_tp`` (older documents were priced with Megatron's token dispatcher under tensor parallelism);
#: 1.11 added ``workload.fp8_saved_inputs`` (older documents kept every fp8 linear's 16-bit input) and the offload
#: ``activations`` (older documents offload states only) and ``workload.adam_states`` (older documents kept
#: Adam's master and moments in fp32); 1.12 added the cross-entropy ``chunked`` (older documents name eager or
#: fused), ``workload.moe_tp`` ``gathered_without_ep`` and target names with a dot (``torchtitan-0.3``)
READABLE_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.11", "1.12")
#: the target a document records when it names none: the whole plan vocabulary (``vocab.targets``)
ANY_TARGET = "any"
SCHEMA_PATH = Path(__file__).parent / "plan.schema.json"


#: a finite number at least 0 (an integer is taken as a float)
NonNegative = Annotated[float, Field(ge=0, strict=False, allow_inf_nan=False)]


class PlanError(ShardplanError):
    """A plan document that cannot be read or does not validate."""


#: how ``profiler.models.load_model`` tells a ``package.module:factory`` name from a preset or a file
FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def names_factory(model: str) -> bool:
    """Whether ``model`` has the shape of ``package.module:factory`` (code that a plan never runs)."""
    return FACTORY.match(model) is not None


def _before(version: str, first: str) -> bool:
    """Whether documents of ``version`` predate ``first`` (both of :data:`READABLE_VERSIONS`)."""
    return READABLE_VERSIONS.index(version) < READABLE_VERSIONS.index(first)


def _rule(message: str) -> PydanticCustomError:
    return PydanticCustomError("plan_rule", message)


def non_finite(data: Any, path: str) -> str | None:
    """The path of the first NaN or infinity inside ``data`` (lists and mappings), or None."""
    stack = [(data, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return where
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(node))
    return None


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ClusterRef(_Doc):
    accelerator: str = Field(..., pattern=ACCELERATOR, description="the accelerator's name")
    nodes: int = Field(..., ge=1)
    gpus_per_node: int = Field(..., ge=1)
    world_size: int = Field(..., ge=1, description="nodes x gpus_per_node")
    memory_gb: float = Field(..., gt=0)

    @model_validator(mode="after")
    def _world(self) -> ClusterRef:
        if self.world_size != self.nodes * self.gpus_per_node:
            raise _rule(f"world_size {self.world_size} is not nodes x gpus_per_node = {self.nodes} x "
                        f"{self.gpus_per_node} = {self.nodes * self.gpus_per_node}")
        return self


class ModelGraph(_Doc):
    """The layer graph the plan was priced on (``profiler.graph.graph_to_dict`` without ``model_id``)."""

    seq_len: int = Field(..., ge=1, description="tokens per sample the per-sample figures are for")
    source: str = Field("analytic", description="analytic or traced")
    config: dict[str, Any] = Field(default_factory=dict, description="the architecture facts, when known")
    nodes: list[dict[str, Any]] = Field(
        ..., min_length=1, description="operators in execution order: the fields of profiler.graph.LayerNode "
        "that differ from their defaults, or {name, block, like: i} for one alike node i in all else"
    )

    @model_validator(mode="after")
    def _finite(self) -> ModelGraph:
        where = non_finite(self.config, "config") or non_finite(self.nodes, "nodes")
        if where is not None:
            raise _rule(f"{where} is not a finite number")
        return self


class TargetRef(_Doc):
    """The trainer the plan was searched for (``vocab/targets/<name>.yaml``) and its pinned release."""

    name: str = Field(..., pattern=r"^[a-z][a-z0-9_.-]*$", description="target name; 'any': no trainer")
    version: str | None = Field(None, pattern=RELEASE, description="the trainer's pinned release (null for 'any')")


class CalibrationBand(_Doc):
    """The measured over the calibrated step time, less 1, over the calibration's runs (each run's
    10th-90th percentile): where a calibrated plan's real step time likely lies."""

    low: float = Field(..., ge=-1, le=100)
    high: float = Field(..., ge=-1, le=100)
    runs: int = Field(..., ge=1, description="the runs the calibration was fitted on")


class CalibrationRef(_Doc):
    """The calibration the plan was priced with (``shardplan calibrate``): the file it was read from
    (for the record: re-pricing uses the values here and opens no file), its content hash, and the
    values pricing used."""

    path: str = Field(..., pattern=MODEL_REF, description="the calibration file, as the command line named it")
    sha256: str = Field(..., pattern=HASH, description="SHA-256 of the file's text")
    accelerator: str = Field(..., pattern=ACCELERATOR, description="the accelerator whose runs it was fitted on")
    constants: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")], NonNegative] = Field(
        ..., description="cost constants it sets (costmodel.constants.CostConstants)")
    network_scale: float = Field(..., gt=0, le=1000, description="both network tiers' bandwidth over the spec sheet's")
    band: CalibrationBand


class PlanInputs(_Doc):
    """What the plan was made for."""

    model: str = Field(..., pattern=MODEL_REF, description="preset name, Hugging Face id, config path or "
                       "package.module:factory")
    model_hash: str = Field(..., pattern=HASH, description="content hash of the layer graph")
    model_graph: ModelGraph | None = Field(
        None, description="the layer graph, for a model that is not a preset or a config file (a factory): "
        "re-pricing uses it, checked against model_hash, and never imports the factory"
    )
    cluster: ClusterRef
    workload: Workload
    memory_limit_gib: float | None = Field(None, gt=0, description="per-GPU limit the plan must fit")
    profile: str | None = Field(None, pattern=MODEL_REF, description="profile document used to calibrate, if any "
                                "(for the record: opened only when the command line asks for it)")
    target: TargetRef = Field(
        default_factory=lambda: TargetRef(name=ANY_TARGET),
        description="the trainer whose capabilities bounded the search and whose behaviour priced the plan; "
        "'any' (the whole plan vocabulary) in documents of schema 1.0 and 1.1",
    )
    calibration: CalibrationRef | None = Field(
        None, description="the calibration of the user's cluster the plan was priced with, if any (schema 1.7)")

    @model_validator(mode="after")
    def _graph_seq(self) -> PlanInputs:
        g = self.model_graph
        if g is not None and g.seq_len != self.workload.seq_len:
            raise _rule(f"model_graph.seq_len {g.seq_len} is not workload.seq_len {self.workload.seq_len}")
        return self


class Predicted(_Doc):
    """The cost model's report for the plan (keys shared with ``shardplan estimate``)."""

    model_config = ConfigDict(extra="allow")

    step_time_s: float = Field(..., gt=0)
    tokens_per_s_per_gpu: float = Field(..., ge=0)
    mfu: float = Field(..., ge=0)
    hfu: float = Field(..., ge=0)
    memory_peak_gib: float = Field(..., ge=0)

    @model_validator(mode="after")
    def _finite(self) -> Predicted:
        extra = self.model_extra or {}
        where = non_finite(extra, "predicted")
        if where is not None:
            raise _rule(f"{where.removeprefix('predicted.')} is not a finite number")
        for key, adapter in _PREDICTED_EXTRA.items():  # the report's other keys, when present, typed
            if key in extra:
                try:
                    adapter.validate_python(extra[key])
                except ValidationError as e:
                    raise _rule(f"{key}: {describe_validation_error(e)}") from None
        return self


class _ReportPart(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class PredictedTime(_ReportPart):
    """The report's ``time``: seconds per optimizer step on the critical path, by kind
    (``costmodel.report.TimeBreakdown``)."""

    compute_s: NonNegative = 0.0
    recompute_s: NonNegative = 0.0
    comm_s: dict[str, NonNegative] = Field(default_factory=dict)
    bubble_s: NonNegative = 0.0
    optimizer_s: NonNegative = 0.0
    offload_s: NonNegative = 0.0


class PredictedStage(_ReportPart):
    """One of the report's ``stages``: a pipeline stage's peak memory on one rank, in GiB, and its
    exact per-rank state bytes (``costmodel.report.StageMemory``)."""

    stage: int = Field(0, ge=0)
    first_block: int | None = None
    last_block: int | None = None
    units: list[str] = Field(default_factory=list)
    phase: str = ""
    param_bytes: int = Field(0, ge=0)
    grad_bytes: int = Field(0, ge=0)
    optim_bytes: int = Field(0, ge=0)
    params_gib: NonNegative = 0.0
    grads_gib: NonNegative = 0.0
    optimizer_gib: NonNegative = 0.0
    activations_gib: NonNegative = 0.0
    buffers_gib: NonNegative = 0.0
    overhead_gib: NonNegative = 0.0
    total_gib: NonNegative = 0.0


#: the types of the report keys beyond the five every plan has, in the report's order
_PREDICTED_EXTRA: dict[str, TypeAdapter[Any]] = {
    "memory_limit_gib": TypeAdapter(Annotated[float, Field(gt=0, strict=False, allow_inf_nan=False)]),
    "fits": TypeAdapter(Annotated[bool, Field(strict=True)]),
    "num_microbatches": TypeAdapter(Annotated[int, Field(ge=1, strict=True)]),
    "model_flops_per_step": TypeAdapter(NonNegative),
    "hardware_flops_per_step": TypeAdapter(NonNegative),
    "time": TypeAdapter(PredictedTime),
    "stages": TypeAdapter(list[PredictedStage]),
    "notes": TypeAdapter(list[str]),
    "host_per_node_gib": TypeAdapter(NonNegative),
    "host_limit_per_node_gib": TypeAdapter(NonNegative),
}

#: every key of the cost model's report, in order: the owner of its shape (``costmodel.report``
#: writes these keys, the ``time`` ones of :class:`PredictedTime`, the stages' of :class:`PredictedStage`)
REPORT_KEYS: tuple[str, ...] = (*Predicted.model_fields, *_PREDICTED_EXTRA)


class SolverInfo(_Doc):
    name: str = Field(..., pattern=SOLVER, description="dp, ilp, hybrid, exhaustive or 'user' for a given plan")
    status: Literal["optimal", "feasible", "time_limit", "given"] = "given"
    space: str = Field("given", description="search space the optimum holds in")
    objective: float | None = Field(None, description="the objective's value (step time, s)")
    bound: float | None = Field(None, description="best proven lower bound on the objective")
    gap: float | None = Field(None, ge=0, description="(objective - bound) / objective")
    time_s: float = Field(0.0, ge=0)
    candidates: int = Field(0, ge=0, description="candidate plans priced")
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _finite(self) -> SolverInfo:
        where = non_finite(self.options, "options")
        if where is not None:
            raise _rule(f"{where} is not a finite number")
        return self


class Alternative(_Doc):
    """A runner-up the search kept (for compare, Pareto plots and explain)."""

    strategy: Strategy
    predicted: Predicted


# What the plan was made for, the strategy, the cost model's prediction, the solver, runners-up. (No
# docstring: it would become the schema's description.)
class Plan(_Doc):
    schema_version: Literal["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.11",
                            "1.12"] = (
        SCHEMA_VERSION)
    inputs: PlanInputs
    strategy: Strategy
    predicted: Predicted
    solver: SolverInfo = SolverInfo(name="user")
    alternatives: list[Alternative] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _printable(cls, data: Any) -> Any:
        why = unprintable_string(data)
        if why is not None:
            raise _rule(why)
        return data

    @field_validator("inputs")
    @classmethod
    def _inputs_of_version(cls, inp: PlanInputs, info: ValidationInfo) -> PlanInputs:
        version = info.data.get("schema_version", SCHEMA_VERSION)
        if version == "1.0" and inp.model_graph is not None:
            raise _rule("model_graph needs schema_version 1.1")
        if version in ("1.0", "1.1") and inp.target.name != ANY_TARGET:
            raise _rule(f"target '{inp.target.name}' needs schema_version 1.2 (older plans were searched for "
                        f"the target '{ANY_TARGET}')")
        if version in ("1.0", "1.1", "1.2") and inp.workload.recv_buffers != "per_micro_batch":
            raise _rule(f"workload.recv_buffers '{inp.workload.recv_buffers}' needs schema_version 1.3 (older plans "
                        "were priced with per-micro-batch receive buffers)")
        if version in ("1.0", "1.1", "1.2", "1.3") and inp.workload.kernels != "eager":
            raise _rule(f"workload.kernels '{inp.workload.kernels}' needs schema_version 1.4 (older plans were "
                        "priced with eager kernels)")
        if version in ("1.0", "1.1", "1.2", "1.3") and inp.workload.zero3_master != "optimizer":
            raise _rule(f"workload.zero3_master '{inp.workload.zero3_master}' needs schema_version 1.4 (older "
                        "plans kept the master weights in the optimizer)")
        older = ("1.0", "1.1", "1.2", "1.3", "1.4")
        if version in older and inp.workload.moe_capacity_factor is not None:
            raise _rule("workload.moe_capacity_factor needs schema_version 1.5 (older plans were priced dropless)")
        if version in older and (inp.workload.moe_dispatch, inp.workload.moe_overlap) != ("alltoall", "none"):
            raise _rule(f"workload.moe_dispatch '{inp.workload.moe_dispatch}' and moe_overlap "
                        f"'{inp.workload.moe_overlap}' need schema_version 1.5 (older plans were priced with an "
                        "all-to-all, not overlapped)")
        if version in (*older, "1.5") and inp.workload.selective != "attention":
            raise _rule(f"workload.selective '{inp.workload.selective}' needs schema_version 1.6 (older plans were "
                        "priced with the attention core recomputed)")
        if version in (*older, "1.5", "1.6") and inp.calibration is not None:
            raise _rule("inputs.calibration needs schema_version 1.7 (older plans were priced without a calibration)")
        if version in (*older, "1.5", "1.6", "1.7") and inp.workload.precision == "mxfp8":
            raise _rule("workload.precision 'mxfp8' needs schema_version 1.8 (older plans name bf16, fp8 or fp32)")
        if version in (*older, "1.5", "1.6", "1.7", "1.8") and inp.workload.low_precision_experts != "always":
            raise _rule(f"workload.low_precision_experts '{inp.workload.low_precision_experts}' needs schema_version "
                        "1.9 (older plans were priced with an fp8 run's experts in fp8 on every mesh)")
        if _before(version, "1.10") and inp.workload.moe_tp != "dispatcher":
            raise _rule(f"workload.moe_tp '{inp.workload.moe_tp}' needs schema_version 1.10 (older plans were priced "
                        "with Megatron's dispatcher under tensor parallelism)")
        if _before(version, "1.11") and inp.workload.adam_states != "fp32":
            raise _rule(f"workload.adam_states '{inp.workload.adam_states}' needs schema_version 1.11 (older plans "
                        "kept Adam's master and moments in fp32)")
        if _before(version, "1.11") and inp.workload.fp8_saved_inputs != "original":
            raise _rule(f"workload.fp8_saved_inputs '{inp.workload.fp8_saved_inputs}' needs schema_version 1.11 (older "
                        "plans kept every fp8 linear layer's 16-bit input)")
        if _before(version, "1.12") and inp.workload.moe_tp == "gathered_without_ep":
            raise _rule("workload.moe_tp 'gathered_without_ep' needs schema_version 1.12 (older plans name dispatcher "
                        "or gathered)")
        if _before(version, "1.12") and inp.workload.cross_entropy == "chunked":
            raise _rule("workload.cross_entropy 'chunked' needs schema_version 1.12 (older plans name eager or fused)")
        if _before(version, "1.12") and inp.target is not None and "." in inp.target.name:
            raise _rule(f"target '{inp.target.name}' needs schema_version 1.12 (older plans name no target with a dot)")
        if version != "1.0" and inp.model_graph is None and names_factory(inp.model):
            raise _rule(f"model '{inp.model}' names a factory, which a plan never imports: the plan must record "
                        "its layer graph (inputs.model_graph), as 'shardplan plan' does")
        return inp

    @field_validator("strategy")
    @classmethod
    def _strategy_fits(cls, s: Strategy, info: ValidationInfo) -> Strategy:
        version = info.data.get("schema_version", SCHEMA_VERSION)
        if s.mesh.etp and _before(version, "1.10"):
            raise _rule("strategy.mesh.etp needs schema_version 1.10 (older plans split every expert over the "
                        "tensor-parallel ranks)")
        if _before(version, "1.11") and any(ls.offload == "activations" for ls in [s.default, *s.layers]):
            raise _rule("offload 'activations' needs schema_version 1.11 (older plans offload states only)")
        inp = info.data.get("inputs")
        if isinstance(inp, PlanInputs):
            _check_fits(s, inp, "")
        return s

    @field_validator("alternatives")
    @classmethod
    def _alternatives_fit(cls, alts: list[Alternative], info: ValidationInfo) -> list[Alternative]:
        inp = info.data.get("inputs")
        if isinstance(inp, PlanInputs):
            for i, a in enumerate(alts):
                _check_fits(a.strategy, inp, f"{i}.strategy.")
        return alts

    def to_json(self) -> str:
        """Canonical JSON: same plan, same bytes."""
        return canonical_json(self.model_dump(mode="json"))

    def save(self, path: str | Path) -> None:
        """Write atomically: a temporary file renamed over the target, never half a file."""
        write_atomic(Path(path), self.to_json())

    # ---- notebook conveniences (delegating to the registered view) -------------------------
    @property
    def report(self) -> dict[str, Any]:
        """The cost model's report for the plan (``predicted`` as a dict)."""
        return self.predicted.model_dump()

    def view(self) -> Any:
        """The registered notebook view of this plan (``planner.notebook.PlanView``)."""
        view = registered()
        if view is None:
            raise ShardplanError("notebook views of a plan need the planner: import planner")
        return view(self)

    def to_dataframe(self) -> Any:
        """One row per unit: stage, sharding, recompute, offload, split, memory and time."""
        return self.view().to_dataframe()

    def plot(self, kind: str = "memory", ax: Any = None) -> Any:
        """A matplotlib figure: ``memory``, ``timeline``, ``layers`` or ``pareto``."""
        return self.view().plot(kind, ax=ax)

    def export(self, target: str, nearest: bool = False) -> Any:
        """The plan for ``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron`` or ``python``, refused as
        ``shardplan export`` refuses it (``nearest`` is its ``--nearest``)."""
        return self.view().export(target, nearest=nearest)

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()


def _check_fits(s: Strategy, inp: PlanInputs, where: str) -> None:
    """The strategy's mesh spans the cluster and its data-parallel micro-batches divide the global batch."""
    world, gb = inp.cluster.world_size, inp.workload.global_batch
    if s.mesh.world_size != world:
        raise _rule(f"{where}mesh spans {s.mesh.world_size} GPUs; inputs.cluster.world_size is {world}")
    problem = batch_problem(gb, s.mesh.dp, s.micro_batch)
    if problem:
        raise _rule(f"{where}mesh.dp, {where}micro_batch: {problem} (inputs.workload.global_batch)")


def parse_plan(data: dict[str, Any] | str, origin: str = "plan") -> Plan:
    """Validate a plan from a dict or JSON text; errors name the field and the reason. A dict is
    checked as text is (values JSON holds, nesting; NaN where the schema names the field): what
    parses, ``to_json`` writes."""
    if isinstance(data, str):
        data = decode_json(data, origin, PlanError)
    elif isinstance(data, dict):
        from vocab.io import as_json_data

        data = as_json_data(data, origin, PlanError, allow_nan=True)
    if not isinstance(data, dict):
        raise PlanError(f"{origin} must be a JSON object")
    version = data.get("schema_version")
    if version is not None and version not in READABLE_VERSIONS:
        raise PlanError(f"{origin}: schema_version '{version}' is not supported (this shardplan reads "
                        f"{', '.join(READABLE_VERSIONS)})")
    return validate_document(Plan, data, origin, "plan", PlanError)


@typed
def load_plan(path: str | Path) -> Plan:
    """The plan in the JSON file at ``path``; an unreadable or invalid file raises :class:`PlanError`."""
    return parse_plan(read_text(path, "plan", PlanError), origin=f"plan '{Path(path)}'")


def json_schema() -> dict[str, Any]:
    """The JSON schema of a plan document."""
    return document_schema(Plan, "plan", SCHEMA_VERSION, "shardplan plan")


def json_schema_text() -> str:
    return canonical_json(json_schema())


if __name__ == "__main__":  # regenerate vocab/plan.schema.json
    write_atomic(SCHEMA_PATH, json_schema_text())
    print(f"wrote {SCHEMA_PATH}")
