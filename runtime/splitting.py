"""OSDP operator splitting: a large Linear or embedding becomes ``k`` slices, each its own module.

Each slice can then be its own FSDP unit, so that only one slice's gathered weights are live at
a time. Slices cut the *output* features (rows of a Linear weight, columns of an embedding
table) into ``k`` blocks and concatenate the results, which computes exactly the same numbers as
the unsplit operator (each output element is the same dot product).

With Megatron tensor parallelism a column-parallel Linear (``interleave = tp``) is cut so that
every slice holds the ``j``-th sub-block of each tp rank's rows: column-sharding slice ``j`` then
gives rank ``r`` the ``j``-th part of its unsplit rows, and the concatenation of its slices'
outputs is its unsplit output (heads and SwiGLU pairs stay on their rank).

The LM head of a split tied embedding (:class:`SplitTiedHead`) multiplies each block of hidden
features by its table slice and sums: the same logits, the table shared slice by slice.

The module keeps its path (``layers.3.mlp.up``); its parameters move to ``<path>.slices.<j>``
(``head.parts.<j>`` for a tied head).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import origins


class SplitLinear(nn.Module):
    """``k`` Linear slices over the output features; ``forward`` concatenates them."""

    def __init__(self, linear: nn.Linear, k: int, interleave: int = 1) -> None:
        super().__init__()
        out, inp = linear.weight.shape
        if out % (k * interleave):
            raise ValueError(f"cannot split {out} output features into {k} slices over {interleave} rank(s)")
        step = out // k
        self.in_features, self.out_features = inp, out
        rows = slice_rows(out, k, interleave)
        self.slices = nn.ModuleList()
        for j in range(k):
            s = nn.Linear(inp, step, bias=linear.bias is not None, device=linear.weight.device,
                          dtype=linear.weight.dtype)
            with torch.no_grad():
                s.weight.copy_(linear.weight[rows[j]])
                if linear.bias is not None:
                    s.bias.copy_(linear.bias[rows[j]])
            origins.inherit(s.weight, linear.weight, 0, rows[j])
            if linear.bias is not None:
                origins.inherit(s.bias, linear.bias, 0, rows[j])
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
            origins.inherit(s.weight, emb.weight, 1, slice(j * step, (j + 1) * step))
            self.slices.append(s)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.cat([s(idx) for s in self.slices], dim=-1)


def slice_rows(out: int, k: int, interleave: int = 1) -> torch.Tensor:
    """Row indices of the ``k`` slices, ``(k, out/k)``: contiguous blocks, or with ``interleave``
    ranks the ``j``-th sub-block of each rank's block in slice ``j``."""
    return torch.arange(out).view(interleave, k, out // (interleave * k)).transpose(0, 1).reshape(k, out // k)


class SplitTiedHead(nn.Module):
    """The LM head of a tied embedding split ``k`` ways: ``parts[j]`` is a bias-free Linear whose
    weight is table slice ``j`` (``(vocab, hidden/k)``); the logits sum each part over its block
    of the hidden features."""

    def __init__(self, tables: list[torch.Tensor], share: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList()
        for t in tables:
            part = nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta")
            part.weight = t if share else nn.Parameter(t.detach().clone())  # type: ignore[assignment]
            self.parts.append(part)
        self.in_features = sum(t.shape[1] for t in tables)
        self.out_features = tables[0].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, at = None, 0
        for part in self.parts:
            n = part.in_features
            y = part(x[..., at : at + n])
            out = y if out is None else out + y
            at += n
        return out  # type: ignore[return-value]


def split_tied_head(stage: nn.Module, k: int) -> SplitTiedHead:
    """Split ``stage.head``, tied to the token table, ``k`` ways as the table is: sharing the
    table's slices when the stage holds them, else (a later pipeline stage's copy) its own."""
    emb = getattr(stage, "embed", None)
    if emb is not None and isinstance(emb.tok, SplitEmbedding):
        head = SplitTiedHead([s.weight for s in emb.tok.slices], share=True)
    else:
        w = stage.head.weight
        step = w.shape[1] // k
        head = SplitTiedHead([w[:, j * step : (j + 1) * step] for j in range(k)], share=False)
        for j, part in enumerate(head.parts):
            origins.inherit(part.weight, w, 1, slice(j * step, (j + 1) * step))
    stage.head = head
    return head


def split_module(root: nn.Module, path: str, k: int, interleave: int = 1) -> nn.Module:
    """Replace the Linear or Embedding at ``path`` by its ``k``-way split (a Linear's rows
    interleaved over ``interleave`` tensor-parallel ranks); returns the new module."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    mod = getattr(parent, name)
    if isinstance(mod, nn.Linear):
        new: nn.Module = SplitLinear(mod, k, interleave)
    elif isinstance(mod, nn.Embedding):
        new = SplitEmbedding(mod, k)
    else:
        raise TypeError(f"'{path}' is a {type(mod).__name__}; only Linear and Embedding can be split")
    setattr(parent, name, new)
    return new
