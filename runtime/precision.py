"""Mixed precision for every unit of a plan, as the cost model prices ``workload.precision``.

Under ``bf16`` (and ``fp8``, whose non-GEMM work is bf16) every parameter computes in bf16 and the
optimizer steps fp32 master weights; gradients are accumulated and reduced in the plan's
``workload.grad_dtype`` (fp32 by default: Megatron's ``main_grad``, FSDP2's fp32 ``reduce_dtype``):

===============================  ==============================================================
unit sharding                    how
===============================  ==============================================================
``zero3``, ``zero3_keep``        FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype)``:
                                 the sharded fp32 parameter is the master, cast to bf16 when
                                 gathered (the cost model's ``zero3_master = parameter``)
``replicate``, ``zero1/2``       the parameter itself becomes bf16 (whatever else applies to it:
(TP/TSP, CP, PP, EP alike)       DTensor TP shards, TSP ring shards, experts, pipeline stages);
                                 :class:`runtime.zero.ReplicatedParams` keeps its fp32 master
                                 (whole, or this rank's ``1/N`` slice under ZeRO-1/2), moves each
                                 bf16 gradient into an fp32 buffer as it is accumulated, reduces
                                 that, steps the master and copies it back (all-gathered in bf16
                                 under ZeRO-1/2)
===============================  ==============================================================

So activations are bf16 everywhere (attention, norms, the ring shards TSP sends, the activations
pipeline stages pass on), the loss is computed on fp32 logits, and the per-rank state is what the
cost model prices: 2 + 4 + 12 bytes per parameter for replicated units, 4 + 4 + 8 for FSDP2's.
:func:`problems` is the check ``runtime.apply.check_plan`` runs before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from vocab.errors import shown

PRECISIONS = ("fp32", "bf16", "fp8")
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """What a run computes in (``name``: fp32, bf16 or fp8) and reduces gradients in (``grad_dtype``)."""

    name: str = "fp32"
    grad_dtype: str = "fp32"

    @property
    def low(self) -> bool:
        """Parameters compute in bf16 (bf16 and fp8 runs)."""
        return self.name != "fp32"

    @property
    def compute(self) -> torch.dtype:
        return torch.bfloat16 if self.low else torch.float32

    @property
    def reduce(self) -> torch.dtype:
        return GRAD_DTYPES[self.grad_dtype] if self.low else torch.float32

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy for the ZeRO-3 units: bf16 gathers and compute, gradients reduced in ``reduce``."""
        if not self.low:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)


def of_policy(mp: MixedPrecisionPolicy | None) -> Precision:
    """The :class:`Precision` an FSDP2 policy given to ``apply_plan`` stands for (fp32 when None)."""
    if mp is None or mp.param_dtype in (None, torch.float32):
        return Precision()
    reduce = mp.reduce_dtype or mp.param_dtype
    return Precision("bf16", "bf16" if reduce == torch.bfloat16 else "fp32")


def problems(precision: str, grad_dtype: str = "fp32") -> list[str]:
    """Why the runtime cannot train at ``precision`` with ``grad_dtype`` gradients (empty when it can)."""
    out = []
    if precision not in PRECISIONS:
        out.append(f"precision {shown(precision)} is not one of {', '.join(PRECISIONS)}")
    if grad_dtype not in GRAD_DTYPES:
        out.append(f"gradient dtype {shown(grad_dtype)} is not one of {', '.join(GRAD_DTYPES)}")
    if precision == "fp8":
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            out.append("fp8 training needs torchao: pip install torchao==0.18.0")
    return out


def to_dtype(params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """Make each parameter ``dtype`` in place, keeping the Parameter object (a tied weight, an
    FSDP ``ignored_params`` entry and the optimizer's references stay valid), its attributes and
    its gradient hooks, DTensors included."""
    for p in params:
        if p.dtype == dtype:
            continue
        post, pre, attrs = p._post_accumulate_grad_hooks, p._backward_hooks, dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
        p.__dict__.update(attrs)  # swapped with the tensors: its origin (runtime.origins) and the like
        # the hooks' dicts follow the Parameter object, not the autograd metadata that makes them
        # run: setting them again installs them on the swapped tensor (TP's gradient layouts, ...)
        if post is not None:
            p._post_accumulate_grad_hooks = post
        if pre is not None:
            p._backward_hooks = pre
