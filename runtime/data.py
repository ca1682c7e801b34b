"""Training data: a token file read through a memory map, or seeded synthetic tokens.

A token file is a flat array of token ids: ``.npy`` (any unsigned or signed integer dtype, read with
``numpy.load(mmap_mode="r")``) or raw ``.bin`` (``uint16``, nanoGPT's format; ``uint32`` with the
``.u32.bin`` suffix). Step ``k`` reads ``global_batch`` windows of ``seq_len + 1`` tokens, window
``i`` starting at ``(k·global_batch + i)·seq_len`` (wrapping round the file): consecutive steps
read the file in order, and every rank reads the same windows (each then keeps its rows and
tokens, :func:`runtime.train.local_batch`). Only the windows a step reads are paged in.

Without a file, step ``k`` of seed ``s`` draws ``global_batch`` sequences of uniform tokens from a
generator seeded with ``(s, k)`` (:func:`synthetic_batch`).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vocab.errors import ShardplanError, shown

#: tokens checked against the vocabulary when a file is opened (larger files: each step's windows)
CHECK_ALL_BELOW = 1 << 26


def synthetic_batch(step: int, seed: int, global_batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of ``step``, each ``(global_batch, seq_len)``: uniform tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    data = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@cache
def _open(path: str) -> np.ndarray:
    p = Path(path)
    try:
        if p.suffix == ".npy":
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        else:
            arr = np.memmap(p, dtype=np.uint32 if p.name.endswith(".u32.bin") else np.uint16, mode="r")
    except (OSError, ValueError) as e:
        raise ShardplanError(f"cannot read token file {shown(str(p))}: {e}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ShardplanError(f"token file {shown(str(p))} is not a flat array of integer token ids "
                             f"({arr.ndim}-d {arr.dtype})")
    return arr


@cache
def open_tokens(path: str, vocab: int, seq_len: int) -> np.ndarray:
    """The memory-mapped token ids of ``path``, checked: long enough for one window, and (up to
    :data:`CHECK_ALL_BELOW` tokens) every id below ``vocab``."""
    arr = _open(str(path))
    if len(arr) < seq_len + 1:
        raise ShardplanError(f"token file {shown(str(path))} holds {len(arr):,} tokens, fewer than one "
                             f"sequence of {seq_len + 1}")
    if len(arr) <= CHECK_ALL_BELOW:
        _check_ids(arr, vocab, path)
    return arr


def _check_ids(ids: Any, vocab: int, path: str | Path) -> None:
    hi, lo = int(np.max(ids)), int(np.min(ids))
    if lo < 0 or hi >= vocab:
        raise ShardplanError(f"token file {shown(str(path))} holds token id {hi if hi >= vocab else lo}, outside "
                             f"the model's vocabulary of {vocab:,}")


def file_batch(path: str | Path, step: int, global_batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of ``step`` read from the token file at ``path``."""
    arr = open_tokens(str(path), vocab, seq_len)
    span = len(arr) - seq_len  # window starts
    rows = []
    for i in range(global_batch):
        at = ((step * global_batch + i) * seq_len) % span
        rows.append(np.asarray(arr[at : at + seq_len + 1], dtype=np.int64))
    data = np.stack(rows)
    if len(arr) > CHECK_ALL_BELOW:
        _check_ids(data, vocab, path)
    t = torch.from_numpy(data)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
