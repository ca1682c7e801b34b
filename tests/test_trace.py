"""The tracer: exact parameters, FLOPs and saved bytes of real modules, measured without memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from profiler.models import config_from_hf, load_model
from profiler.trace import EXTRA_FLOP_FORMULAS, trace_module
from profiler.trace_factories import hf_inputs, trace_factory, trace_hf_config
from profiler.transformer import build_graph
from tests.fixtures_models import D_HID, D_IN, D_OUT, LLAMA_KW
from vocab.errors import ShardplanError

try:
    import transformers
except ImportError:  # the plain-module tests still run
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="needs transformers")

B, S = 2, 16
LLAMA_HF = {"model_type": "llama", **LLAMA_KW, "tie_word_embeddings": False}
GPT2_KW = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)


def _llama(attn: str) -> nn.Module:
    cfg = transformers.LlamaConfig(**LLAMA_KW, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(attn: str) -> nn.Module:
    cfg = transformers.GPT2Config(**GPT2_KW, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg)


def _real_counts(model: nn.Module, inputs: dict) -> tuple[int, int, int]:
    """Forward FLOPs, forward+backward FLOPs and saved-for-backward bytes of a real CPU step."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved.setdefault(st.data_ptr(), st.nbytes())
        return t

    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as fc:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**inputs)
        fwd = fc.get_total_flops()
        out.loss.backward()
    return fwd, fc.get_total_flops(), sum(saved.values())


# ---- Hugging Face models: traced on meta / fake equals a real CPU step ------------------------------

@needs_hf
@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("where", ["meta", "fake"])
def test_hf_trace_matches_real_cpu_step(build, attn: str, where: str) -> None:
    if where == "meta":
        with torch.device("meta"):
            model = build(attn)
    else:
        with FakeTensorMode():
            model = build(attn)
    model.train()
    graph = trace_module(model, hf_inputs(model, B, S), model_id="m", seq_len=S)

    assert graph.total_params == sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    real = build(attn).train()
    fwd, total, saved = _real_counts(real, hf_inputs(real, B, S))
    assert graph.fwd_flops * B == fwd
    assert graph.train_flops * B == total
    assert graph.act_saved_bytes * B == saved


@needs_hf
def test_plain_flop_counter_agrees_on_eager_attention() -> None:
    """With eager attention every FLOP is a matmul that stock FlopCounterMode already counts."""
    with torch.device("meta"):
        model = _gpt2("eager")
    graph = trace_module(model, hf_inputs(model, B, S), model_id="gpt2", seq_len=S)
    real = _gpt2("eager")
    with FlopCounterMode(display=False) as fc:
        real(**hf_inputs(real, B, S))
    assert graph.fwd_flops * B == fc.get_total_flops()


@needs_hf
def test_gpt2_tied_head_counted_once() -> None:
    with torch.device("meta"):
        model = _gpt2("sdpa")
    graph = trace_module(model, hf_inputs(model, B, S), model_id="gpt2", seq_len=S)
    by_name = {n.name: n for n in graph.nodes}
    assert by_name["transformer.wte"].params == 128 * 64
    assert by_name["lm_head"].params == 0 and by_name["lm_head"].fwd_flops == 2 * S * 64 * 128
    assert by_name["transformer.wte"].tp == "vocab" and by_name["transformer.wpe"].tp == "replicated"
    assert by_name["transformer.h.1.attn.c_attn"].kind == "linear"
    assert by_name["transformer.h.1.attn.c_attn"].dims == {"in": 64, "out": 192}


