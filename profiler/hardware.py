"""Accelerators and clusters as data.

One YAML file per accelerator in ``profiler/data/accelerators`` (adding a GPU is adding a file;
``SHARDPLAN_ACCELERATOR_PATH`` adds more folders). A cluster is nodes × GPUs per node of one
accelerator, with two network tiers: the scale-up domain (NVLink/xGMI) and scale-out
(InfiniBand/RoCE/EFA). Clusters come from a YAML/JSON file or the shorthand ``64xh100``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import read_text

ACCELERATOR_DIR = Path(__file__).parent / "data" / "accelerators"
DTYPES = ("fp32", "tf32", "bf16", "fp8")
ATTENTION_KERNELS = ("flash2", "flash3")  # oldest first; ``auto`` picks the newest a file lists


@dataclass(frozen=True)
class NetworkTier:
    """One level of the network, per GPU.

    Attributes:
        name: what it is (``NVLink4 + NVSwitch``).
        gbps: unidirectional bandwidth per GPU in GB/s (1e9 bytes/s).
        latency_us: per-message latency α in microseconds.
        domain: GPUs that share this tier directly (scale-up only; 0 = unbounded).
    """

    name: str
    gbps: float
    latency_us: float
    domain: int = 0

    def __post_init__(self) -> None:
        if self.gbps <= 0 or self.latency_us < 0:
            raise ShardplanError(f"network tier '{self.name}': bandwidth must be > 0 and latency >= 0")


@dataclass(frozen=True)
class Accelerator:
    """An accelerator's spec sheet, every number with its source.

    Attributes:
        name: registry name (lower case).
        kind: ``gpu`` or ``cpu`` (a profile must match it).
        peak_tflops: dense peak per dtype in TFLOP/s (0 = not supported).
        hbm_gb: memory capacity in GB as labelled by the vendor (1e9 bytes).
        hbm_tbps: memory bandwidth in TB/s.
        gpus_per_node: GPUs in one server (compute tray for NVL72).
        scale_up / scale_out: the two network tiers.
        host_link_gbps: device-host bandwidth per direction (PCIe, NVLink-C2C), for offload.
        gemm_efficiency: measured best bf16 GEMM throughput over peak.
        busbw_efficiency: measured large-message ring bus bandwidth over the scale-up spec.
        attention_efficiency: best published forward throughput of each flash-attention kernel
            over the bf16 peak (``flash2``: FlashAttention-2 / PyTorch SDPA's flash backend;
            ``flash3``: Hopper-native kernels, FlashAttention-3 or cuDNN/Transformer Engine fused
            attention). Empty: attention kernels are assumed to reach ``gemm_efficiency``.
        cores_per_node: physical cores a node's ranks share (CPU hosts; 0 = each rank has its own
            device). A profile measured with ``t`` threads per rank then runs at
            ``min(1, cores / (ranks per node · t))`` of its measured speed.
        cost_constants: physics of this device that overrides fitted cost constants (e.g. no
            communication/computation overlap on a CPU, where gloo runs on the compute cores).
        sources: where each group of numbers comes from.
    """

    name: str
    kind: str
    peak_tflops: dict[str, float]
    hbm_gb: float
    hbm_tbps: float
    gpus_per_node: int
    scale_up: NetworkTier
    scale_out: NetworkTier
    host_link_gbps: float
    gemm_efficiency: float
    busbw_efficiency: float
    attention_efficiency: dict[str, float] = field(default_factory=dict)
    cores_per_node: int = 0
    cost_constants: dict[str, float] = field(default_factory=dict)
    vendor: str = ""
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ShardplanError(f"accelerator '{self.name}': kind must be gpu or cpu, got '{self.kind}'")
        missing = [d for d in DTYPES if d not in self.peak_tflops]
        if missing:
            raise ShardplanError(f"accelerator '{self.name}': peak_tflops lacks {missing}")
        if self.hbm_gb <= 0 or self.hbm_tbps <= 0 or self.gpus_per_node <= 0:
            raise ShardplanError(f"accelerator '{self.name}': hbm_gb, hbm_tbps and gpus_per_node must be > 0")
        for f in ("gemm_efficiency", "busbw_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ShardplanError(f"accelerator '{self.name}': {f} must be in (0, 1]")
        for k, v in self.attention_efficiency.items():
            if k not in ATTENTION_KERNELS or not 0 < v <= 1:
                raise ShardplanError(f"accelerator '{self.name}': attention_efficiency needs kernels from "
                                     f"{list(ATTENTION_KERNELS)} with values in (0, 1], got {k}: {v}")

    def attention_kernel(self, kernel: str) -> str:
        """The kernel ``auto`` means here (the newest one the file lists), or ``kernel`` if available."""
        effs = self.attention_efficiency
        if kernel == "auto":
            return next((k for k in reversed(ATTENTION_KERNELS) if k in effs), "flash2")
        if effs and kernel not in effs:
            raise ShardplanError(f"attention kernel '{kernel}' is not available on '{self.name}' "
                                 f"(it has: {', '.join(sorted(effs))})")
        return kernel

    def attention_fraction(self, kernel: str) -> float:
        """Best forward throughput of the attention kernel over the bf16 peak."""
        return self.attention_efficiency.get(self.attention_kernel(kernel), self.gemm_efficiency)

    @property
    def memory_bytes(self) -> float:
        return self.hbm_gb * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for ``dtype``; fp8 falls back to bf16 where unsupported."""
        v = self.peak_tflops.get(dtype, 0.0) or self.peak_tflops["bf16"]
        return v * 1e12

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Accelerator:
        try:
            d = dict(d)
            d["scale_up"] = NetworkTier(**d["scale_up"])
            d["scale_out"] = NetworkTier(**d["scale_out"])
            d["aliases"] = tuple(d.get("aliases", ()))
            d["peak_tflops"] = {k: float(v) for k, v in d["peak_tflops"].items()}
            d["attention_efficiency"] = {k: float(v) for k, v in (d.get("attention_efficiency") or {}).items()}
            d["cost_constants"] = {k: float(v) for k, v in (d.get("cost_constants") or {}).items()}
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise ShardplanError(f"accelerator '{d.get('name', '?')}': bad or missing field: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def _accelerator_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("SHARDPLAN_ACCELERATOR_PATH", "").split(os.pathsep) if p]
    return [ACCELERATOR_DIR, *extra]


@cache
def _load_accelerators(dirs: tuple[Path, ...]) -> dict[str, Accelerator]:
    out: dict[str, Accelerator] = {}
    for d in dirs:
        for path in sorted(d.glob("*.yaml")) + sorted(d.glob("*.json")):
            with path.open() as f:
                data = yaml.safe_load(f)
            acc = Accelerator.from_dict(data)
            out[acc.name] = acc
    return out


def accelerators() -> dict[str, Accelerator]:
    """Every accelerator file found, by name."""
    return _load_accelerators(tuple(_accelerator_dirs()))


def accelerator(name: str) -> Accelerator:
    table = accelerators()
    key = name.strip().lower()
    if key in table:
        return table[key]
    for acc in table.values():
        if key in acc.aliases:
            return acc
    raise UnknownNameError("accelerator", name, list(table) + [a for x in table.values() for a in x.aliases])


@dataclass(frozen=True)
class Cluster:
    """``nodes`` servers of ``gpus_per_node`` accelerators each.

    The scale-up domain may be larger than a node (NVL72); an axis of the device mesh whose
    group fits in the scale-up domain uses that tier, otherwise the scale-out tier.
    """

    accelerator: Accelerator
    nodes: int
    gpus_per_node: int
    memory_gb: float = 0.0  # usable memory per GPU; 0 = the accelerator's capacity

    def __post_init__(self) -> None:
        if self.nodes <= 0 or self.gpus_per_node <= 0:
            raise ShardplanError(f"cluster: nodes ({self.nodes}) and gpus_per_node ({self.gpus_per_node}) must be > 0")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def scale_up_domain(self) -> int:
        dom = self.accelerator.scale_up.domain or self.gpus_per_node
        return max(self.gpus_per_node, min(dom, self.world_size))

    @property
    def memory_bytes(self) -> float:
        return (self.memory_gb or self.accelerator.hbm_gb) * 1e9

    @property
    def name(self) -> str:
        return f"{self.world_size}x{self.accelerator.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator.name, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "world_size": self.world_size,
                "memory_gb": self.memory_gb or self.accelerator.hbm_gb}


