"""Megatron's layer split over (virtual) pipeline stages: the target's rule
(:func:`vocab.targets.split_problem`, ``stage_split: layout``), the flags the export writes for it,
checked against megatron-core's own functions, the import reading them back to the same price, and the
search yielding interleaved meshes whose virtual stages hold unequal layer counts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from costmodel.estimate import estimate
from planner.reprice import load_named_model, price
from planner.trainers import ConfigError, export, import_plan, lacks
from planner.trainers.megatron.export import layout_text, split_flags
from planner.trainers.megatron.read import layout_sizes
from profiler.hardware import parse_cluster
from solvers.space import SPACES, restrict, schedules, split_allowed
from vocab.errors import ShardplanError
from vocab.plan import Plan, TargetRef
from vocab.strategy import Strategy, Workload, even_split
from vocab.targets import load_target, split_problem

Z = {"sharding": "zero1"}


def test_the_rule_on_small_cases() -> None:
    # layout (megatron): any count per virtual stage, 0 included; the MTP layers together in the last
    # virtual stage of a rank
    assert split_problem("layout", [1, 2, 2, 1], 2) is None
    assert split_problem("layout", [0, 1, 1, 0], 2) is None
    assert split_problem("layout", [5, 5, 6, 6, 5, 5], 6) is None
    assert split_problem("layout", [1, 2, 1, 0], 2, tail=1) is None  # MTP in rank 0's last virtual stage
    assert "MTP" in str(split_problem("layout", [2, 0, 1, 1], 2, tail=2))  # split over two stages
    assert "MTP" in str(split_problem("layout", [1, 1, 0, 0], 2, tail=1))  # in a first virtual stage
    # the other rules as before
    assert split_problem("first_last", [1, 2, 2, 1], 2) == "interleaved virtual stages of unequal layer counts (6 layers over 4)"
    assert split_problem("first_last", [5, 5, 6, 6, 5, 5], 6) == "uneven middle pipeline stages"
    assert split_problem("first_last", [7, 8, 8, 7], 4) is None
    assert split_problem("any", [0, 1, 1, 0], 2) is not None and split_problem("even", [3, 4, 4, 3], 4) is None
    assert load_target("megatron").pipeline.stage_split == "layout"
    mg = restrict(SPACES["full"], load_target("megatron"))
    assert split_allowed(even_split(126, 64), 16, mg.stage_split)


def test_the_search_offers_megatrons_accounted_splits() -> None:
    mg = restrict(SPACES["full"], load_target("megatron"))
    vpps = {v for _, v in schedules(16, 64, 126, mg) if v > 1}
    # (126 + 2) / (16 v) whole: v = 2, 4, 8 (128 virtual stages: the first and last hold only the
    # embedding and the loss); never more stages than the blocks and those two
    assert {2, 4, 8} <= vpps and max(vpps) == 8
    tt = restrict(SPACES["full"], load_target("torchtitan"))
    assert {v for _, v in schedules(16, 64, 126, tt) if v > 1} == {2}


def _megatron_split(flags: list[tuple[str | None, object]], layers: int, pp: int, vpp: int) -> list[int]:
    """Blocks per virtual stage as megatron-core 0.16.1 builds them from the flags (its own functions)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    f = dict(flags)
    if "--pipeline-model-parallel-layout" in f:
        lay = PipelineParallelLayerLayout(str(f["--pipeline-model-parallel-layout"]), pp)
        lay.validate_layer_layout(layers, None)
        return [len([t for t in lay.layout[r][v] if t.name == "decoder"]) for v in range(vpp) for r in range(pp)]
    c = SimpleNamespace(pipeline_model_parallel_layout=None, num_layers=layers, pipeline_model_parallel_size=pp,
                        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                        num_layers_in_first_pipeline_stage=f.get("--decoder-first-pipeline-num-layers"),
                        num_layers_in_last_pipeline_stage=f.get("--decoder-last-pipeline-num-layers"),
                        account_for_embedding_in_pipeline_split=bool(f.get("--account-for-embedding-in-pipeline-split")),
                        account_for_loss_in_pipeline_split=bool(f.get("--account-for-loss-in-pipeline-split")))
    return [get_num_layers_to_build(c, vp_stage=v if vpp > 1 else None, pp_rank=r)  # type: ignore[arg-type]
            for v in range(vpp) for r in range(pp)]


