"""The few parameters a calibration may move, each a piece of physics the cost model already has.

A *factor* scales constants as they are for the accelerator (:class:`costmodel.constants.CostConstants`
after the constants file and the accelerator file's ``cost_constants``; prior 1): ``compute`` is the
device's speed over what the cost model assumes, for GEMMs, attention and memory-bound kernels alike;
``gemm`` and ``memory`` split it; ``network`` is the bandwidth of both network tiers over the spec
sheet's. A *value* knob sets one constant (prior: its value now): ``overhead`` the fixed cost of a
step, ``fragmentation`` and ``context`` the memory the allocator and the context add to the
tensors' peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from costmodel.constants import CostConstants
    from costmodel.device import DeviceModel
    from profiler.hardware import Cluster
    from profiler.profile_schema import Profile

GIB = 1024.0**3


@dataclass(frozen=True)
class Knob:
    """One parameter of a calibration: the constants it moves, whether it scales them (``factor``)
    or sets the one it names, its bounds, and whether step time or memory measures it."""

    name: str
    what: str
    constants: tuple[str, ...]
    factor: bool
    bounds: tuple[float, float]
    measured_by: str = "time"


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("compute", "compute speed over the model's (GEMMs, attention, memory-bound kernels)",
         ("gemm_scale", "attention_efficiency", "memory_efficiency", "gemm_stream_efficiency"), True, (0.05, 20.0)),
    Knob("gemm", "GEMM and attention speed over the model's", ("gemm_scale", "attention_efficiency"), True,
         (0.05, 20.0)),
    Knob("memory", "memory-bound kernels' bandwidth over the model's", ("memory_efficiency", "gemm_stream_efficiency"),
         True, (0.05, 20.0)),
    Knob("network", "network bandwidth over the spec sheet's (both tiers)", (), True, (0.02, 50.0)),
    Knob("overhead", "fixed seconds per step (data loading, logging, launch)", ("step_overhead_s",), False,
         (0.0, 30.0)),
    Knob("fragmentation", "allocator slack over the tensors' peak", ("fragmentation",), False, (0.0, 1.0), "memory"),
    Knob("context", "bytes per GPU that are no tensor (CUDA context, NCCL buffers; a process on a CPU)",
         ("context_bytes",), False, (0.0, 64 * GIB), "memory"),
)}
#: the time knobs fitted unless ``--fit`` names others
DEFAULT_TIME = ("compute", "network", "overhead")
#: knobs that move the same constants: at most one of each group
EXCLUSIVE = (("compute", "gemm"), ("compute", "memory"))


def check_names(names: list[str]) -> None:
    """Known knob names, none twice, no two that move the same constants."""
    from vocab.errors import UnknownNameError

    for n in names:
        if n not in KNOBS:
            raise UnknownNameError("calibration parameter", n, KNOBS)
    if len(set(names)) != len(names):
        raise ShardplanError(f"a calibration parameter is named twice: {', '.join(names)}")
    for a, b in EXCLUSIVE:
        if a in names and b in names:
            raise ShardplanError(f"'{a}' and '{b}' move the same constants: fit one of them")


def prior(name: str, base: CostConstants) -> float:
    """A knob's value before the fit: 1 for a factor, the constant's value for a value knob."""
    k = KNOBS[name]
    return 1.0 if k.factor else float(getattr(base, k.constants[0]))


def settings(values: dict[str, float], base: CostConstants) -> tuple[dict[str, float], float]:
    """(constant overrides, network bandwidth factor) that ``values`` of the knobs give on ``base``."""
    overrides: dict[str, float] = {}
    network = 1.0
    for name, v in values.items():
        k = KNOBS[name]
        if name == "network":
            network = v
        for c in k.constants:
            overrides[c] = getattr(base, c) * v if k.factor else v
    return overrides, network


def scaled_cluster(cluster: Cluster, network: float) -> Cluster:
    """``cluster`` with both network tiers' bandwidth times ``network``."""
    if network == 1.0:
        return cluster
    if not network > 0:
        raise ShardplanError(f"a network bandwidth factor must be positive, got {network}")
    acc = cluster.accelerator
    acc = replace(acc, scale_up=replace(acc.scale_up, gbps=acc.scale_up.gbps * network),
                  scale_out=replace(acc.scale_out, gbps=acc.scale_out.gbps * network))
    return replace(cluster, accelerator=acc)


def base_constants(cluster: Cluster) -> CostConstants:
    """The constants the cost model prices ``cluster`` with (what a calibration moves from)."""
    from costmodel.device import DeviceModel

    return DeviceModel(cluster).c


def device(cluster: Cluster, overrides: dict[str, float], network: float = 1.0,
           profile: Profile | None = None) -> DeviceModel:
    """A device model of ``cluster`` with the constant ``overrides`` and network factor of a
    calibration (its cluster is :func:`scaled_cluster`)."""
    from costmodel.device import DeviceModel

    consts = base_constants(cluster).with_overrides(overrides)
    return DeviceModel(scaled_cluster(cluster, network), profile, constants=consts)
