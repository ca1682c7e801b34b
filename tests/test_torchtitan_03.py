"""The torchtitan-0.3 target: a launch script of torchtitan 0.3.0's flags, written and read back."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from planner.api import plan as search
from planner.trainers import ConfigError, export, import_plan, read_config
from planner.trainers.torchtitan.cli.read import parse
from tests.test_explain import make_plan
from vocab.plan import parse_plan

T = "torchtitan-0.3"


def _args(text: str) -> list[str]:
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    return tokens[tokens.index("torchtitan.train") + 1:]


def _write(tmp_path: Path, text: str, name: str = "job.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_pipelined_plan_writes_its_stages_schedule_and_the_cuda_graph_switch(tmp_path: Path) -> None:
    """pp 2 over 32 blocks: module lists one comma-joined token per stage, the embedding first and torchtitan
    0.3's head modules (norm, lm_head) last; CUDA graphs turned off (Trainer.Config refuses them with pp);
    the checkpointing subcommand after every flag; the import gives back the plan's price."""
    p = make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "micro_batch": 1, "stage_layers": [15, 17],
                   "default": {"sharding": "zero3"},
                   "layers": [{"unit": f"layers.{i}", "sharding": "zero3", "recompute": "full"} for i in range(32)]},
                  model="llama3.1-8b",
                  zero3_master="parameter", cross_entropy="chunked")  # as torchtitan keeps it: the plan is priced as the target runs it
    e = export(p, T)
    assert not e.losses
    args = _args(e.text)
    assert args[:4] == ["--module", "llama3", "--config", "llama3_8b"]
    assert args[-1] == "activation_checkpoint:full"
    parts = args[args.index("--parallelism.module_fqns_per_model_part") + 1:][:2]
    assert parts[0].split(",")[:2] == ["tok_embeddings", "layers.0"] and len(parts[0].split(",")) == 16
    assert parts[1].split(",")[-2:] == ["norm", "lm_head"] and len(parts[1].split(",")) == 19
    assert "--training.disable_cuda_graphs" in args
    back = import_plan(_write(tmp_path, e.text))
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    assert back.strategy.stage_layers == [15, 17] and back.inputs.target.name == T


def test_an_unpipelined_dense_plan_keeps_cuda_graphs_and_says_sequence_parallelism() -> None:
    p = make_plan({"mesh": {"tp": 2, "dp_shard": 8}, "sequence_parallel": False,
                   "default": {"sharding": "zero3"}}, model="llama3.1-8b")
    args = _args(export(p, T).text)
    assert "--training.disable_cuda_graphs" not in args
    assert "--parallelism.no_enable_sequence_parallel" in args and args[-1] == "activation_checkpoint:none"


def test_a_model_without_a_registry_function_gets_placeholders_and_a_note() -> None:
    e = export(make_plan({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}, model="gpt2"), T)
    assert _args(e.text)[:4] == ["--module", "SET-ME-module", "--config", "SET-ME-config"]
    assert any("no registry function of gpt2" in x for x in e.notes)


def test_experts_fold_over_tp_whenever_ep_is_above_one() -> None:
    """torchtitan 0.3 has no expert-tensor degree: the search offers no ep > 1 with experts split over tp,
    and an export of such a plan folds them (etp 1), saying so."""
    p = search("mixtral-8x7b", "16xh100", 2048, 64, target=T, top_k=1)
    m = p.strategy.mesh
    assert not (m.ep > 1 and m.tp > 1 and m.etp in (0, m.tp))
    split = make_plan({"mesh": {"tp": 2, "dp_shard": 8, "ep": 4}, "default": {"sharding": "zero3"}},
                      model="mixtral-8x7b", zero3_master="parameter", cross_entropy="chunked",
                      moe_tp="gathered_without_ep")
    e = export(split, T)
    assert e.strategy.mesh.etp == 1
    assert [x.what for x in e.losses] == ["experts split over tp"]


