"""The cost model's report has one shape, owned by the plan vocabulary: ``Report.to_dict`` writes
exactly the keys of ``vocab.plan`` (``REPORT_KEYS``, ``PredictedTime``, ``PredictedStage``), every
field of the report's dataclasses lands under one of them, and the result validates as ``Predicted``."""

from __future__ import annotations

from dataclasses import fields

import pytest

from costmodel.report import GIB, HOST_KEYS, Report, StageMemory, TimeBreakdown, attribute_of
from vocab.plan import REPORT_KEYS, Predicted, PredictedStage, PredictedTime


def _report(host_gib: float = 3.0) -> Report:
    stages = [StageMemory(0, 0, 1, ["layers.0", "layers.1"], 1 * GIB, 2 * GIB, 3 * GIB, 4 * GIB, 0.5 * GIB, 0.25 * GIB,
                          "backward", 10, 20, 30),
              StageMemory(1, -1, -1, [])]
    time = TimeBreakdown(1.0, 0.25, {"dp": 0.5, "tp": 0.125}, 0.0625, 0.01, 0.02)
    return Report(2.0, 1000.0, 0.4, 0.5, 10.75, time, stages, 80.0, 1e15, 1.3e15, 8, True, ["a note"],
                  host_gib, 100.0 if host_gib else 0.0)


@pytest.mark.parametrize(("cls", "keys"), [(TimeBreakdown, PredictedTime.model_fields),
                                           (StageMemory, PredictedStage.model_fields),
                                           (Report, REPORT_KEYS)], ids=["time", "stage", "report"])
def test_every_field_has_a_key_and_every_key_a_field(cls: type, keys: tuple[str, ...]) -> None:
    obj = {TimeBreakdown: TimeBreakdown(), StageMemory: StageMemory(0, 0, 0, []), Report: _report()}[cls]
    read = {attribute_of(obj, k) for k in keys}  # a key the dataclass cannot answer raises here
    assert {f.name for f in fields(cls)} <= read, "a report field that vocab.plan does not name"
    assert len(read) == len(tuple(keys)), "two report keys read the same field"


def test_the_report_is_the_vocabulary_s_shape() -> None:
    d = _report().to_dict()
    assert tuple(d) == REPORT_KEYS
    assert tuple(d["time"]) == tuple(PredictedTime.model_fields)
    assert all(tuple(s) == tuple(PredictedStage.model_fields) for s in d["stages"])
    p = Predicted(**d)
    assert p.model_dump() == d
    assert d["stages"][0]["params_gib"] == 1.0 and d["stages"][0]["total_gib"] == 10.75
    assert d["time"]["comm_s"] == {"dp": 0.5, "tp": 0.125}


def test_host_keys_only_with_offloaded_states() -> None:
    d = _report(host_gib=0.0).to_dict()
    assert not set(HOST_KEYS) & set(d)
    assert tuple(d) == tuple(k for k in REPORT_KEYS if k not in HOST_KEYS)
    assert Predicted(**d).model_dump() == d


def test_a_report_key_of_the_wrong_type_is_refused() -> None:
    d = _report().to_dict()
    with pytest.raises(ValueError, match="host_per_node_gib"):
        Predicted(**{**d, "host_per_node_gib": -1.0})
    with pytest.raises(ValueError, match="compute_s"):
        Predicted(**{**d, "time": {**d["time"], "compute_s": "fast"}})
