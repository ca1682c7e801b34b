"""``shardplan import``: a trainer's configuration read back into a plan, priced the same as the plan
it was exported from; bad files are one line and exit 2, with nothing written."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from planner.api import plan as search
from planner.cli import main
from planner.trainers import ConfigError, export, import_plan, importer_for
from planner.trainers.reading import inputs_line, read_inputs
from planner.trainers.torchtitan.read import generated_sizes
from tests.benchmark_scripts import benchmark_script
from tests.trainer_loaders import trainer_loader
from vocab.errors import ShardplanError
from vocab.plan import Plan, load_plan

_JOBS = benchmark_script("target_jobs")
JOBS, TARGETS, exporter = _JOBS.JOBS, _JOBS.TARGETS, _JOBS.exporter  # the headline jobs, every trainer's target


@functools.cache
def job_plan(job: str, target: str) -> Plan:
    model, cluster, seq, gb = JOBS[job]
    return search(model, cluster, seq, gb, target=target)


def round_trip(p: Plan, target: str, tmp_path: Path, load: bool = False, **given: object) -> Plan:
    """``p`` exported for ``target`` (read by the trainer's own loader with ``load``) and imported back."""
    e = export(p, exporter(target))
    loader = trainer_loader(exporter(target), skip=False) if load else None
    if loader is not None:
        loader(e, tmp_path / "loader")
    path = tmp_path / f"{target}{e.suffix}"
    path.write_text(e.text)
    return import_plan(path, **given)  # type: ignore[arg-type]


def close(a: Plan, b: Plan) -> bool:
    return abs(a.predicted.step_time_s - b.predicted.step_time_s) <= 1e-9 * a.predicted.step_time_s


#: jobs a target has no plan for, and why: nanotron 0.4 cannot recompute activations
NO_PLAN = {("405b", "nanotron"): "no plan in the 'full' space fits"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("job", list(JOBS))
def test_headline_jobs_round_trip(job: str, target: str, tmp_path: Path) -> None:
    """plan --target T, export --to T, the trainer's own loader accepts it, import: the same step time and
    peak memory (DeepSpeed's JSON names no model, cluster, sequence length or expert parallelism: they
    are given)."""
    if (job, target) in NO_PLAN:
        with pytest.raises(ShardplanError, match=NO_PLAN[job, target]) as err:
            job_plan(job, target)
        assert f"target {target}" in str(err.value)
        return
    p = job_plan(job, target)
    model, cluster, seq, _ = JOBS[job]
    given = {"model": model, "cluster": cluster, "seq_len": seq, "ep": p.strategy.mesh.ep} \
        if target == "deepspeed" else {}
    back = round_trip(p, target, tmp_path, load=True, **given)
    assert close(p, back), (p.strategy, back.strategy)
    assert back.predicted.memory_peak_gib == pytest.approx(p.predicted.memory_peak_gib, rel=1e-9)
    assert back.inputs.target.name == target and back.inputs.workload == p.inputs.workload


def test_headline_plans_keep_a_reserve() -> None:
    """No default plan runs the GPU full: the limit is the device's memory less the 5% reserve."""
    from planner.reprice import device_gib, predicted_dict

    for job in JOBS:
        p = job_plan(job, "shardplan")
        pred = predicted_dict(p)
        assert pred["memory_limit_gib"] == pytest.approx(0.95 * device_gib(p))
        assert pred["memory_peak_gib"] <= 0.95 * device_gib(p)


def test_torchtitan_selective_every_nth_and_stages(tmp_path: Path) -> None:
    """Full recompute on every 2nd block a rank builds, uneven stages and offload come back exactly."""
    from tests.test_explain import make_plan

    blocks = [f"layers.{i}" for i in range(32)]
    p = make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "micro_batch": 1, "stage_layers": [15, 17],
                   "default": {"sharding": "zero3"},
                   "layers": [{"unit": u, "sharding": "zero3", "recompute": "full"} for u in blocks[1:15:2] + blocks[16::2]]},
                  global_batch=64, zero3_master="parameter")
    e = export(p, "torchtitan")
    assert 'selective_ac_option = "2"' in e.text and not e.losses
    back = round_trip(p, "torchtitan", tmp_path)
    assert back.strategy.stage_layers == [15, 17] and close(p, back)