@needs_hf
def test_llama_graph_structure() -> None:
    with torch.device("meta"):
        model = _llama("sdpa")
    graph = trace_module(model, hf_inputs(model, 1, S), model_id="llama", seq_len=S)
    nodes = {n.name: n for n in graph.nodes}
    assert graph.source == "traced" and graph.num_blocks == 2
    assert [u for u, _ in graph.blocks()] == ["embedding", "layers.0", "layers.1", "head"]
    q = nodes["model.layers.1.self_attn.q_proj"]
    assert (q.kind, q.block, q.block_type, q.tp) == ("linear", 1, "decoder", "column")
    assert nodes["model.layers.1.self_attn.o_proj"].tp == "row"
    # Backward FLOPs belong to the op that ran: q/k/v share an input yet none is over-counted.
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        n = nodes[f"model.layers.0.self_attn.{p}"]
        assert n.bwd_flops == 2 * n.fwd_flops
    attn = nodes["model.layers.0.self_attn.fn"]
    assert attn.kind == "attention" and attn.params == 0 and attn.causal
    assert attn.fwd_flops == 4 * S * S * 64
    assert dict(attn.dims) == {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq": S}
    assert nodes["model.embed_tokens"].kind == "embedding" and nodes["model.embed_tokens"].block_type == "embedding"
    assert nodes["model.layers.0.input_layernorm"].kind == "norm"
    assert nodes["model.layers.0.mlp.act_fn"].kind == "activation"
    assert nodes["model.norm"].block_type == "head" and nodes["root.fn"].kind == "loss"
    # Execution order: k/v projections before the attention core, the head before the loss.
    names = [n.name for n in graph.nodes]
    assert names.index("model.layers.0.self_attn.v_proj") < names.index("model.layers.0.self_attn.fn")
    assert names.index("lm_head") < names.index("root.fn")
    # Saved activations: q_proj keeps the normed input (fp32), k/v share it and keep nothing new.
    assert q.act_saved_bytes == S * 64 * 4 and nodes["model.layers.1.self_attn.k_proj"].act_saved_bytes == 0


@needs_hf
def test_traced_and_analytic_llama_agree() -> None:
    analytic = build_graph(config_from_hf(LLAMA_HF, name="tiny-llama"), S)
    traced = trace_hf_config(LLAMA_HF, seq_len=S, model_id="tiny-llama")
    assert traced.total_params == analytic.total_params
    assert traced.fwd_flops == pytest.approx(analytic.fwd_flops, rel=0.01)
    assert traced.num_blocks == analytic.num_blocks == 2
    assert next(n for n in traced.nodes if n.params).param_bytes == 2  # traced in bf16 by default


@needs_hf
def test_trace_hf_config_errors() -> None:
    with pytest.raises(ShardplanError, match="model_type"):
        trace_hf_config({"hidden_size": 8}, seq_len=8, model_id="x")
    with pytest.raises(ShardplanError, match="transformers cannot build"):
        trace_hf_config({"model_type": "no-such-arch"}, seq_len=8, model_id="x")


# ---- factories and plain modules ---------------------------------------------------------------

def test_a_config_of_another_type_is_traced_not_read_as_llama() -> None:
    """Phi-3 (fused QKV and gate-up projections) has Llama's keys but is no type the reader knows:
    the traced graph holds what transformers builds."""
    import transformers

    cfg = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
           "pad_token_id": 0, "tie_word_embeddings": False}
    with torch.device("meta"):
        want = transformers.Phi3ForCausalLM(transformers.Phi3Config(**cfg)).num_parameters()
    assert load_model(cfg, 16).total_params == want


def test_a_gemma2_config_is_read_as_gemma2_not_as_llama() -> None:
    """Gemma-2 (tied embeddings, its own head_dim, norms after the attention and the MLP): the
    graph read from its keys holds what transformers builds."""
    import transformers

    cfg = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256,
           "max_position_embeddings": 64, "tie_word_embeddings": True}
    with torch.device("meta"):
        want = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**cfg)).num_parameters()
    assert load_model(cfg, 16).total_params == want


def test_tiny_mlp_factory_exact() -> None:
    graph = trace_factory("tests.fixtures_models:tiny_mlp", seq_len=S)
    assert graph.total_params == D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT
    nodes = {n.name: n for n in graph.nodes}
    assert [n.name for n in graph.nodes] == ["up", "act", "down"]
    for name, d_in, d_out in (("up", D_IN, D_HID), ("down", D_HID, D_OUT)):
        n = nodes[name]
        assert (n.kind, n.block, n.block_type) == ("linear", None, "embedding")
        assert n.fwd_flops == 2 * S * d_in * d_out
        assert n.bwd_flops == 2 * n.fwd_flops
        assert n.act_saved_bytes == S * d_in * 2 and n.param_bytes == 2  # bf16 input kept for dW
        assert n.out_bytes == S * d_out * 2
    assert nodes["act"].kind == "activation" and nodes["act"].fwd_flops == 0


