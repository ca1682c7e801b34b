"""Small analogs of the four headline plans the ``shardplan`` target recommends (``shardplan plan``
defaults: llama3-70b on 1,024 H100, gpt3-175b on 1,024 A100, mixtral-8x22b on 256 H100,
llama3.1-405b on 16,384 H100), on the tiny reference models and 4 ranks: the same features — mesh
axes and modes, per-unit and per-operator sharding, OSDP splits, recomputation — at a size a CPU
trains. Used by ``tests/test_runtime_headline.py`` and ``benchmarks/runtime_families.py``."""

from __future__ import annotations

from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

WORLD = 4
BLOCK_OPS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")

#: name: (tiny model, strategy, what the searched plan has that the analog keeps)
ANALOGS: dict[str, tuple[str, Strategy, str]] = {
    "llama3-70b": ("tiny-llama", Strategy(
        mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", micro_batch=2, default=L(sharding="zero2"),
        layers=[L(unit="embedding", sharding="zero1"), L(unit="layers.0", sharding="zero1"),
                L(unit="head", sharding="zero1")]),
        "dp_shard=128 tp=8 TSP, ZeRO-2 blocks, ZeRO-1 embedding, first blocks and head, 2 micro-batches"),
    "gpt3-175b": ("tiny-gpt", Strategy(
        mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", micro_batch=2, default=L(recompute="selective"),
        layers=[L(unit="embedding", sharding="zero1"),
                *[L(unit=f"layers.{i}.{op}", sharding="zero3", split=2) for i in range(4) for op in BLOCK_OPS],
                L(unit="layers.3", recompute="full"), L(unit="head", recompute="full")]),
        "dp_shard=128 tp=8 TSP, replicated blocks recomputed selectively around ZeRO-3 operators split 4 "
        "ways, full recomputation of the last blocks and the head"),
    "mixtral-8x22b": ("tiny-mixtral", Strategy(
        mesh=Mesh(dp_shard=4, ep=2), micro_batch=1, default=L(sharding="zero3", recompute="selective"),
        layers=[L(unit="embedding", sharding="zero1"), L(unit="embed", sharding="zero3"),
                L(unit="layers.0", sharding="zero1", recompute="selective"),
                L(unit="layers.0.moe.experts", sharding="zero3"),
                L(unit="layers.3", sharding="zero3", recompute="full"),
                L(unit="head", sharding="zero3", recompute="full")]),
        "dp_shard=256 ep=8, ZeRO-3 selective blocks, a ZeRO-1 first block with ZeRO-3 experts, full "
        "recomputation of the last blocks and the head"),
    "llama3.1-405b": ("tiny-llama", Strategy(
        mesh=Mesh(pp=2, cp=2), schedule="zb", micro_batch=1, default=L(sharding="zero1")),
        "pp=64 zero-bubble, cp=4, ZeRO-1 (its dp_shard=8 and tp=8 SP need more than 4 ranks: CP's "
        "sequence split and the pipeline are kept)"),
}
