"""Architectures beyond the Llama family: sliding-window attention (Mistral 7B, Gemma-2/3,
gpt-oss), multi-head latent attention with multi-token prediction (DeepSeek-V3), read from presets
and from Hugging Face config keys, counted exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate, tied_table
from costmodel.node_costs import is_tied_head
from profiler.hardware import parse_cluster
from profiler.models import config_from_hf, preset
from profiler.transformer import attention_span, build_graph
from runtime.model import unsupported_features
from tests.trainer_loaders import unknown_to_megatron_core
from vocab.errors import ShardplanError
from vocab.strategy import Mesh, Strategy, Workload

DEEPSEEK_V3_HF = {  # deepseek-ai/DeepSeek-V3 config.json, the keys shardplan reads
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "rope_theta": 10000, "rms_norm_eps": 1e-06,
}
GPT_OSS_120B_HF = {  # openai/gpt-oss-120b config.json
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128,
    "attention_bias": True, "tie_word_embeddings": False, "rope_theta": 150000, "rms_norm_eps": 1e-05,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


def _arch(cfg: object) -> dict:
    """The architecture fields of a config (not its name, source or published count)."""
    d = cfg.to_dict()  # type: ignore[attr-defined]
    return {k: v for k, v in d.items() if k not in ("name", "source", "params_published")}


def _attn(graph: object, i: int) -> object:
    return next(n for n in graph.nodes if n.name == f"layers.{i}.attn.core")  # type: ignore[attr-defined]


def test_sliding_window_counts_the_band_of_keys() -> None:
    """Causal queries attend min(i + 1, w) keys: s·w − w²/2 in all, counted (like every attention)
    over a full s × span matrix then halved; a window at least the sequence changes nothing."""
    assert attention_span(8192, 4096, causal=True) == 8192 - 2048
    assert attention_span(2048, 4096, causal=True) == 2048
    assert attention_span(8192, 0, causal=True) == 8192
    cfg = preset("mistral-7b")
    a, d = cfg.heads, cfg.head_dim
    for s, span in ((8192, 6144), (4096, 4096)):
        n = _attn(build_graph(cfg, s), 0)
        assert n.fwd_flops == 4.0 * s * span * a * d
    # the causal work, half the count: QK^T and AV over s·w − w²/2 query-key pairs
    assert _attn(build_graph(cfg, 8192), 0).fwd_flops / 2 == 2 * 2.0 * a * d * (8192 * 4096 - 4096**2 / 2)
    # Gemma-2: even layers local, odd ones global; Gemma-3: every sixth
    g = build_graph(preset("gemma2-9b"), 8192)
    assert _attn(g, 0).dims["span"] == 8192 - 2048 and "span" not in _attn(g, 1).dims
    g3 = replace(preset("gemma2-9b"), global_every=6)
    assert [g3.window_of(i) for i in range(7)] == [4096] * 5 + [0, 4096]


def test_mla_projections_and_attention_shape() -> None:
    """DeepSeek-V3's attention per layer: the query down to 1,536, normalised, up to 128 heads of
    128 + 64; the hidden state down to the 512-wide latent and the shared 64-wide rotary key, the
    latent normalised and up to 128 keys of 128 and values of 128; the kernel at head dim 192."""
    cfg = preset("deepseek-v3")
    g = build_graph(cfg, 4096)
    attn = [n for n in g.nodes if n.block == 3 and (".attn" in n.name or n.name.endswith("attn_norm"))]
    assert [n.name.split(".", 2)[2] for n in attn] == [
        "attn_norm", "attn.q_down", "attn.q_norm", "attn.q_up", "attn.kv_down", "attn.kv_norm", "attn.kv_up",
        "attn.core", "attn.out"]
    h = 7168
    assert sum(n.params for n in attn) == (h + h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512
                                           + 512 * 128 * 256 + 128 * 128 * h)
    core = _attn(g, 3)
    assert core.fwd_flops == 2.0 * 4096 * 4096 * 128 * (192 + 128)
    assert (core.dims["head_dim"], core.dims["v_head_dim"]) == (192, 128)
    tp = {n.name.rsplit(".", 1)[1]: n.tp for n in attn if n.kind == "linear"}
    assert tp == {"q_down": "replicated", "q_up": "column", "kv_down": "replicated", "kv_up": "column", "out": "row"}


def test_deepseek_v3_counts_and_its_mtp_module() -> None:
    """671B in the main model (the report's figure) and 37.6B active per token with the embedding;
    the MTP module is one more block (number 61, like the decoder's last) and, in the head, its
    projection and a second pass of the output head, which shares the head's weights: no tied
    table, no second copy."""
    cfg = preset("deepseek-v3")
    main = build_graph(replace(cfg, mtp_layers=0), 4096)
    assert abs(main.total_params / 671e9 - 1) < 0.001
    active = sum(n.params * (n.dims["top_k"] / n.dims["experts"] if n.kind == "experts" else 1) for n in main.nodes)
    assert abs(active / 37.55e9 - 1) < 0.001
    g = build_graph(cfg, 4096)
    assert g.num_blocks == 62
    blocks = dict(g.blocks())
    assert [n.name.split(".", 2)[2] for n in blocks["layers.61"]] == [n.name.split(".", 2)[2] for n in blocks["layers.60"]]
    assert [n.name for n in blocks["head"]][-6:] == ["mtp.0.hnorm", "mtp.0.enorm", "mtp.0.proj", "mtp.0.final_norm",
                                                     "mtp.0.head", "mtp.0.loss"]
    heads = [n for n in g.nodes if n.kind == "linear" and n.tp == "vocab"]
    assert [n.name for n in heads] == ["head", "mtp.0.head"] and heads[1].params == 0
    assert not any(is_tied_head(n) for n in heads) and tied_table(g) == 0
    assert sum(n.kind == "loss" for n in g.nodes) == 2


def test_the_families_read_from_their_config_keys() -> None:
    """Each key set gives the preset's architecture."""
    assert _arch(config_from_hf(DEEPSEEK_V3_HF)) == _arch(preset("deepseek-v3"))
    # group-limited routing: DeepSeek-V2's plain greedy top-k routes over every expert
    greedy = config_from_hf({**DEEPSEEK_V3_HF, "topk_method": "greedy"})
    assert (greedy.expert_groups, preset("deepseek-v3").expert_groups, preset("deepseek-v3").group_top_k) == (0, 8, 4)
    assert _arch(config_from_hf(GPT_OSS_120B_HF)) == _arch(preset("gpt-oss-120b"))
    gemma3 = config_from_hf({"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                             "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                             "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024})
    assert (gemma3.global_every, gemma3.sliding_window, gemma3.qk_norm, gemma3.sandwich_norm) == (6, 1024, True, True)
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 4096}
    assert config_from_hf(mistral).sliding_window == 4096
    assert config_from_hf({**mistral, "sliding_window": None}).sliding_window == 0
    qwen2 = {**mistral, "model_type": "qwen2"}  # Qwen2 configs carry a window they do not use
    assert config_from_hf(qwen2).sliding_window == 0
    assert config_from_hf({**qwen2, "use_sliding_window": True}).sliding_window == 4096


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention"] * 12},
     "layer_types is not one global layer in every 2"),
    ({"layer_types": ["local"] * 36}, "layer_types \\['local'\\] are not full_attention or sliding_attention"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok must be in 1..128"),
])
def test_bad_family_configs_get_one_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ShardplanError, match=message):
        config_from_hf({**GPT_OSS_120B_HF, **change})


