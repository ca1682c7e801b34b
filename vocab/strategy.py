"""What the cost model prices: a workload (what to train) and a parallel strategy (how).

The device mesh has named axes, outermost first: ``pp, dp_replicate, dp_shard, cp, tp``. Their
product is the world size. ``ep`` (expert parallelism) is carved out of ``dp_shard × cp`` for the
MoE layers, as in torchtitan: expert weights are split over ``ep`` ranks and sharded/replicated
over the remaining ``dp_shard·cp/ep``. With ``etp`` set (MoE parallel folding: Megatron's
``--expert-tensor-parallel-size``, torchtitan's ``expert_tensor_parallel_degree``) the expert ranks
are carved out of ``tp × dp_shard × cp`` instead: ``etp`` ranks split each expert's width, ``ep``
groups of them hold the experts, in the order ``(edp, ep, etp)`` with ``etp`` innermost.

Per-layer choices (:class:`LayerStrategy`) apply to *units*: ``embedding``, ``layers.<i>``,
``head``, or any operator inside them (``layers.3.mlp.up``); the most specific unit wins and
``Strategy.default`` covers the rest.

A mesh owns the facts derived from its degrees (:class:`MeshFacts`: world size, data-parallel
degree, shard groups, parallel axes) and a strategy those derived from its mesh and modes, which
the cost model, the solvers, the exporters and the runtime share: the micro-batches per step
(:func:`num_microbatches`), what each sequence must be a multiple of (:func:`sequence_chunks`) and
the pipeline layout (:meth:`Strategy.stage_layout`, :meth:`Strategy.rank_blocks`: virtual stage
``k`` holds the next ``stage_layout[k]`` blocks and lives on pipeline rank ``k mod pp``). Whether a
strategy suits a model and a workload is :mod:`vocab.rules`. :class:`MeshConfig` is a strategy
without its per-unit choices and stage boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vocab.errors import ShardplanError
from vocab.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN
from vocab.names import UNIT

SHARDINGS = ("replicate", "zero1", "zero2", "zero3", "zero3_keep")
RECOMPUTES = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "params", "activations")
#: the offloads of model states (the rest, ``activations``, moves a unit's saved activations)
STATE_OFFLOADS = ("none", "optimizer", "params")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
ATTENTION_KERNEL_CHOICES = ("auto", "flash2", "flash3")
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: every degree of a mesh: its axes, then expert parallelism (carved out of ``dp_shard x cp``)
DEGREES = (*MESH_AXES, "ep")
ZERO_TO_SHARDING = {0: "replicate", 1: "zero1", 2: "zero2", 3: "zero3"}

Sharding = Literal["replicate", "zero1", "zero2", "zero3", "zero3_keep"]
Recompute = Literal["none", "selective", "full"]
Offload = Literal["none", "optimizer", "params", "activations"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb"]
AttentionKernel = Literal["auto", "flash2", "flash3"]
Precision = Literal["bf16", "fp8", "mxfp8", "fp32"]
#: the precisions a workload trains in: bf16 mixed precision, its GEMMs in fp8 with a scale per tensor
#: (``fp8``) or with a shared 8-bit exponent per 32-element block (``mxfp8``, the OCP Microscaling
#: format, which needs block-scaled tensor cores: an accelerator file's ``mx_formats``), or fp32 throughout
PRECISIONS = ("bf16", "fp8", "mxfp8", "fp32")
#: the precisions whose GEMMs run in fp8 (E4M3), priced alike but for the block scales' bytes
FP8_PRECISIONS = ("fp8", "mxfp8")
#: precisions the trainers run that the cost model cannot price, and why (a named refusal)
UNPRICED_PRECISIONS = {"nvfp4": "no FP4 throughput in the hardware data (hardware.csv)"}
CROSS_ENTROPY_CHOICES = ("eager", "fused", "chunked")
#: the sequence chunks of torchtitan 0.3's ChunkedLossWrapper (components/loss.py:567-613, ``num_chunks`` 8 in
#: every registry function): the head and the loss run one chunk at a time, backward included, with an fp32
#: accumulator of the hidden states' gradient (GradAccumulator, loss.py:705)
LOSS_CHUNKS = 8
GRAD_DTYPE_CHOICES = ("fp32", "bf16")
RECV_BUFFER_CHOICES = ("per_micro_batch", "one", "none")
KERNEL_CHOICES = ("eager", "fused")
ZERO3_MASTER_CHOICES = ("optimizer", "parameter")
MOE_DISPATCH_CHOICES = ("alltoall", "dedup")
MOE_OVERLAP_CHOICES = ("none", "1f1b")
SELECTIVE_CHOICES = ("attention", "op", "gemms")
LOW_PRECISION_EXPERTS_CHOICES = ("always", "float8_unpiped", "never")
MOE_TP_CHOICES = ("dispatcher", "gathered", "gathered_without_ep")
FP8_SAVED_INPUT_CHOICES = ("original", "quantized")
ADAM_STATE_CHOICES = ("fp32", "bf16")
#: the workload's kernel and buffer choices: field -> (what a message calls it, accepted values)
WORKLOAD_CHOICES = {"attention_kernel": ("attention kernel", ATTENTION_KERNEL_CHOICES),
                    "cross_entropy": ("cross-entropy", CROSS_ENTROPY_CHOICES),
                    "grad_dtype": ("gradient dtype", GRAD_DTYPE_CHOICES),
                    "recv_buffers": ("pipeline receive buffers", RECV_BUFFER_CHOICES),
                    "kernels": ("memory-bound kernels", KERNEL_CHOICES),
                    "zero3_master": ("ZeRO-3 master weights", ZERO3_MASTER_CHOICES),
                    "moe_dispatch": ("MoE token dispatch", MOE_DISPATCH_CHOICES),
                    "moe_overlap": ("MoE all-to-all overlap", MOE_OVERLAP_CHOICES),
                    "selective": ("selective recomputation", SELECTIVE_CHOICES),
                    "low_precision_experts": ("low-precision experts", LOW_PRECISION_EXPERTS_CHOICES),
                    "moe_tp": ("MoE layer under tensor parallelism", MOE_TP_CHOICES),
                    "fp8_saved_inputs": ("fp8 linear layers' saved inputs", FP8_SAVED_INPUT_CHOICES),
                    "adam_states": ("Adam's state", ADAM_STATE_CHOICES)}
#: Transient memory of the loss beside the fp32 softmax it keeps, as a multiple of that softmax:
#: PyTorch eager ``F.cross_entropy(logits.float())`` holds, in its backward, the incoming gradient
#: of the log-softmax and the outgoing one (2x); a fused kernel (Megatron's vocab-parallel
#: cross-entropy, Liger, a compiled loss) writes the gradient in place and holds the bf16 logits (1/2).
LOSS_BUFFER = {"eager": 2.0, "fused": 0.5, "chunked": 2.0}


def check_precision(precision: str) -> None:
    """One line for a precision the vocabulary has no word for, or one it names but cannot price
    (:data:`UNPRICED_PRECISIONS`)."""
    if precision in UNPRICED_PRECISIONS:
        raise ShardplanError(f"{precision}: {UNPRICED_PRECISIONS[precision]}")
    if precision not in PRECISIONS:
        raise ShardplanError(f"unknown precision '{precision}'; known: {', '.join(PRECISIONS)}")


def check_workload_choices(**values: str) -> None:
    """One clear message for a value of a :data:`WORKLOAD_CHOICES` field that is not accepted."""
    for name, value in values.items():
        what, known = WORKLOAD_CHOICES[name]
        if value not in known:
            raise ShardplanError(f"unknown {what} '{value}'; known: {', '.join(known)}")


def even_split(blocks: int, stages: int) -> list[int]:
    """Blocks per stage, as even as possible, the extra blocks on the middle stages."""
    return list(_even_split(blocks, stages))


@lru_cache(maxsize=4096)
def _even_split(blocks: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(blocks, stages)
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    bonus = set(order[:extra])
    return tuple(base + (1 if i in bonus else 0) for i in range(stages))


def split_blocks(blocks: int, stages: int, stage_layers: Sequence[int] | None = None) -> list[int]:
    """Blocks per virtual stage: ``stage_layers`` when given, else :func:`even_split`."""
    return list(stage_layers) if stage_layers is not None else even_split(blocks, stages)


def rank_blocks(blocks: int, p: int, v: int = 1, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Block indices each of ``p`` pipeline ranks holds: virtual stage ``k`` (blocks per stage from
    ``layout``, or the even split of ``blocks`` into ``p·v``) lives on rank ``k mod p``."""
    out: list[list[int]] = [[] for _ in range(p)]
    start = 0
    for k, n in enumerate(layout if layout is not None else even_split(blocks, p * v)):
        out[k % p].extend(range(start, start + n))
        start += n
    return out




