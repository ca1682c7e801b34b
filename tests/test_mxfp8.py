"""MXFP8: fp8 GEMMs with an 8-bit exponent scale per 32-element block, priced as fp8 plus the
block scales' bytes in the casts, on accelerators whose file says ``mx_formats``; refused on Hopper; exported
to and imported from Megatron-LM (``--fp8-recipe mxfp8``) and torchtitan (``quantize.linear.mx``); the plan
schema 1.8 that names it. NVFP4 is a named refusal (no FP4 throughput in the hardware data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.configs import ConfigArrays
from costmodel.constants import CostConstants
from costmodel.device import DeviceModel
from costmodel.estimate import check, estimate
from costmodel.kernels import FP8_CAST_BYTES, MX_SCALE_BYTES, fp8_cast_elements
from costmodel.node_costs import gemm_shape, node_times
from planner.api import plan
from planner.cli import main
from planner.reprice import load_named_model, price
from planner.trainers import ConfigError, export, import_plan
from profiler.hardware import accelerator, parse_cluster
from profiler.models import load_model
from vocab.errors import ShardplanError
from vocab.plan import READABLE_VERSIONS, SCHEMA_VERSION, PlanError, load_plan, parse_plan
from vocab.strategy import Strategy, Workload
from vocab.targets import load_target

#: a small Llama: 2 blocks, hidden 256, 4 heads of 64 (2 KV heads), SwiGLU FFN 512
TINY = {"name": "tiny-mx", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 512,
        "vocab": 1024, "activation": "swiglu", "norm": "rmsnorm", "position": "rope"}
HOPPER_REFUSAL = ("mxfp8: h100-sxm has no MX (block-scaled fp8) tensor cores (its accelerator file does not set "
                  "mx_formats: true); use --precision fp8 or bf16")
NVFP4_REFUSAL = "nvfp4: no FP4 throughput in the hardware data (hardware.csv)"


def _w(precision: str, kernels: str = "fused", seq: int = 128, gb: int = 2) -> Workload:
    return Workload(seq_len=seq, global_batch=gb, precision=precision, kernels=kernels)  # type: ignore[arg-type]


def test_the_accelerator_files_say_which_run_mx() -> None:
    for name in ("b200", "b300", "gb200", "gb300"):
        acc = accelerator(name)
        assert acc.mx_formats and "Blackwell" in acc.sources["mx_formats"]
        assert acc.peak_flops("mxfp8") == acc.peak_flops("fp8")
        assert acc.precision_problem("mxfp8") is None
    for name in ("h100-sxm", "h200", "a100-80gb", "mi300x"):
        assert not accelerator(name).mx_formats and accelerator(name).precision_problem("mxfp8")
    assert accelerator("h100-sxm").precision_problem("mxfp8") == HOPPER_REFUSAL


@pytest.mark.parametrize("kernels", ["fused", "eager"])
def test_gemms_priced_as_fp8_and_the_casts_write_the_block_scales(kernels: str) -> None:
    """On B200 every linear layer of an mxfp8 run costs the fp8 GEMMs and fp8's casts, plus one scale
    byte per 32 elements cast in each of the two orientations; the head stays bf16 either way."""
    c = CostConstants()
    dev = DeviceModel(parse_cluster("1xb200"), constants=c)
    graph = load_model(TINY, 128)
    cfg = ConfigArrays.of_strategy(Strategy(micro_batch=2))
    bw = dev.acc.hbm_tbps * 1e12 * c.memory_efficiency  # bytes per second of a streamed kernel
    scale_bytes = 0.0
    for n in graph.nodes:
        if n.kind != "linear":
            continue
        (f8, b8), (fm, bm) = node_times(n, dev, cfg, _w("fp8", kernels)), node_times(n, dev, cfg, _w("mxfp8", kernels))
        if n.tp == "vocab":  # the LM head: bf16 under both
            assert (float(fm[0]), float(bm[0])) == (float(f8[0]), float(b8[0]))
            continue
        shape = gemm_shape(n, 2, 1, 1)
        flops = n.fwd_flops * 2
        assert dev.gemm_time(flops, "mxfp8", shape=shape) == dev.gemm_time(flops, "fp8", shape=shape)
        ef, eb = fp8_cast_elements(shape)
        per = FP8_CAST_BYTES[kernels]
        # the GEMMs alike: each time less its casts is the same under fp8 and mxfp8
        assert float(fm[0]) - ef * (per + MX_SCALE_BYTES) / bw == pytest.approx(float(f8[0]) - ef * per / bw, rel=1e-12)
        assert float(bm[0]) - eb * (per + MX_SCALE_BYTES) / bw == pytest.approx(float(b8[0]) - eb * per / bw, rel=1e-12)
        scale_bytes += (float(fm[0]) - float(f8[0]) + float(bm[0]) - float(b8[0])) * bw
    # counted by hand: m = 2 x 128 tokens; per block qkv (k 256, n 256 + 2*2*64), out (256, 256), gate+up
    # (256, 2*512), down (512, 256); each GEMM casts m*k + n*k forward and m*n backward elements:
    # 327,680 + 196,608 + 589,824 + 327,680 = 1,441,792 a block, 2,883,584 for both; 2 scale bytes per 32
    m = 256
    gemms = [(256, 512), (256, 256), (256, 1024), (512, 256)]
    elements = 2 * sum(m * k + n * k + m * n for k, n in gemms)
    assert elements == 2_883_584 and MX_SCALE_BYTES == 2 / 32
    assert scale_bytes == pytest.approx(elements * 2 / 32, rel=1e-9) and round(scale_bytes) == 180_224


def test_one_plan_on_b200_costs_the_scales_and_keeps_the_fp8_peak() -> None:
    graph, cl = load_named_model("llama3-8b", 4096), parse_cluster("8xb200")
    s = Strategy.model_validate({"mesh": {"dp_shard": 8}, "micro_batch": 1, "default": {"sharding": "zero1"}})
    fp8, mx = (estimate(graph, cl, s, _w(p, seq=4096, gb=64)).to_dict() for p in ("fp8", "mxfp8"))
    assert fp8["step_time_s"] < mx["step_time_s"] < fp8["step_time_s"] * 1.01
    # MFU over the same (fp8) peak
    assert mx["mfu"] * mx["step_time_s"] == pytest.approx(fp8["mfu"] * fp8["step_time_s"], rel=1e-12)
    assert mx["memory_peak_gib"] == fp8["memory_peak_gib"]


def test_refused_on_hopper_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(ShardplanError) as e:
        plan("llama3-8b", "8xh100", 4096, 64, precision="mxfp8", target="megatron")
    assert str(e.value) == HOPPER_REFUSAL
    graph = load_named_model("llama3-8b", 4096)
    with pytest.raises(ShardplanError, match="mxfp8: h100-sxm has no MX"):
        check(graph, parse_cluster("8xh100"), Strategy.model_validate({"mesh": {"dp_shard": 8}}), _w("mxfp8", seq=4096, gb=64))
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "8xh100", "--seq-len", "4096", "--global-batch", "64",
                 "--precision", "mxfp8", "--target", "megatron", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(HOPPER_REFUSAL) and len(err.splitlines()) == 1 and not out.exists()


def test_nvfp4_is_a_named_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["plan", "--model", "llama3-8b", "--cluster", "8xb200", "--seq-len", "4096", "--global-batch", "64"],
                ["estimate", "--model", "llama3-8b", "--cluster", "8xb200", "--seq-len", "4096", "--global-batch", "64",
                 "--dp", "8"]):
        assert main([*cmd, "--precision", "nvfp4"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(NVFP4_REFUSAL) and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match=NVFP4_REFUSAL.replace("(", r"\(").replace(")", r"\)")):
        _w("nvfp4")


def test_targets_without_mxfp8_refuse_it() -> None:
    assert load_target("megatron").mxfp8 and load_target("torchtitan").mxfp8
    for name in ("deepspeed", "nanotron", "shardplan"):
        assert not load_target(name).mxfp8
        with pytest.raises(ShardplanError, match=f"the {name} target .* has no mxfp8 training"):
            plan("llama3-8b", "8xb200", 4096, 64, precision="mxfp8", target=name)


def _megatron_plan() -> object:
    from vocab.plan import TargetRef

    w = Workload(seq_len=2048, global_batch=64, precision="mxfp8", cross_entropy="fused", grad_dtype="fp32",
                 kernels="fused", fp8_saved_inputs="quantized")
    p = price(load_named_model("llama3-8b", 2048), parse_cluster("16xb200"),
              Strategy.model_validate({"mesh": {"dp_shard": 8, "tp": 2}, "sequence_parallel": True,
                                       "default": {"sharding": "zero1"}}), w, model="llama3-8b")
    return p.model_copy(update={"inputs": p.inputs.model_copy(update={"target": TargetRef(name="megatron")})})


def test_megatron_export_and_import_keep_mxfp8(tmp_path: Path) -> None:
    p = _megatron_plan()
    e = export(p, "megatron")
    assert e.exact and "\n--fp8-format e4m3\n" in e.text and "\n--fp8-recipe mxfp8\n" in e.text
    path = tmp_path / "mx.args"
    path.write_text(e.text)
    back = import_plan(path)
    assert back.inputs.workload.precision == "mxfp8" and back.schema_version == SCHEMA_VERSION
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    # the recipe alone does not turn fp8 on; another recipe is fp8; NVFP4 is refused by name
    path.write_text(e.text.replace("--fp8-format e4m3\n", ""))
    assert import_plan(path).inputs.workload.precision == "bf16"
    path.write_text(e.text.replace("--fp8-recipe mxfp8", "--fp8-recipe tensorwise"))
    assert import_plan(path).inputs.workload.precision == "fp8"
    path.write_text(e.text.replace("--fp8-recipe mxfp8", "--fp8-recipe mx"))
    with pytest.raises(ConfigError, match="argument --fp8-recipe: invalid choice: 'mx' .choose from 'tensorwise', "
                                          "'delayed', 'mxfp8'"):
        import_plan(path)
    path.write_text(e.text.replace("--fp8-format e4m3\n--fp8-recipe mxfp8\n", "--fp4-format e2m1\n"))
    with pytest.raises(ConfigError, match=r"--fp4-format: nvfp4: no FP4 throughput in the hardware data \(hardware.csv\)"):
        import_plan(path)


def test_torchtitan_export_and_import_keep_mxfp8(tmp_path: Path) -> None:
    import tomllib

    p = plan("llama3-8b", "8xb200", 2048, 32, precision="mxfp8", target="torchtitan")
    e = export(p, "torchtitan")
    assert e.exact and tomllib.loads(e.text)["model"]["converters"] == ["quantize.linear.mx"]
    path = tmp_path / "mx.toml"
    path.write_text(e.text)
    back = import_plan(path)
    assert back.inputs.workload.precision == "mxfp8"
    assert back.predicted.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)


def test_schema_reads_the_previous_version() -> None:
    assert SCHEMA_VERSION == "1.12" and "1.7" in READABLE_VERSIONS
    old = load_plan(Path(__file__).parent / "data" / "calibration" / "cpu-runs" / "ddp.plan.json")
    assert old.schema_version == "1.7"
    doc = json.loads(_megatron_plan().model_dump_json())
    assert parse_plan(json.dumps(doc)).inputs.workload.precision == "mxfp8"
    doc["schema_version"] = "1.7"
    with pytest.raises(PlanError, match="workload.precision 'mxfp8' needs schema_version 1.8"):
        parse_plan(json.dumps(doc))
    doc["inputs"]["workload"]["precision"] = "fp8"
    doc["schema_version"] = "1.10"
    with pytest.raises(PlanError, match="workload.fp8_saved_inputs 'quantized' needs schema_version 1.11"):
        parse_plan(json.dumps(doc))
    del doc["inputs"]["workload"]["fp8_saved_inputs"]
    doc["schema_version"] = "1.7"
    assert parse_plan(json.dumps(doc)).schema_version == "1.7"


def test_cli_plans_mxfp8_for_megatron_on_b200(tmp_path: Path) -> None:
    out = tmp_path / "mx.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "8xb200", "--seq-len", "4096", "--global-batch", "64",
                 "--precision", "mxfp8", "--target", "megatron", "-o", str(out)]) == 0
    p = load_plan(out)
    assert p.schema_version == "1.12" and p.inputs.workload.precision == "mxfp8"
    assert p.inputs.target.name == "megatron" and p.predicted.step_time_s > 0


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_trainer_loaders_accept_the_mxfp8_exports(target: str, tmp_path: Path) -> None:
    """The pinned release's own loader accepts the export (skipped where the trainer is not installed)."""
    from tests.trainer_loaders import trainer_loader

    load = trainer_loader(target)
    p = _megatron_plan() if target == "megatron" else plan("llama3-8b", "8xb200", 2048, 32, precision="mxfp8",
                                                             target="torchtitan")
    load(export(p, target), tmp_path)
