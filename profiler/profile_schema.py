"""The profile document: what ``shardplan profile`` measured on one device, versioned JSON.

A profile names the device and software it was measured with and holds every measured curve:

* ``compute``: forward and backward time of GEMMs over (m, n, k) shapes, of scaled-dot-product
  attention, and of the bandwidth-bound operators (norm, softmax, activation, elementwise,
  embedding, cross-entropy), on one device in one dtype;
* ``comm``: one α-β fit per collective and group size, with the points it was fitted to;
* ``model``: per-layer forward/backward time and saved-activation bytes of a few real layers of
  a model, beside the cost model's prediction for the same layers.

The cost model reads it through :meth:`Profile.gemm_flops_per_s`,
:meth:`Profile.attention_flops_per_s`, :meth:`Profile.bytes_per_s` and
:meth:`Profile.comm_alpha_beta`. ``profiler/profile.schema.json`` is generated from these models
(``python -m profiler.profile_schema``) and a test keeps it in step. Reading a file that is
truncated, of another schema version or with a bad field raises :class:`ProfileError` (a
:class:`~vocab.errors.ShardplanError`) naming the file, the field and the reason.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from vocab.errors import ShardplanError, shown
from vocab.io import canonical_json, decode_json, document_schema, read_text, validate_document, write_atomic

SCHEMA_VERSION = "1.0"
SCHEMA_PATH = Path(__file__).parent / "profile.schema.json"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
BW_OPS = ("norm", "softmax", "activation", "elementwise", "embedding", "cross_entropy", "optimizer")
#: Other names the cost model may ask by (layer-graph kinds, common spellings).
_BW_ALIASES = {"loss": "cross_entropy", "dropout": "elementwise", "layernorm": "norm", "rmsnorm": "norm",
               "add": "elementwise", "gelu": "activation", "silu": "activation", "swiglu": "activation"}
_COMM_ALIASES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                 "alltoall": "all_to_all", "all2all": "all_to_all", "p2p": "send_recv", "send": "send_recv",
                 "recv": "send_recv", "sendrecv": "send_recv"}


#: bandwidth entries that are not a tensor op with a backward (the optimizer step)
NOT_TENSOR_OPS = ("optimizer",)
#: bytes an Adam step moves per parameter as the cost model counts them (fp32 master weight and
#: two moments read and written, the gradient read, the compute copy written); the profiled step's
#: ``bytes_per_s`` is over this many bytes per parameter
ADAM_BYTES_PER_PARAM = 36


class ProfileError(ShardplanError):
    """A profile document that cannot be read, does not validate, or does not fit the request."""


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # measured numbers are finite


class DeviceInfo(_Doc):
    """Where and with what the profile was measured."""

    kind: Literal["cpu", "gpu"]
    name: str = Field(..., description="CPU model or CUDA device name")
    torch_version: str
    cuda_version: str | None = None
    threads: int = Field(..., ge=1, description="torch intra-op threads (CPU) or CPU threads of the host")
    hostname: str
    created: str = Field(..., description="ISO 8601 time the measurement finished")
    index: int | None = Field(None, description="CUDA device index, None on CPU")
    accelerator: str | None = Field(None, description="accelerator file this device matches, if known")
    load_before: float | None = Field(None, ge=0, description="1-minute load average of the host when the "
                                      "measurement started (busy hosts inflate CPU timings)")


class GemmPoint(_Doc):
    """``y[m, n] = x[m, k] @ w[n, k]^T`` forward; backward computes dx and dw (2× the FLOPs).

    ``flops`` is the forward count 2·m·n·k; ``flops_per_s`` is the training throughput
    ``3·flops / (fwd_s + bwd_s)``.
    """

    m: int = Field(..., ge=1)
    n: int = Field(..., ge=1)
    k: int = Field(..., ge=1)
    fwd_s: float = Field(..., gt=0)
    bwd_s: float = Field(..., gt=0)
    flops: float = Field(..., gt=0)
    flops_per_s: float = Field(..., gt=0)
    spread: float = Field(0.0, ge=0, description="relative interquartile range of fwd+bwd repeats")
    tag: str = Field("", description="where the shape comes from (square, qkv/tp4, ...)")


class AttnPoint(_Doc):
    """SDPA on (batch, heads, seq, head_dim); ``flops`` = 4·b·h·s²·d in full even when causal;
    ``flops_per_s`` = ``3·flops / (fwd_s + bwd_s)``."""

    batch: int = Field(..., ge=1)
    heads: int = Field(..., ge=1)
    seq: int = Field(..., ge=1)
    head_dim: int = Field(..., ge=1)
    causal: bool
    fwd_s: float = Field(..., gt=0)
    bwd_s: float = Field(..., gt=0)
    flops: float = Field(..., gt=0)
    flops_per_s: float = Field(..., gt=0)
    spread: float = Field(0.0, ge=0)


class BwPoint(_Doc):
    """A bandwidth-bound operator: ``bytes`` moved in forward (read + written), forward ``seconds``."""

    bytes: float = Field(..., gt=0)
    seconds: float = Field(..., gt=0)
    bytes_per_s: float = Field(..., gt=0)
    bwd_s: float | None = Field(None, gt=0, description="backward seconds, when measured")
    variant: str = Field("", description="layernorm/rmsnorm, gelu/swiglu, add, ...")
    shape: list[int] = Field(default_factory=list)
    spread: float = Field(0.0, ge=0)


class DTensorOverhead(_Doc):
    """Host seconds DTensor tensor parallelism adds per module call beyond the plain module's,
    forward and backward, measured on a one-rank mesh (``profiler/measure_dtensor.py``): a column-
    or row-parallel linear (or vocabulary-parallel embedding), a sequence-parallel norm, the
    vocabulary-parallel loss; and that loss's device time per logit over plain cross-entropy's."""

    linear_fwd_s: float = Field(..., ge=0)
    linear_bwd_s: float = Field(..., ge=0)
    norm_fwd_s: float = Field(..., ge=0)
    norm_bwd_s: float = Field(..., ge=0)
    loss_fwd_s: float = Field(..., ge=0)
    loss_bwd_s: float = Field(..., ge=0)
    loss_traffic_ratio: float = Field(1.0, ge=1, description="loss_parallel cross-entropy's time per logit "
                                      "over F.cross_entropy's (its decomposed passes)")

    def host(self, role: str) -> tuple[float, float]:
        """(forward, backward) seconds of one module of ``role``: linear, norm or loss."""
        return getattr(self, f"{role}_fwd_s"), getattr(self, f"{role}_bwd_s")


class ComputeProfile(_Doc):
    dtype: str = Field(..., description="bf16, fp16 or fp32")
    gemm: list[GemmPoint] = Field(default_factory=list)
    attention: list[AttnPoint] = Field(default_factory=list)
    bandwidth: dict[Literal["norm", "softmax", "activation", "elementwise", "embedding", "cross_entropy", "optimizer"],
                    list[BwPoint]] = Field(default_factory=dict)
    wall_s: float = Field(0.0, ge=0, description="time the sweep took")
    skipped: int = Field(0, ge=0, description="grid points left out to keep the time limit (busy host)")
    dtensor: DTensorOverhead | None = Field(None, description="DTensor TP's host overhead (None: not measured)")


class CommFit(_Doc):
    """``time(bytes) = alpha_s + beta_s_per_byte · bytes`` for one collective at one group size.

    ``bytes`` is the full tensor in the nccl-tests convention: the reduced tensor (all_reduce),
    the gathered output (all_gather), the input before scattering (reduce_scatter), each rank's
    buffer (all_to_all), the message (send_recv, one way: half a ping-pong).
    """

    collective: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
    world: int = Field(..., ge=1)
    backend: str
    alpha_s: float = Field(..., ge=0)
    beta_s_per_byte: float = Field(..., ge=0)
    median_rel_error: float = Field(..., ge=0)
    stat: Literal["median", "min"] = Field("median", description="statistic of the repeats fitted")
    points: list[tuple[float, float]] = Field(..., min_length=1, description="(bytes, seconds)")
    min_points: list[tuple[float, float]] = Field(default_factory=list, description="(bytes, min seconds)")
    wait_s: float = Field(0.0, ge=0, description=(
        "seconds a collective adds to a rank's step beyond alpha + beta*bytes when every rank computes "
        "between collectives (the partner's skew on time-shared cores); measured under load, 0 if not"))
    sharing_efficiency: float = Field(1.0, ge=0.01, le=2, description=(
        "the fraction of its fair share of the cores (cores / ranks) a rank's compute got while every "
        "rank of the run computed at once: lone time over loaded time of a small MLP's forward and "
        "backward, divided by the fair share; 1 where cores were not shared or it was not measured"))

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


class LayerMeasurement(_Doc):
    model: str
    layer: str = Field(..., description="layer-graph node name (layers.0.attn.qkv) or a block (layers.0)")
    micro_batch: int = Field(..., ge=1)
    seq_len: int = Field(..., ge=1)
    fwd_s: float = Field(..., ge=0)
    bwd_s: float = Field(..., ge=0)
    saved_bytes: float = Field(..., ge=0, description="bytes kept for backward, parameters excluded")
    predicted_fwd_s: float | None = None
    predicted_bwd_s: float | None = None
    predicted_saved_bytes: float | None = None
    kind: str = Field("", description="layer-graph node kind, 'block' for a whole block")
    dtype: str = ""
    allocated_bytes: float | None = Field(None, description="CUDA only: memory the forward left allocated "
                                          "(saved tensors and the output), from torch.cuda.memory_allocated")


class Profile(_Doc):
    schema_version: Literal["1.0"] = SCHEMA_VERSION
    kind: Literal["shardplan-profile"] = "shardplan-profile"
    device: DeviceInfo
    compute: ComputeProfile | None = None
    comm: list[CommFit] = Field(default_factory=list)
    model: list[LayerMeasurement] = Field(default_factory=list)

    # ---- what the cost model asks ------------------------------------------------------------
    def gemm_flops_per_s(self, flops: float, phase: Literal["both", "fwd", "bwd"] = "both",
                         shape: tuple[float, float, float] | None = None) -> float:
        """Achieved GEMM throughput for a GEMM of ``flops`` forward FLOPs (2·m·n·k).

        Without ``shape``: median throughput of the points of each size, piecewise linear in
        log(flops), clamped at the ends. With ``shape`` (m, n, k): the measured shapes nearest in
        (log m, log n, log k) — a thin GEMM (few tokens, a TP-shrunk n or k) is slower than a
        square one of equal FLOPs — their log throughputs weighted by inverse squared distance.
        ``phase`` picks forward (``flops/fwd_s``), backward (``2·flops/bwd_s``) or the training
        throughput of both (default, ``flops_per_s``).
        """
        pts = self._compute("gemm").gemm
        if not pts:
            raise ProfileError("profile has no GEMM measurements")
        rates = _rates(pts, phase)
        if shape is None or min(shape) <= 0:
            return _interp_log(rates, flops)
        return _nearest_shapes([(p.m, p.n, p.k) for p in pts], [r for _, r in rates], shape)

    def attention_flops_per_s(self, flops: float, causal: bool = False,
                              phase: Literal["both", "fwd", "bwd"] = "both") -> float:
        """Achieved SDPA throughput (full 4·b·h·s²·d FLOPs) at ``flops``, as for GEMMs.

        The default reads the non-causal points (a cost model that halves causal time wants
        those); ``causal=True`` reads the causal points, whose throughput counts the full FLOPs
        in a time that already skips the masked half. Falls back to all points when the asked
        kind was not measured.
        """
        pts = self._compute("attention").attention
        if not pts:
            raise ProfileError("profile has no attention measurements")
        sel = [p for p in pts if p.causal == causal] or pts
        return _interp_log(_rates(sel, phase), flops)

    def bytes_per_s(self, op: str, variant: str | None = None) -> float:
        """Large-size achieved bandwidth of ``op`` (median over the larger half of its points);
        an op that was not measured gets the median of the measured ops. ``variant`` narrows an
        op to one implementation (``layernorm``/``rmsnorm``, ``gelu``/``swiglu``) when measured."""
        bw = self._compute("bandwidth").bandwidth
        per_op = {k: _large_bw(v) for k, v in bw.items() if v}
        if not per_op:
            raise ProfileError("profile has no bandwidth measurements")
        key = _BW_ALIASES.get(op, op)
        variant = variant or (op if op != key else None)  # ``dropout`` is the elementwise variant
        if key in per_op:
            sel = [p for p in bw[key] if p.variant == variant] if variant else []
            return _large_bw(sel) if sel else per_op[key]
        tensor_ops = [v for k, v in per_op.items() if k not in NOT_TENSOR_OPS]
        if key == "optimizer" and "elementwise" in per_op:  # older profiles: the step streams like an add
            return per_op["elementwise"]
        return statistics.median(tensor_ops or per_op.values())

    def bwd_fwd_ratio(self, op: str) -> float:
        """Backward over forward time of a bandwidth-bound op at large sizes (2.0 if unmeasured)."""
        bw = self._compute("bandwidth").bandwidth
        key = _BW_ALIASES.get(op, op)
        pts = bw.get(key) or [p for k, v in bw.items() if k not in NOT_TENSOR_OPS for p in v]
        if op != key:
            pts = [p for p in pts if p.variant == op] or pts
        ratios = [p.bwd_s / p.seconds for p in _upper_half(pts) if p.bwd_s]
        return statistics.median(ratios) if ratios else 2.0

    def embedding_backward(self) -> tuple[float, float] | None:
        """(seconds per forward byte, seconds per byte of the table) of an embedding's backward,
        fitted to the measured points: PyTorch's dense backward zeroes a gradient of the whole
        table and then adds each looked-up row's gradient, so its time is a part proportional to
        the lookups and one to the table (``bwd = a·bytes + b·table``, both ≥ 0). ``None``
        without two points of different lookup sizes (the ratio to the forward stands in)."""
        pts = [p for p in self._compute("bandwidth").bandwidth.get("embedding", []) if p.bwd_s and len(p.shape) == 3]
        if len({p.bytes for p in pts}) < 2:
            return None
        es = {"fp32": 4, "bf16": 2, "fp16": 2}.get(self._compute("dtype").dtype, 4)
        x = np.array([[p.bytes, p.shape[1] * p.shape[2] * es] for p in pts], dtype=float)
        y = np.array([p.bwd_s for p in pts], dtype=float)
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        if a < 0:  # the lookups cost nothing measurable: all of it is the table
            a, b = 0.0, float(np.linalg.lstsq(x[:, 1:], y, rcond=None)[0][0])
        elif b < 0:
            a, b = float(np.linalg.lstsq(x[:, :1], y, rcond=None)[0][0]), 0.0
        return float(a), float(b)

    def comm_alpha_beta(self, collective: str, world: int | None = None) -> tuple[float, float]:
        """(alpha seconds, beta seconds per byte) of ``collective`` from the fit with the nearest
        group size (the largest measured one when ``world`` is None)."""
        best = self.comm_fit(collective, world)
        return best.alpha_s, best.beta_s_per_byte

    def comm_fit(self, collective: str, world: int | None = None) -> CommFit:
        """The fit of ``collective`` with the nearest group size (see :meth:`comm_alpha_beta`)."""
        name = _COMM_ALIASES.get(collective.lower().replace("-", "_"), collective.lower().replace("-", "_"))
        fits = [f for f in self.comm if f.collective == name]
        if not fits:
            have = sorted({f.collective for f in self.comm})
            raise ProfileError(f"profile has no '{collective}' measurement"
                               + (f" (it has {', '.join(have)})" if have else " (no comm measurements)"))
        if world is None:
            best = max(fits, key=lambda f: f.world)
        else:  # nearest world; on a tie the larger one; among equals the last measured
            best = min(reversed(fits), key=lambda f: (abs(f.world - world), -f.world))
        return best

    def _compute(self, what: str) -> ComputeProfile:
        if self.compute is None:
            raise ProfileError(f"profile has no compute section (needed for {what}); run "
                               "'shardplan profile compute'")
        return self.compute

    # ---- checks and merging --------------------------------------------------------------------
    def check_kind(self, kind: str, what: str = "the cluster") -> None:
        """Refuse to mix: a GPU profile for a CPU cluster (or the reverse) is an error."""
        if self.device.kind != kind:
            raise ProfileError(f"profile was measured on a {self.device.kind} ({self.device.name}) but "
                               f"{what} is {kind}; profile the right kind of device")

    def merged(self, other: Profile) -> Profile:
        """This profile with ``other``'s sections laid over it (same device kind required)."""
        other.check_kind(self.device.kind, f"the profile it is merged into ({self.device.name})")
        keys = {(f.collective, f.world, f.backend) for f in other.comm}
        comm = [f for f in self.comm if (f.collective, f.world, f.backend) not in keys] + list(other.comm)
        mkeys = {(m.model, m.layer, m.micro_batch, m.seq_len) for m in other.model}
        model = [m for m in self.model if (m.model, m.layer, m.micro_batch, m.seq_len) not in mkeys]
        return self.model_copy(update={
            "device": other.device if other.compute is not None else self.device,
            "compute": other.compute if other.compute is not None else self.compute,
            "comm": comm, "model": model + list(other.model)})

    # ---- files -------------------------------------------------------------------------------
    def to_json(self) -> str:
        """Canonical JSON: same profile, same bytes."""
        return canonical_json(self.model_dump(mode="json"))

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file renamed over the target): never half a profile."""
        write_atomic(Path(path), self.to_json())


# ---- interpolation helpers -------------------------------------------------------------------

def _rates(pts: list[Any], phase: str) -> list[tuple[float, float]]:
    if phase == "fwd":
        return [(p.flops, p.flops / p.fwd_s) for p in pts]
    if phase == "bwd":
        return [(p.flops, 2 * p.flops / p.bwd_s) for p in pts]
    if phase != "both":
        raise ProfileError(f"phase must be both, fwd or bwd, got '{phase}'")
    return [(p.flops, p.flops_per_s) for p in pts]


def _nearest_shapes(shapes: list[tuple[int, int, int]], rates: list[float], shape: tuple[float, float, float],
                    k: int = 4) -> float:
    """Inverse-squared-distance mean of log rate over the ``k`` shapes nearest in log space."""
    q = [math.log(x) for x in shape]
    dist = sorted((sum((math.log(a) - b) ** 2 for a, b in zip(sh, q, strict=True)), i)
                  for i, sh in enumerate(shapes))
    if dist[0][0] < 1e-12:
        same = [rates[i] for d, i in dist if d < 1e-12]
        return statistics.median(same)
    near = dist[:k]
    wsum = sum(1 / d for d, _ in near)
    return math.exp(sum(math.log(rates[i]) / d for d, i in near) / wsum)


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Median y per distinct x, then linear in log(x) between neighbours, clamped at the ends."""
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(float(px), []).append(float(py))
    xs = sorted(by_x)
    ys = [statistics.median(by_x[v]) for v in xs]
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lx = math.log(x)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = math.log(xs[i - 1]), math.log(xs[i])
            t = (lx - x0) / (x1 - x0)
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]  # not reached


