"""Accelerators and clusters as data.

One YAML file per accelerator in ``profiler/data/accelerators`` (adding a GPU is adding a file;
``SHARDPLAN_ACCELERATOR_PATH`` adds more folders). A cluster is nodes × GPUs per node of one
accelerator, with two network tiers: the scale-up domain (NVLink/xGMI) and scale-out
(InfiniBand/RoCE/EFA). Clusters come from a YAML/JSON file or the shorthand ``64xh100``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, model_validator

from profiler.model_config import describe_fields, shown
from vocab.errors import ShardplanError, UnknownNameError
from vocab.io import decode_json, decode_yaml, read_text
from vocab.limits import MAX_GPUS
from vocab.strategy import FP8_PRECISIONS

ACCELERATOR_DIR = Path(__file__).parent / "data" / "accelerators"
DTYPES = ("fp32", "tf32", "bf16", "fp8")
ATTENTION_KERNELS = ("flash2", "flash3")  # oldest first; ``auto`` picks the newest a file lists
_log = logging.getLogger(__name__)

# The supported ranges of accelerator and cluster numbers: far above any device or cluster built,
# small enough that every derived quantity stays finite.
#: GPUs in a cluster (``vocab.strategy.MAX_GPUS``, as in plans), nodes and GPUs per node within it
MAX_WORLD_SIZE = MAX_GPUS
#: memory per device, GB
MAX_HBM_GB = 1_000_000.0
#: dense peak per dtype, TFLOP/s
MAX_TFLOPS = 1_000_000.0
#: memory bandwidth, TB/s
MAX_HBM_TBPS = 1_000.0
#: network and host-link bandwidth per GPU, GB/s
MAX_LINK_GBPS = 1_000_000.0
#: per-message latency, microseconds (one second)
MAX_LATENCY_US = 1_000_000.0
#: a cost constant's value (overlap fractions, byte counts, passes)
MAX_COST_CONSTANT = 1e18
#: the fraction of a GPU's memory a plan leaves free by default: workspaces the cost model does not
#: price (NCCL's NVLS and proxy buffers, cuBLAS and attention workspaces, a trainer's communication
#: buffers such as Megatron's TP-overlap userbuffers) and allocator slack beyond the modelled
#: fragmentation. A policy, not a measurement: ``shardplan plan --reserve`` changes it.
DEFAULT_RESERVE = 0.05
#: the largest reserve accepted
MAX_RESERVE = 0.9
#: host memory per node, GB
MAX_HOST_GB = 1_000_000_000.0
#: the fraction of a node's host memory offloaded states leave to everything else: the OS and page
#: cache, the data loader's workers and the trainer's pinned staging buffers. A policy, not a
#: measurement (as :data:`DEFAULT_RESERVE` is for the GPU).
HOST_RESERVE = 0.10

Fraction = Annotated[float, Field(gt=0.0, le=1.0)]
Count = Annotated[int, Field(gt=0, le=MAX_WORLD_SIZE)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _TierDoc(_Strict):
    name: StrictStr
    gbps: Annotated[float, Field(gt=0.0, le=MAX_LINK_GBPS)]
    latency_us: Annotated[float, Field(ge=0.0, le=MAX_LATENCY_US)]
    domain: Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE)] = 0
    topology: Literal["switch", "mesh"] = "switch"


class _TierPatch(_Strict):
    """Part of a network tier a cluster file overrides (checked in full once merged)."""

    name: Any = None
    gbps: Any = None
    latency_us: Any = None
    domain: Any = None
    topology: Any = None


class _AcceleratorDoc(_Strict):
    """An accelerator file: every size and rate finite and positive, efficiencies in (0, 1]."""

    name: Annotated[str, Field(min_length=1)]
    kind: Literal["gpu", "cpu"]
    peak_tflops: dict[StrictStr, Annotated[float, Field(ge=0.0, le=MAX_TFLOPS)]]
    hbm_gb: Annotated[float, Field(gt=0.0, le=MAX_HBM_GB)]
    memory_reported_mib: Annotated[float, Field(ge=0.0, le=MAX_HBM_GB * 1e9 / 2**20)] = 0.0
    hbm_tbps: Annotated[float, Field(gt=0.0, le=MAX_HBM_TBPS)]
    gpus_per_node: Count
    scale_up: _TierDoc
    scale_out: _TierDoc
    host_link_gbps: Annotated[float, Field(gt=0.0, le=MAX_LINK_GBPS)]
    host_memory_gb: Annotated[float, Field(ge=0.0, le=MAX_HOST_GB)] = 0.0
    gemm_efficiency: Fraction
    busbw_efficiency: Fraction
    attention_efficiency: dict[Literal["flash2", "flash3"], Fraction] | None = None
    cores_per_node: Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE)] = 0
    cost_constants: dict[StrictStr, Annotated[float, Field(ge=0.0, le=MAX_COST_CONSTANT)]] | None = None
    mx_formats: StrictBool = False
    vendor: StrictStr = ""
    aliases: list[StrictStr] = []
    sources: dict[StrictStr, StrictStr] = {}

    @model_validator(mode="after")
    def _dtypes(self) -> _AcceleratorDoc:
        missing = [d for d in DTYPES if d not in self.peak_tflops]
        if missing:
            raise ValueError(f"peak_tflops lacks {missing}")
        if self.peak_tflops["bf16"] <= 0:
            raise ValueError("peak_tflops.bf16 must be > 0 (other dtypes fall back to it)")
        return self


@dataclass(frozen=True)
class NetworkTier:
    """One level of the network, per GPU.

    Attributes:
        name: what it is (``NVLink4 + NVSwitch``).
        gbps: unidirectional bandwidth per GPU in GB/s (1e9 bytes/s).
        latency_us: per-message latency α in microseconds.
        domain: GPUs that share this tier directly (scale-up only; 0 = unbounded).
        topology: ``switch`` (every GPU's bandwidth reaches any peer through a switch: NVSwitch)
            or ``mesh`` (a link to each other GPU of the domain, ``gbps`` over all of them: AMD's
            Infinity Fabric); a group of ``k`` ranks of a mesh domain of ``d`` uses ``k - 1`` of
            each GPU's ``d - 1`` links.
    """

    name: str
    gbps: float
    latency_us: float
    domain: int = 0
    topology: str = "switch"

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
        memory_reported_mib: the memory the driver reports per device (``nvidia-smi``'s total, MiB);
            0 = not recorded, and the vendor's label read as 1e9-byte GB stands for it (a lower bound).
        hbm_tbps: memory bandwidth in TB/s.
        gpus_per_node: GPUs in one server (compute tray for NVL72).
        scale_up / scale_out: the two network tiers.
        host_link_gbps: device-host bandwidth per direction (PCIe, NVLink-C2C), for offload.
        host_memory_gb: host memory (DRAM) of one node of ``gpus_per_node`` GPUs, in 1e9-byte GB
            (the reference server's: DGX, NVL72 compute tray); offloaded states must fit in it
            (:attr:`Cluster.host_bytes_per_node`). 0 = not recorded, and offload is not bounded.
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
        mx_formats: its tensor cores run the OCP Microscaling (MX) formats, block-scaled fp8 (MXFP8:
            E4M3 values, one 8-bit exponent scale per 32) at the fp8 rate (Blackwell); False: a
            precision ``mxfp8`` is refused on it.
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
    memory_reported_mib: float = 0.0
    host_memory_gb: float = 0.0
    mx_formats: bool = False
    vendor: str = ""
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ShardplanError(f"accelerator '{self.name}': kind must be gpu or cpu, got {shown(self.kind)}")
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
        """Bytes of one device: what the driver reports, else the vendor's label as 1e9-byte GB."""
        return self.memory_reported_mib * 2**20 if self.memory_reported_mib else self.hbm_gb * 1e9

    def precision_problem(self, precision: str) -> str | None:
        """Why this accelerator cannot train in ``precision`` (one line), or None: ``mxfp8`` needs
        tensor cores that run the MX formats (:attr:`mx_formats`)."""
        if precision == "mxfp8" and not self.mx_formats:
            return (f"mxfp8: {self.name} has no MX (block-scaled fp8) tensor cores (its accelerator file does not "
                    "set mx_formats: true); use --precision fp8 or bf16")
        return None

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for ``dtype``; fp8 falls back to bf16 where unsupported. ``mxfp8`` is
        fp8 at the fp8 peak (block-scaled tensor cores run it at the fp8 rate)."""
        v = self.peak_tflops.get("fp8" if dtype in FP8_PRECISIONS else dtype, 0.0) or self.peak_tflops["bf16"]
        return v * 1e12

    @classmethod
    def from_dict(cls, d: dict[str, Any], origin: str = "") -> Accelerator:
        """An accelerator from the fields of its file (``origin`` names the file in errors):
        each field's type and range checked, then the values kept as written."""
        name = d.get("name") if isinstance(d, dict) and isinstance(d.get("name"), str) else "?"
        where = origin or f"accelerator '{name}'"
        if not isinstance(d, dict):
            raise ShardplanError(f"{where}: expected a mapping of fields, got {type(d).__name__}")
        try:
            _AcceleratorDoc.model_validate(d)
        except ValidationError as e:
            raise ShardplanError(f"{where}: {describe_fields(e)}") from None
        d = dict(d)
        d["scale_up"] = NetworkTier(**d["scale_up"])
        d["scale_out"] = NetworkTier(**d["scale_out"])
        d["aliases"] = tuple(d.get("aliases", ()))
        d["peak_tflops"] = {k: float(v) for k, v in d["peak_tflops"].items()}
        d["attention_efficiency"] = {k: float(v) for k, v in (d.get("attention_efficiency") or {}).items()}
        d["cost_constants"] = {k: float(v) for k, v in (d.get("cost_constants") or {}).items()}
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def _accelerator_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("SHARDPLAN_ACCELERATOR_PATH", "").split(os.pathsep) if p]
    return [ACCELERATOR_DIR, *extra]


