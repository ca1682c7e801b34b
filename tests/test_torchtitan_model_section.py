"""A torchtitan export names the model it trains ([model] name and flavor) where torchtitan has a
flavor of the plan's layer shape, and says so where it has none (torchtitan would train its
``debugmodel``); torchtitan's own ConfigManager reads the section and the import reads it back."""

from __future__ import annotations

import tomllib
from pathlib import Path

from planner.trainers import export
from tests.test_explain import make_plan
from tests.trainer_loaders import trainer_loader

FSDP = {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}


def test_a_preset_with_a_flavor_names_it(tmp_path: Path) -> None:
    e = export(make_plan(FSDP, model="llama3-8b", zero3_master="parameter"), "torchtitan")
    assert tomllib.loads(e.text)["model"] == {"name": "llama3", "flavor": "8B", "hf_assets_path": "SET-ME/hf-assets"}
    assert not any("[model] names no flavor" in x for x in e.notes)
    load = trainer_loader("torchtitan")
    assert load is not None
    load(e, tmp_path)


def test_a_model_without_a_flavor_gets_a_note() -> None:
    e = export(make_plan(FSDP, model="gpt2", zero3_master="parameter"), "torchtitan")
    assert tomllib.loads(e.text)["model"] == {"hf_assets_path": "SET-ME/hf-assets"}  # no name, no flavor
    assert any(x.startswith("[model] names no flavor: torchtitan 0.2.2 has none of gpt2's shape") for x in e.notes)


def test_exported_converters_are_ones_torchtitan_registers() -> None:
    """torchtitan builds every name of model.converters from its registry (a name it does not register
    is a KeyError when the model is built): fp8 and mxfp8 exports name registered converters, and the
    import refuses a name torchtitan does not register."""
    import pytest

    from planner.trainers import ConfigError
    from planner.trainers.torchtitan.keys import TORCHTITAN_CONVERTERS
    from planner.trainers.torchtitan.read import workload

    pytest.importorskip("torchao")
    import torchtitan.components.quantization.float8  # noqa: F401  (registers its converters)
    import torchtitan.components.quantization.mx  # noqa: F401
    from torchtitan.protocols.model_converter import _registry_model_converter_cls as registry

    assert set(TORCHTITAN_CONVERTERS) == set(registry)
    fp8 = export(make_plan(FSDP, model="llama3-8b", zero3_master="parameter", precision="fp8"), "torchtitan")
    assert tomllib.loads(fp8.text)["model"]["converters"] == ["quantize.linear.float8"]
    assert workload(tomllib.loads(fp8.text), "'x'")["precision"] == "fp8"
    with pytest.raises(ConfigError, match=r"^'x': model.converters \['float8'\]: torchtitan registers only "):
        workload({"model": {"converters": ["float8"]}}, "'x'")
