"""``shardplan import`` of a nanotron YAML config (:mod:`planner.trainers.nanotron.read`): export then import
gives back the predicted step time; keys and values nanotron 0.4 does not take are refused by name."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import yaml

from planner.api import plan as search
from planner.cli import main
from planner.trainers import ConfigError, export, import_plan
from tests.test_explain import make_plan
from vocab.plan import Plan

FULL = {"default": {"sharding": "zero1", "recompute": "full"}}


@functools.cache
def plans() -> dict[str, Plan]:
    """Searched plans (small presets) and hand-made ones, some exported as the nearest nanotron plan."""
    return {
        "zero1": search("llama3-8b", "16xh100", 2048, 64, target="nanotron"),
        "tp-sequence-parallel": search("llama3-8b", "16xh100", 4096, 64, memory_limit_gib=18, target="nanotron"),
        "gpt2": search("gpt2", "16xh100", 1024, 64, target="nanotron"),
        "moe-pipeline": search("mixtral-8x7b", "16xh100", 2048, 64, target="nanotron"),
        "gpipe-tp-replicate": make_plan({"mesh": {"pp": 4, "dp_shard": 2, "tp": 2}, "schedule": "gpipe",
                                         "sequence_parallel": True, "default": {"sharding": "replicate"}}),
        "nearest-no-recompute": make_plan({"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "micro_batch": 1, **FULL}),
        "nearest-no-offload": make_plan({"mesh": {"dp_shard": 16},
                                         "default": {"sharding": "zero3", "offload": "params"}}),
    }


BASE: dict[str, Any] = {
    "parallelism": {"dp": 16, "pp": 1, "tp": 1},
    "tokens": {"micro_batch_size": 2, "batch_accumulation_per_replica": 2, "sequence_length": 2048},
    "optimizer": {"zero_stage": 1},
}


def write(tmp_path: Path, doc: dict[str, Any] | str, name: str = "nt.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def edited(**sections: dict[str, Any]) -> dict[str, Any]:
    """BASE with keys of its sections replaced (a value of None drops the key)."""
    doc = {k: dict(v) for k, v in BASE.items()}
    for name, changes in sections.items():
        doc.setdefault(name, {})
        for k, v in changes.items():
            if v is None:
                doc[name].pop(k, None)
            else:
                doc[name][k] = v
    return doc


def load(path: Path) -> Plan:
    return import_plan(path, model="llama3-8b", cluster="16xh100")


@pytest.mark.parametrize("name", list(plans()))
def test_round_trip_gives_back_the_step_time(name: str, tmp_path: Path) -> None:
    p = plans()[name]
    e = export(p, "nanotron")
    want = p.predicted.step_time_s if e.exact else e.repriced.variant["step_time_s"]  # type: ignore[union-attr,index]
    back = import_plan(write(tmp_path, e.text))  # model and cluster from the export's header
    assert back.predicted.step_time_s == pytest.approx(want, rel=1e-9)
    assert back.strategy.mesh == e.strategy.mesh and back.strategy.schedule == e.strategy.schedule
    assert back.strategy.sequence_parallel == e.strategy.sequence_parallel
    assert back.inputs.workload.global_batch == p.inputs.workload.global_batch
    assert back.inputs.workload.seq_len == p.inputs.workload.seq_len and back.inputs.target.name == "nanotron"


def test_expert_parallel_ranks_are_data_parallel_ranks(tmp_path: Path) -> None:
    doc = edited(parallelism={"dp": 2, "tp": 2, "expert_parallel_size": 4})
    back = import_plan(write(tmp_path, doc), model="mixtral-8x7b", cluster="16xh100")
    assert (back.strategy.mesh.dp_shard, back.strategy.mesh.ep, back.strategy.mesh.tp) == (8, 4, 2)
    assert back.inputs.workload.global_batch == 2 * 2 * 8


def test_defaults_and_spellings(tmp_path: Path) -> None:
    s = load(write(tmp_path, edited(parallelism={"dp": 4, "pp": 2, "tp": 2, "tp_mode": "reduce_scatter"}))).strategy
    assert s.schedule == "gpipe" and s.sequence_parallel  # nanotron's default engine is afab
    one = load(write(tmp_path, edited(parallelism={"dp": 8, "pp": 2, "pp_engine": "1f1b"}, optimizer={"zero_stage": 0})))
    assert one.strategy.schedule == "1f1b" and one.strategy.default.sharding == "replicate"
    assert one.strategy.default.recompute == "none" and one.inputs.workload.precision == "bf16"
    fp32 = load(write(tmp_path, edited(model={"dtype": "float32"})))
    assert fp32.inputs.workload.precision == "fp32"


@pytest.mark.parametrize(("doc", "message"), [
    (edited(parallelism={"recompute_layer": True}), "has no key parallelism.recompute_layer"),
    (edited(tokens={"global_batch_size": 64}), "has no key tokens.global_batch_size"),
    (edited(trainer={"steps": 1}), "has no key trainer"),
    ("parallelism: {dp: 16\ntokens: [", "is not valid YAML"),
    ("- dp: 16\n", "is a YAML mapping, not list"),
    (edited(parallelism={"pp_engine": "interleaved"}), "parallelism.pp_engine 'interleaved' is not one of afab, 1f1b"),
    (edited(parallelism={"tp_mode": "ALL_GATHER"}), "tp_mode 'ALL_GATHER' is not one of REDUCE_SCATTER, ALL_REDUCE"),
    (edited(optimizer={"zero_stage": 2}), "optimizer.zero_stage 2 is not one of 0, 1"),
    (edited(optimizer={"zero_stage": None}), "does not set optimizer.zero_stage"),
    (edited(parallelism={"dp": None}), "does not set parallelism.dp"),
    (edited(parallelism={"dp": 4}), "lays out 4 GPUs"),
    (edited(parallelism={"tp": 2, "dp": 8, "tp_linear_async_communication": True}),
     "tp_linear_async_communication with tp_mode ALL_REDUCE"),
    (edited(tokens={"micro_batch_size": 0}), "tokens.micro_batch_size must be an integer >= 1, got 0"),
    (edited(tokens={"batch_accumulation_per_replica": None}), "does not set tokens.batch_accumulation_per_replica"),
    (edited(model={"dtype": "float16"}), "model.dtype 'float16' is not one of bfloat16, float32"),
    ({"tokens": BASE["tokens"], "optimizer": BASE["optimizer"]}, "has no parallelism section"),
    (edited(parallelism={"dp": "16"}), "parallelism.dp must be an integer"),
])
def test_errors_name_the_problem(doc: dict[str, Any] | str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, doc))
    assert message in str(err.value)


def test_seq_len_must_agree(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError, match="trains 2048 tokens per sample, not --seq-len 4096"):
        import_plan(path, model="llama3-8b", cluster="16xh100", seq_len=4096)
    no_seq = write(tmp_path, edited(tokens={"sequence_length": None}), "noseq.yaml")
    with pytest.raises(ConfigError, match="give --seq-len"):
        load(no_seq)
    assert import_plan(no_seq, model="llama3-8b", cluster="16xh100", seq_len=1024).inputs.workload.seq_len == 1024


def test_cli_writes_nothing_for_a_bad_file(tmp_path: Path) -> None:
    out = tmp_path / "back.json"
    header = "# shardplan-inputs: {\"model\": \"llama3-8b\", \"cluster\": \"16xh100\"}\n"
    bad = write(tmp_path, header + yaml.safe_dump(edited(parallelism={"pp_engine": "zb"})))
    assert main(["import", str(bad), "-o", str(out)]) == 2
    assert main(["import", str(write(tmp_path, header + "parallelism: [", "cut.yml")), "-o", str(out)]) == 2
    assert not out.exists()
    good = write(tmp_path, export(plans()["gpt2"], "nanotron").text, "good.yaml")
    assert main(["import", str(good), "-o", str(out)]) == 0
    assert out.exists()


def test_a_llama_exports_its_model_section_and_imports_only_as_itself(tmp_path: Path) -> None:
    """nanotron 0.4's LlamaConfig of the plan's model (llama3-8b: its rotary base cannot be set, a note
    says so); an import for a model of another shape is refused, naming each difference; a model its
    Llama cannot build (gpt2: GELU, LayerNorm, learned positions, biases) gets no section, and a note."""
    e = export(plans()["zero1"], "nanotron")
    model = yaml.safe_load(e.text)["model"]
    assert model["dtype"] == "bfloat16" and model["model_config"] == {
        "is_llama_config": True, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    assert any("fixes the rotary base at 10000; the model's 500000 cannot be set" in x for x in e.notes)
    path = write(tmp_path, e.text)
    assert import_plan(path).predicted.step_time_s == plans()["zero1"].predicted.step_time_s
    with pytest.raises(ConfigError, match=r"model.model_config is not llama3-70b: num_hidden_layers 32 \(the priced "
                                          r"model's 80\); hidden_size 4096 \(the priced model's 8192\)"):
        import_plan(path, model="llama3-70b", cluster="16xh100")
    gpt2 = export(plans()["gpt2"], "nanotron")
    assert "model" not in yaml.safe_load(gpt2.text)
    assert any(x.startswith("the model section is not written: nanotron 0.4's Llama has a gated SiLU MLP, RMSNorm")
               for x in gpt2.notes)