def test_torchtitan_defaults_follow_the_release(tmp_path: Path) -> None:
    """What a file leaves out is torchtitan 0.2.2's default: dp_shard the GPUs left, selective AC on
    every 2nd layer, local batch 8, and stages cut as ``generate_llm_fqn_per_model_part`` cuts them."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(inputs_line("llama3-8b", {"accelerator": "h100", "nodes": 2, "gpus_per_node": 8}).join(["# ", "\n"])
                   + '[parallelism]\ntensor_parallel_degree = 2\npipeline_parallel_degree = 2\n'
                   'pipeline_parallel_schedule = "Interleaved1F1B"\n[training]\nseq_len = 2048\n')
    p = import_plan(cfg)
    s = p.strategy
    assert (s.mesh.dp_shard, s.mesh.tp, s.mesh.pp, s.vpp, s.schedule) == (4, 2, 2, 2, "interleaved")
    assert s.micro_batch == 1 and p.inputs.workload.global_batch == 8 * 4
    assert s.stage_layers == [8, 9, 8, 7] and s.default.sharding == "zero3_keep"  # 'default' keeps it with PP
    full = [ls.unit for ls in s.layers if ls.recompute == "full"]
    assert len(full) == 16 and s.default.recompute == "none"
    assert generated_sizes(4, 32, 1, 1, "x") == [8, 9, 8, 7] and generated_sizes(1, 32, 1, 1, "x") == [32]


def _job_toml(tmp_path: Path, model: str, section: str) -> Path:
    cfg = tmp_path / "job.toml"
    cfg.write_text(inputs_line(model, {"accelerator": "h100", "nodes": 2, "gpus_per_node": 8}).join(["# ", "\n"])
                   + section + '[parallelism]\ntensor_parallel_degree = 8\n[training]\nseq_len = 2048\n')
    return cfg


def test_torchtitan_flavor_of_another_model_is_refused(tmp_path: Path) -> None:
    """A ``[model]`` flavor that is a preset of another shape than the model priced (the header's or
    ``--model``) is one line naming both; the same shape (Llama 3 and 3.1) or an unknown flavor passes."""
    cfg = _job_toml(tmp_path, "llama3-70b", '[model]\nname = "llama3"\nflavor = "8B"\n')
    with pytest.raises(ConfigError) as err:
        import_plan(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith("'job.toml': [model] name 'llama3' flavor '8B' trains llama3.1-8b")
    assert "but the model being priced is llama3-70b (80 layers, hidden 8192)" in line and "--model" in line
    with pytest.raises(ConfigError, match="trains llama3.1-8b .* priced is llama3-70b"):
        import_plan(_job_toml(tmp_path, "llama3-8b", '[model]\nflavor = "8B"\n'), model="llama3-70b")
    assert import_plan(cfg, model="llama3-8b").inputs.model == "llama3-8b"  # Llama 3 8B: the 3.1 flavor's shape
    assert import_plan(cfg, model="meta-llama/Meta-Llama-3-8B").strategy.mesh.tp == 8  # an id a preset lists
    for section in ('[model]\nflavor = "debugmodel"\n', '[model]\nname = "mine"\nflavor = "8B"\n', ""):
        assert import_plan(_job_toml(tmp_path, "llama3-70b", section)).inputs.model == "llama3-70b"  # not checked


def test_torchtitan_flavors_are_the_pinned_releases() -> None:
    """Each flavor mapped to a preset has the preset's layers and width in the installed torchtitan
    (its model files read as text: importing torchtitan's models needs torchdata)."""
    import ast
    import importlib.util

    from planner.trainers.torchtitan.keys import TORCHTITAN_FLAVORS
    from profiler.models import preset

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed (tests/trainers.txt)")
    root = Path(next(iter(spec.submodule_search_locations))) / "models"
    for (family, flavor), name in TORCHTITAN_FLAVORS.items():
        tree = ast.parse((root / family / "__init__.py").read_text())
        table = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                     and any(isinstance(k, ast.Constant) and k.value == flavor for k in n.value.keys))
        call = next(v for k, v in zip(table.keys, table.values, strict=True)
                    if isinstance(k, ast.Constant) and k.value == flavor)
        given = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg in ("n_layers", "dim")}
        cfg = preset(name)
        assert given.get("n_layers") == cfg.layers, (family, flavor)
        assert given.get("dim", cfg.hidden) == cfg.hidden, (family, flavor)  # gpt_oss leaves dim to its default


def test_python_script_round_trip(tmp_path: Path) -> None:
    p = search("llama3-8b", "16xh100", 2048, 64)
    back = round_trip(p, "shardplan", tmp_path)
    assert back.strategy == p.strategy and close(p, back)


