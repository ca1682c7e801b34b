"""OSDP operator splitting: a large Linear or embedding becomes ``k`` slices, each its own module.

Each slice can then be its own FSDP unit, so that only one slice's gathered weights are live at
a time. Slices cut the *output* features (rows of a Linear weight, columns of an embedding
table) into ``k`` contiguous blocks and concatenate the results, which computes exactly the
same numbers as the unsplit operator (each output element is the same dot product).

The module keeps its path (``layers.3.mlp.up``); its parameters move to ``<path>.slices.<j>``.
"""

from __future__ import annotations

import torch
from torch import nn


class SplitLinear(nn.Module):
    """``k`` Linear slices over the output features; ``forward`` concatenates them."""

    def __init__(self, linear: nn.Linear, k: int) -> None:
        super().__init__()
        out, inp = linear.weight.shape
        if out % k:
            raise ValueError(f"cannot split {out} output features into {k} slices")
        step = out // k
        self.in_features, self.out_features = inp, out
        self.slices = nn.ModuleList()
        for j in range(k):
            s = nn.Linear(inp, step, bias=linear.bias is not None, device=linear.weight.device,
                          dtype=linear.weight.dtype)
            with torch.no_grad():
                s.weight.copy_(linear.weight[j * step : (j + 1) * step])
                if linear.bias is not None:
                    s.bias.copy_(linear.bias[j * step : (j + 1) * step])
            self.slices.append(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([s(x) for s in self.slices], dim=-1)


class SplitEmbedding(nn.Module):
    """``k`` embedding tables over the hidden columns; ``forward`` concatenates the lookups."""

    def __init__(self, emb: nn.Embedding, k: int) -> None:
        super().__init__()
        n, d = emb.weight.shape
        if d % k:
            raise ValueError(f"cannot split embedding width {d} into {k} slices")
        step = d // k
        self.num_embeddings, self.embedding_dim = n, d
        self.slices = nn.ModuleList()
        for j in range(k):
            s = nn.Embedding(n, step, device=emb.weight.device, dtype=emb.weight.dtype)
            with torch.no_grad():
                s.weight.copy_(emb.weight[:, j * step : (j + 1) * step])
            self.slices.append(s)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.cat([s(idx) for s in self.slices], dim=-1)


def split_module(root: nn.Module, path: str, k: int) -> nn.Module:
    """Replace the Linear or Embedding at ``path`` by its ``k``-way split; returns the new module."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    mod = getattr(parent, name)
    if isinstance(mod, nn.Linear):
        new: nn.Module = SplitLinear(mod, k)
    elif isinstance(mod, nn.Embedding):
        new = SplitEmbedding(mod, k)
    else:
        raise TypeError(f"'{path}' is a {type(mod).__name__}; only Linear and Embedding can be split")
    setattr(parent, name, new)
    return new