def test_mla_fields_need_the_latent() -> None:
    with pytest.raises(ShardplanError, match="give kv_lora_rank too"):
        replace(preset("llama3-8b"), qk_rope_head_dim=64)
    with pytest.raises(ShardplanError, match="kv_heads 8 must be heads 32"):
        replace(preset("llama3-8b"), kv_lora_rank=512)
    with pytest.raises(ShardplanError, match="give sliding_window too"):
        replace(preset("llama3-8b"), global_every=2)


def test_the_runtime_refuses_what_it_cannot_build() -> None:
    assert "multi-head latent attention" in unsupported_features(preset("deepseek-v3"))
    assert "multi-token prediction" in unsupported_features(preset("deepseek-v3"))
    assert "sliding-window attention" in unsupported_features(preset("gpt-oss-20b"))
    assert "norms after the attention and the MLP" in unsupported_features(preset("gemma2-9b"))


def test_a_windowed_model_prices_less_attention_than_without_its_window() -> None:
    """Mistral 7B at 32,768 tokens: its 4,096-token window removes exactly the attention FLOPs
    outside the band (forward and backward, every layer, every sample) and costs less time."""
    cfg = preset("mistral-7b")
    cluster, s = parse_cluster("8xh100"), Strategy(mesh=Mesh(dp_shard=8), micro_batch=1)
    seq, batch = 32768, 8
    w = Workload(seq_len=seq, global_batch=batch)
    windowed = estimate(build_graph(cfg, seq), cluster, s, w)
    full = estimate(build_graph(replace(cfg, sliding_window=0), seq), cluster, s, w)
    span = attention_span(seq, 4096, causal=True)
    removed = batch * cfg.layers * 3 * 4.0 * seq * (seq - span) * cfg.heads * cfg.head_dim
    assert full.model_flops_per_step - windowed.model_flops_per_step == pytest.approx(removed, rel=1e-12)
    assert windowed.step_time_s < full.step_time_s


