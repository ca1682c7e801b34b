"""One reference transformer: the profiler measures the blocks the runtime trains (same modules,
parameters, layouts and numbers); only the runtime's parallel parts and the profiler's dropout and
eager attention differ."""

from __future__ import annotations

import pytest
import torch

from profiler import reference_model as ref
from profiler.measure_model import build_stack, cut_config
from profiler.model_config import TransformerConfig
from runtime import model as rt

LLAMA = TransformerConfig(name="llama-like", layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, ffn_hidden=96,
                          activation="swiglu", norm="rmsnorm", position="rope")
GPT = TransformerConfig(name="gpt-like", layers=2, hidden=64, heads=4, vocab=100, bias=True, position="learned")
MOE = TransformerConfig(name="moe-like", layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, activation="swiglu",
                        norm="rmsnorm", position="rope", experts=4, top_k=2, moe_ffn_hidden=32, shared_experts=1)


def test_the_runtime_builds_the_reference_parts() -> None:
    assert issubclass(rt.Block, ref.Block) and issubclass(rt.AttentionCore, ref.AttentionCore)
    assert issubclass(rt.Experts, ref.Experts)
    assert rt.MLP is ref.MLP and rt.MoE is ref.MoE and rt.Activation is ref.Activation
    assert rt.INIT_STD == ref.INIT_STD


@pytest.mark.parametrize("cfg", [LLAMA, GPT, MOE], ids=lambda c: c.name)
def test_profiled_and_trained_blocks_compute_the_same(cfg: TransformerConfig) -> None:
    torch.manual_seed(0)
    stack = build_stack(cut_config(cfg, 2), torch.device("cpu"), torch.float32)
    model = rt.Transformer(cfg)
    blocks = {f"layers.{k}": v for k, v in model.layers.items()}
    trained = {f"{b}.{n}": t for b, blk in blocks.items() for n, t in blk.state_dict().items()}
    profiled = stack.state_dict()
    assert {k: v.shape for k, v in profiled.items()} == {k: v.shape for k, v in trained.items()}
    for b, blk in blocks.items():
        blk.load_state_dict({n.removeprefix(b + "."): t for n, t in profiled.items() if n.startswith(b + ".")})
    x = torch.randn(2, 16, cfg.hidden)
    y = x
    for blk in blocks.values():
        y = blk(y)
    torch.testing.assert_close(stack(x), y, rtol=0, atol=0)


def test_only_the_profiler_runs_dropout_and_eager_attention() -> None:
    cfg = TransformerConfig(name="gpt-drop", layers=1, hidden=64, heads=4, vocab=100, dropout=0.1,
                            attention_impl="eager")
    measured, trained = ref.Block(cfg, 0), rt.Block(cfg, 0)
    assert {"attn.dropout", "mlp.dropout"} <= set(dict(measured.named_modules()))
    assert not {"attn.dropout", "mlp.dropout"} & set(dict(trained.named_modules()))
    assert measured.attn.core.eager and not trained.attn.core.eager
    trained.load_state_dict(measured.state_dict())
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(measured.eval()(x), trained.eval()(x), rtol=1e-5, atol=1e-5)


def test_swiglu_interleaves_gate_and_up() -> None:
    x = torch.tensor([[1.0, 2.0, -1.0, 3.0]])  # (gate, up) pairs: (1, 2), (-1, 3)
    want = torch.stack([torch.nn.functional.silu(torch.tensor(1.0)) * 2, torch.nn.functional.silu(torch.tensor(-1.0)) * 3])
    torch.testing.assert_close(ref.Activation("swiglu")(x)[0], want)
