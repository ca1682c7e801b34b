"""fp8 Linear layers (:mod:`runtime.fp8`): which layers torchao's float8 training converts, a
no-op with a note where fp8 GEMMs cannot run, and the converted model trains (on CPU torch
emulates the fp8 GEMM, so the conversion itself is checked here; CUDA runs it for real)."""

from __future__ import annotations

import pytest
import torch

from runtime import fp8
from runtime.model import TINY_MODELS, Transformer, lm_loss


def _model(name: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY_MODELS[name])


def test_cpu_is_a_no_op_with_a_note() -> None:
    m = _model("tiny-llama")
    notes = fp8.convert(m, "cpu")
    assert notes and "no-op on cpu" in notes[0] and fp8.converted(m) == []


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
def test_the_blocks_linear_layers_are_converted_not_the_head_or_router(name: str) -> None:
    m = _model(name)
    assert fp8.convert(m, "cpu", force=True) == []
    cfg = TINY_MODELS[name]
    ops = ("attn.qkv", "attn.out") + (("mlp.up", "mlp.down") if not cfg.is_moe else ())
    assert sorted(fp8.converted(m)) == sorted(f"layers.{i}.{op}" for i in range(cfg.layers) for op in ops)
    assert type(m.head).__name__ == "Linear"


def test_a_misaligned_layer_stays_bf16() -> None:
    lin = torch.nn.Linear(64, 24)
    assert fp8.eligible(torch.nn.Linear(64, 32), "layers.0.mlp.up") and not fp8.eligible(lin, "layers.0.mlp.up")
    assert not fp8.eligible(torch.nn.Linear(64, 256), "lm_head")
    assert not fp8.eligible(torch.nn.Linear(64, 256), "head.slices.0")


def test_the_converted_model_trains_close_to_full_precision() -> None:
    """fp8 GEMMs round inputs and weights to 3 mantissa bits: the loss moves, but little."""
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    ref = _model("tiny-llama")
    want = lm_loss(ref(x[:, :-1]), x[:, 1:]).detach()
    m = _model("tiny-llama")
    fp8.convert(m, "cpu", force=True)
    got = lm_loss(m(x[:, :-1]), x[:, 1:])
    got.backward()
    assert float(got.detach()) != float(want) and float(got.detach()) == pytest.approx(float(want), rel=2e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