@pytest.mark.parametrize(("sizes", "pp", "flags"), [
    ([1] + [2] * 62 + [1], 16, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                "--num-layers-per-virtual-pipeline-stage"]),
    ([0] + [1] * 126 + [0], 16, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                 "--num-layers-per-virtual-pipeline-stage"]),
    ([0] + [1] * 30 + [0], 4, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                               "--num-layers-per-virtual-pipeline-stage"]),
    ([0, 1, 1], 3, ["--account-for-embedding-in-pipeline-split"]),
    ([7, 8, 8, 7], 4, ["--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"]),
    ([5, 5, 6, 6, 5, 5], 6, ["--pipeline-model-parallel-layout"]),
    ([3, 4, 4, 3, 4, 4], 3, ["--pipeline-model-parallel-layout"]),
    ([4, 4, 4, 4], 2, ["--num-layers-per-virtual-pipeline-stage"]),
])
def test_the_flags_make_megatron_build_the_split(sizes: list[int], pp: int, flags: list[str]) -> None:
    vpp = len(sizes) // pp
    out = [(f, v) for f, v in split_flags(sizes, pp, vpp) if v is not None]
    assert [f for f, _ in out] == flags
    assert _megatron_split(out, sum(sizes), pp, vpp) == sizes


def test_the_layout_string() -> None:
    assert layout_text([1] + [2] * 30 + [1], mtp=1) == "Et|(t*2|)*30mL"  # DeepSeek-V3's on pp16 vpp2
    assert layout_text([0, 1, 1, 0]) == "E|(t|)*2L"
    assert layout_sizes("Et|(t*2|)*30mL", 16, 62, "x") == [1] + [2] * 30 + [1]
    assert layout_sizes("E,t|tt|t|tL", 2, 5, "x") == [1, 2, 1, 1]
    with pytest.raises(ConfigError, match="the embedding .E. must open the first stage"):
        layout_sizes("t|EtL", 2, 2, "x")
    with pytest.raises(ConfigError, match="places 3 layers, not the model's 4"):
        layout_sizes("Et|ttL", 2, 4, "x")
    with pytest.raises(ConfigError, match="unrolls to more than"):
        layout_sizes("E(t|)*99999999L", 2, 4, "x")


def _made(model: str, strategy: dict, seq_len: int, global_batch: int, cluster: str) -> Plan:
    w = Workload(seq_len=seq_len, global_batch=global_batch, precision="bf16", cross_entropy="fused",
                 grad_dtype="fp32", kernels="fused")
    p = price(load_named_model(model, seq_len), parse_cluster(cluster), Strategy.model_validate(strategy), w,
              model=model)
    return p.model_copy(update={"inputs": p.inputs.model_copy(update={"target": TargetRef(name="megatron")})})


