"""The plan document: versioned JSON that solvers write and explain/export/runtime read.

``planner/plan.schema.json`` is generated from these models (``python -m planner.schema``) and a
test keeps it in step. A document that does not validate raises :class:`PlanError` naming the
field and the reason.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from costmodel.strategy import Strategy, Workload
from profiler.errors import ShardplanError, describe_validation_error

SCHEMA_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).parent / "plan.schema.json"


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


class Plan(_Doc):
    schema_version: Literal["1.0"] = SCHEMA_VERSION
    inputs: PlanInputs
    strategy: Strategy
    predicted: Predicted
    solver: SolverInfo = SolverInfo(name="user")
    alternatives: list[Alternative] = Field(default_factory=list)

    def to_json(self) -> str:
        """Canonical JSON: same plan, same bytes."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a temporary file renamed over the target, never half a file."""
        write_atomic(Path(path), self.to_json())

    # ---- notebook conveniences (delegating to planner.notebook, imported on use) ---------
    @property
    def report(self) -> dict[str, Any]:
        """The cost model's report for the plan (``predicted`` as a dict)."""
        return self.predicted.model_dump()

    def to_dataframe(self) -> Any:
        """One row per unit: stage, sharding, recompute, offload, split, memory and time."""
        from planner.notebook import PlanView

        return PlanView(self).to_dataframe()

    def plot(self, kind: str = "memory", ax: Any = None) -> Any:
        """A matplotlib figure: ``memory``, ``timeline``, ``layers`` or ``pareto``."""
        from planner.notebook import PlanView

        return PlanView(self).plot(kind, ax=ax)

    def export(self, target: str) -> Any:
        """The plan for ``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron`` or ``python``."""
        from planner.notebook import PlanView

        return PlanView(self).export(target)

    def _repr_html_(self) -> str:
        from planner.notebook import PlanView

        return PlanView(self)._repr_html_()


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse_plan(data: dict[str, Any] | str, origin: str = "plan") -> Plan:
    """Validate a plan from a dict or JSON text; errors name the field and the reason."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise PlanError(f"{origin} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{origin} must be a JSON object")
    version = data.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise PlanError(f"{origin}: schema_version '{version}' is not supported (this shardplan reads {SCHEMA_VERSION})")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise PlanError(f"{origin} is not a valid plan: {describe_validation_error(e)}") from None


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PlanError(f"cannot read plan '{p}': {e.strerror}") from None
    except UnicodeDecodeError:
        raise PlanError(f"plan '{p}' is not a text (JSON) file") from None
    return parse_plan(text, origin=f"plan '{p}'")


def json_schema() -> dict[str, Any]:
    schema = Plan.model_json_schema()
    schema["$id"] = f"https://shardplan.dev/schema/plan-{SCHEMA_VERSION}.json"
    schema["title"] = "shardplan plan"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # regenerate planner/plan.schema.json
    write_atomic(SCHEMA_PATH, json_schema_text())
    print(f"wrote {SCHEMA_PATH}")
