"""shardplan import of Megatron-LM flags: ``export --to megatron`` then ``import`` gives back the plan's
predicted step time (the nearest plan's, where the export is not exact); flags that make no plan are
one clear ConfigError, and the command line exits 2 writing nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner.api import plan
from planner.cli import main
from planner.reprice import load_named_model, price
from planner.trainers import ConfigError, export, import_plan
from profiler.hardware import parse_cluster
from vocab.plan import Plan, TargetRef
from vocab.strategy import Strategy, Workload

Z = {"sharding": "zero1"}


def made(model: str, strategy: dict[str, Any], seq_len: int = 2048, global_batch: int = 64,
         precision: str = "bf16", cluster: str = "16xh100") -> Plan:
    """A hand-made plan priced as Megatron-LM runs it (what a search does not pick)."""
    w = Workload(seq_len=seq_len, global_batch=global_batch, precision=precision, cross_entropy="fused",
                 grad_dtype="fp32", kernels="fused")
    p = price(load_named_model(model, seq_len), parse_cluster(cluster), Strategy.model_validate(strategy), w,
              model=model)
    return p.model_copy(update={"inputs": p.inputs.model_copy(update={"target": TargetRef(name="megatron")})})


def full_on(*blocks: int) -> list[dict[str, Any]]:
    return [{"unit": f"layers.{i}", **Z, "recompute": "full"} for i in blocks]


#: name -> (the plan, flags its export must carry: what the case covers)
CASES: dict[str, tuple[Callable[[], Plan], tuple[str, ...]]] = {
    "searched-pp-cp-tp": (lambda: plan("llama3-8b", "16xh100", 4096, 64, memory_limit_gib=18, target="megatron",
                                       tie_break=False),
                          ("--pipeline-model-parallel-size 2", "--context-parallel-size 2", "--cp-comm-type p2p")),
    "searched-gpt2": (lambda: plan("gpt2", "16xh100", 1024, 64, target="megatron"), ("--num-layers 12",)),
    "searched-moe": (lambda: plan("mixtral-8x7b", "16xh100", 2048, 64, target="megatron"),
                     ("--num-experts 8",)),
    "interleaved-selective": (
        lambda: made("llama3-8b", {"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "schedule": "interleaved", "vpp": 2,
                                   "sequence_parallel": True, "default": {**Z, "recompute": "selective"}}),
        ("--num-layers-per-virtual-pipeline-stage 8", "--recompute-granularity selective", "--sequence-parallel")),
    "uneven-first-last": (
        lambda: made("llama3-8b", {"mesh": {"pp": 4, "dp_shard": 4}, "stage_layers": [7, 9, 9, 7], "default": Z}),
        ("--decoder-first-pipeline-num-layers 7", "--decoder-last-pipeline-num-layers 7")),
    "uneven-block-recompute": (
        lambda: made("llama3-8b", {"mesh": {"pp": 2, "dp_shard": 8}, "stage_layers": [12, 20], "default": Z,
                                   "layers": full_on(0, 1, 12, 13)}),
        ("--decoder-first-pipeline-num-layers 12", "--recompute-method block", "--recompute-num-layers 2")),
    "virtual-block-recompute": (
        lambda: made("llama3-8b", {"mesh": {"pp": 2, "dp_shard": 8}, "schedule": "interleaved", "vpp": 2,
                                   "default": Z, "layers": full_on(0, 8, 16, 24)}),
        ("--num-layers-per-virtual-pipeline-stage 8", "--recompute-method block", "--recompute-num-layers 1")),
    "instances-uniform": (
        lambda: made("llama3-8b", {"mesh": {"dp_replicate": 2, "dp_shard": 4, "tp": 2}, "sequence_parallel": True,
                                   "default": {**Z, "recompute": "full"}}),
        ("--num-distributed-optimizer-instances 2", "--recompute-method uniform")),
    "ulysses-offload": (
        lambda: made("llama3-8b", {"mesh": {"dp_shard": 4, "cp": 2, "tp": 2}, "cp_mode": "ulysses",
                                   "default": {**Z, "offload": "optimizer"}}, seq_len=8192),
        ("--cp-comm-type a2a", "--optimizer-cpu-offload", "--use-precision-aware-optimizer")),
    "moe-ep-pp": (
        lambda: made("mixtral-8x7b", {"mesh": {"pp": 2, "dp_shard": 4, "tp": 2, "ep": 4}, "sequence_parallel": True,
                                      "default": {**Z, "recompute": "full"}}),
        ("--expert-model-parallel-size 4", "--pipeline-model-parallel-size 2")),
    "fp8-ddp": (lambda: made("llama3-8b", {"mesh": {"dp_shard": 8, "tp": 2}}, precision="fp8"),
                ("--fp8-format hybrid",)),
    "megatron-fsdp": (lambda: made("llama3-8b", {"mesh": {"dp_shard": 16}, "default": {"sharding": "zero3"}}),
                      ("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                       "--ckpt-format fsdp_dtensor", "--overlap-param-gather")),
    "megatron-fsdp-hsdp": (
        lambda: made("llama3-8b", {"mesh": {"dp_replicate": 2, "dp_shard": 8}, "default": {"sharding": "zero3"}}),
        ("--use-megatron-fsdp", "--num-distributed-optimizer-instances 2")),
}


@functools.cache
def exported(name: str) -> tuple[Plan, Any]:
    p = CASES[name][0]()
    return p, export(p, "megatron")


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_gives_the_step_time_back(name: str, tmp_path: Path) -> None:
    p, e = exported(name)
    for flag in CASES[name][1]:
        assert f"\n{flag}\n" in e.text, flag
    if e.strategy.mesh.ep > 1:
        assert f"\n--expert-model-parallel-size {e.strategy.mesh.ep}\n" in e.text
    path = tmp_path / f"{name}.args"
    path.write_text(e.text)
    back = import_plan(path)
    r = e.repriced
    want = p.predicted.step_time_s if e.exact else r.variant["step_time_s"]
    assert back.predicted.step_time_s == pytest.approx(want, rel=1e-9)
    s, b = e.strategy, back.strategy
    assert (b.mesh.world_size, b.mesh.tp, b.mesh.pp, b.mesh.cp, b.mesh.ep, b.mesh.dp) == (
        s.mesh.world_size, s.mesh.tp, s.mesh.pp, s.mesh.cp, s.mesh.ep, s.mesh.dp)
    assert (b.schedule, b.vpp, b.micro_batch, b.cp_mode, b.sequence_parallel) == (
        s.schedule, s.vpp, s.micro_batch, s.cp_mode, s.sequence_parallel)
    if s.default.sharding in ("zero1", "zero3"):  # the distributed optimizer's instances are the replicas
        assert (b.mesh.dp_replicate, b.default.sharding) == (s.mesh.dp_replicate, s.default.sharding)
    w, bw = p.inputs.workload, back.inputs.workload
    assert (bw.seq_len, bw.global_batch, bw.precision) == (w.seq_len, w.global_batch, w.precision)
    assert back.inputs.target.name == "megatron"


BASE = "searched-gpt2"  # ZeRO-1 (the distributed optimizer) over 16 data-parallel ranks


def edited(drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> str:
    lines = [x for x in exported(BASE)[1].text.splitlines() if not x.startswith(tuple(f"{d} " for d in drop))
             and x not in drop]
    return "\n".join([*lines, *add]) + "\n"


@pytest.mark.parametrize(("drop", "add", "message"), [
    ((), ("--no-such-flag 3", "--bogus"), "megatron-core 0.16.1 has no key --no-such-flag, --bogus"),
    (("--tensor-model-parallel-size",), ("--tensor-model-parallel-size two",),
     "Megatron-LM 0.19.2's parser refuses it: argument --tensor-model-parallel-size: invalid int value: 'two'"),
    (("--micro-batch-size",), ("--micro-batch-size 0",), "--micro-batch-size must be an integer >= 1, got '0'"),
    (("--num-layers",), ("--num-layers 30",), "--num-layers 30 is not the model's 12 layers"),
    (("--global-batch-size",), (), "has no --global-batch-size"),
    (("--micro-batch-size",), (), "has no --micro-batch-size"),
    (("--bf16",), ("--bf16 yes",), "--bf16 takes no value"),
    ((), ("--context-parallel-size 2", "--cp-comm-type a2a+p2p"),
     "--cp-comm-type 'a2a+p2p' is not priced; accepted: all_gather, p2p, a2a"),
    ((), ("--recompute-granularity full", "--recompute-method every"),
     "argument --recompute-method: invalid choice: 'every' (choose from 'uniform', 'block')"),
    ((), ("--recompute-granularity some",),
     "argument --recompute-granularity: invalid choice: 'some' (choose from 'full', 'selective')"),
    ((), ("--recompute-granularity full", "--recompute-method block"), "has no --recompute-num-layers"),
    (("--tensor-model-parallel-size",), ("--tensor-model-parallel-size 3",), "does not divide the cluster's 16 GPUs"),
    ((), ("--num-distributed-optimizer-instances 3",),
     "--num-distributed-optimizer-instances 3 does not divide 16 data-parallel ranks"),
    (("--use-distributed-optimizer",), ("--num-distributed-optimizer-instances 2",), "--num-distributed-optimizer-instances needs "
                                                      "--use-distributed-optimizer"),
    (("--use-distributed-optimizer",), ("--optimizer-cpu-offload",), "--optimizer-cpu-offload needs --use-distributed-optimizer"),
    ((), ("--optimizer-cpu-offload",), "--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron-LM asserts it)"),
    ((), ("--decoder-first-pipeline-num-layers 5",), "--decoder-first-pipeline-num-layers needs "
                                                     "--pipeline-model-parallel-size > 1"),
    (("--pipeline-model-parallel-size",), ("--pipeline-model-parallel-size 4", "--decoder-first-pipeline-num-layers 5"),
     "12 layers do not split over 4 stages"),
    (("--pipeline-model-parallel-size",), ("--pipeline-model-parallel-size 2",
                                           "--num-layers-per-virtual-pipeline-stage 4"),
     "12 layers do not split into --num-layers-per-virtual-pipeline-stage 4 over 2 pipeline ranks"),
    ((), ("--fp8-format e5m2",), "argument --fp8-format: invalid choice: 'e5m2' (choose from 'e4m3', 'hybrid')"),
    ((), ("--use-custom-fsdp",), "--use-custom-fsdp is not priced"),
    ((), ("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads"),
     "--data-parallel-sharding-strategy 'optim_grads' is not priced; accepted: optim_grads_params (ZeRO-3)"),
    ((), ("--seq-length 'unclosed",), "is not a list of command-line flags"),
])
def test_flags_that_make_no_plan_are_one_clear_error(drop: tuple[str, ...], add: tuple[str, ...], message: str,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "bad.args"
    path.write_text(edited(drop, add))
    with pytest.raises(ConfigError) as err:
        import_plan(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_value_before_any_flag(tmp_path: Path) -> None:
    path = tmp_path / "bad.args"
    path.write_text("# comment\npretrain_gpt.py\n" + edited())
    with pytest.raises(ConfigError, match="'pretrain_gpt.py' follows no --flag"):
        import_plan(path)


def test_precision_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "x.args"
    path.write_text(edited(("--bf16",)))
    assert import_plan(path).inputs.workload.precision == "fp32"
    path.write_text(edited(("--bf16",), ("--fp16",)))
    assert import_plan(path).inputs.workload.precision == "bf16"
    path.write_text(edited((), ("--fp8-format e4m3",)))
    assert import_plan(path).inputs.workload.precision == "fp8"
    path.write_text(edited(("--num-layers", "--cp-comm-type")))  # both optional
    assert import_plan(path).predicted.step_time_s == pytest.approx(exported(BASE)[0].predicted.step_time_s,
                                                                    rel=1e-9)


def test_cli_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, out = tmp_path / "bad.args", tmp_path / "back.json"
    bad.write_text(edited((), ("--no-such-flag",)))
    assert main(["import", str(bad), "-o", str(out)]) == 2
    assert not out.exists() and "--no-such-flag" in capsys.readouterr().err
    good = tmp_path / "good.args"
    good.write_text(edited())
    assert main(["import", str(good), "-o", str(out)]) == 0 and out.exists()


def test_fp32_and_flat_data_parallelism(tmp_path: Path) -> None:
    """An fp32 plan is written without --bf16 and comes back fp32; DDP split into replicas x shards is not
    Megatron's (one flat data-parallel group), so the export says it lacks it instead of calling it exact."""
    p = made("gpt2", {"mesh": {"dp_shard": 16}}, precision="fp32")
    e = export(p, "megatron")
    path = tmp_path / "fp32.args"
    path.write_text(e.text)
    assert e.exact and "--bf16" not in e.text
    back = import_plan(path)
    assert back.inputs.workload.precision == "fp32"
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    hsdp = export(made("gpt2", {"mesh": {"dp_replicate": 2, "dp_shard": 8}}), "megatron")
    assert not hsdp.exact and any("dp_replicate" in x.lacks or "HSDP" in x.lacks or "replica" in x.lacks
                                  for x in hsdp.losses)