def test_megatron_export_writes_mla_and_mtp_flags() -> None:
    """DeepSeek-V3 for Megatron-LM: multi-latent attention with its ranks and head widths (no
    kv-channels), one MTP layer, the shared expert and the three leading dense layers."""
    from planner.trainers import export
    from tests.test_exports import flags
    from vocab.plan import ClusterRef, Plan, PlanInputs, Predicted, SolverInfo

    graph = build_graph(preset("deepseek-v3"), 4096)
    s = Strategy(mesh=Mesh(pp=16, dp_shard=8, tp=2, ep=8), micro_batch=1)
    plan = Plan(inputs=PlanInputs(model="deepseek-v3", model_hash=graph.content_hash(),
                                  cluster=ClusterRef(accelerator="h100", nodes=32, gpus_per_node=8, world_size=256,
                                                     memory_gb=80),
                                  workload=Workload(seq_len=4096, global_batch=512)),
                strategy=s, predicted=Predicted(step_time_s=1.0, tokens_per_s_per_gpu=0.0, mfu=0.0, hfu=0.0,
                                                memory_peak_gib=0.0), solver=SolverInfo(name="user"))
    f = flags(export(plan, "megatron").text)
    assert f["--multi-latent-attention"] is True
    assert (f["--q-lora-rank"], f["--kv-lora-rank"], f["--qk-head-dim"], f["--qk-pos-emb-head-dim"],
            f["--v-head-dim"]) == ("1536", "512", "128", "64", "128")
    assert "--kv-channels" not in f and "--group-query-attention" not in f
    assert (f["--mtp-num-layers"], f["--moe-shared-expert-intermediate-size"], f["--moe-layer-freq"]) == (
        "1", "2048", "[0]*3+[1]*58")
    assert f["--num-layers"] == "61"  # the MTP block is not a decoder layer
    assert (f["--rotary-base"], f["--norm-epsilon"]) == ("10000", "1e-06")  # config.json's rope_theta, rms_norm_eps
    assert (f["--moe-router-num-groups"], f["--moe-router-group-topk"]) == ("8", "4")  # node-limited routing
    # every flag is one megatron-core's configs have at the pinned version (MLATransformerConfig too)
    assert unknown_to_megatron_core(f) == []


def test_the_rotary_base_and_norm_epsilon_are_what_the_config_states() -> None:
    """rope_theta and rms_norm_eps are read from a config (0: not stated), and the Megatron export
    writes them where stated; a rotary model whose base is not stated, or is not a whole number
    (--rotary-base takes an integer), gets a note instead of Megatron-LM's default 10000."""
    from planner.trainers.exporting import Nearest
    from planner.trainers.megatron.export import _rotary_and_norm_flags

    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}
    stated = config_from_hf({**mistral, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5})
    assert (stated.rope_theta, stated.norm_eps) == (1e6, 1e-5)
    assert (config_from_hf(mistral).rope_theta, config_from_hf(mistral).norm_eps) == (0.0, 0.0)
    assert (preset("llama3-8b").rope_theta, preset("qwen3-235b-a22b").norm_eps) == (500000.0, 1e-6)

    class _Notes(Nearest):
        def __init__(self) -> None:  # only the notes of a nearest plan
            self.notes = []

    n = _Notes()
    assert _rotary_and_norm_flags(n, {"position": "rope", "rope_theta": 1e6, "norm_eps": 1e-5}) == [
        ("--rotary-base", 1000000), ("--norm-epsilon", 1e-5)]
    assert _rotary_and_norm_flags(n, {"position": "rope", "rope_theta": 0.0}) == [] and "states no rotary base" in n.notes[0]
    assert _rotary_and_norm_flags(n, {"position": "rope", "rope_theta": 10000.5}) == [] and "not a whole" in n.notes[1]
    assert _rotary_and_norm_flags(n, {"position": "learned", "norm_eps": 1e-5}) == [("--norm-epsilon", 1e-5)]
