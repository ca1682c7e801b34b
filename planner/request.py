"""Requests as typed objects, each field documented once: :class:`Request` (what to plan, on what,
for which trainer, and how hard to search) and :class:`PriceRequest` (one plan to price: ``shardplan
estimate`` and each line of its batch file).

    from planner.api import search_plan
    from planner.request import Request
    planned = search_plan(Request("llama3-8b", "64xh100", 8192, 256, target="torchtitan"))

A field's metadata holds its command-line flags, the type the command line reads and how it checks
the value, and its documentation, which is the option's help text: :func:`option` builds the options
of ``shardplan plan``, ``estimate`` and ``sweep`` from the fields, so an option is added in one place
and its help written once (a command gives its own only where its option means more, as sweep's
lists). ``reserve`` is a fraction here and a percent on the command line (``--reserve 5``).

Field types are checked when a request is made (:func:`check_fields`): a wrong type is one
:class:`~vocab.errors.ShardplanError` line naming the caller, the field and the type it takes. This
module is loaded with the command line, so it imports no pydantic, numpy or solver module.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from planner.options import Opt, count_option, int_option, number_option, positive_option
from vocab.arguments import describe, matches
from vocab.errors import ShardplanError

if TYPE_CHECKING:
    from costmodel.calibration.document import Calibration
    from profiler.hardware import Cluster

#: the target a request is for by default (:data:`vocab.targets.DEFAULT_TARGET`, not imported: pydantic)
DEFAULT_TARGET = "shardplan"
#: the integer-program back-end by default (:data:`solvers.mip.DEFAULT_SOLVER`, not imported: numpy)
DEFAULT_SOLVER = "highs"
#: the mesh axes a request may hold at a degree (``degrees``)
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def fact(doc: str, *flags: str, default: Any = MISSING, cli: Any = str, make: Callable[..., Any] = typer.Option,
         cli_default: Any = MISSING, **bounds: Any) -> Any:
    """A field of a request: its documentation (its option's help text), its command-line ``flags``
    (none: not on the command line), the type the command line reads (``cli``), the typer option
    maker that checks it (:mod:`planner.options`) with its ``bounds``, its default (none: a field
    given by position) and, where the command line's differs, the option's (``cli_default``)."""
    meta = {"doc": doc, "flags": flags, "cli": cli, "make": make, "bounds": bounds,
            "cli_default": default if cli_default is MISSING else cli_default}
    if default is MISSING:
        return field(metadata=meta)
    return field(default=default, kw_only=True, metadata=meta)


@dataclass(frozen=True)
class Request:
    """What to plan: the model, the cluster, the workload (sequence length, global batch, precision,
    kernels), the trainer the plan must run in, the memory it may use, what to price with, and how to
    search. ``global_batch`` may list several batches: the one with the most samples per second wins."""

    # ---- the model and the cluster
    model: Any = fact("preset name, config.json path or pkg.module:factory", "--model", "-m")
    cluster: str | dict[str, Any] | Cluster = fact("'64xh100' or a cluster YAML/JSON file", "--cluster", "-c")
    # ---- the workload
    seq_len: int = fact("tokens per sample", "--seq-len", cli=int, make=count_option)
    global_batch: int | Sequence[int] = fact(
        "samples per step; a comma list compares throughput (samples/s)", "--global-batch")
    # ---- the memory a plan may use
    memory_limit_gib: float | None = fact(
        "per-GPU memory limit in GiB (default: the GPU's memory less --reserve)", "--memory-limit", default=None,
        cli=float, make=positive_option)
    reserve: float | None = fact(
        "fraction of each GPU's memory no plan may use (default: profiler.hardware.DEFAULT_RESERVE); "
        "not with memory_limit_gib", default=None)
    headroom_gib: float | None = fact(
        "GiB of the memory limit each GPU keeps free, for the memory model's error (default 0): plans are "
        "searched under the limit less it, and the plan records it", "--headroom", default=None, cli=float,
        make=number_option, minimum=0.0)
    # ---- the search
    space: str = fact(
        "fsdp | osdp | megatron | hybrid | full | staged (hybrid, every unit of a pipeline its own sharding, "
        "exact, slower)", "--space", default="full")
    precision: str = fact("bf16 | fp8 | mxfp8 (block-scaled fp8: Blackwell) | fp32", "--precision", default="bf16")
    attention_kernel: str = fact(
        "auto | flash2 (FlashAttention-2, SDPA) | flash3 (Hopper-native)", "--attention-kernel", default="auto")
    # ---- the trainer, and how it runs what the workload leaves open
    target: str = fact(
        "the trainer the plan must run in: shardplan (this runtime) | torchtitan | megatron | deepspeed | "
        "nanotron | any (the whole plan vocabulary); see docs/targets.md", "--target", default=DEFAULT_TARGET)
    cross_entropy: str | None = fact(
        "eager (PyTorch F.cross_entropy) | fused (Megatron's kernel); default: how the target computes it",
        "--cross-entropy", default=None)
    grad_dtype: str | None = fact("gradient buffers and their reduction: fp32 | bf16 (the target must run it); "
                                  "default: the target's", "--grad-dtype", default=None)
    adam_states: str | None = fact("Adam's master and moments: fp32 | bf16 (Megatron's precision-aware optimizer: "
                                   "both moments bf16, the master as 16-bit remainders; the target must run it); "
                                   "default: the target's", "--adam-states", default=None)
    moe_dispatch: str | None = fact(
        "alltoall (NCCL all-to-all) | dedup (DeepEP: one copy per node; the target must offer it); default: the "
        "target's", "--moe-dispatch", default=None)
    moe_overlap: str | None = fact(
        "none | 1f1b (EP all-to-alls hidden under the paired micro-batch's compute, where the schedule allows: "
        "Megatron's --overlap-moe-expert-parallel-comm); default: the target's", "--moe-overlap", default=None)
    moe_capacity_factor: float | None = fact(
        "tokens each expert takes, as a multiple of its mean (the rest dropped; Megatron-LM); default: dropless",
        "--moe-capacity-factor", default=None, cli=float, make=positive_option)
    # ---- what to price with
    profile: str | Path | None = fact(
        "measured profile (shardplan profile) to price with", "--profile", default=None, cli=Path)
    calibration: Calibration | None = fact(
        "price with this calibration of your cluster (shardplan calibrate); the plan records it", "--calibration",
        default=None, cli=Path)
    # ---- how hard to search
    time_limit: float | None = fact(
        "seconds; the best plan so far, with its gap", "--time-limit", default=None, cli=float, make=positive_option)
    top_k: int = fact("runners-up to keep", "--top-k", default=5, cli=int, make=int_option, minimum=0, maximum=1000)
    solver: str = fact(
        "the back-end of the integer programs, through OR-Tools MathOpt: highs (HiGHS, default) | scip (SCIP); or "
        "highspy (HiGHS 1.16 called directly); "
        "docs/solvers.md", "--solver", default=DEFAULT_SOLVER)
    tie_break: bool = fact(
        "the plan is the fastest (default); with --tie-break, the one with the fewest parallel axes among plans "
        "closer to it than the model can order (the published sweeps' band), which is then not the optimum",
        "--tie-break/--fastest", default=False, cli=bool)
    degrees: dict[str, int] | None = fact(
        "mesh axes held at a degree ({'tp': 4, 'pp': 8}), the rest of the space free", default=None)

    def __post_init__(self) -> None:
        check_fields(type(self).__name__, vars(self), type(self))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field of the dataclass ``cls`` (the cluster and calibration
    types loaded on first use)."""
    from costmodel.calibration.document import Calibration
    from profiler.hardware import Cluster

    return typing.get_type_hints(cls, localns={"Cluster": Cluster, "Calibration": Calibration})


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_fields(caller: str, values: dict[str, Any], cls: type = Request) -> None:
    """Each value of ``values`` is of the type of its field of ``cls``; a wrong one, or a name no
    field has, is one line naming ``caller`` (as :func:`vocab.arguments.typed` words it)."""
    types = field_types(cls)
    for name, value in values.items():
        if name not in types:
            raise ShardplanError(f"{caller}: got an unexpected keyword argument '{name}'")
        if not matches(value, types[name]):
            raise ShardplanError(f"{caller}: {name} must be {describe(types[name])}, got {_shown(value)}")


def _field(cls: type, name: str) -> Any:
    return next(f for f in fields(cls) if f.name == name)


def doc(name: str, cls: type = Request) -> str:
    """The documentation of the field ``name`` of ``cls`` (its option's help text)."""
    return str(_field(cls, name).metadata["doc"])


def option(name: str, default: Any = MISSING, help: str | None = None, cls: type = Request) -> Opt:
    """The command-line option of the field ``name`` of ``cls``: its flags, the type the command
    line reads, its check, default (a field given by position: a required option) and help text;
    ``default`` and ``help`` where a command's option differs from the field's."""
    meta = _field(cls, name).metadata
    if default is MISSING:
        default = ... if meta["cli_default"] is MISSING else meta["cli_default"]
    return Opt(name, meta["cli"], meta["make"](default, *meta["flags"], help=doc(name, cls) if help is None else help,
                                              **meta["bounds"]))


@dataclass(frozen=True)
class PriceRequest:
    """One plan to price (``shardplan estimate``; a line of its ``--batch`` file holds these keys):
    the model, the cluster and the workload, and either the plan's degrees, micro-batching,
    schedule and per-layer choices, or a plan file; None is "not given" (a default, the plan's, or
    the target's). The command line reads files' paths; a batch line their names."""

    model: str | dict[str, Any] | None = fact(
        "preset name, config.json path or pkg.module:factory (a factory: imports and runs that code); with --plan, "
        "price the plan with this model instead of the one it records", "--model", "-m", default=None)
    cluster: str | dict[str, Any] | None = fact(doc("cluster"), "--cluster", "-c", default=None)
    seq_len: int | None = fact(doc("seq_len"), "--seq-len", default=None, cli=int, make=count_option)
    global_batch: int | None = fact("samples per optimizer step", "--global-batch", default=None, cli=int,
                                    make=count_option)
    micro_batch: int | None = fact("samples per micro-batch", "--micro-batch", default=None, cli=int,
                                   make=count_option, cli_default=1)
    tp: int | None = fact("tensor-parallel degree", "--tp", default=None, cli=int, make=count_option, cli_default=1)
    pp: int | None = fact("pipeline stages", "--pp", default=None, cli=int, make=count_option, cli_default=1)
    cp: int | None = fact("context-parallel degree", "--cp", default=None, cli=int, make=count_option, cli_default=1)
    ep: int | None = fact("expert-parallel degree", "--ep", default=None, cli=int, make=count_option, cli_default=1)
    etp: int | None = fact("expert-tensor-parallel degree (default: tp; 1 folds the expert ranks over tp, MoE "
                           "parallel folding)", "--etp", default=None, cli=int, make=count_option)
    dp: int | None = fact("data-parallel degree (default: GPUs / (pp*cp*tp))", "--dp", default=None, cli=int,
                          make=count_option)
    dp_shard: int | None = fact("ranks ZeRO/FSDP shards over", "--dp-shard", default=None, cli=int, make=count_option)
    dp_replicate: int | None = fact("plain data-parallel replicas", "--dp-replicate", default=None, cli=int,
                                    make=count_option)
    zero: int | None = fact("0 (DDP, dp_shard 1), 1, 2 or 3", "--zero", default=None, cli=int, make=int_option,
                            cli_default=0)
    recompute: str | None = fact("none | selective | full", "--recompute", default=None, cli_default="none")
    schedule: str | None = fact("gpipe | 1f1b | interleaved | zb", "--schedule", default=None, cli_default="1f1b")
    vpp: int | None = fact("virtual stages per rank (interleaved)", "--vpp", default=None, cli=int, make=count_option,
                           cli_default=1)
    precision: str | None = fact(doc("precision"), "--precision", default=None)
    attention_kernel: str | None = fact(doc("attention_kernel"), "--attention-kernel", default=None)
    cross_entropy: str | None = fact("eager (PyTorch F.cross_entropy, the default) | fused (Megatron)",
                                     "--cross-entropy", default=None)
    grad_dtype: str | None = fact("gradient buffers: fp32 (default) | bf16", "--grad-dtype", default=None)
    adam_states: str | None = fact("Adam's master and moments: fp32 (default) | bf16 (both moments bf16, the master "
                                   "as 16-bit remainders: Megatron's precision-aware optimizer)", "--adam-states",
                                   default=None)
    moe_dispatch: str | None = fact(
        "alltoall (NCCL all-to-all, the default) | dedup (DeepEP: one copy per node)", "--moe-dispatch", default=None)
    moe_overlap: str | None = fact(
        "none | 1f1b (EP all-to-alls under the paired micro-batch's compute: Megatron)", "--moe-overlap", default=None)
    moe_capacity_factor: float | None = fact(
        "tokens each expert takes, as a multiple of its mean (the rest dropped); default: dropless",
        "--moe-capacity-factor", default=None, cli=float, make=positive_option)
    selective: str | None = fact(
        "what --recompute selective keeps: attention (attention core recomputed: Megatron) | op (every other GEMM "
        "output kept: torchtitan) | gemms (every GEMM output kept: this runtime); default: the target's",
        "--selective", default=None)
    sequence_parallel: bool | None = fact("Megatron sequence parallelism", "--sequence-parallel", default=None,
                                          cli=bool, cli_default=False)
    profile: str | None = fact("measured profile to price with", "--profile", default=None, cli=Path)
    memory_limit: float | None = fact("per-GPU limit in GiB", "--memory-limit", default=None, cli=float,
                                      make=positive_option)
    memory_limit_gib: float | None = fact("the same as memory_limit (a batch line's other name for it)",
                                          default=None)
    plan: str | None = fact("price this plan file instead of the degree flags", "--plan", default=None, cli=Path)
    tp_mode: str | None = fact("megatron | tsp: how tensor parallelism shards", "--tp-mode", default=None)
    cp_mode: str | None = fact("ring | ulysses: how context parallelism exchanges", "--cp-mode", default=None)
    cp_rotate: str | None = fact("allgather | alltoall: how a ring moves K/V (default: the target's)", "--cp-rotate",
                                 default=None)
    offload: str | None = fact("none | optimizer | params | activations: what every unit keeps in host memory",
                               "--offload", default=None)
    offload_layers: int | None = fact("with --offload activations: the first N transformer blocks only (Megatron's "
                                      "--cpu-offloading-num-layers)", "--offload-layers", default=None, cli=int,
                                      make=count_option)
    stage_layers: str | list[int] | None = fact(
        "blocks per pipeline stage, per virtual stage in order with --vpp: comma-separated on the command line, a "
        "list in a batch line (an uneven layout; default: as even as possible)", "--stage-layers", default=None)
    target: str | None = fact("price as this trainer runs it (its cross-entropy and gradient dtype), and refuse what "
                              "it cannot express", "--target", default=None)
    calibration: str | None = fact(
        "price with this calibration of your cluster (shardplan calibrate); a plan priced with one is re-priced "
        "with it by default", "--calibration", default=None, cli=Path)