_SHORTHAND = re.compile(r"^\s*(\d+)\s*[x×*]\s*([A-Za-z0-9._-]+)\s*$")


def parse_cluster(spec: str | dict[str, Any] | Cluster, gpus_per_node: int | None = None) -> Cluster:
    """``64xh100`` / ``4xcpu``, a YAML/JSON file path, or a dict with ``accelerator`` and sizes."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, dict):
        return _cluster_from_dict(spec)
    m = _SHORTHAND.match(spec)
    if m:
        total, acc = int(m.group(1)), accelerator(m.group(2))
        if total <= 0 or (gpus_per_node is not None and gpus_per_node <= 0):
            raise ShardplanError(f"cluster '{spec}': the GPU count and GPUs per node must be positive")
        per = gpus_per_node or min(acc.gpus_per_node, total)
        if total % per:
            raise ShardplanError(f"cluster '{spec}': {total} GPUs is not a multiple of {per} GPUs per node")
        return Cluster(acc, total // per, per)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        text = read_text(path, "cluster file")
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ShardplanError(f"cluster file '{spec}' is not valid {path.suffix[1:].upper()}: {e}") from None
        if not isinstance(data, dict):
            raise ShardplanError(f"cluster file '{spec}' must hold a mapping")
        return _cluster_from_dict(data)
    raise ShardplanError(f"cluster '{spec}': expected 'N x accelerator' like 64xh100, or a YAML/JSON file")


def _cluster_from_dict(d: dict[str, Any]) -> Cluster:
    if "accelerator" not in d:
        raise ShardplanError("cluster: missing field 'accelerator'")
    acc = d["accelerator"]
    acc = Accelerator.from_dict(acc) if isinstance(acc, dict) else accelerator(str(acc))
    per = int(d.get("gpus_per_node", acc.gpus_per_node))
    if "nodes" in d:
        nodes = int(d["nodes"])
    elif "gpus" in d:
        if int(d["gpus"]) % per:
            raise ShardplanError(f"cluster: {d['gpus']} GPUs is not a multiple of {per} GPUs per node")
        nodes = int(d["gpus"]) // per
    else:
        raise ShardplanError("cluster: give 'nodes' or 'gpus'")
    overrides = {k: d[k] for k in ("scale_up", "scale_out") if k in d}
    if overrides:  # a cluster file may describe its own network
        base = acc.to_dict()
        for k, v in overrides.items():
            base[k] = {**base[k], **v}
        acc = Accelerator.from_dict(base)
    return Cluster(acc, nodes, per, float(d.get("memory_gb", 0.0)))
