"""The megatron-0.19 target: megatron-core 0.19.2 and the Megatron-LM of its wheel, written and read
back with the megatron folder's exporter, where the release differs from 0.16.1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.trainers import ConfigError, export, import_plan
from tests.test_imports_megatron import made
from tests.trainer_loaders import megatron_lm_validates

FSDP = {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}


def test_megatron_fsdp_writes_its_gradient_dtype_where_the_release_reads_it(tmp_path: Path) -> None:
    """0.19.2's Megatron-FSDP keeps gradients in --megatron-fsdp-main-grads-dtype (default: the parameters'
    bf16) and no longer reads grad_reduce_in_fp32: the export writes the dtype the plan prices; 0.16.1's has
    no such flag. Megatron-LM 0.19.2's validate_args accepts the export."""
    p = made("llama3-8b", FSDP)
    new, old = export(p, "megatron-0.19"), export(p, "megatron")
    assert "\n--megatron-fsdp-main-grads-dtype fp32\n" in new.text and "--megatron-fsdp-main-grads-dtype" not in old.text
    assert new.text.splitlines()[0] == "# shardplan export for megatron-core 0.19.2"
    got = megatron_lm_validates([new])
    if got is not None:
        assert got[0]["dp"] == 16
    path = tmp_path / "fsdp.args"
    path.write_text(new.text)
    back = import_plan(path)  # the header names the release
    assert back.inputs.target.name == "megatron-0.19" and back.inputs.workload.grad_dtype == "fp32"
    assert back.predicted.step_time_s == pytest.approx(new.repriced.variant["step_time_s"] if new.repriced and
                                                       new.repriced.variant else p.predicted.step_time_s, rel=1e-9)


def test_an_fsdp_file_without_the_gradient_dtype_reads_as_each_release_runs_it(tmp_path: Path) -> None:
    """The same flags without --megatron-fsdp-main-grads-dtype: 0.19.2 keeps bf16 gradients, 0.16.1 (with
    Megatron-LM's --bf16 and no --grad-reduce-in-bf16) fp32 ones."""
    text = export(made("llama3-8b", FSDP), "megatron-0.19").text
    path = tmp_path / "fsdp.args"
    path.write_text(text.replace("--megatron-fsdp-main-grads-dtype fp32\n", ""))
    assert import_plan(path, trainer="megatron-0.19").inputs.workload.grad_dtype == "bf16"
    assert import_plan(path, trainer="megatron").inputs.workload.grad_dtype == "fp32"


def test_bf16_adam_states_are_not_offered_and_an_export_says_so() -> None:
    """0.19.2's Megatron-FSDP keeps its own fp32 master beside bf16 moments (8 bytes, not the 6 priced):
    the target runs fp32 Adam states only; a bf16 plan exports as fp32, named as how the target runs it."""
    p = made("llama3-8b", {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero1"}})
    p = p.model_copy(update={"inputs": p.inputs.model_copy(update={"workload": p.inputs.workload.model_copy(
        update={"adam_states": "bf16"})})})
    e = export(p, "megatron-0.19")
    assert [x.what for x in e.losses if x.behaviour] == ["Adam's state"]
    assert "--exp-avg-dtype" not in e.text


def test_an_unknown_flag_is_refused_against_the_releases_own_keys(tmp_path: Path) -> None:
    e = export(made("llama3-8b", FSDP), "megatron-0.19")
    path = tmp_path / "x.args"
    path.write_text(e.text + "--no-such-flag 3\n")
    with pytest.raises(ConfigError, match="megatron-core 0.19.2 has no key --no-such-flag"):
        import_plan(path)


def test_validate_args_refuses_what_megatron_lm_refuses() -> None:
    """The check is Megatron-LM's own: an optimizer offloaded without the precision-aware optimizer fails."""
    e = export(made("llama3-8b", {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero1", "offload": "optimizer"}}),
               "megatron-0.19")
    assert megatron_lm_validates([e]) is not None or pytest.skip("megatron-core 0.19.2 is not installed beside")
    bad = dataclasses.replace(e, text=e.text.replace("--use-precision-aware-optimizer\n", ""))
    with pytest.raises(AssertionError, match="must be used in conjunction with `--use-precision-aware-optimizer`"):
        megatron_lm_validates([bad])
