"""Hugging Face safetensors weights loaded into the reference model shard by shard.

A Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``) of a Llama-style or GPT-2
model gives the reference model's config (:func:`profiler.models.config_from_hf`) and the values of
each parameter part a rank holds (:func:`values`, the ``init`` of ``apply_plan``): every row of the
reference model's parameter comes from a row (GPT-2's ``Conv1D``: a column) of one checkpoint
tensor, and only the rows a rank holds are read, through ``safe_open(...).get_slice``.

Layouts (:mod:`runtime.model`): the fused ``attn.qkv`` rows are ordered per KV group —
``[q heads of the group, k, v]`` — from Llama's ``q_proj``, ``k_proj``, ``v_proj`` (GPT-2's
``c_attn`` columns ``[q | k | v]``); the SwiGLU ``mlp.up`` rows interleave ``gate_proj`` and
``up_proj`` row by row. The reference model's RMSNorm epsilon is 1e-6 (a checkpoint trained with
another one computes slightly other norms).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from profiler.model_config import TransformerConfig
from runtime.origins import Origin
from vocab.errors import ShardplanError, shown

#: a source of rows: (checkpoint tensor, its rows (or columns: transposed) for each of ours)
Rows = list[tuple[str, torch.Tensor, bool]]


def read_config(path: str | Path) -> tuple[TransformerConfig, str]:
    """The reference model's config of the checkpoint directory ``path``, and its family (llama, gpt2)."""
    from profiler.models import config_from_hf

    p = Path(path)
    try:
        conf = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ShardplanError(f"cannot read {shown(str(p / 'config.json'))}: {e}") from None
    cfg = config_from_hf(conf, name=p.name or "hf-model")
    family = "gpt2" if cfg.norm == "layernorm" and cfg.position == "learned" else "llama"
    if not _files(str(p)):
        raise ShardplanError(f"no *.safetensors file in {shown(str(p))}")
    return cfg, family


