"""One pipeline layout: the blocks the cost model prices on each pipeline rank are the blocks the
runtime cuts for that rank (``Strategy.stage_layout``: the extra blocks on the middle stages)."""

from __future__ import annotations

import pytest
import torch

from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.transformer import build_graph
from runtime.model import Transformer
from runtime.pipeline import rank_stage_modules
from vocab.strategy import Mesh, Strategy, Workload, even_split, rank_blocks

SIX = TransformerConfig(name="six-blocks", layers=6, hidden=32, heads=2, kv_heads=2, vocab=64, max_seq=32,
                        ffn_hidden=64, activation="swiglu", norm="rmsnorm", position="rope", bias=False)
SEQ = 16

UNEVEN = {
    "pp4": Strategy(mesh=Mesh(pp=4), schedule="1f1b"),
    "pp2_vpp2": Strategy(mesh=Mesh(pp=2), schedule="interleaved", vpp=2),
    "pp4_zb": Strategy(mesh=Mesh(pp=4), schedule="zb"),
    "pp2_given": Strategy(mesh=Mesh(pp=2), schedule="gpipe", stage_layers=[4, 2]),
}


def test_even_split_puts_the_extra_blocks_on_the_middle_stages() -> None:
    assert even_split(6, 4) == [1, 2, 2, 1]
    assert even_split(10, 4) == [2, 3, 3, 2]
    assert even_split(7, 3) == [2, 3, 2]
    assert even_split(8, 4) == [2] * 4
    s = UNEVEN["pp2_vpp2"]
    assert s.stage_layout(6) == [1, 2, 2, 1]
    assert [list(r) for r in s.stage_blocks(6)] == [[0], [1, 2], [3, 4], [5]]
    assert s.rank_stages(0) == [0, 2] and s.rank_stages(1) == [1, 3]
    assert s.rank_blocks(6) == rank_blocks(6, 2, 2) == [[0, 3, 4], [1, 2, 5]]
    assert UNEVEN["pp2_given"].stage_layout(6) == [4, 2]


def _priced(s: Strategy) -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank, from the cost model's report: (blocks, holds the embedding, holds the head)."""
    w = Workload(seq_len=SEQ, global_batch=8, precision="fp32")
    report = estimate(build_graph(SIX, SEQ), parse_cluster(f"{s.mesh.world_size}xcpu"), s, w)
    out = []
    for r, st in enumerate(report.stages):
        assert st.stage == r
        blocks = [int(u.split(".")[1]) for u in st.units if u.startswith("layers.")]
        assert (st.first_block, st.last_block) == (min(blocks), max(blocks))
        out.append((sorted(blocks), "embedding" in st.units, "head" in st.units))
    return out


def _cut(s: Strategy) -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank, from the runtime's stage cutting (what ``build_pipeline`` runs on each rank)."""
    with torch.device("meta"):
        model = Transformer(SIX)
    out = []
    for r in range(s.mesh.pp):
        mods, ids = rank_stage_modules(model, s, r)
        assert ids == s.rank_stages(r)
        blocks = sorted(int(k) for m in mods for k in m.layers)
        out.append((blocks, any(m.embed is not None for m in mods), any(m.head is not None for m in mods)))
    return out


@pytest.mark.parametrize("name", list(UNEVEN))
def test_runtime_cuts_the_blocks_the_cost_model_priced(name: str) -> None:
    s = UNEVEN[name]
    priced, cut = _priced(s), _cut(s)
    assert cut == priced
    assert [b for b, _, _ in cut] == s.rank_blocks(SIX.layers)
    if name == "pp4":  # the middle ranks hold the extra blocks
        assert [b for b, _, _ in cut] == [[0], [1, 2], [3, 4], [5]]


def test_class_front_is_the_front_of_every_choice() -> None:
    """n identical blocks, each with one of k (time, memory) options: the front built block by
    block equals the Pareto front of all C(n + k - 1, k - 1) multisets, within the room."""
    from itertools import combinations_with_replacement

    from solvers.stage_tables import class_front, pareto_front

    opts = [(5.0, 1.0, 0), (3.0, 2.5, 1), (2.0, 4.0, 2), (4.0, 1.5, 3), (6.0, 0.5, 4)]
    for n in (1, 3, 6):
        for room in (1e9, 2.0 * n, 1.0 * n):
            every = [(sum(opts[i][0] for i in c), sum(opts[i][1] for i in c), c)
                     for c in combinations_with_replacement(range(len(opts)), n)]
            want = pareto_front([x for x in every if x[1] <= room])
            got = class_front(opts, n, room)
            assert [(t, m) for t, m, _ in got] == [(t, m) for t, m, _ in want]
            for t, m, comp in got:  # each point's options add up to it
                assert len(comp) == n and sum(opts[i][0] for i in comp) == t and sum(opts[i][1] for i in comp) == m
