"""The headline plans' analogs (:mod:`tests.headline_analogs`) train in bf16 on 4 ranks as priced:
like one process in bf16 (``runtime.train.parity_tolerance``), with the state bytes a bf16 workload
prices, and with identical losses run to run (a MoE router fed uninitialised tensors, or an expert
load counted twice, would make them differ)."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.launch import Job, launch
from runtime.model import spec_for
from runtime.train import TrainSettings
from tests.headline_analogs import ANALOGS, WORLD
from tests.runtime_checks import assert_parity, predicted_state_bytes, state_bytes

pytestmark = pytest.mark.slow
BF16 = TrainSettings(steps=2, global_batch=8, seq_len=32, seed=0, precision="bf16")
TWICE = ("gpt3-175b", "mixtral-8x22b")  # run twice: nested units under recomputation, routing
#: (the benchmark runs each analog 10 times: benchmarks/runtime_families.py --headline)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], dict[str, Any]]:
    jobs = [Job(model=spec_for(m), plan_json=s.model_dump_json(), settings=BF16.to_dict(), name=f"{name}/{run}",
                reference=True) for name, (m, s, _) in ANALOGS.items() for run in ("a", "b")[: 1 + (name in TWICE)]]
    return {tuple(r["name"].split("/")): r for r in launch(jobs, WORLD)}  # type: ignore[misc]


@pytest.mark.parametrize("name", list(ANALOGS))
def test_the_headline_analogs_train_in_bf16_as_priced(runs: dict, name: str) -> None:
    model, s, _ = ANALOGS[name]
    a = runs[(name, "a")]
    assert_parity(a)
    assert state_bytes(a) == predicted_state_bytes(model, s, WORLD, BF16)
    if name in TWICE:
        assert [st["loss"] for st in a["steps"]] == [st["loss"] for st in runs[(name, "b")]["steps"]]  # bit for bit