@pytest.mark.parametrize(("drop", "add", "expect"), [
    (("--overlap-moe-expert-parallel-comm",), (), ("alltoall", "none")),
    (("--moe-token-dispatcher-type",), ("--moe-token-dispatcher-type flex",), ("dedup", "1f1b")),
    (("--moe-token-dispatcher-type",), (), "the allgather token dispatcher is not priced"),
    (("--moe-token-dispatcher-type",), ("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend hybridep"),
     ("dedup", "1f1b")),
    (("--moe-token-dispatcher-type",), ("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend ncclep"),
     "the flex token dispatcher with ncclep is not priced"),
])
def test_the_moe_dispatcher_and_overlap_are_read(drop: tuple[str, ...], add: tuple[str, ...], expect: Any,
                                                 tmp_path: Path) -> None:
    """With expert parallelism the file's dispatcher and overlap flag set how the plan is priced: no
    overlap flag, no overlap (Megatron's default); flex is DeepEP's de-duplicated dispatch, with its
    deepep or hybridep backend; the default allgather dispatcher, and any other backend, are refused by name."""
    p = made("mixtral-8x7b", {"mesh": {"dp_shard": 16, "ep": 8}, "default": Z})
    p = p.model_copy(update={"inputs": p.inputs.model_copy(update={"workload": p.inputs.workload.model_copy(
        update={"moe_overlap": "1f1b"})})})
    text = export(p, "megatron").text
    assert "\n--overlap-moe-expert-parallel-comm\n" in text and "\n--moe-token-dispatcher-type alltoall\n" in text
    lines = [x for x in text.splitlines() if not x.startswith(drop)]
    path = tmp_path / "moe.args"
    path.write_text("\n".join([*lines, *add]) + "\n")
    if isinstance(expect, str):
        with pytest.raises(ConfigError, match=expect):
            import_plan(path)
        return
    w = import_plan(path).inputs.workload
    assert (w.moe_dispatch, w.moe_overlap) == expect


