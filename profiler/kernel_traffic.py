"""Bytes the memory-bound kernels of a training step move, counted from the ATen ops they run.

A bandwidth-bound operator costs the bytes its kernels read and write. How many kernels that is
depends on the stack: PyTorch eager runs a decomposed RMSNorm (cast, square, mean, rsqrt, two
multiplies, cast back) and a SwiGLU of two kernels, each a full pass over the activations, and
autograd's backward runs the mirror of every one; a fused stack (Transformer Engine, Apex,
Megatron's fused kernels, ``torch.compile``) runs one kernel each way. This module counts the
traffic of both, ATen op by ATen op under a dispatch mode: every op reads its tensor arguments and
writes its outputs (views move nothing), per element of the operator's input, forward and backward
apart. The counts are exact and machine-independent; ``costmodel.kernels`` holds them as the
bytes each kernel class moves, and a test recounts them.

The eager modules are written as the eager stacks write them (torchtitan's and Hugging Face's
``RMSNorm``, ``F.silu(w1(x)) * w3(x)``, ``F.cross_entropy(logits.float(), target)``); the fused
references are the single native kernels that do the same work (``native_layer_norm`` for a norm,
one pass in and one out for an activation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_FREE = {"aten.detach.default", "aten.view.default", "aten._unsafe_view.default", "aten.expand.default",
         "aten.t.default", "aten.alias.default", "aten.unsqueeze.default", "aten.squeeze.dim",
         "aten.lift_fresh.default", "aten.empty.memory_format", "aten.empty_like.default"}
#: ops that read one element per row of a tensor argument (the target's logit), not the tensor
_GATHERS = {"aten.nll_loss_forward.default": (), "aten.nll_loss_backward.default": (0,)}


class _Count(TorchDispatchMode):
    """Bytes read and written by every ATen op run under it: its tensor arguments read, its outputs
    and the arguments it mutates written (views and allocations are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in _FREE or getattr(func, "is_view", False):
            return out
        read = [args[i] for i in _GATHERS[name]] if name in _GATHERS else [args, kwargs or {}]
        mutated = [a for a, spec in zip(args, func._schema.arguments, strict=False)
                   if spec.alias_info is not None and spec.alias_info.is_write]
        moved = _bytes(read) + _bytes([out, mutated])
        self.bytes += moved
        self.ops.append(name)
        return out


def _bytes(tree: object) -> int:
    """Bytes of the distinct tensors (more than one element) in ``tree``."""
    seen: set[int] = set()
    total = 0
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.numel() > 1 and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class Traffic:
    """Bytes per element of the operator's first input, each way, and the ATen ops that moved them."""

    forward: float
    backward: float
    forward_ops: int
    backward_ops: int


def count(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...], dtype: torch.dtype = torch.bfloat16
          ) -> Traffic:
    """Traffic of ``fn`` on fresh inputs of ``shapes`` (requiring gradients), forward then a
    backward from a gradient of ones, per element of the first input."""
    xs = [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]
    fwd = _Count()
    with fwd:
        y = fn(*xs)
    grad = torch.ones_like(y)
    bwd = _Count()
    with bwd:
        y.backward(grad)
    n = xs[0].numel()
    return Traffic(fwd.bytes / n, bwd.bytes / n, len(fwd.ops), len(bwd.ops))


# ---- the kernels of the stacks ---------------------------------------------------------------

def rmsnorm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """torchtitan's / Hugging Face's RMSNorm, op by op."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def norm_fused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One norm kernel each way (``native_layer_norm``; a fused RMSNorm moves the same bytes)."""
    return F.layer_norm(x, x.shape[-1:], weight)


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU is one native kernel each way, eager or fused."""
    return F.gelu(x)


def cross_entropy_eager(logits: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` on the logits cast to fp32, as the eager stacks call it."""
    target = torch.zeros(logits.shape[0], dtype=torch.long)
    return F.cross_entropy(logits.float(), target)


ROWS, WIDTH = 256, 4096  # shapes of the count: per-row statistics are negligible at this width


def eager_counts() -> dict[str, Traffic]:
    """The traffic of every eager kernel class, per element of its (16-bit) input."""
    rows, w = ROWS, WIDTH
    return {
        "rmsnorm": count(lambda x, g: rmsnorm_eager(x, g), (rows, w), (w,)),
        "layernorm": count(lambda x, g: norm_fused(x, g), (rows, w), (w,)),
        "swiglu": count(swiglu_eager, (rows, w), (rows, w)),
        "gelu": count(gelu, (rows, w)),
        "cross_entropy": count(cross_entropy_eager, (rows, w)),
    }