def test_trace_module_real_model_fp32_batch() -> None:
    from tests.fixtures_models import TinyMLP

    model = TinyMLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = trace_module(model, (torch.randn(4, S, D_IN),), model_id="mlp", seq_len=S)
    assert graph.nodes[0].fwd_flops == 2 * S * D_IN * D_HID  # per sample, batch 4 divided out
    assert graph.nodes[0].act_saved_bytes == S * D_IN * 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # model untouched
    fwd_only = trace_module(model, (torch.randn(4, S, D_IN),), model_id="mlp", seq_len=S, backward=False)
    assert fwd_only.fwd_flops == graph.fwd_flops and fwd_only.train_flops == graph.fwd_flops


@needs_hf
def test_factory_with_seq_len_and_hf_factory() -> None:
    graph = trace_factory("tests.fixtures_models:tiny_mlp_seq", seq_len=24)
    assert graph.seq_len == 24 and dict(graph.nodes[0].dims) == {"in": D_IN, "out": 24}
    llama = trace_factory("tests.fixtures_models:tiny_llama", seq_len=S)
    assert llama.total_params == build_graph(config_from_hf(LLAMA_HF), S).total_params


def test_load_model_dispatches_to_tracer() -> None:
    from profiler.models import load_model

    assert load_model("tests.fixtures_models:tiny_mlp", seq_len=8).source == "traced"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_pkg.mod:f", "cannot import 'no_such_pkg.mod'"),
        ("tests.fixtures_models:missing", "has no attribute 'missing'"),
        ("tests.fixtures_models:NOT_CALLABLE", "is not callable"),
        ("tests.fixtures_models:not_a_module", "not a torch.nn.Module"),
        ("tests.fixtures_models:no_inputs", "example_inputs"),
        ("tests.fixtures_models", "package.module:factory"),
    ],
)
def test_bad_factory_specs(spec: str, match: str) -> None:
    with pytest.raises(ShardplanError, match=match) as e:
        trace_factory(spec, seq_len=8)
    assert spec.split(":")[0] in str(e.value)


# ---- MoE ---------------------------------------------------------------------------------------

MIXTRAL_HF = {"model_type": "mixtral", **LLAMA_KW, "num_local_experts": 4, "num_experts_per_tok": 2}


def _mixtral(impl: str) -> nn.Module:
    kw = {k: v for k, v in MIXTRAL_HF.items() if k != "model_type"}
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw, experts_implementation=impl))


@needs_hf
def test_mixtral_grouped_mm_matches_real_routing_and_analytic() -> None:
    """grouped_mm experts have static shapes: every routed token copy is counted, as on real data."""
    with torch.device("meta"):
        model = _mixtral("grouped_mm")
    graph = trace_module(model, hf_inputs(model, B, S), model_id="mixtral", seq_len=S, dtype=torch.bfloat16)
    torch.manual_seed(0)
    real = _mixtral("grouped_mm").to(torch.bfloat16)
    fwd, total, _ = _real_counts(real, hf_inputs(real, B, S))
    assert graph.fwd_flops * B == fwd and graph.train_flops * B == total
    kinds = {n.name.rsplit(".", 2)[-2] if n.name.endswith(".fn") else n.name.rsplit(".", 1)[-1]: n.kind
             for n in graph.nodes if n.block == 0}
    assert kinds["experts"] == "experts" and kinds["gate"] == "router"

    traced = trace_hf_config(MIXTRAL_HF, seq_len=S, model_id="mixtral")  # picks grouped_mm itself
    analytic = build_graph(config_from_hf(MIXTRAL_HF), S)
    assert traced.total_params == analytic.total_params
    assert traced.fwd_flops == analytic.fwd_flops  # router + top-k experts + attention, exactly


@needs_hf
def test_data_dependent_moe_loop_is_a_clear_error() -> None:
    with torch.device("meta"):
        model = _mixtral("eager")
    with pytest.raises(ShardplanError, match="grouped_mm"):
        trace_module(model, hf_inputs(model, 1, S), model_id="mixtral", seq_len=S)
