"""``headroom_gib``: the search leaves that much of the memory limit free, the plan records it, and
its memory line says so."""

from __future__ import annotations

import pytest

from planner.api import search_plan
from planner.reprice import headroom_text
from planner.request import Request
from vocab.errors import ShardplanError

KW = dict(seq_len=8192, global_batch=32, top_k=1)


def test_headroom_is_the_limit_less_what_the_plan_keeps_free() -> None:
    kept = search_plan(Request("llama3-8b", "16xh100", memory_limit_gib=20.0, headroom_gib=6.0, **KW)).plan
    under = search_plan(Request("llama3-8b", "16xh100", memory_limit_gib=14.0, **KW)).plan
    assert kept.strategy == under.strategy and kept.predicted.step_time_s == under.predicted.step_time_s
    assert kept.inputs.memory_limit_gib == 14.0 and kept.solver.options["headroom_gib"] == 6.0
    assert kept.predicted.memory_peak_gib <= 14.0
    assert "headroom_gib" not in under.solver.options


def test_the_memory_line_names_the_headroom() -> None:
    p = search_plan(Request("llama3-8b", "16xh100", headroom_gib=4.0, **KW)).plan
    assert headroom_text(p) == "device 79.65 GiB, 5% reserved, 4 GiB headroom"


@pytest.mark.parametrize("h", [-1.0, 20.0, float("nan")])
def test_a_headroom_outside_the_limit_is_one_error(h: float) -> None:
    with pytest.raises(ShardplanError, match="^headroom must be at least 0 GiB and below the 20.00 GiB memory limit"):
        search_plan(Request("llama3-8b", "16xh100", memory_limit_gib=20.0, headroom_gib=h, **KW))