@cache
def _files(path: str) -> dict[str, str]:
    """Checkpoint tensor name → file, over the directory's safetensors files."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: str(f) for k in h.keys()})  # noqa: SIM118 (a safe_open handle, not a dict)
    return out


def _qkv_rows(cfg: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """For each fused QKV row: which of q, k, v (0, 1, 2) and its row there."""
    g, d = cfg.heads // cfg.kv_heads, cfg.head_dim
    r = torch.arange((cfg.heads + 2 * cfg.kv_heads) * d)
    grp, w = r // ((g + 2) * d), r % ((g + 2) * d)
    which = torch.where(w < g * d, 0, torch.where(w < (g + 1) * d, 1, 2))
    row = torch.where(which == 0, grp * g * d + w, grp * d + w - torch.where(which == 1, g * d, (g + 1) * d))
    return which, row


def sources(name: str, cfg: TransformerConfig, family: str, have: dict[str, str]) -> Rows:
    """Where each row of reference parameter ``name`` comes from: per checkpoint tensor, the rows it
    gives (``-1``: none) and whether it is stored transposed (GPT-2's ``Conv1D``)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    i, rest = (m.group(1), m.group(2)) if m else ("", name)
    rows = _llama(i, rest, cfg) if family == "llama" else _gpt2(i, rest, cfg)
    out = []
    for src, idx, t in rows:
        key = next((k for k in (src, f"model.{src}", f"transformer.{src}") if k in have), None)
        if key is None and src == "lm_head.weight":  # a tied head: the token table
            key = next((k for k in ("model.embed_tokens.weight", "transformer.wte.weight", "wte.weight") if k in have), None)
        if key is None:
            raise ShardplanError(f"the checkpoint has no tensor for {shown(name)} (looked for {shown(src)})")
        out.append((key, idx, t))
    return out


def _pick(n: int, which: torch.Tensor, k: int, row: torch.Tensor) -> torch.Tensor:
    return torch.where(which == k, row, torch.full((n,), -1))


def _llama(i: str, rest: str, cfg: TransformerConfig) -> Rows:
    blk = f"layers.{i}."
    if rest == "attn.qkv.weight":
        which, row = _qkv_rows(cfg)
        n = len(row)
        return [(f"{blk}self_attn.{p}_proj.weight", _pick(n, which, k, row), False) for k, p in enumerate("qkv")]
    if rest == "mlp.up.weight":
        r = torch.arange(2 * cfg.ffn_hidden)
        return [(f"{blk}mlp.gate_proj.weight", torch.where(r % 2 == 0, r // 2, -1), False),
                (f"{blk}mlp.up_proj.weight", torch.where(r % 2 == 1, r // 2, -1), False)]
    names = {"attn.out.weight": "self_attn.o_proj.weight", "mlp.down.weight": "mlp.down_proj.weight",
             "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
    top = {"embed.tok.weight": "embed_tokens.weight", "final_norm.weight": "norm.weight", "head.weight": "lm_head.weight"}
    if i and rest in names:
        return [(blk + names[rest], torch.arange(_rows(rest, cfg)), False)]
    if not i and rest in top:
        return [(top[rest], torch.arange(_rows(rest, cfg)), False)]
    raise ShardplanError(f"no Llama checkpoint tensor holds {shown(rest)}")


def _gpt2(i: str, rest: str, cfg: TransformerConfig) -> Rows:
    blk = f"h.{i}."
    if rest in ("attn.qkv.weight", "attn.qkv.bias"):
        which, row = _qkv_rows(cfg)  # MHA: one head per group, [q, k, v] of c_attn's columns
        col = which * cfg.hidden + row
        return [(f"{blk}attn.c_attn.{rest.rsplit('.', 1)[1]}", col, rest.endswith("weight"))]
    conv = {"attn.out": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
    norms = {"attn_norm": "ln_1", "mlp_norm": "ln_2"}
    op, _, kind = rest.rpartition(".")
    if i and op in conv:
        return [(f"{blk}{conv[op]}.{kind}", torch.arange(_rows(rest, cfg)), kind == "weight")]
    if i and op in norms:
        return [(f"{blk}{norms[op]}.{kind}", torch.arange(cfg.hidden), False)]
    top = {"embed.tok.weight": "wte.weight", "embed.pos.weight": "wpe.weight", "final_norm.weight": "ln_f.weight",
           "final_norm.bias": "ln_f.bias", "head.weight": "lm_head.weight"}
    if not i and rest in top:
        return [(top[rest], torch.arange(_rows(rest, cfg)), False)]
    raise ShardplanError(f"no GPT-2 checkpoint tensor holds {shown(rest)}")


def _rows(rest: str, cfg: TransformerConfig) -> int:
    """Rows of a reference parameter (dimension 0)."""
    if rest.startswith(("embed.tok", "head")):
        return cfg.vocab
    if rest.startswith("embed.pos"):
        return cfg.max_seq
    if rest.startswith("mlp.up"):
        return cfg.ffn_hidden
    return cfg.hidden


def _runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position in ``idx``, first value, length) of its runs of consecutive values."""
    out, start = [], 0
    for j in range(1, len(idx) + 1):
        if j == len(idx) or int(idx[j]) != int(idx[j - 1]) + 1:
            out.append((start, int(idx[start]), j - start))
            start = j
    return out


def read(o: Origin, src: Rows, files: dict[str, str]) -> torch.Tensor:
    """The part ``o`` of a reference parameter from the checkpoint rows ``src`` (fp32)."""
    from safetensors import safe_open

    out = torch.empty(o.local_shape)
    want = o.index[0]
    for key, rows, transposed in src:
        take = rows[want]
        at = torch.nonzero(take >= 0).flatten()
        if len(at) == 0:
            continue
        with safe_open(files[key], framework="pt") as h:
            sl = h.get_slice(key)
            for pos, first, n in _runs(take[at]):
                part = (sl[:, first : first + n].t() if transposed else sl[first : first + n]).float()
                for d, idx in enumerate(o.index[1:], start=1):
                    part = part.index_select(d, idx)
                out[at[pos : pos + n]] = part
    return out


def values(path: str | Path) -> Callable[[Origin], torch.Tensor]:
    """The ``init`` of ``apply_plan`` that reads each parameter part from the checkpoint at ``path``."""
    cfg, family = read_config(path)
    files = _files(str(path))
    return lambda o: read(o, sources(o.name, cfg, family, files), files)
