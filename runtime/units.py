"""Which plan entry governs a unit, operator or parameter, and which operators a plan splits.

Names are the layer graph's (``embed``, ``layers.3.mlp.up``, ``final_norm``, ``head``); units are
``embedding``, ``layers.<i>`` and ``head``. The most specific entry wins: an operator's entry
beats its unit's, which beats ``Strategy.default``.
"""

from __future__ import annotations

from torch import nn

from runtime.adapters import ModelAdapter
from vocab.strategy import LayerStrategy, Strategy


def unit_of(gname: str) -> str:
    """The unit (``embedding``, ``layers.<i>``, ``head``) a graph operator name belongs to."""
    if gname.startswith("layers."):
        return ".".join(gname.split(".")[:2])
    return "embedding" if gname.startswith("embed") else "head"


def resolve(strategy: Strategy, gname: str) -> LayerStrategy:
    """The most specific entry of ``strategy`` for graph operator (or parameter path) ``gname``."""
    unit = unit_of(gname)
    best, score = strategy.default, 0
    for ls in strategy.layers:
        u = ls.unit
        if u in ("embedding", "head") and u == unit:
            s = 2
        elif gname == u or gname.startswith(u + "."):  # layers.<i>[.op...] or a top-level op
            s = len(u.split(".")) + (0 if u.startswith("layers.") else 2)
        else:
            continue
        if s > score:
            best, score = ls, s
    return best


def graph_name(ad: ModelAdapter, path: str) -> str:
    """Graph name of a module/parameter path (identity for the reference model)."""
    if ad.kind == "reference":
        return path
    best, best_len = "", -1
    for op, paths in ad.top.items():
        for p in paths:
            if (path == p or path.startswith(p + ".")) and len(p) > best_len:
                best, best_len = op, len(p)
    if path.startswith(ad.block_prefix):
        i = path[len(ad.block_prefix):].split(".")[0]
        base = f"{ad.block_prefix}{i}"
        best, best_len = f"layers.{i}", len(base)
        for op, paths in ad.in_block.items():
            for p in paths:
                full = f"{base}.{p}"
                if (path == full or path.startswith(full + ".")) and len(full) > best_len:
                    best, best_len = f"layers.{i}.{op}", len(full)
    return best or "embed"


#: Operators a unit-level ``split`` slices in the reference model (Linear and embedding tables).
UNIT_SPLITS = {"embedding": ("embed.tok", "embed.pos"), "head": ("head",)}
BLOCK_SPLITS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
#: operators Megatron TP shards by output features (their slices interleave the tp ranks' rows)
COLUMN_PARALLEL = ("attn.qkv", "mlp.up", "head")


def slice_interleave(strategy: Strategy, path: str) -> int:
    """Over how many tensor-parallel ranks the OSDP slices of the Linear at ``path`` interleave
    their rows: ``tp`` for a column-parallel layer under Megatron TP, else 1."""
    return strategy.mesh.tp if strategy.tp_mode == "megatron" and path.endswith(COLUMN_PARALLEL) else 1


def split_targets(ad: ModelAdapter, strategy: Strategy, root: nn.Module | None = None) -> list[tuple[str, int]]:
    """(module path, k) for every operator the plan splits ``k > 1`` ways, present in ``root``."""
    root = root if root is not None else ad.model
    names = {n for n, _ in root.named_modules()}
    cands: list[str] = []
    for u in ad.units():
        if u in UNIT_SPLITS:
            cands += UNIT_SPLITS[u]
        else:
            cands += [f"{u}.{op}" for op in BLOCK_SPLITS]
    cands += [ls.unit for ls in strategy.layers if ls.unit not in ad.units() and ls.split > 1]
    out: list[tuple[str, int]] = []
    for path in dict.fromkeys("embed.tok" if c == "embed" else c for c in cands):  # the graph's embed: its table
        k = resolve(strategy, path).split
        if k == 1:
            continue
        if ad.kind == "reference" and path not in names:
            continue
        if path == "head" and ad.tied:
            continue  # a tied head has no weight of its own: it follows the table's split
        out.append((path, k))
    return out
