"""The plan document: versioned JSON that solvers write and explain/export/runtime read.

``vocab/plan.schema.json`` is generated from these models (``python -m vocab.plan``) and a test
keeps it in step. A document that does not validate raises :class:`PlanError` naming the field and
the reason.

A plan's notebook conveniences (``to_dataframe``, ``plot``, ``export``, the HTML view) delegate to
the view that :func:`register_viewer` installs; importing ``planner`` installs
``planner.notebook.PlanView``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vocab.errors import ShardplanError
from vocab.io import canonical_json, decode_json, document_schema, read_text, validate_document, write_atomic
from vocab.strategy import Strategy, Workload

SCHEMA_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).parent / "plan.schema.json"
_VIEWER: list[Callable[[Plan], Any]] = []


class PlanError(ShardplanError):
    """A plan document that cannot be read or does not validate."""


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterRef(_Doc):
    accelerator: str
    nodes: int = Field(..., ge=1)
    gpus_per_node: int = Field(..., ge=1)
    world_size: int = Field(..., ge=1)
    memory_gb: float = Field(..., gt=0)


class PlanInputs(_Doc):
    """What the plan was made for."""

    model: str = Field(..., description="preset name, config path or factory")
    model_hash: str = Field(..., description="content hash of the layer graph")
    cluster: ClusterRef
    workload: Workload
    memory_limit_gib: float | None = Field(None, gt=0, description="per-GPU limit the plan must fit")
    profile: str | None = Field(None, description="profile document used to calibrate, if any")


class Predicted(_Doc):
    """The cost model's report for the plan (keys shared with ``shardplan estimate``)."""

    model_config = ConfigDict(extra="allow")

    step_time_s: float = Field(..., gt=0)
    tokens_per_s_per_gpu: float = Field(..., ge=0)
    mfu: float = Field(..., ge=0)
    hfu: float = Field(..., ge=0)
    memory_peak_gib: float = Field(..., ge=0)


class SolverInfo(_Doc):
    name: str = Field(..., description="dp, ilp, hybrid, exhaustive or 'user' for a given plan")
    status: Literal["optimal", "feasible", "time_limit", "given"] = "given"
    space: str = Field("given", description="search space the optimum holds in")
    objective: float | None = Field(None, description="the objective's value (step time, s)")
    bound: float | None = Field(None, description="best proven lower bound on the objective")
    gap: float | None = Field(None, ge=0, description="(objective - bound) / objective")
    time_s: float = Field(0.0, ge=0)
    candidates: int = Field(0, ge=0, description="candidate plans priced")
    options: dict[str, Any] = Field(default_factory=dict)


class Alternative(_Doc):
    """A runner-up the search kept (for compare, Pareto plots and explain)."""

    strategy: Strategy
    predicted: Predicted


# What the plan was made for, the strategy, the cost model's prediction, the solver, runners-up. (No
# docstring: it would become the schema's description.)
class Plan(_Doc):
    schema_version: Literal["1.0"] = SCHEMA_VERSION
    inputs: PlanInputs
    strategy: Strategy
    predicted: Predicted
    solver: SolverInfo = SolverInfo(name="user")
    alternatives: list[Alternative] = Field(default_factory=list)

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
        if not _VIEWER:
            raise ShardplanError("notebook views of a plan need the planner: import planner")
        return _VIEWER[-1](self)

    def to_dataframe(self) -> Any:
        """One row per unit: stage, sharding, recompute, offload, split, memory and time."""
        return self.view().to_dataframe()

    def plot(self, kind: str = "memory", ax: Any = None) -> Any:
        """A matplotlib figure: ``memory``, ``timeline``, ``layers`` or ``pareto``."""
        return self.view().plot(kind, ax=ax)

    def export(self, target: str) -> Any:
        """The plan for ``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron`` or ``python``."""
        return self.view().export(target)

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()


def register_viewer(factory: Callable[[Plan], Any]) -> None:
    """Make ``factory(plan)`` the view :class:`Plan`'s notebook conveniences delegate to."""
    _VIEWER.append(factory)


def parse_plan(data: dict[str, Any] | str, origin: str = "plan") -> Plan:
    """Validate a plan from a dict or JSON text; errors name the field and the reason."""
    if isinstance(data, str):
        data = decode_json(data, origin, PlanError)
    if not isinstance(data, dict):
        raise PlanError(f"{origin} must be a JSON object")
    version = data.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise PlanError(f"{origin}: schema_version '{version}' is not supported (this shardplan reads {SCHEMA_VERSION})")
    return validate_document(Plan, data, origin, "plan", PlanError)


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