#: what a Megatron-LM launch script holds besides the plan: data, tokenizer, optimizer, schedule, logging,
#: checkpoints and kernels (flags of Megatron-LM's parser that shardplan does not price)
LAUNCH = ("--train-iters 500000", "--lr 3e-4", "--min-lr 3e-5", "--lr-decay-style cosine", "--lr-warmup-iters 2000",
          "--weight-decay 0.1", "--clip-grad 1.0", "--adam-beta2 0.95", "--init-method-std 0.02",
          "--tokenizer-type HuggingFaceTokenizer", "--tokenizer-model /models/llama3", "--data-path /data/corpus_text_document",
          "--split 99,1,0", "--save /ckpt", "--load /ckpt", "--save-interval 1000", "--log-interval 10",
          "--eval-interval 1000", "--eval-iters 10", "--norm-epsilon 1e-5", "--rotary-base 500000",
          "--attention-softmax-in-fp32", "--distributed-backend nccl", "--no-masked-softmax-fusion",
          "--transformer-impl transformer_engine", "--ckpt-format torch_dist")


def test_a_launch_script_is_read_as_megatron_lm_parses_it(tmp_path: Path) -> None:
    """Megatron-LM's own flags beyond the plan are accepted and not read; --recompute-activations is its
    selective recomputation (arguments.py:589-590); a value the parser refuses is one line."""
    from planner.trainers import read_config

    p, e = exported("searched-gpt2")
    path = tmp_path / "launch.args"
    path.write_text(edited((), LAUNCH))
    plan, unread, _ = read_config(path)
    assert plan.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    assert {x.split()[0] for x in LAUNCH} <= set(unread)  # named as not priced
    assert not {"--tensor-model-parallel-size", "--micro-batch-size", "--hidden-size", "--bf16"} & set(unread)
    assert main(["import", str(path)]) == 0
    path.write_text(edited((), (*LAUNCH, "--recompute-activations")))
    back = import_plan(path)
    assert {back.strategy.for_unit(f"layers.{i}").recompute for i in range(12)} == {"selective"}
    path.write_text(edited((), ("--ckpt-format fsdp_tensor",)))
    with pytest.raises(ConfigError, match=r"Megatron-LM 0.19.2's parser refuses it: argument --ckpt-format: "
                                          r"invalid choice: 'fsdp_tensor'"):
        import_plan(path)


