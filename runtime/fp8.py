"""fp8 training of the Linear layers on CUDA: torchao's float8 training, as torchtitan applies it.

``convert`` swaps each eligible ``nn.Linear`` of the blocks for torchao's ``Float8Linear``
(``convert_to_float8_training``, dynamic tensorwise scaling: inputs and weights cast to e4m3,
output gradients to e5m2, GEMMs through ``torch._scaled_mm``) before tensor parallelism and FSDP
are applied; Megatron TP then uses torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
on them (:func:`tp_style`). Everything else (norms, attention, the loss) runs in bf16 under FSDP2's
``MixedPrecisionPolicy``. Eligible: Linear layers whose input and output widths divide by 16 (the
fp8 GEMM's alignment), not the LM head nor a MoE router (torchtitan leaves both in bf16).

fp8 GEMMs need CUDA with compute capability 8.9 or more (Ada, Hopper, Blackwell): elsewhere, on
CPU too, ``convert`` changes nothing and returns a note saying so. torchao is an optional
dependency (``pip install torchao==0.18.0``; it requires nothing, so it never moves torch). TSP's
ring layers (:mod:`runtime.tsp`) compute their shards with ``F.linear``: they stay bf16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vocab.errors import ShardplanError

#: compute capability from which ``torch._scaled_mm`` runs fp8 GEMMs
MIN_CAPABILITY = (8, 9)
#: the fp8 GEMM's alignment: both widths of a converted layer divide by it
ALIGN = 16


def eligible(module: nn.Module, fqn: str) -> bool:
    """Whether ``convert`` swaps ``module`` (at path ``fqn``) for a float8 Linear."""
    last = fqn.rsplit(".", 1)[-1]
    head = last.endswith("head") or ".head." in f".{fqn}."  # the LM head (lm_head), split or not
    return (isinstance(module, nn.Linear) and not head and last != "router"
            and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0)


def unsupported(device_type: str) -> str | None:
    """Why this device cannot run fp8 GEMMs, or None when it can."""
    if device_type != "cuda":
        return f"fp8 requested: a no-op on {device_type} (fp8 GEMMs need CUDA, compute capability >= 8.9); bf16 used"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return f"fp8 requested: a no-op on compute capability {cap[0]}.{cap[1]} (fp8 GEMMs need >= 8.9); bf16 used"
    return None


def _torchao() -> Any:
    try:
        from torchao import float8
    except ImportError:
        raise ShardplanError("fp8 training needs torchao: pip install torchao==0.18.0") from None
    return float8


def convert(stage: nn.Module, device_type: str, force: bool = False) -> list[str]:
    """Swap the eligible Linear layers of ``stage`` for float8 ones; the notes say what was not done.
    ``force`` converts whatever the device (tests check the conversion on CPU, where torch emulates
    the fp8 GEMM)."""
    why = None if force else unsupported(device_type)
    if why is not None:
        return [why]
    float8 = _torchao()
    float8.convert_to_float8_training(stage, config=float8.Float8LinearConfig(), module_filter_fn=eligible)
    return []


def converted(stage: nn.Module) -> list[str]:
    """Paths of the float8 Linear layers of ``stage``."""
    return [n for n, m in stage.named_modules() if type(m).__name__ == "Float8Linear"]


def tp_style(style: Any, module: nn.Module) -> Any:
    """``style`` for ``module``: a Colwise/RowwiseParallel on a float8 Linear becomes torchao's
    float8 version with the same layouts (casts to fp8 before the TP collectives' GEMMs)."""
    if type(module).__name__ != "Float8Linear":
        return style
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else (
        Float8RowwiseParallel if isinstance(style, RowwiseParallel) else None)
    if cls is None:
        return style
    return cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
               use_local_output=style.use_local_output)
