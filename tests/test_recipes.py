"""``benchmarks/recipes.py``: NVIDIA's recipe rows mapped to a model, a cluster and a strategy, and what
the megatron target says of them (a few rows; the whole table is the benchmark's)."""

from __future__ import annotations

from tests.benchmark_scripts import benchmark_script

recipes = benchmark_script("recipes")
ROWS = recipes.load_rows()


def assessed(i: int):
    return recipes.assess(recipes.map_row(i, ROWS[i]))


def test_llama70b_on_h100_maps_to_the_preset_and_its_mesh() -> None:
    r = ROWS[85]  # Llama 3.1 70B, 64 H100, TP4 PP4 CP2 VP5, dgxc-benchmarking
    assert (r["model"], r["gpus"], r["tp"], r["pp"], r["cp"], r["vp"]) == ("Llama 3.1 70B", "64", "4", "4", "2", "5")
    m = recipes.map_row(85, r)
    assert not m.error and m.model == "llama3.1-70b"
    assert m.cluster.accelerator.name == "h100-sxm" and m.cluster.world_size == 64
    s = m.strategy
    assert s.mesh.model_dump() == {"pp": 4, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 4, "ep": 1}
    assert (s.schedule, s.vpp, s.micro_batch, s.sequence_parallel) == ("interleaved", 5, 1, True)
    assert (s.default.sharding, s.default.recompute) == ("zero1", "none")
    assert m.workload.global_batch == 128 and m.workload.precision == "bf16"
    assert assessed(85).reasons == []


def test_scaled_down_405b_keeps_the_shape_with_fewer_layers() -> None:
    m = recipes.map_row(97, ROWS[97])  # "Llama 3.1 405B" of 7 layers on 32 GPUs
    assert m.model == "llama3.1-405b-7l"
    assert (m.spec["layers"], m.spec["hidden"], m.spec["heads"], m.spec["kv_heads"]) == (7, 16384, 128, 8)
    assert m.strategy.mesh.tp == 8 and m.strategy.mesh.cp == 2 and m.strategy.schedule == "1f1b"


def test_known_refusals() -> None:
    fsdp = assessed(0)  # Llama 3 70B with Megatron-FSDP on 64 GB300: ZeRO-3, which the megatron target runs
    assert fsdp.reasons == [] and fsdp.mapped.strategy.default.sharding == "zero3"
    mx = assessed(1)  # Llama 3 70B on GB300 in MXFP8: priced as mxfp8, nothing to refuse for it
    assert mx.mapped.workload.precision == "mxfp8" and not any("MXFP8" in r for r in mx.reasons)
    fp4 = assessed(2)  # the same in NVFP4: a named refusal, not priced
    assert fp4.reasons == ["nvfp4: no FP4 throughput in the hardware data (hardware.csv)"] and fp4.peak_gib is None
    folded = assessed(32)  # Qwen3-235B tp2 pp8 ep32 on 256 H100: ep32 > dp 16, so the experts fold over tp
    assert folded.reasons == [] and folded.mapped.strategy.mesh.etp == 1 and folded.fits
    assert any("folded over tp" in a for a in folded.mapped.assumptions)
    kimi = assessed(33)  # Kimi K2 on 256 GB300: the preset; 61 layers over pp4 x vp4 in Megatron's layout
    assert kimi.mapped.model == "kimi-k2" and kimi.reasons == [] and kimi.step_s is not None
    nano = assessed(34)
    assert nano.reasons[0].startswith("no model: Nemotron-3 Nano") and nano.peak_gib is None


def test_the_plan_for_a_recipes_job_is_no_slower_than_the_recipe() -> None:
    """Llama 3.1 70B on 64 H100 (row 85): the recipe is in the megatron search's space (whole device as
    the limit), so the plan searched for the job prices no slower than the recipe."""
    x = assessed(85)
    got = recipes.planned(x)
    assert got is not None and x.step_s is not None and got.step_s <= x.step_s and got.mesh.startswith("pp=")
    assert got.ratio >= 1.0 and (" less" in got.where or "no part differs" in got.where)  # it names what it saves


def test_a_published_moe_row_maps_as_a_recipe() -> None:
    """benchmarks/moe_runs.py: a moe_runs.csv row (DeepSeek-V3 without MTP, 256 GB200, FP8-MX, VP=4 in its
    notes) becomes the recipe mapping's inputs: the preset without its MTP layer, the mesh, mxfp8."""
    import csv

    moe = benchmark_script("moe_runs")
    rows = [r for r in csv.DictReader(moe.CSV.open()) if r["metric"] == "tokens_per_s_per_gpu"]
    r = next(r for r in rows if r["model"] == "DeepSeekV3 (w/o MTP)" and r["precision"] == "FP8-MX"
             and r["gpu_type"].startswith("GB200"))
    m = recipes.map_row(0, moe.recipe_row(r))
    assert not m.error and m.model == "deepseek-v3 (no MTP)" and m.spec["mtp_layers"] == 0
    assert m.strategy.mesh.model_dump() == {"pp": 8, "dp_replicate": 1, "dp_shard": 32, "cp": 1, "tp": 1, "ep": 32}
    assert (m.strategy.schedule, m.strategy.vpp, m.workload.precision) == ("interleaved", 4, "mxfp8")
