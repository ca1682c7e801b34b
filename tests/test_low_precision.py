"""fp8 and MXFP8 are never priced slower than bf16 for the same plan without the output saying why
(the casts, by how the trainer runs them)."""

from __future__ import annotations

from costmodel.device import DeviceModel
from costmodel.units import unit_cost
from planner.commands.estimate import price_args
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.transformer import build_graph
from vocab.strategy import Strategy, Workload

JOB = dict(model="llama3.1-8b", cluster="8xh100", seq_len=8192, global_batch=128, micro_batch=1, cp=2)


def _step_and_notes(**kw: object) -> tuple[float, list[str]]:
    rep = price_args({**JOB, **kw})
    return rep["step_time_s"], [n for n in rep["notes"] if "slower than bf16" in n]


def test_eager_casts_that_outweigh_the_gemms_are_named() -> None:
    """torchtitan casts eagerly (27 bytes per element): at 8K tokens and micro-batch 1 on 8 H100 its
    fp8 costs more than it saves, and the note gives both step times."""
    bf16, _ = _step_and_notes(zero=3, target="torchtitan", precision="bf16")
    fp8, notes = _step_and_notes(zero=3, target="torchtitan", precision="fp8")
    assert fp8 > bf16 and len(notes) == 1
    assert notes[0].startswith(f"fp8 prices {fp8 - bf16:.3g} s slower than bf16 for this plan ({fp8:.4g} s against "
                               f"{bf16:.4g} s): its casts to fp8 (eager kernels, 27 bytes moved per element cast)")


def test_fused_casts_make_fp8_faster_and_say_nothing() -> None:
    """Megatron-LM fuses the casts (Transformer Engine, 4 bytes per element): fp8 is faster, no note."""
    bf16, _ = _step_and_notes(zero=1, target="megatron", precision="bf16")
    low, notes = _step_and_notes(zero=1, target="megatron", precision="fp8")
    assert low < bf16 and notes == []


def test_no_recipe_in_fp8_or_mxfp8_prices_slower_than_bf16_on_megatron() -> None:
    """Every NVIDIA recipe row in fp8 or MXFP8 that the megatron target prices (recipes.csv), as
    Megatron runs it (fused casts): no slower than the same plan in bf16, so no note is needed."""
    from costmodel.estimate import estimate
    from profiler.models import load_model
    from tests.benchmark_scripts import benchmark_script

    recipes = benchmark_script("recipes")
    low = [m for m in (recipes.map_row(i, r) for i, r in enumerate(recipes.load_rows()))
           if not m.error and m.workload is not None and m.workload.precision in ("fp8", "mxfp8")]
    assert len(low) > 40
    slower = []
    for m in low:
        graph = load_model(m.spec, m.workload.seq_len)
        step = estimate(graph, m.cluster, m.strategy, m.workload).step_time_s
        bf16 = estimate(graph, m.cluster, m.strategy, m.workload.model_copy(update={"precision": "bf16"})).step_time_s
        if step > bf16:
            slower.append((m.index, m.model, step, bf16))
    assert slower == []


# ---- what an fp8 linear keeps of its input (Workload.fp8_saved_inputs) ------------------------------------
def _block_activations(cfg: TransformerConfig, precision: str, saved: str, cluster: str = "8xh100") -> float:
    nodes = dict(build_graph(cfg, 1024).blocks())["layers.1"]
    w = Workload(seq_len=1024, global_batch=2, precision=precision, fp8_saved_inputs=saved)  # type: ignore[arg-type]
    return unit_cost("layers.1", nodes, DeviceModel(parse_cluster(cluster)), Strategy(micro_batch=2), w).activations


def _tiny(**kw: int) -> TransformerConfig:
    base = {"name": "t", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 640, "vocab": 1000,
            "activation": "swiglu", "norm": "rmsnorm", "position": "rope"}
    return TransformerConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_quantized_inputs_keep_one_byte_for_each_gemm_input_but_the_attention_output() -> None:
    """Transformer Engine keeps the fp8 copy of the QKV, up and down projections' inputs (h, h and f wide):
    one byte an element less than 16 bits, per token of the micro-batch of 2; linear_proj shares the
    attention core's 16-bit output. mxfp8 keeps a 1-byte scale per 32 elements on top."""
    cfg, tokens, h, f = _tiny(), 2 * 1024, 256, 640
    bf16_kept = _block_activations(cfg, "fp8", "original")
    assert bf16_kept - _block_activations(cfg, "fp8", "quantized") == tokens * (2 * h + f)
    assert bf16_kept - _block_activations(cfg, "mxfp8", "quantized", "8xb200") == tokens * (2 * h + f) * (1 - 1 / 32)
    assert _block_activations(cfg, "bf16", "quantized") == _block_activations(cfg, "bf16", "original")
    # an accelerator without fp8 runs the GEMMs in bf16 and keeps their 16-bit inputs
    assert _block_activations(cfg, "fp8", "quantized", "8xa100-80gb") == _block_activations(
        cfg, "fp8", "original", "8xa100-80gb")


def test_quantized_inputs_of_routed_experts() -> None:
    """Each routed copy keeps its input (h) and the down projection's input (f) in fp8, the SwiGLU input
    (2f) in 16 bits: 1 byte less for h + f of each of the top_k copies of every token."""
    cfg, tokens, h, f, k = _tiny(experts=4, top_k=2, moe_ffn_hidden=128), 2 * 1024, 256, 128, 2
    assert (_block_activations(cfg, "fp8", "original") - _block_activations(cfg, "fp8", "quantized")
            == tokens * (k * (h + f) + h))  # the experts' copies and the QKV input (the router keeps 16 bits)