def test_megatron_lms_own_parse_args_and_validate_args_accept_every_export() -> None:
    """Megatron-LM's ``add_megatron_arguments`` + ``validate_args`` (the megatron-core 0.19.2 wheel's
    megatron/training, installed beside the pinned 0.16.1: tests/trainers-megatron-core-0.19.txt) accept
    every export above, each on one rank of its job's world, and parse the export's mesh; so do an mxfp8
    plan on B200 and the first blocks' activations offloaded."""
    from tests.trainer_loaders import megatron_lm_validates

    extra = [made("llama3-8b", {"mesh": {"dp_shard": 8, "tp": 2}, "sequence_parallel": True}, cluster="16xb200",
                  precision="mxfp8"),
             made("llama3-8b", {"mesh": {"dp_shard": 16}, "default": Z, "layers": [
                 {"unit": f"layers.{i}", "sharding": "zero1", "offload": "activations"} for i in range(4)]})]
    exports = [exported(name)[1] for name in CASES] + [export(p, "megatron") for p in extra]
    got = megatron_lm_validates(exports)
    if got is None:
        pytest.skip("megatron-core 0.19.2 is not installed in .trainers/ (the README's test command)")
    assert len(got) == len(exports)
    assert [g["fp32_grads"] for g in got] == ["--grad-reduce-in-bf16" not in e.text for e in exports]
