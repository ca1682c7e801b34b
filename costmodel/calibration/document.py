"""The calibration document (``shardplan calibrate -o cluster.yaml``) and what applies it.

The document holds what pricing uses — the accelerator it was fitted on, the constant overrides, the
network bandwidth factor and the error band of the runs — and, for the record, each fitted parameter
(its prior, value, bounds and how far it moved), every run (configuration, log, format, the steady
state, the predictions before and after) and the errors before and after. A plan priced with a
calibration records the values it used (:meth:`Calibration.ref`), so that re-pricing the plan needs
no file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from costmodel.calibration.knobs import KNOBS
from vocab.errors import ShardplanError
from vocab.names import ACCELERATOR

if TYPE_CHECKING:
    from costmodel.calibration.fit import Fitted
    from costmodel.device import DeviceModel
    from profiler.hardware import Cluster
    from profiler.profile_schema import Profile

KIND = "shardplan-calibration"
VERSION = 1
HEADER = ("# shardplan calibration: cost-model constants fitted on this cluster's own runs (shardplan calibrate).\n"
          "# Pricing reads accelerator, constants, network_scale and band; the rest is the record of the fit.\n")


class CalibrationFileError(ShardplanError):
    """A calibration document that cannot be read or does not apply."""


class _Band(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    low: float = Field(..., ge=-1.0, le=100.0)
    high: float = Field(..., ge=-1.0, le=100.0)
    runs: int = Field(..., ge=1)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    kind: Literal["shardplan-calibration"]
    version: Literal[1]
    accelerator: str = Field(..., pattern=ACCELERATOR)
    constants: dict[str, float]
    network_scale: float = Field(..., gt=0.0, le=1000.0)
    band: _Band
    parameters: list[dict[str, Any]] = Field(default_factory=list)
    runs: list[dict[str, Any]] = Field(default_factory=list)
    error: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    """What pricing takes of a calibration: where it was read (``path``, its ``sha256``), the
    accelerator, the constant overrides, the network factor and the band (signed relative errors
    of the runs, low and high, and how many runs)."""

    path: str
    sha256: str
    accelerator: str
    constants: dict[str, float]
    network_scale: float
    band_low: float
    band_high: float
    runs: int

    def device(self, cluster: Cluster, profile: Profile | None = None) -> DeviceModel:
        """A device model of ``cluster`` priced with this calibration (the cluster's accelerator
        must be the one it was fitted on)."""
        from costmodel.calibration.knobs import device

        if cluster.accelerator.name != self.accelerator:
            raise CalibrationFileError(f"the calibration {self.path} was fitted on {self.accelerator} runs; the "
                                       f"cluster's accelerator is {cluster.accelerator.name}")
        return device(cluster, self.constants, self.network_scale, profile)

    def ref(self) -> dict[str, Any]:
        """What a plan records of the calibration it was priced with (``inputs.calibration``)."""
        return {"path": self.path, "sha256": self.sha256, "accelerator": self.accelerator,
                "constants": dict(sorted(self.constants.items())), "network_scale": self.network_scale,
                "band": {"low": self.band_low, "high": self.band_high, "runs": self.runs}}

    @classmethod
    def from_ref(cls, ref: dict[str, Any]) -> Calibration:
        """The calibration a plan records (:meth:`ref`), checked as a document's values are."""
        band = ref["band"]
        cal = cls(str(ref["path"]), str(ref["sha256"]), str(ref["accelerator"]), dict(ref["constants"]),
                  float(ref["network_scale"]), float(band["low"]), float(band["high"]), int(band["runs"]))
        _check_constants(cal.constants, f"the plan's calibration {cal.path}")
        return cal


def _check_constants(constants: dict[str, float], origin: str) -> None:
    from costmodel.constants import CostConstants

    try:
        CostConstants().with_overrides(constants)
    except ShardplanError as e:
        raise CalibrationFileError(f"{origin}: {e}") from None


def load_calibration(path: str | Path) -> Calibration:
    """The calibration document at ``path``, validated (one line naming what is wrong)."""
    from vocab.io import decode_yaml, read_text, validate_document

    p = Path(path)
    text = read_text(p, "calibration", CalibrationFileError)
    origin = f"'{p.name}'"
    data = decode_yaml(text, origin, CalibrationFileError)
    doc = validate_document(_Doc, data, origin, "calibration (shardplan calibrate -o FILE.yaml)",
                            CalibrationFileError)
    _check_constants(doc.constants, origin)
    return Calibration(_recordable(p), hashlib.sha256(text.encode()).hexdigest(), doc.accelerator, doc.constants,
                       doc.network_scale, doc.band.low, doc.band.high, doc.band.runs)


def _recordable(p: Path) -> str:
    """The path as a plan may record it (a path of odd characters: its name, else ``calibration``)."""
    import re

    from vocab.names import MODEL_REF

    return next((c for c in (str(p), p.name) if re.match(MODEL_REF, c)), "calibration")


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def document(fitted: Fitted) -> dict[str, Any]:
    """The calibration document of a fit."""
    low, high = fitted.band()
    params = []
    for name, value in fitted.values.items():
        k, before = KNOBS[name], fitted.priors[name]
        moved = value / before - 1 if k.factor or before else None
        params.append({"name": name, "what": k.what, "prior": _round(before), "value": _round(value),
                       "bounds": [_round(b) for b in k.bounds],
                       "moved": None if moved is None else round(moved, 4),
                       "sets": list(k.constants) or ["scale_up.gbps", "scale_out.gbps"]})
    runs = [{k: (_round(v) if isinstance(v, float) else v) for k, v in r.items()} for r in fitted.runs]

    def summary(errs: list[float]) -> dict[str, float]:
        return {"median_abs": round(float(sorted(abs(e) for e in errs)[len(errs) // 2]), 4),
                "max_abs": round(max(abs(e) for e in errs), 4)} if errs else {}

    error = {when: {"step_time": summary(fitted.errors(when)), "memory": summary(fitted.errors(when, "memory"))}
             for when in ("before", "after")}
    return {"kind": KIND, "version": VERSION, "accelerator": fitted.accelerator,
            "constants": {k: _round(v) for k, v in sorted(fitted.overrides.items())},
            "network_scale": _round(fitted.network),
            "band": {"low": round(low, 4), "high": round(high, 4), "runs": len(fitted.runs)},
            "parameters": params, "runs": runs, "error": error}


def write_calibration(fitted: Fitted, path: str | Path) -> dict[str, Any]:
    """Write the calibration document of ``fitted`` to ``path`` (atomically); return it."""
    import yaml

    from vocab.io import write_atomic

    doc = document(fitted)
    write_atomic(Path(path), HEADER + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True),
                 CalibrationFileError)
    return doc