def _read_document(path: Path, what: str) -> Any:
    """The YAML (or, for ``.json``, JSON) document of the ``what`` file at ``path``."""
    text = read_text(path, what)
    origin = f"{what} '{path}'"
    return decode_json(text, origin) if path.suffix == ".json" else decode_yaml(text, origin)


def _load_file(path: Path) -> Accelerator:
    return Accelerator.from_dict(_read_document(path, "accelerator file"), f"accelerator file '{path}'")


def _names_of(path: Path) -> set[str]:
    """Every name a (broken) accelerator file may have been asked by: its stem, and the name and
    aliases it declares when it can be read that far."""
    names = {path.stem.lower()}
    try:
        data = _read_document(path, "accelerator file")
    except ShardplanError:
        return names
    if isinstance(data, dict):
        aliases = data.get("aliases")
        declared = [data.get("name"), *(aliases if isinstance(aliases, list) else [])]
        names |= {n.strip().lower() for n in declared if isinstance(n, str)}
    return names


@cache
def _load_accelerators(dirs: tuple[Path, ...]) -> tuple[dict[str, Accelerator], dict[str, ShardplanError], list[str]]:
    """The accelerators in ``dirs`` by name, the errors of the broken files of the extra folders by
    every name they may be asked by (the shipped folder must load: its errors raise), and what was
    skipped."""
    out: dict[str, Accelerator] = {}
    broken: dict[str, ShardplanError] = {}
    problems: list[str] = []
    for i, d in enumerate(dirs):
        try:
            if i and not d.is_dir():
                raise NotADirectoryError(0, "not a folder")
            paths = sorted(d.glob("*.yaml")) + sorted(d.glob("*.json"))
        except (OSError, ValueError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            problems.append(f"cannot list '{d}': {reason}")
            continue
        for path in paths:
            if i == 0:
                acc = _load_file(path)
            else:
                try:
                    acc = _load_file(path)
                except ShardplanError as e:
                    problems.append(str(e))
                    for n in _names_of(path):
                        broken.setdefault(n, e)
                    continue
            out[acc.name] = acc
    return out, broken, problems


def accelerators(warn: bool = True) -> dict[str, Accelerator]:
    """Every accelerator file found, by name. Broken files of ``SHARDPLAN_ACCELERATOR_PATH`` are
    skipped, with one warning each when ``warn`` (a listing; a command that uses one accelerator
    stays quiet about files it does not use, and asking for a broken one raises its error)."""
    table, _, problems = _load_accelerators(tuple(_accelerator_dirs()))
    if warn:
        for p in problems:
            _log.warning("warning: SHARDPLAN_ACCELERATOR_PATH: %s; skipped", p)
    return table


def accelerator(name: str) -> Accelerator:
    """The accelerator called ``name`` or one of its aliases; a broken file of that name raises
    its error."""
    if not isinstance(name, str):
        raise ShardplanError(f"accelerator name must be a string, got {type(name).__name__}")
    table, broken, _ = _load_accelerators(tuple(_accelerator_dirs()))
    key = name.strip().lower()
    if key in table:
        return table[key]
    for acc in table.values():
        if key in acc.aliases:
            return acc
    if key in broken:
        raise ShardplanError(str(broken[key]))
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
    memory_gb: float = 0.0  # memory per GPU in 1e9 bytes; 0 = the accelerator's (``Accelerator.memory_bytes``)
    reserve: float = DEFAULT_RESERVE  # the fraction of it no plan may use

    def __post_init__(self) -> None:
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int | float) or not (
                0 <= self.reserve <= MAX_RESERVE):
            raise ShardplanError(f"cluster: the memory reserve must be a fraction in 0..{MAX_RESERVE}, got "
                                 f"{shown(self.reserve)}")
        for f in ("nodes", "gpus_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_WORLD_SIZE:
                raise ShardplanError(f"cluster: {f} must be an integer in 1..{MAX_WORLD_SIZE:,}, got {shown(v)}")
        if self.nodes * self.gpus_per_node > MAX_WORLD_SIZE:
            raise ShardplanError(f"cluster: {self.nodes * self.gpus_per_node:,} GPUs ({self.nodes:,} nodes x "
                                 f"{self.gpus_per_node:,}) is over the supported {MAX_WORLD_SIZE:,}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def scale_up_domain(self) -> int:
        dom = self.accelerator.scale_up.domain or self.gpus_per_node
        return max(self.gpus_per_node, min(dom, self.world_size))

    @property
    def device_bytes(self) -> float:
        """Bytes of one GPU: the cluster's ``memory_gb``, else what the accelerator reports."""
        return self.memory_gb * 1e9 if self.memory_gb else self.accelerator.memory_bytes

    @property
    def host_bytes_per_node(self) -> float:
        """Host bytes offloaded states may use on one node: the accelerator's server memory, per GPU
        times this cluster's GPUs per node, less :data:`HOST_RESERVE`; 0 when not recorded."""
        acc = self.accelerator
        return acc.host_memory_gb * 1e9 / acc.gpus_per_node * self.gpus_per_node * (1 - HOST_RESERVE)

    @property
    def memory_bytes(self) -> float:
        """Bytes a plan may use per GPU by default: the device less the :data:`DEFAULT_RESERVE`
        (or the cluster's ``reserve``) kept for what the cost model does not price."""
        return self.device_bytes * (1 - self.reserve)

    @property
    def name(self) -> str:
        return f"{self.world_size}x{self.accelerator.name}"

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator.name, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "world_size": self.world_size,
                "memory_gb": self.device_bytes / 1e9}


#: ``64xh100`` or ``64 x h100``: a count of GPUs in ASCII digits, ``x`` (or ``×``, ``*``) with as many
#: blanks before as after it, an accelerator (``4 xcpu`` is no cluster)
_SHORTHAND = re.compile(r"^[ \t]*([0-9]+)( *)[x×*]\2([A-Za-z0-9._-]+)[ \t]*$")


class _ClusterDoc(_Strict):
    """A cluster file or dict: an accelerator (a name, or its fields) and the sizes."""

    accelerator: Any
    nodes: Count | None = None
    gpus: Count | None = None
    gpus_per_node: Count | None = None
    world_size: Count | None = None
    memory_gb: Annotated[float, Field(ge=0.0, le=MAX_HBM_GB)] = 0.0
    scale_up: _TierPatch | None = None
    scale_out: _TierPatch | None = None


def _exists(spec: str) -> bool:
    try:
        return os.path.exists(spec)
    except (OSError, ValueError):  # a NUL byte, a name too long
        return False


def names_cluster_file(spec: str) -> bool:
    """Whether :func:`parse_cluster` reads the string ``spec`` from a file (not ``64xh100``)."""
    return _SHORTHAND.match(spec) is None and (Path(spec).suffix in (".yaml", ".yml", ".json") or _exists(spec))


def parse_cluster(spec: str | dict[str, Any] | Cluster, gpus_per_node: int | None = None) -> Cluster:
    """``64xh100`` / ``4xcpu``, a YAML/JSON file path, or a dict with ``accelerator`` and sizes.

    At most :data:`MAX_WORLD_SIZE` GPUs; counts are integers (``4.5``, ``"4"`` and ``true`` are
    refused, not coerced)."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, dict):
        return _cluster_from_dict(spec, "cluster")
    if not isinstance(spec, str):
        raise ShardplanError(f"cluster must be 'N x accelerator', a file or a mapping, got {type(spec).__name__}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool)
                                      or not 0 < gpus_per_node <= MAX_WORLD_SIZE):
        raise ShardplanError(f"cluster '{spec}': GPUs per node must be in 1..{MAX_WORLD_SIZE:,}, "
                             f"got {shown(gpus_per_node)}")
    m = _SHORTHAND.match(spec)
    if m:
        digits = m.group(1)
        total = int(digits) if len(digits) <= 18 else MAX_WORLD_SIZE + 1
        if total <= 0:
            raise ShardplanError(f"cluster '{spec}': the GPU count and GPUs per node must be positive")
        if total > MAX_WORLD_SIZE:
            count = f"{total:,}" if len(digits) <= 18 else f"{digits[:12]}... ({len(digits)} digits)"
            raise ShardplanError(f"cluster '{spec}': {count} GPUs is over the supported {MAX_WORLD_SIZE:,}")
        acc = accelerator(m.group(3))
        per = gpus_per_node or min(acc.gpus_per_node, total)
        if total % per:
            raise ShardplanError(f"cluster '{spec}': {total} GPUs is not a multiple of {per} GPUs per node")
        return Cluster(acc, total // per, per)
    path = Path(spec)
    if names_cluster_file(spec):
        where = f"cluster file '{spec}'"
        text = read_text(path, "cluster file")
        data = decode_json(text, where) if path.suffix == ".json" else decode_yaml(text, where)
        if not isinstance(data, dict):
            raise ShardplanError(f"{where} must hold a mapping, got {type(data).__name__}")
        return _cluster_from_dict(data, where)
    raise ShardplanError(f"cluster '{spec}': expected 'N x accelerator' like 64xh100 or 64 x h100 (N in ASCII "
                         "digits), or a YAML/JSON file")


def _cluster_from_dict(d: dict[str, Any], where: str) -> Cluster:
    """The cluster a mapping describes; errors start with ``where`` (the file, or ``cluster``)."""
    if "accelerator" not in d:
        raise ShardplanError(f"{where}: missing field 'accelerator'")
    try:
        doc = _ClusterDoc.model_validate(d)
    except ValidationError as e:
        raise ShardplanError(f"{where}: {describe_fields(e)}") from None
    acc = doc.accelerator
    if isinstance(acc, dict):
        acc = Accelerator.from_dict(acc, f"{where}: accelerator")
    elif isinstance(acc, str):
        acc = accelerator(acc)
    else:
        raise ShardplanError(f"{where}: accelerator must be a name or a mapping of fields, got {type(acc).__name__}")
    per = doc.gpus_per_node if doc.gpus_per_node is not None else acc.gpus_per_node
    if doc.nodes is not None:
        nodes = doc.nodes
        if doc.gpus is not None and doc.gpus != nodes * per:
            raise ShardplanError(f"{where}: gpus {doc.gpus} is not nodes x gpus_per_node ({nodes} x {per})")
    elif doc.gpus is not None:
        if doc.gpus % per:
            raise ShardplanError(f"{where}: {doc.gpus} GPUs is not a multiple of {per} GPUs per node")
        nodes = doc.gpus // per
    else:
        raise ShardplanError(f"{where}: give 'nodes' or 'gpus'")
    if nodes * per > MAX_WORLD_SIZE:
        raise ShardplanError(f"{where}: {nodes * per:,} GPUs ({nodes:,} nodes x {per:,}) is over the supported "
                             f"{MAX_WORLD_SIZE:,}")
    if doc.world_size is not None and doc.world_size != nodes * per:
        raise ShardplanError(f"{where}: world_size {doc.world_size} is not nodes x gpus_per_node ({nodes} x {per})")
    overrides = {k: d[k] for k in ("scale_up", "scale_out") if d.get(k) is not None}
    if overrides:  # a cluster file may describe its own network
        base = acc.to_dict()
        for k, v in overrides.items():
            base[k] = {**base[k], **v}
        acc = Accelerator.from_dict(base, where)
    return Cluster(acc, nodes, per, float(d.get("memory_gb", 0.0)))
