"""Where an fp8 run's experts run in fp8 (``Workload.low_precision_experts``): always on Megatron
(Transformer Engine's GroupedLinear); on torchtitan 0.2.2 only through its grouped-GEMM converter, whose
float8 form refuses pipelines and context parallelism, so there an fp8 plan's experts are priced in bf16.
The export writes the converter exactly where the price runs the experts in fp8, and the import reads
it back to the same price."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from costmodel.kernels import experts_low_precision
from planner.trainers import ConfigError, export, import_plan
from tests.test_explain import make_plan
from tests.trainer_loaders import trainer_loader
from vocab.plan import PlanError, TargetRef, parse_plan

TT = TargetRef(name="torchtitan", version="0.2.2")
TT_RUNS = {"zero3_master": "parameter", "selective": "op"}  # how torchtitan runs the rest
FLAT = {"mesh": {"dp_shard": 16, "ep": 8}, "micro_batch": 1, "default": {"sharding": "zero3"}}
PIPED = {"mesh": {"pp": 2, "dp_shard": 8, "ep": 8}, "micro_batch": 1, "default": {"sharding": "zero3"}}


def mixtral(strategy: dict[str, Any], experts: str, precision: str = "fp8", target: TargetRef = TT) -> Any:
    return make_plan(strategy, model="mixtral-8x7b", precision=precision, target=target,
                     low_precision_experts=experts, **TT_RUNS)


def test_the_rule_per_mesh() -> None:
    pp, cp = [1, 2, 1, 1], [1, 1, 2, 1]
    assert experts_low_precision("fp8", "always", pp, cp).tolist() == [True] * 4
    assert experts_low_precision("fp8", "float8_unpiped", pp, cp).tolist() == [True, False, False, True]
    assert experts_low_precision("mxfp8", "float8_unpiped", pp, cp).tolist() == [True] * 4
    assert experts_low_precision("fp8", "never", pp, cp).tolist() == [False] * 4
    assert experts_low_precision("bf16", "always", pp, cp).tolist() == [False] * 4


def test_the_pipeline_prices_torchtitans_experts_in_bf16() -> None:
    step = {(s, e): mixtral(st, e).predicted.step_time_s for s, st in (("flat", FLAT), ("piped", PIPED))
            for e in ("always", "float8_unpiped", "never")}
    assert step["flat", "float8_unpiped"] == step["flat", "always"] != step["flat", "never"]
    assert step["piped", "float8_unpiped"] == step["piped", "never"] != step["piped", "always"]


def _toml(e: Any) -> dict[str, Any]:
    return tomllib.loads(e.text)


@pytest.mark.parametrize(("strategy", "grouped"), [(FLAT, True), (PIPED, False)])
def test_the_export_writes_the_converter_where_the_price_runs_fp8_experts(strategy: dict[str, Any], grouped: bool,
                                                                         tmp_path: Path) -> None:
    p = mixtral(strategy, "float8_unpiped")
    e = export(p, "torchtitan")
    doc = _toml(e)
    assert e.exact, e.warnings()
    converters = doc["model"]["converters"]
    assert converters == ["quantize.linear.float8", *(["quantize.grouped_mm.float8"] if grouped else [])]
    assert (doc.get("quantize", {}).get("grouped_mm", {}).get("float8", {}).get("fqns") == ["experts"]) is grouped
    loader = trainer_loader("torchtitan")
    assert loader is not None
    loader(e, tmp_path / "loaded")  # torchtitan's own ConfigManager reads it
    path = tmp_path / "job.toml"
    path.write_text(e.text)
    back = import_plan(path, model="mixtral-8x7b", cluster="16xh100")
    # no converter in the file: bf16 experts, as the plan priced them under a pipeline
    assert back.inputs.workload.low_precision_experts == ("float8_unpiped" if grouped else "never")
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)


def test_a_plan_priced_with_fp8_experts_everywhere_is_repriced_for_torchtitan() -> None:
    """A plan for ``any`` runs its experts in fp8 under a pipeline; torchtitan cannot: the export says
    so and prices the nearest plan with bf16 experts."""
    e = export(mixtral(PIPED, "always", target=TargetRef(name="any")), "torchtitan")
    assert any(x.what == "low-precision experts" and x.behaviour for x in e.losses), e.losses
    r = e.repriced
    assert r is not None and r.variant is not None and r.original is not None
    assert r.variant["step_time_s"] == pytest.approx(mixtral(PIPED, "never").predicted.step_time_s, rel=1e-9)
    assert "quantize.grouped_mm.float8" not in e.text


def test_the_import_prices_what_the_file_converts(tmp_path: Path) -> None:
    import tomli_w

    e = export(mixtral(FLAT, "float8_unpiped"), "torchtitan")
    without = _toml(e)
    without["model"]["converters"].remove("quantize.grouped_mm.float8")
    path = tmp_path / "job.toml"
    path.write_text(tomli_w.dumps(without))
    back = import_plan(path, model="mixtral-8x7b", cluster="16xh100")
    assert back.inputs.workload.low_precision_experts == "never"
    assert back.predicted.step_time_s == pytest.approx(mixtral(FLAT, "never").predicted.step_time_s, rel=1e-9)
    piped = _toml(e)
    piped["parallelism"]["pipeline_parallel_degree"] = 2
    path.write_text(tomli_w.dumps(piped))
    with pytest.raises(ConfigError, match="quantize.grouped_mm.float8 with pipeline_parallel_degree 2 .* torchtitan "
                                          "0.2.2 asserts both are 1"):
        import_plan(path, model="mixtral-8x7b", cluster="16xh100")


def test_older_documents_were_priced_with_fp8_experts_everywhere() -> None:
    doc = json.loads(mixtral(FLAT, "never").model_dump_json())
    doc["schema_version"] = "1.8"
    with pytest.raises(PlanError, match="workload.low_precision_experts 'never' needs schema_version 1.9"):
        parse_plan(json.dumps(doc))
    doc["inputs"]["workload"]["low_precision_experts"] = "always"
    assert parse_plan(json.dumps(doc)).schema_version == "1.8"


def test_estimate_says_the_experts_are_priced_in_bf16() -> None:
    from planner.commands.estimate import price_args

    job = dict(model="mixtral-8x7b", cluster="16xh100", seq_len=2048, global_batch=32, micro_batch=1, ep=8,
               zero=3, target="torchtitan", precision="fp8")
    piped = price_args({**job, "pp": 2, "dp_shard": 8})["notes"]
    assert any(n.startswith("the experts' GEMMs are priced in bf16, the other GEMMs in fp8: the trainer's float8 "
                            "grouped-GEMM converter runs only with pp = cp = 1 (pp=2, cp=1)") for n in piped)
    flat = price_args({**job, "dp_shard": 16})["notes"]
    assert not any("experts' GEMMs" in n for n in flat)
    megatron = price_args({**job, "pp": 2, "dp_shard": 8, "zero": 1, "target": "megatron"})["notes"]
    assert not any("experts' GEMMs" in n for n in megatron)