def test_inputs_line_and_suffixes(tmp_path: Path) -> None:
    line = "# " + inputs_line("llama3-8b", {"accelerator": "h100"}, 40.0)
    assert read_inputs(line, "x") == {"model": "llama3-8b", "cluster": {"accelerator": "h100"}, "memory_limit_gib": 40.0}
    assert read_inputs("[parallelism]\n", "x") == {}
    with pytest.raises(ConfigError, match="not JSON"):
        read_inputs("# shardplan-inputs: {nope}", "x")
    assert [importer_for(Path(f"a{s}"), None) for s in (".toml", ".args", ".json", ".yaml", ".py")] == [
        "torchtitan", "megatron", "deepspeed", "nanotron", "python"]
    assert importer_for(Path("a.txt"), "shardplan") == "python"
    with pytest.raises(ConfigError, match="--from"):
        importer_for(Path("a.txt"), None)


BAD_TOML = {
    "unknown key": ('[parallelism]\nenable_sequence_parallel = true\n', "torchtitan 0.2.2 has no key "
                                                                         "parallelism.enable_sequence_parallel"),
    "not toml": ("[parallelism\n", "is not TOML"),
    "bad degree": ('[parallelism]\ntensor_parallel_degree = 0\n', "tensor_parallel_degree must be an integer"),
    "world": ('[parallelism]\ndata_parallel_shard_degree = 3\n', "lays out 3 GPUs"),
    "schedule": ('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "ZBVZeroBubble"\n',
                 "is not priced"),
    "ac mode": ('[activation_checkpoint]\nmode = "memory_budget"\n', "activation_checkpoint.mode"),
    "micro-batches": ('[parallelism]\npipeline_parallel_degree = 4\n', "must split into at least pp = 4 micro-batches"),
    "fqns": ('[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = [["tok_embeddings", '
             '"layers.0"], ["layers.2", "norm", "output"]]\n', "once each, in order"),
}


@pytest.mark.parametrize("case", list(BAD_TOML))
def test_bad_torchtitan_files_are_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body, message = BAD_TOML[case]
    cfg = tmp_path / "job.toml"
    cfg.write_text("[training]\nseq_len = 2048\nlocal_batch_size = 1\n" + body if "training" not in body else body)
    out = tmp_path / "plan.json"
    assert main(["import", str(cfg), "--model", "llama3-8b", "--cluster", "16xh100", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not out.exists()


def test_import_needs_the_model_and_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "job.toml"
    cfg.write_text("[training]\nseq_len = 2048\n")
    assert main(["import", str(cfg), "--cluster", "16xh100"]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["import", str(cfg), "--model", "llama3-8b"]) == 2
    assert "give --cluster" in capsys.readouterr().err
    assert main(["import", str(cfg), "--model", "nope-13b", "--cluster", "16xh100"]) == 2
    assert "nope-13b" in capsys.readouterr().err


def test_import_cli_writes_a_plan_that_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = search("llama3-8b", "16xh100", 2048, 64, target="torchtitan")
    cfg, out = tmp_path / "job.toml", tmp_path / "back.json"
    cfg.write_text(export(p, "torchtitan").text)
    assert main(["import", str(cfg), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "torchtitan 0.2.2" in said and f"{p.predicted.step_time_s:.4g} s/step" in said
    back = load_plan(out)
    assert close(p, back) and json.loads(out.read_text())["inputs"]["target"]["name"] == "torchtitan"
    assert main(["explain", str(out)]) == 0


@pytest.mark.parametrize("dispatch", ["alltoall", "dedup"])
def test_torchtitan_expert_parallel_backend_round_trips(dispatch: str, tmp_path: Path) -> None:
    """torchtitan's expert_parallel_comm_backend carries the dispatch: deepep is the de-duplicated
    one; the plan comes back with it and its step time."""
    from tests.test_explain import make_plan
    from vocab.plan import TargetRef

    p = make_plan({"mesh": {"dp_shard": 16, "ep": 8}, "default": {"sharding": "zero3"}}, model="mixtral-8x7b",
                  target=TargetRef(name="torchtitan", version="0.2.2"), zero3_master="parameter",
                  moe_dispatch=dispatch)
    back = round_trip(p, "torchtitan", tmp_path)
    assert back.inputs.workload.moe_dispatch == dispatch and close(p, back)