def test_import_takes_the_registry_functions_defaults_and_lists_what_it_does_not_price(tmp_path: Path) -> None:
    """llama3_70b presets tp 8, local batch 8 and full checkpointing (torchtitan 0.3.0's config registry);
    the flags a price does not read are listed."""
    text = ("#!/bin/sh\n# a launch as a user writes it\ntorchrun --nproc-per-node 8 -m torchtitan.train \\\n"
            "  --module llama3 --config llama3_70b --training.steps 500 --training.global_batch_size 64 \\\n"
            "  --metrics.enable_wandb\n")
    plan, unread, assumed = read_config(_write(tmp_path, text), model="llama3.1-70b", cluster="64xh100")
    s = plan.strategy
    assert (s.mesh.tp, s.mesh.dp_shard, s.micro_batch, s.sequence_parallel) == (8, 8, 8, True)
    assert {s.for_unit(f"layers.{i}").recompute for i in range(80)} == {"full"}
    assert plan.inputs.workload.global_batch == 64 and plan.inputs.workload.seq_len == 8192
    assert unread == ["--training.steps", "--metrics.enable_wandb"] and assumed == []


def test_a_registry_function_of_ones_own_is_read_with_the_release_defaults_and_says_so(tmp_path: Path) -> None:
    """``--module my_pkg.registry --config my_70b``: Trainer.Config's defaults under the flags (local batch
    8, selective per-op checkpointing), and the import names what it assumed."""
    from planner.cli import main

    text = ("torchrun -m torchtitan.train --module my_pkg.registry --config my_70b --training.seq_len 4096 "
            "--training.global_batch_size 64 --parallelism.tensor_parallel_degree 8\n")
    path = _write(tmp_path, text)
    plan, _, assumed = read_config(path, model="llama3.1-70b", cluster="64xh100")
    assert (plan.strategy.mesh.tp, plan.strategy.micro_batch) == (8, 8)
    assert {plan.strategy.for_unit(f"layers.{i}").recompute for i in range(80)} == {"selective"}
    assert len(assumed) == 1 and "Trainer.Config's defaults" in assumed[0]
    assert main(["import", str(path), "--model", "llama3.1-70b", "--cluster", "64xh100"]) == 0


@pytest.mark.parametrize("flags,message", [
    ("--parallelism.expert_tensor_parallel_degree 1", "is not a flag of torchtitan 0.3.0"),
    ("--parallelism.context_parallel_rotate_method allgather", "is not a flag of torchtitan 0.3.0"),
    ("--parallelism.tensor_parallel_degree two", "takes an integer"),
    ("--parallelism.enable_sequence_parallel=False", "is a switch"),
    ("activation_checkpoint:everything", "activation_checkpoint is one of"),
    ("'$(touch /tmp/pwned)'", "neither a flag of torchtitan 0.3.0 nor a subcommand"),
    ("--training.mixed_precision_param float16", "is one of bfloat16, float32, got 'float16'"),
    ("--training.max_norm abc", "takes a number, got 'abc'"),
    ("'--bad\nflag' 3", "is not a flag of torchtitan 0.3.0"),
])
def test_import_refuses_what_torchtitan_03_refuses_in_one_line(flags: str, message: str, tmp_path: Path) -> None:
    text = f"torchrun -m torchtitan.train --module llama3 --config llama3_8b {flags}\n"
    with pytest.raises(ConfigError, match=message) as err:
        import_plan(_write(tmp_path, text), model="llama3.1-8b", cluster="8xh100")
    assert "\n" not in str(err.value)


def test_import_refuses_a_registry_model_of_another_shape(tmp_path: Path) -> None:
    text = "torchrun -m torchtitan.train --module llama3 --config llama3_8b\n"
    with pytest.raises(ConfigError, match="trains llama3.1-8b"):
        import_plan(_write(tmp_path, text), model="llama3.1-70b", cluster="64xh100")


def test_a_value_with_a_colon_is_a_value_and_the_subcommand_ends_the_flags() -> None:
    doc = parse("--module llama3 --config llama3_8b --dataloader.dataset_path s3://bucket/c4 activation_checkpoint:full",
                "f")
    assert doc["flags"] == {"dataloader.dataset_path": "s3://bucket/c4"} and doc["policy"] == "full"


def test_parse_reads_bare_flags_and_the_no_form() -> None:
    doc = parse("--module llama3 --config llama3_8b --training.no_enable_cpu_offload --parallelism.pipeline_parallel_degree=2",
                "f")
    assert doc["flags"] == {"training.enable_cpu_offload": False, "parallelism.pipeline_parallel_degree": 2}


