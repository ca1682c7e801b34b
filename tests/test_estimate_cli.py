"""shardplan estimate: flags, plan files, JSON-lines batches, clear errors, no torch, fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the commands)
from planner.cli import app

runner = CliRunner()
BASE = [
    "estimate",
    "--model",
    "llama3-8b",
    "--cluster",
    "64xh100",
    "--seq-len",
    "8192",
    "--global-batch",
    "256",
]


def test_estimate_json_keys() -> None:
    r = runner.invoke(
        app,
        [
            *BASE,
            "--tp",
            "4",
            "--pp",
            "2",
            "--zero",
            "1",
            "--schedule",
            "interleaved",
            "--vpp",
            "2",
            "--sequence-parallel",
            "--recompute",
            "selective",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for key in ("step_time_s", "tokens_per_s_per_gpu", "mfu", "hfu", "memory_peak_gib", "stages", "time"):
        assert key in d
    assert len(d["stages"]) == 2 and d["num_microbatches"] == 256 // 8


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tp", "3"], "tp=3 does not divide the 32 attention heads"),
        (
            ["--tp", "4", "--pp", "2", "--dp-shard", "3", "--dp-replicate", "3"],
            "does not match the cluster's 64 GPUs",
        ),
        (["--pp", "64"], "pp=64 stages for only 32 layers"),
        (["--schedule", "bogus"], "unknown schedule 'bogus'"),
        (["--zero", "5"], "--zero must be 0, 1, 2 or 3"),
        (["--pp", "2", "--vpp", "2"], "vpp=2 needs schedule 'interleaved'"),
        (["--cross-entropy", "bogus"], "unknown cross-entropy 'bogus'; known: eager, fused"),
        (["--grad-dtype", "fp8"], "unknown gradient dtype 'fp8'"),
        (["--selective", "some"], "unknown selective recomputation 'some'; known: attention, op, gemms"),
        (["--target", "megatron", "--selective", "op"], "runs selective recomputation attention, not 'op'"),
    ],
)
def test_estimate_errors_exit_2(args: list[str], needle: str) -> None:
    r = runner.invoke(app, [*BASE, *args])
    assert r.exit_code == 2 and needle in r.output, r.output


def test_target_prices_its_behaviour_and_refuses_what_it_lacks() -> None:
    """--target megatron prices with Megatron's fused cross-entropy (the loss's memory) and refuses
    ZeRO-3, which Megatron-LM's distributed optimizer does not do."""
    def memory(*extra: str) -> float:
        r = runner.invoke(app, [*BASE, "--tp", "4", "--zero", "1", "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["memory_peak_gib"]

    assert memory("--target", "megatron") == memory("--cross-entropy", "fused")
    assert memory("--target", "megatron") < memory()  # the fused kernel keeps no fp32 logit gradients
    r = runner.invoke(app, [*BASE, "--tp", "4", "--zero", "3", "--target", "megatron"])
    assert r.exit_code == 2 and "megatron-core 0.16.1 cannot express: ZeRO-3" in r.output
    r = runner.invoke(app, [*BASE, "--target", "megatron", "--cross-entropy", "eager"])
    assert r.exit_code == 2 and "runs cross-entropy fused, not 'eager'" in r.output


def test_selective_prices_what_each_policy_keeps() -> None:
    """--selective: torchtitan's op policy keeps less than the attention core's recomputation and
    recomputes more; --target torchtitan prices its op policy."""
    def priced(*extra: str) -> tuple[float, float]:
        r = runner.invoke(app, [*BASE, "--recompute", "selective", "--json", *extra])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        return d["memory_peak_gib"], d["time"]["recompute_s"]

    attention, op, gemms = (priced("--selective", p) for p in ("attention", "op", "gemms"))
    assert op[0] < gemms[0] < attention[0] and op[1] > gemms[1] > attention[1] > 0
    assert priced() == attention
    # torchtitan checkpoints the blocks only: its op policy, less the recomputation of the embedding and head
    titan = priced("--target", "torchtitan", "--zero", "3")[1]
    assert titan == priced("--target", "torchtitan", "--selective", "op", "--zero", "3")[1]
    assert 0 < titan < priced("--selective", "op", "--zero", "3")[1]


def test_ep_must_divide_experts() -> None:
    r = runner.invoke(
        app,
        [
            "estimate",
            "--model",
            "mixtral-8x7b",
            "--cluster",
            "64xh100",
            "--seq-len",
            "4096",
            "--global-batch",
            "256",
            "--ep",
            "3",
            "--zero",
            "1",
        ],
    )
    assert r.exit_code == 2 and "ep=3 does not divide the 8 experts" in r.output


def test_etp_folds_the_expert_ranks_as_a_plan_does() -> None:
    """--etp 1 prices the folded mesh a search emits (ep 16 from tp 2 x dp_shard 8), as the API prices
    it; --etp equal to tp is the default; a folding the target does not run is one line."""
    from costmodel.estimate import estimate
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload
    from vocab.targets import load_target

    job = ["estimate", "--model", "gpt-oss-20b", "--cluster", "16xh100", "--seq-len", "4096", "--global-batch", "64",
           "--tp", "2", "--zero", "1", "--sequence-parallel", "--target", "megatron", "--json"]
    folded = json.loads(runner.invoke(app, [*job, "--ep", "16", "--etp", "1"]).stdout)
    w = Workload(seq_len=4096, global_batch=64, **load_target("megatron").behaviour.workload())
    s = Strategy(mesh=Mesh(tp=2, dp_shard=8, ep=16, etp=1), micro_batch=1, sequence_parallel=True,
                 default=LayerStrategy(sharding="zero1"))
    assert folded["step_time_s"] == estimate(load_model("gpt-oss-20b", 4096), parse_cluster("16xh100"), s,
                                             w).step_time_s
    same = [json.loads(runner.invoke(app, [*job, "--ep", "8", *extra]).stdout)["step_time_s"] for extra in
            ([], ["--etp", "2"])]
    assert same[0] == same[1]
    r = runner.invoke(app, [*job[:-3], "--ep", "16", "--etp", "1", "--target", "shardplan"])
    assert r.exit_code == 2 and "expert-tensor parallelism etp=1 beside tp=2" in r.output


def test_the_fields_a_search_emits_have_flags() -> None:
    """--cp-rotate, --cp-mode, --tp-mode and --offload price the strategy they name (as the API
    prices it); without --cp-rotate a target's ring rotates as the target's does."""
    from costmodel.estimate import estimate
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

    job = ["estimate", "--model", "llama3-8b", "--cluster", "16xh100", "--seq-len", "8192", "--global-batch", "64",
           "--cp", "2", "--zero", "1", "--json"]
    graph, cluster, w = load_model("llama3-8b", 8192), parse_cluster("16xh100"), Workload(seq_len=8192, global_batch=64)

    def api(**fields: object) -> float:
        offload = str(fields.pop("offload", "none"))
        s = Strategy(mesh=Mesh(dp_shard=8, cp=2), micro_batch=1, default=LayerStrategy(sharding="zero1", offload=offload),
                     **fields)
        return estimate(graph, cluster, s, w).step_time_s

    def cli(*extra: str) -> float:
        return json.loads(runner.invoke(app, [*job, *extra]).stdout)["step_time_s"]

    assert cli("--cp-rotate", "alltoall") == api(cp_rotate="alltoall") != api()
    assert cli("--cp-mode", "ulysses") == api(cp_mode="ulysses")
    assert cli("--offload", "optimizer") == api(offload="optimizer")
    meg = runner.invoke(app, [*job, "--target", "megatron"])  # its ring passes K/V point to point
    assert meg.exit_code == 0, meg.output
    assert cli("--target", "megatron") == cli("--target", "megatron", "--cp-rotate", "alltoall")
    assert cli("--target", "megatron", "--cp-rotate", "allgather") == cli("--cp-rotate", "allgather", "--target",
                                                                          "megatron") != cli("--target", "megatron")
    r = runner.invoke(app, [*job, "--tp", "2", "--tp-mode", "bogus"])
    assert r.exit_code == 2 and "unknown tp mode 'bogus'; known: megatron, tsp" in r.output


def test_stage_layers_price_an_uneven_pipeline(tmp_path: Path) -> None:
    """--stage-layers 7,9,9,7 (a batch line's list) is the strategy's stage_layers; a count that is not
    pp*vpp, or a value that is no whole number, is one line and exit 2."""
    from costmodel.estimate import estimate
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

    job = ["estimate", "--model", "llama3-8b", "--cluster", "16xh100", "--seq-len", "4096", "--global-batch", "64",
           "--pp", "4", "--zero", "1"]
    got = json.loads(runner.invoke(app, [*job, "--stage-layers", "7,9,9,7", "--json"]).stdout)
    s = Strategy(mesh=Mesh(pp=4, dp_shard=4), stage_layers=[7, 9, 9, 7], default=LayerStrategy(sharding="zero1"))
    want = estimate(load_model("llama3-8b", 4096), parse_cluster("16xh100"), s, Workload(seq_len=4096, global_batch=64))
    assert got["step_time_s"] == want.step_time_s and [st["first_block"] for st in got["stages"]] == [0, 7, 16, 25]
    line = {"model": "llama3-8b", "cluster": "16xh100", "seq_len": 4096, "global_batch": 64, "pp": 4, "zero": 1,
            "stage_layers": [7, 9, 9, 7]}
    (tmp_path / "b.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({**line, "stage_layers": [7, "x"]}) + "\n")
    r = runner.invoke(app, ["estimate", "--batch", str(tmp_path / "b.jsonl")])
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert out[0]["step_time_s"] == want.step_time_s and "stage_layers must be whole numbers" in out[1]["error"]
    for bad, why in (("7,9,9", "stage_layers has 3 entries, expected pp*vpp=4"), ("7,-1,9,9", "whole numbers")):
        r = runner.invoke(app, [*job, "--stage-layers", bad])
        assert r.exit_code == 2 and why in r.output


def test_zero_0_means_replicas_and_dp_fills_the_cluster() -> None:
    r0 = json.loads(runner.invoke(app, [*BASE, "--tp", "2", "--json"]).stdout)
    r3 = json.loads(runner.invoke(app, [*BASE, "--tp", "2", "--zero", "3", "--json"]).stdout)
    rh = json.loads(
        runner.invoke(app, [*BASE, "--tp", "2", "--zero", "3", "--dp-replicate", "4", "--json"]).stdout
    )
    assert r0["stages"][0]["optim_bytes"] > r3["stages"][0]["optim_bytes"] * 16  # sharded over 32
    assert rh["stages"][0]["optim_bytes"] == pytest.approx(r3["stages"][0]["optim_bytes"] * 4, rel=1e-6)


def test_estimate_from_plan(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    assert (
        runner.invoke(
            app,
            [
                "plan",
                "--model",
                "gpt2",
                "--cluster",
                "4xcpu",
                "--seq-len",
                "128",
                "--global-batch",
                "8",
                "-o",
                str(out),
                "--top-k",
                "0",
            ],
        ).exit_code
        == 0
    )
    r = runner.invoke(app, ["estimate", "--plan", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step_time_s"] == json.loads(out.read_text())["predicted"]["step_time_s"]


def test_batch_mode(tmp_path: Path) -> None:
    lines = [
        {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "dp_shard": 4, "zero": 3},
        "not json",
        {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "tp": 5},
        {
            "model": {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 128,
            },
            "cluster": {"accelerator": "h100", "gpus": 8},
            "seq_len": 64,
            "global_batch": 8,
            "micro_batch": 1,
        },
        {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "bogus_key": 1},
    ]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    r = runner.invoke(app, ["estimate", "--batch", str(f)])
    assert r.exit_code == 2 and r.stderr == "error: 4 of 6 lines failed\n", r.output
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(out) == 6
    assert "step_time_s" in out[0] and "step_time_s" in out[3]
    assert (
        "not valid JSON" in out[1]["error"]
        and "tp=5 does not divide the 12 attention heads" in out[2]["error"]
    )
    assert "unknown key" in out[4]["error"] and "empty line" in out[5]["error"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    r = runner.invoke(app, ["estimate", "--batch", str(empty)])
    assert r.exit_code == 2 and "holds no plans" in r.output and r.stdout.count("\n") <= 1


def test_estimate_never_imports_torch() -> None:
    """The pricer's command runs without torch (its start-up time is benchmarks/solver_speed.py --startup)."""
    code = (
        "import sys, runpy; sys.argv = ['shardplan'] + sys.argv[1:]; "
        "from planner.cli import run\ntry:\n    run()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *BASE, "--tp", "8", "--json"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] > 0


def test_one_micro_batch_is_said_in_the_singular() -> None:
    r = runner.invoke(app, [*BASE[:-1], "64", "--dp", "64"], env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "(1 micro-batch)" in r.output and "1 micro-batches" not in r.output, r.output
    r = runner.invoke(app, [*BASE[:-1], "32", "--pp", "2", "--dp", "32", "--schedule", "interleaved", "--vpp", "2"])
    assert r.exit_code == 2 and "interleaved schedule: 1 micro-batch must be a multiple of pp=2" in r.output, r.output
    r = runner.invoke(app, ["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "4"],
                      env={"COLUMNS": "120"})
    assert r.exit_code == 0 and "1 micro-batch of" in r.output and "1 micro-batches" not in r.output, r.output