@pytest.mark.parametrize("vpp", [4, 8])
def test_405b_pp16_interleaved_is_expressible_priced_and_round_trips(vpp: int, tmp_path: Path) -> None:
    """NVIDIA's Llama-3.1 405B recipe: tp4 pp16 vp4 (and vp8: 128 virtual stages for 126 layers, the first
    holding only the embedding and the last only the loss)."""
    p = _made("llama3.1-405b", {"mesh": {"pp": 16, "dp_shard": 8, "tp": 4}, "schedule": "interleaved", "vpp": vpp,
                                "sequence_parallel": True, "default": {**Z, "recompute": "full"},
                                "layers": [{"unit": u, **Z, "recompute": "none"} for u in ("embedding", "head")]},
              8192, 256, "512xh100")
    sizes = p.strategy.stage_layout(126)
    assert sizes == ([1] + [2] * 62 + [1] if vpp == 4 else [0] + [1] * 126 + [0])
    assert p.predicted.step_time_s > 0 and not [x for x in lacks(p, "megatron") if not x.behaviour]
    e = export(p, "megatron")
    assert not [x for x in e.losses if not x.behaviour], e.losses
    want = p.predicted.step_time_s if e.exact else e.repriced.variant["step_time_s"]
    assert "\n--account-for-embedding-in-pipeline-split\n--account-for-loss-in-pipeline-split\n" in e.text
    assert f"\n--num-layers-per-virtual-pipeline-stage {8 // vpp}\n" in e.text
    pytest.importorskip("megatron.core")
    from tests.trainer_loaders import LOADERS

    LOADERS["megatron"](e, tmp_path)  # megatron-core's TransformerConfig takes the accounted split
    path = tmp_path / "405b.args"
    path.write_text(e.text)
    back = import_plan(path)
    assert back.strategy.vpp == vpp and back.strategy.stage_layout(126) == sizes
    assert back.predicted.step_time_s == pytest.approx(want, rel=1e-9)


def test_an_uneven_layout_round_trips(tmp_path: Path) -> None:
    p = _made("llama3-8b", {"mesh": {"pp": 6, "dp_shard": 4}, "stage_layers": [5, 5, 6, 6, 5, 5], "default": Z},
              2048, 64, "24xh100")
    e = export(p, "megatron")
    assert not [x for x in e.losses if not x.behaviour] and "\n--pipeline-model-parallel-layout 'Et*5|t*5|(t*6|)*2t*5|t*5L'\n" in e.text
    pytest.importorskip("megatron.core")
    from tests.trainer_loaders import LOADERS

    LOADERS["megatron"](e, tmp_path)  # megatron-core's TransformerConfig takes the layout
    path = tmp_path / "uneven.args"
    path.write_text(e.text)
    back = import_plan(path)
    assert back.strategy.stage_layout(32) == [5, 5, 6, 6, 5, 5]
    want = p.predicted.step_time_s if e.exact else e.repriced.variant["step_time_s"]
    assert back.predicted.step_time_s == pytest.approx(want, rel=1e-9)


def test_what_megatron_cannot_build_is_refused(tmp_path: Path) -> None:
    # more virtual stages than the blocks and the embedding and loss stages
    g, cl = load_named_model("llama3-8b", 2048), parse_cluster("16xh100")
    w = Workload(seq_len=2048, global_batch=64)
    s = Strategy.model_validate({"mesh": {"pp": 16}, "schedule": "interleaved", "vpp": 3})
    with pytest.raises(ShardplanError, match=r"pp\*vpp = 16\*3 = 48 stages for only 32 layers"):
        estimate(g, cl, s, w)
    # flags Megatron refuses together (transformer_config.py:1294-1324)
    base = export(_made("llama3-8b", {"mesh": {"pp": 2, "dp_shard": 8}, "default": Z}, 2048, 64, "16xh100"),
                  "megatron").text
    for extra, message in [("--account-for-loss-in-pipeline-split\n--decoder-first-pipeline-num-layers 15\n",
                            "cannot be combined with uneven first/last stages"),
                           ("--pipeline-model-parallel-layout 'Et*16|t*16L'\n--account-for-loss-in-pipeline-split\n",
                            "cannot be combined with --account-for-loss-in-pipeline-split"),
                           ("--account-for-embedding-in-pipeline-split\n",
                            "33 layers do not split evenly over --pipeline-model-parallel-size 2")]:
        path = tmp_path / "bad.args"
        path.write_text(base + extra)
        with pytest.raises(ConfigError, match=message):
            import_plan(path)