def _upper_half(pts: list[BwPoint]) -> list[BwPoint]:
    srt = sorted(pts, key=lambda p: p.bytes)
    return srt[len(srt) // 2:]


def _large_bw(pts: list[BwPoint]) -> float:
    return statistics.median(p.bytes_per_s for p in _upper_half(pts))


# ---- reading ---------------------------------------------------------------------------------

def parse_profile(data: dict[str, Any] | str, origin: str = "profile") -> Profile:
    """Validate a profile from a dict or JSON text; errors name the field and the reason."""
    if isinstance(data, str):
        data = decode_json(data, origin, ProfileError, truncated_advice="measure again")
    if not isinstance(data, dict):
        raise ProfileError(f"{origin} must hold a JSON object, not {type(data).__name__}")
    if data.get("kind") != "shardplan-profile":
        raise ProfileError(f"{origin} is not a shardplan profile (its 'kind' is {shown(data.get('kind'))}, "
                           "expected 'shardplan-profile'; is it a plan?)")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{origin}: schema_version {shown(version)} is not supported (this shardplan reads "
                           f"{SCHEMA_VERSION}); measure again with 'shardplan profile'")
    return validate_document(Profile, data, origin, "profile", ProfileError)


def load_profile(path: str | Path) -> Profile:
    """The profile in the JSON file at ``path``; an unreadable or invalid file raises :class:`ProfileError`."""
    return parse_profile(read_text(path, "profile", ProfileError), origin=f"profile '{Path(path)}'")


def json_schema() -> dict[str, Any]:
    """The JSON schema of a profile document."""
    return document_schema(Profile, "profile", SCHEMA_VERSION, "shardplan profile")


def json_schema_text() -> str:
    return canonical_json(json_schema())


if __name__ == "__main__":  # regenerate profiler/profile.schema.json
    write_atomic(SCHEMA_PATH, json_schema_text())
    print(f"wrote {SCHEMA_PATH}")