def test_a_chunked_loss_keeps_one_chunk_of_the_softmax_and_an_fp32_gradient_accumulator() -> None:
    """torchtitan 0.3's ChunkedLossWrapper (8 chunks): the head keeps its norm's and linear's 16-bit inputs
    (L·D·2 bytes each), an fp32 accumulator of the linear input's gradient (L·D·4) and one chunk of the fp32
    softmax (L·V·4 / 8), against eager's whole softmax; the step time is eager's (the same kernels, per
    chunk), the peak lower by the bytes saved, their transient twice over, and the allocator's share."""
    from costmodel.constants import constants_for
    from costmodel.node_costs import chunked_loss_widths
    from planner.reprice import load_named_model

    L, D, V = 8192, 4096, 128256
    head = dict(load_named_model("llama3.1-8b", L).blocks())["head"]
    widths = chunked_loss_widths(head, [1.0] * len(head))
    assert sum(n.act_saved_bytes for n in head) == L * D * 2 + L * D * 2 + L * V * 4
    assert sum(x * n.act_saved_bytes for x, n in zip(widths, head, strict=True)) == L * D * 2 + L * D * 6 + L * V * 4 / 8
    eager, chunked = (make_plan({"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}, model="llama3.1-8b",
                                seq_len=L, cross_entropy=ce) for ce in ("eager", "chunked"))
    assert chunked.predicted.step_time_s == eager.predicted.step_time_s
    saved = L * V * 4 * 7 / 8 - L * D * 4
    frag = constants_for("h100-sxm").fragmentation
    gib = (eager.predicted.memory_peak_gib - chunked.predicted.memory_peak_gib) * 2**30
    assert gib == pytest.approx(saved * 3 * (1 + frag), rel=1e-9)


def test_schema_112_holds_a_chunked_loss_and_a_dotted_target() -> None:
    """A 1.11 document names neither the chunked loss, nor torchtitan 0.3's MoE layer, nor a target with a
    dot; a 1.12 one may."""
    from vocab.plan import PlanError

    p = search("llama3.1-8b", "8xh100", 4096, 32, target=T, top_k=1)
    doc = json.loads(p.to_json())
    assert doc["schema_version"] == "1.12" and doc["inputs"]["workload"]["cross_entropy"] == "chunked"
    assert doc["inputs"]["target"] == {"name": T, "version": "0.3.0"}
    old = {**doc, "schema_version": "1.11"}
    with pytest.raises(PlanError, match="moe_tp 'gathered_without_ep' needs schema_version 1.12"):
        parse_plan(old)
    old["inputs"] = {**doc["inputs"], "workload": {**doc["inputs"]["workload"], "moe_tp": "gathered"}}
    with pytest.raises(PlanError, match="cross_entropy 'chunked' needs schema_version 1.12"):
        parse_plan(old)
    old["inputs"]["workload"]["cross_entropy"] = "eager"
    with pytest.raises(PlanError, match="target 'torchtitan-0.3' needs schema_version 1.12"):
        parse_plan(old)


@pytest.mark.parametrize("mesh,same_as", [
    ({"tp": 2, "dp_shard": 8}, "gathered"),  # ep 1: the layer's tokens gathered over tp, the router on all
    ({"tp": 2, "dp_shard": 8, "ep": 4, "etp": 1}, "dispatcher"),  # ep 4, folded: each tp rank its own share
])
def test_the_moe_layer_under_tp_gathers_only_without_expert_parallelism(mesh: dict, same_as: str) -> None:
    """torchtitan 0.3 (moe_tp gathered_without_ep, models/common/moe_sharding.py:279-281): where ep = 1 its
    MoE layer is 0.2.2's gathered one (all-gather before routing, the router replicated); where ep > 1 it
    gathers nothing, each tp rank routing and dispatching its own tokens to experts folded over tp, which
    is Megatron's dispatcher with no expert-TP collective: step time and memory equal, to the last bit."""
    strategy = {"mesh": mesh, "sequence_parallel": True, "default": {"sharding": "zero3"}}
    new, old = (make_plan(strategy, model="mixtral-8x7b", moe_tp=m) for m in ("gathered_without_ep", same_as))
    other = make_plan(strategy, model="mixtral-8x7b", moe_tp="dispatcher" if same_as == "gathered" else "gathered")
    assert new.predicted.step_time_s == old.predicted.step_time_s
    assert new.predicted.memory_peak_gib == old.predicted.memory_peak_gib
    assert new.predicted.step_time_s != other.predicted.step_time_s