def num_microbatches(global_batch: Any, dp: Any, micro_batch: Any) -> Any:
    """Micro-batches per step on each data-parallel rank: ``global_batch // (dp * micro_batch)``
    (integers, or arrays over configurations)."""
    return global_batch // (dp * micro_batch)


def sequence_chunks(cp: int, tp: int = 1, tsp: bool = False) -> int:
    """Chunks each sequence is cut into, which its length must be a multiple of: ``2*cp`` under
    context parallelism (head-tail load balancing), ``2*cp*tp`` under TSP, else one."""
    ways = cp * tp if tsp else cp
    return 2 * ways if ways > 1 else 1


def parallel_axes(degrees: dict[str, int]) -> dict[str, int]:
    """The degrees above one, in :data:`DEGREES` order: the parallelism a person sets up."""
    return {a: degrees[a] for a in DEGREES if degrees.get(a, 1) > 1}


class MeshFacts:
    """What follows from a mesh's degrees, written once for every form of a mesh (:class:`Mesh`,
    :class:`MeshConfig`, the arrays of ``costmodel.configs.ConfigArrays``): integers or arrays
    over configurations alike. Global rank order: ``pp, dp_replicate, dp_shard, cp, tp``."""

    if TYPE_CHECKING:
        pp: Any
        dp_replicate: Any
        dp_shard: Any
        cp: Any
        tp: Any
        ep: Any
        etp: Any

    @property
    def world_size(self) -> Any:
        """Ranks of the mesh: the product of its axes."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> Any:
        """Data-parallel replicas of the batch, ``dp_replicate * dp_shard`` (context-parallel ranks
        share their samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> Any:
        """Ranks of the group ZeRO/FSDP shards dense states over: ``dp_shard * cp``."""
        return self.dp_shard * self.cp

    @property
    def expert_tp(self) -> Any:
        """Ranks that split each expert's FFN width: ``etp``, or ``tp`` where it is unset (0)."""
        return self.etp + (self.etp == 0) * self.tp

    @property
    def expert_shard(self) -> Any:
        """Ranks of the group expert states are sharded over: the ``tp·dp_shard·cp`` ranks of a stage
        replica over ``etp·ep`` (the shard group over ``ep`` where ``etp`` is ``tp``)."""
        return self.tp * self.shard // (self.expert_tp * self.ep)

    @property
    def dp_all(self) -> Any:
        """Every rank holding the same parameters, which gradients are reduced over:
        ``dp_replicate * dp_shard * cp``."""
        return self.dp_replicate * self.shard

    def degrees(self) -> dict[str, Any]:
        """Every degree by name (:data:`DEGREES`)."""
        return {a: getattr(self, a) for a in DEGREES}

    @property
    def parallel_axes(self) -> dict[str, int]:
        """The degrees above one (:func:`parallel_axes`; of integer degrees only)."""
        return parallel_axes(self.degrees())


class _Strict(BaseModel):
    """Plain typed data: no unknown keys, no coercion (``2.5``, ``"2"`` or ``true`` are not
    counts), no NaN or infinities."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Mesh(_Strict, MeshFacts):
    """Degrees of the named mesh axes."""

    pp: int = Field(1, ge=1, le=MAX_GPUS, description="pipeline stages")
    dp_replicate: int = Field(1, ge=1, le=MAX_GPUS, description="plain data-parallel replicas")
    dp_shard: int = Field(1, ge=1, le=MAX_GPUS, description="ranks that ZeRO/FSDP shards states across")
    cp: int = Field(1, ge=1, le=MAX_GPUS, description="context-parallel ranks (sequence split in attention)")
    tp: int = Field(1, ge=1, le=MAX_GPUS, description="tensor-parallel ranks")
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="expert-parallel ranks, carved from dp_shard x cp "
                    "(from tp x dp_shard x cp where etp is set)")
    etp: int = Field(0, ge=0, le=MAX_GPUS, exclude_if=lambda v: v == 0,
                     description="expert-tensor-parallel ranks: 0 (the default) as tp; set, the expert ranks "
                     "etp x ep are carved from tp x dp_shard x cp (MoE parallel folding)")

    @model_validator(mode="after")
    def _ep_fits(self) -> Mesh:
        if self.world_size > MAX_GPUS:
            raise ValueError(f"the mesh spans {self.world_size:,} GPUs; at most {MAX_GPUS:,} are supported")
        problem = expert_ranks_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    def axes(self) -> dict[str, int]:
        """The degrees of the mesh axes (:data:`MESH_AXES`), without ``ep``."""
        return {a: getattr(self, a) for a in MESH_AXES}

    def shown_degrees(self) -> dict[str, int]:
        """The degrees a person sets, as a plan shows them: the axes and ``ep`` above 1, ``etp`` where set."""
        shown = {a: v for a, v in self.degrees().items() if v > 1}
        return shown | ({"etp": self.etp} if self.etp else {})


def expert_ranks_problem(m: MeshFacts) -> str | None:
    """Why the ``etp x ep`` expert ranks of mesh ``m`` cannot be carved out of its ranks, or None:
    ``ep`` divides ``dp_shard*cp`` (``etp`` unset), ``etp*ep`` divides ``tp*dp_shard*cp`` (set)."""
    if not m.etp:
        return None if m.shard % m.ep == 0 else \
            f"ep={m.ep} must divide dp_shard*cp = {m.shard} (expert ranks are data-parallel ranks)"
    if (m.tp * m.shard) % (m.etp * m.ep):
        return (f"etp*ep = {m.etp}*{m.ep} must divide tp*dp_shard*cp = {m.tp * m.shard} (folded expert ranks "
                "are tensor- and data-parallel ranks)")
    return None


class LayerStrategy(_Strict):
    """Per-unit choices.

    Attributes:
        unit: ``*`` (default), ``embedding``, ``layers.<i>``, ``head`` or an operator path.
        sharding: ``replicate`` (DDP), ``zero1`` (optimizer states), ``zero2`` (+ gradients),
            ``zero3`` (+ parameters, resharded after forward), ``zero3_keep`` (ZeRO-3 whose
            parameters stay gathered from forward to backward).
        recompute: ``none``, ``selective`` (attention core) or ``full`` (the whole unit).
        offload: ``optimizer`` (fp32 master + Adam states in host memory, step on the CPU),
            ``params`` (parameters too) or ``activations`` (the unit's saved activations copied to host
            memory after its forward and back before its backward, states on the device: Transformer
            Engine's CPU offload, Megatron's ``cpu_offloading_num_layers``); a unit's choice, not an
            operator's.
        split: OSDP operator splitting: run each large operator of the unit as ``split`` slices,
            so that only one slice's gathered weights live at a time.
    """

    unit: str = Field("*", pattern=UNIT)
    sharding: Sharding = "replicate"
    recompute: Recompute = "none"
    offload: Offload = "none"
    split: int = Field(1, ge=1, le=64)


def first_blocks_offloaded(ls: LayerStrategy, count: int) -> list[LayerStrategy]:
    """Layer entries giving the first ``count`` transformer blocks ``ls`` with their activations in host
    memory (Megatron's ``--cpu-offloading-num-layers``: the first N layers)."""
    return [ls.model_copy(update={"unit": f"layers.{i}", "offload": "activations"}) for i in range(count)]


class Workload(_Strict):
    """What to train: tokens per sample, samples per step, precision."""

    seq_len: int = Field(..., ge=1, le=MAX_SEQ_LEN)
    global_batch: int = Field(..., ge=1, le=MAX_GLOBAL_BATCH, description="samples (sequences) per optimizer step")
    precision: Precision = Field(
        "bf16", description="bf16/fp8 mixed precision (fp32 master weights and Adam; fp8: E4M3 GEMMs with a scale "
        "per tensor; mxfp8: E4M3 GEMMs with an 8-bit exponent scale per 32-element block, OCP MX, Blackwell), or "
        "fp32 throughout"
    )
    attention_kernel: AttentionKernel = Field(
        "auto", description="flash2: FlashAttention-2 / PyTorch SDPA; flash3: Hopper-native (FlashAttention-3, "
        "cuDNN / Transformer Engine); auto: the newest the accelerator runs"
    )
    cross_entropy: Literal["eager", "fused", "chunked"] = Field(
        "eager", description="eager: PyTorch F.cross_entropy on fp32 logits (this runtime, torchtitan, HF); "
        "fused: a fused vocab-parallel kernel (Megatron-LM, NeMo); chunked: eager over LOSS_CHUNKS sequence chunks "
        "one at a time, backward included (torchtitan 0.3's ChunkedLossWrapper)"
    )
    grad_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="gradient buffers under bf16/fp8: fp32 (Megatron's main_grad, FSDP2 with an fp32 "
        "reduce dtype, DeepSpeed's bf16 optimizer) or 16-bit (the ZeRO paper's 2 bytes per parameter)"
    )
    recv_buffers: Literal["per_micro_batch", "one", "none"] = Field(
        "per_micro_batch", description="pipeline receive buffers kept beyond the activations: per_micro_batch "
        "(torch's PipelineStage: one per micro-batch, held between steps), one (DeepSpeed's pipeline engine: "
        "one input and one gradient buffer, reused), none (Megatron-LM, nanotron: allocated per receive, "
        "freed with the activations)"
    )
    kernels: Literal["eager", "fused"] = Field(
        "eager", description="memory-bound kernels (norms, activations): eager (PyTorch op by op: this runtime, "
        "torchtitan without compile, Hugging Face) or fused (one kernel each way: Megatron-LM / Transformer Engine, "
        "Apex, torch.compile); the cross-entropy follows cross_entropy"
    )

    zero3_master: Literal["optimizer", "parameter"] = Field(
        "optimizer", description="where ZeRO-3 keeps the fp32 master weights under bf16/fp8: optimizer (a 16-bit "
        "parameter shard beside an fp32 master in the optimizer: DeepSpeed) or parameter (the sharded parameter "
        "is the fp32 master, cast to 16 bits when gathered: FSDP and FSDP2 with mixed precision, this runtime, "
        "torchtitan)"
    )
    moe_dispatch: Literal["alltoall", "dedup"] = Field(
        "alltoall", description="how expert parallelism sends tokens to their experts: alltoall (every routed copy "
        "to its expert's rank: NCCL all-to-all, Megatron's alltoall dispatcher, torchtitan's standard backend) or "
        "dedup (one copy per scale-up domain, forwarded inside it: DeepEP, Megatron's flex dispatcher, "
        "torchtitan's deepep backend)"
    )
    moe_capacity_factor: float | None = Field(
        None, gt=0.0, le=64.0, allow_inf_nan=False,
        description="tokens an expert takes per step, as a multiple of its mean load: the rest are dropped "
        "(Megatron's moe_expert_capacity_factor); none: dropless (every target's default)"
    )
    moe_overlap: Literal["none", "1f1b"] = Field(
        "none", description="whether the expert-parallel all-to-alls hide under compute: none, or 1f1b (each "
        "micro-batch's all-to-alls under the compute of the micro-batch paired with it in 1F1B: Megatron's "
        "overlap_moe_expert_parallel_comm, without a pipeline or with virtual stages, not with full "
        "recomputation)"
    )
    selective: Literal["attention", "op", "gemms"] = Field(
        "attention", description="what recompute 'selective' keeps and recomputes: attention (the attention core "
        "recomputed, everything else kept: Korthikanti et al., Megatron-LM's core_attn), op (torchtitan's "
        "op-level policy: the outputs of every other weight GEMM, of attention and of reduce-scatters kept, the "
        "rest recomputed) or gemms (this runtime: the outputs of every weight GEMM and collective kept, the "
        "rest, attention included, recomputed)"
    )
    low_precision_experts: Literal["always", "float8_unpiped", "never"] = Field(
        "always", description="where an fp8 or mxfp8 run's mixture-of-experts grouped GEMMs run in that precision: "
        "always (Transformer Engine's GroupedLinear: Megatron-LM), float8_unpiped (torchtitan's grouped-GEMM "
        "converters: mxfp8 on every mesh, fp8 only without pipeline and context parallelism, which its float8 one "
        "refuses; elsewhere the experts run in bf16) or never (no grouped-GEMM converter: bf16 experts)"
    )
    fp8_saved_inputs: Literal["original", "quantized"] = Field(
        "original", exclude_if=lambda v: v == "original",
        description="what an fp8 or mxfp8 linear layer keeps of its input for the weight gradient: original (the "
        "16-bit input: torchao's Float8Linear, this runtime) or quantized (Transformer Engine: the fp8 copy it cast, "
        "one byte an element, one orientation, with mxfp8's block scales; Megatron-LM). A layer whose input is "
        "the attention core's output keeps that output (Megatron sets save_original_input on linear_proj)"
    )
    adam_states: Literal["fp32", "bf16"] = Field(
        "fp32", exclude_if=lambda v: v == "fp32",
        description="Adam's state: fp32 (the fp32 master weight and two fp32 moments) or bf16 (Megatron's "
        "precision-aware optimizer as NVIDIA's recipes run it: both moments in bf16 and, under 16-bit training, "
        "the fp32 master kept as the 16 bits the bf16 parameter lacks: --use-precision-aware-optimizer "
        "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16, store_param_remainders)"
    )
    moe_tp: Literal["dispatcher", "gathered", "gathered_without_ep"] = Field(
        "dispatcher", exclude_if=lambda v: v == "dispatcher",
        description="how a mixture-of-experts layer meets tensor parallelism with sequence parallelism: "
        "dispatcher (Megatron's alltoall dispatcher: each tp rank dispatches its share of the tokens, the "
        "expert-TP ranks gather the routed copies after the dispatch and reduce-scatter them before the combine) "
        "or gathered (torchtitan: the layer all-gathers the tokens over tp before routing and reduce-scatters "
        "its output; every tp rank dispatches all of them where the experts split over tp, its share where "
        "they fold over tp) or gathered_without_ep (torchtitan 0.3: gathered where ep = 1; where ep > 1 the "
        "experts fold over tp and each tp rank routes and dispatches its own share, nothing gathered)"
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _priced(cls, value: Any) -> Any:
        if isinstance(value, str) and value in UNPRICED_PRECISIONS:
            raise ValueError(f"{value}: {UNPRICED_PRECISIONS[value]}")
        return value

    @property
    def loss_buffer(self) -> float:
        """The loss's transient memory as a multiple of the fp32 softmax it keeps."""
        return LOSS_BUFFER[self.cross_entropy]


class Strategy(_Strict):
    """How to train it."""

    mesh: Mesh = Mesh()
    micro_batch: int = Field(1, ge=1, le=MAX_GLOBAL_BATCH)
    schedule: Schedule = "1f1b"
    vpp: int = Field(1, ge=1, le=1024, description="virtual stages per rank (interleaved schedule)")
    stage_layers: list[int] | None = Field(
        None, description="blocks per (virtual) stage in order; None = as even as possible"
    )
    sequence_parallel: bool = False
    tp_mode: Literal["megatron", "tsp"] = "megatron"
    cp_mode: Literal["ring", "ulysses"] = "ring"
    cp_rotate: Literal["allgather", "alltoall"] = Field(
        "allgather", description="how a ring moves K/V (torchtitan's names): allgather (gathered while the "
        "rank attends its own block) or alltoall (passed point to point round the ring, cp-1 steps, each "
        "under the step's attention)")
    default: LayerStrategy = LayerStrategy()
    layers: list[LayerStrategy] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Strategy:
        if self.schedule != "interleaved" and self.vpp != 1:
            raise ValueError(f"vpp={self.vpp} needs schedule 'interleaved', not '{self.schedule}'")
        if self.schedule == "interleaved" and self.mesh.pp == 1:
            raise ValueError("schedule 'interleaved' needs pp > 1")
        if self.sequence_parallel and self.mesh.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.default.unit != "*":
            raise ValueError("default layer strategy must have unit '*'")
        units = [ls.unit for ls in self.layers]
        if len(set(units)) != len(units):
            raise ValueError(f"layer strategies name a unit twice: {sorted({u for u in units if units.count(u) > 1})}")
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.mesh.pp * self.vpp:
                raise ValueError(
                    f"stage_layers has {len(self.stage_layers)} entries, expected pp*vpp={self.mesh.pp * self.vpp}"
                )
            if any(n < 0 for n in self.stage_layers):
                raise ValueError("stage_layers entries must be >= 0")
        return self

    def num_microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank (:func:`num_microbatches`)."""
        return num_microbatches(global_batch, self.mesh.dp, self.micro_batch)

    @property
    def sequence_chunks(self) -> int:
        """Chunks each sequence is cut into (:func:`sequence_chunks`)."""
        return sequence_chunks(self.mesh.cp, self.mesh.tp, self.tp_mode == "tsp")

    @property
    def num_stages(self) -> int:
        """Virtual pipeline stages: ``pp * vpp``."""
        return self.mesh.pp * self.vpp

    def stage_layout(self, num_blocks: int) -> list[int]:
        """Blocks per virtual stage: ``stage_layers`` when set, else :func:`even_split` (the extra
        blocks on the middle stages). The cost model prices and the runtime cuts this layout."""
        return split_blocks(num_blocks, self.num_stages, self.stage_layers)

    def stage_blocks(self, num_blocks: int) -> list[range]:
        """Block indices of each virtual stage, in order."""
        out: list[range] = []
        start = 0
        for n in self.stage_layout(num_blocks):
            out.append(range(start, start + n))
            start += n
        return out

    def rank_stages(self, rank: int) -> list[int]:
        """Virtual stages pipeline rank ``rank`` runs: ``rank, rank + pp, ...`` (the looping layout)."""
        return list(range(rank, self.num_stages, self.mesh.pp))

    def rank_blocks(self, num_blocks: int) -> list[list[int]]:
        """Block indices each pipeline rank holds."""
        return rank_blocks(num_blocks, self.mesh.pp, self.vpp, self.stage_layout(num_blocks))

    def _match(self, name: str) -> LayerStrategy | None:
        best: LayerStrategy | None = None
        for ls in self.layers:
            if name == ls.unit or name.startswith(ls.unit + "."):
                if best is None or len(ls.unit) > len(best.unit):
                    best = ls
        return best

    def for_unit(self, name: str) -> LayerStrategy:
        """The strategy of a unit (or operator path): the most specific matching entry, else default."""
        return self._match(name) or self.default

    def for_op(self, unit: str, op: str) -> LayerStrategy:
        """An operator's strategy: the most specific entry naming it or a path above it, else its
        unit's (operators outside ``layers.<i>`` have names of their own: ``embed`` is in ``embedding``)."""
        return self._match(op) or self.for_unit(unit)


@dataclass(frozen=True, order=True)
class MeshConfig(MeshFacts):
    """Everything of a strategy but the per-unit choices and the stage boundaries."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    micro_batch: int
    schedule: str
    vpp: int
    sequence_parallel: bool
    tp_mode: str = "megatron"
    cp_mode: str = "ring"
    cp_rotate: str = "allgather"  # how the target's ring moves K/V (costmodel.units._Traffic.ring)
    etp: int = 0  # expert-tensor-parallel ranks (0: as tp; :attr:`Mesh.etp`)

    @classmethod
    def of(cls, s: Strategy) -> MeshConfig:
        """The mesh configuration a strategy uses."""
        return cls(**s.mesh.degrees(), micro_batch=s.micro_batch, schedule=s.schedule, vpp=s.vpp,
                   sequence_parallel=s.sequence_parallel, tp_mode=s.tp_mode, cp_mode=s.cp_mode, cp_rotate=s.cp_rotate,
                   etp=s.mesh.etp)

    @property
    def mesh(self) -> Mesh:
        """The degrees as a :class:`Mesh`."""
        return Mesh(**self.degrees(), etp=self.etp)

    def num_microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank (:func:`num_microbatches`)."""
        return num_microbatches(global_batch, self.dp, self.micro_batch)

    @property
    def sequence_chunks(self) -> int:
        """Chunks each sequence is cut into (:func:`sequence_chunks`)."""
        return sequence_chunks(self.cp, self.tp, self.tp_mode == "tsp")

    def strategy(
        self,
        default: LayerStrategy | None = None,
        layers: list[LayerStrategy] | None = None,
        stage_layers: list[int] | None = None,
    ) -> Strategy:
        return Strategy(
            mesh=self.mesh,
            micro_batch=self.micro_batch,
            schedule=self.schedule,  # type: ignore[arg-type]
            vpp=self.vpp,
            sequence_parallel=self.sequence_parallel,
            tp_mode=self.tp_mode,  # type: ignore[arg-type]
            cp_mode=self.cp_mode,
            cp_rotate=self.cp_rotate,  # type: ignore[arg-type]
            default=default or LayerStrategy(),  # type: ignore[arg-type]
            layers=layers or [],
            stage_layers=stage_layers,
        )

    def describe(self) -> str:
        parts = [f"{k}{d}" for k, d in self.parallel_axes.items()] + ([f"etp{self.etp}"] if self.etp else [])
        sched = f"{self.schedule}" + (f"/vpp{self.vpp}" if self.vpp > 1 else "")
        return f"{' '.join(parts) or 'single GPU'} mb{self.micro_batch} {sched}"
