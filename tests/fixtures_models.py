"""Model factories for the tracer's tests (``tests.fixtures_models:<name>``)."""

from __future__ import annotations

import torch
from torch import nn

D_IN, D_HID, D_OUT = 32, 64, 16


class TinyMLP(nn.Module):
    """Linear -> GELU -> Linear over ``(batch, seq, D_IN)`` inputs."""

    def __init__(self, d_in: int = D_IN, d_hid: int = D_HID, d_out: int = D_OUT) -> None:
        super().__init__()
        self.up = nn.Linear(d_in, d_hid)
        self.act = nn.GELU()
        self.down = nn.Linear(d_hid, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

    def example_inputs(self, batch: int, seq_len: int) -> tuple[torch.Tensor]:
        return (torch.randn(batch, seq_len, self.up.in_features),)


def tiny_mlp() -> TinyMLP:
    return TinyMLP()


def tiny_mlp_seq(seq_len: int) -> TinyMLP:
    """A factory that takes ``seq_len`` (the tracer passes it); the hidden width shows it."""
    return TinyMLP(d_hid=seq_len)


def no_inputs() -> nn.Module:
    """Neither an ``example_inputs`` method nor an HF config: the tracer cannot guess inputs."""
    return nn.Sequential(nn.Linear(4, 4))


def not_a_module() -> int:
    return 3


NOT_CALLABLE = 42


def tiny_llama() -> nn.Module:
    """A 2-layer Llama from ``transformers`` (inputs guessed from ``config.vocab_size``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA_KW))


LLAMA_KW = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=128, max_position_embeddings=256, use_cache=False,
)
