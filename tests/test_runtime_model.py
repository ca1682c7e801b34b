"""Runtime pieces that need no process group: reference model, splitting, checkpointing,
memory accounting, pipeline cutting, plan/model validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiler.model_config import TransformerConfig
from profiler.transformer import build_graph
from runtime import checkpointing
from runtime.adapters import adapt
from runtime.apply import check_plan, model_problem
from runtime.memory import state_bytes, tensor_bytes
from runtime.model import TINY_MODELS, Transformer, build, count_params, lm_loss, resolve_config, spec_for
from runtime.pipeline import rank_stage_modules, release_unheld, stage_module
from runtime.plans import hand_plan
from runtime.splitting import SplitEmbedding, SplitLinear, slice_rows, split_module, split_tied_head
from runtime.units import graph_name, resolve, split_targets
from runtime.validate import PlanMismatchError, check
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

GPT_LIKE = TransformerConfig(name="gpt-like", layers=2, hidden=64, heads=4, vocab=256, max_seq=32, bias=True,
                             position="learned", tied_embeddings=True, activation="gelu", norm="layernorm")
LLAMA_LIKE = TransformerConfig(name="llama-like", layers=3, hidden=64, heads=4, kv_heads=2, vocab=256, max_seq=32,
                               ffn_hidden=96, activation="swiglu", norm="rmsnorm", position="rope", bias=False)


def _tokens(vocab: int = 256, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE, TINY_MODELS["tiny-gpt"], TINY_MODELS["tiny-llama"]],
                         ids=lambda c: c.name)
def test_reference_model_matches_layer_graph(cfg: TransformerConfig) -> None:
    torch.manual_seed(0)
    m = Transformer(cfg)
    g = build_graph(cfg, 16)
    assert count_params(m) == g.total_params
    modules = dict(m.named_modules())
    assert [n.name for n in g.nodes if n.name not in modules] == ["loss"]
    x = _tokens(cfg.vocab)
    logits = m(x)
    assert logits.shape == (2, 16, cfg.vocab)
    assert torch.isfinite(lm_loss(logits, x))
    assert (m.head.weight is m.embed.tok.weight) == cfg.tied_embeddings


def test_gpt2_preset_parameter_count_on_meta() -> None:
    cfg = resolve_config("gpt2")
    with torch.device("meta"):
        m = Transformer(cfg)
    assert count_params(m) == build_graph(cfg, 128).total_params == 124_439_808


def test_resolve_config_takes_any_size_and_rejects_unsupported_models() -> None:
    assert resolve_config("llama2-7b").layers == 32  # built on the meta device, initialised shard by shard
    assert resolve_config("mixtral-8x7b").experts == 8
    assert resolve_config("tiny-mixtral").experts == 4 and resolve_config("tiny-deepseek").shared_experts == 1
    with pytest.raises(ShardplanError, match="arch 'encoder'"):
        resolve_config("bert-large")
    with pytest.raises(ShardplanError, match="unknown model"):
        spec_for("no-such-model")


def test_split_linear_and_embedding_compute_the_same() -> None:
    torch.manual_seed(0)
    lin, emb = nn.Linear(64, 96), nn.Embedding(256, 64)
    x, idx = torch.randn(2, 5, 64), torch.randint(0, 256, (2, 5))
    torch.testing.assert_close(SplitLinear(lin, 3)(x), lin(x), rtol=0, atol=1e-6)
    assert torch.equal(SplitEmbedding(emb, 4)(idx), emb(idx))
    m = Transformer(TINY_MODELS["tiny-llama"])
    x = _tokens()
    ref = m(x)
    for path in ("layers.0.mlp.up", "layers.1.attn.qkv", "head", "embed.tok"):
        split_module(m, path, 2)
    assert count_params(m) == build_graph(TINY_MODELS["tiny-llama"], 16).total_params
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="only Linear and Embedding"):
        split_module(m, "layers.0.attn_norm", 2)


def test_split_targets_name_each_operator_once() -> None:
    """A unit's split and its operators' entries (as the search writes them) split the table once."""
    ad = adapt(Transformer(TINY_MODELS["tiny-gpt"]))
    s = Strategy(layers=[L(unit="embedding", split=2), L(unit="embed", sharding="zero3", split=2),
                         L(unit="layers.1.mlp.up", split=4)])
    assert split_targets(ad, s) == [("embed.tok", 2), ("embed.pos", 2), ("layers.1.mlp.up", 4)]


def test_split_slices_interleave_tensor_parallel_ranks_and_a_tied_head_sums_them() -> None:
    """Slice j of a column-parallel layer holds the j-th part of each tp rank's rows; the head of a
    split tied table computes the unsplit logits."""
    assert slice_rows(8, 2, 2).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    s = SplitLinear(lin, 2, interleave=2)
    rank1 = torch.cat([sl(x)[:, 2:] for sl in s.slices], -1)  # each slice column-sharded over 2 ranks
    torch.testing.assert_close(rank1, lin(x)[:, 4:], rtol=0, atol=1e-6)
    m = Transformer(TINY_MODELS["tiny-gpt"])
    x = _tokens()
    ref = m(x)
    split_module(m, "embed.tok", 4)
    split_tied_head(m, 4)
    assert m.head.parts[2].weight is m.embed.tok.slices[2].weight
    assert count_params(m) == build_graph(TINY_MODELS["tiny-gpt"], 16).total_params
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_checkpointing_full_and_selective_keep_gradients(name: str) -> None:
    torch.manual_seed(0)
    m = Transformer(TINY_MODELS[name])
    x = _tokens()
    lm_loss(m(x), x).backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    checkpointing.wrap(m.layers["0"], "full", "cpu")
    checkpointing.wrap(m.layers["1"], "selective", "cpu")
    lm_loss(m(x), x).backward()
    for a, b in zip(ref, [p.grad for p in m.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert m.layers["1"]._shardplan_recompute == "selective"
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in checkpointing.recompute_ops("cpu")


def test_state_bytes_counts_each_storage_once() -> None:
    torch.manual_seed(0)
    m = Transformer(TINY_MODELS["tiny-gpt"])  # tied: head.weight is embed.tok.weight
    n = count_params(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    assert state_bytes(m, opt) == {"param_bytes": 4 * n, "grad_bytes": 0, "optim_bytes": 0}
    x = _tokens()
    lm_loss(m(x), x).backward()
    opt.step()
    assert state_bytes(m, opt) == {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optim_bytes": 8 * n}
    t = torch.zeros(100)
    assert tensor_bytes([t, t[10:20], t[50:]]) == 400
    assert tensor_bytes([t[:10], t[20:30]]) == 80


def test_pipeline_stages_compose_to_the_model() -> None:
    for cfg in (TINY_MODELS["tiny-gpt"], TINY_MODELS["tiny-llama"]):
        torch.manual_seed(0)
        m = Transformer(cfg)
        x = _tokens()
        ref = m(x)
        s = Strategy(mesh=Mesh(pp=2), stage_layers=[1, 3])
        counts = s.stage_layout(cfg.layers)
        assert counts == [1, 3]
        assert Strategy(mesh=Mesh(pp=2), schedule="interleaved", vpp=2).stage_layout(6) == [1, 2, 2, 1]
        (first,), _ = rank_stage_modules(m, s, 0)
        (last,), _ = rank_stage_modules(m, s, 1)
        assert list(first.layers) == ["0"] and list(last.layers) == ["1", "2", "3"]
        assert first.head is None and last.embed is None
        assert (last.head is m.head) == (not cfg.tied_embeddings)  # tied: the last stage holds a copy
        torch.testing.assert_close(last(first(x)), ref)


@pytest.mark.parametrize("cfg", [GPT_LIKE, LLAMA_LIKE], ids=lambda c: c.name)
@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_rank_frees_the_stages_it_does_not_hold(cfg: TransformerConfig, stage: int) -> None:
    """After the cut, the model's other parts move to the meta device: the rank's tensor memory is
    its own stage's, and the stage still computes what it did (a tied table stays where it is held)."""
    torch.manual_seed(0)
    m = Transformer(cfg)
    counts = [1, cfg.layers - 1]
    mod = stage_module(m, stage, counts)
    held = {id(p) for p in mod.parameters()}
    x = _tokens(cfg.vocab) if stage == 0 else torch.randn(2, 16, cfg.hidden)
    before = mod(x).detach()
    release_unheld(m, [mod])
    assert all(p.device.type == "meta" for p in m.parameters() if id(p) not in held)
    assert all(p.device.type == "cpu" for p in mod.parameters())
    assert any(p.device.type == "meta" for p in m.parameters())
    assert tensor_bytes(p for p in m.parameters() if p.device.type != "meta") == tensor_bytes(
        p for p in mod.parameters() if any(p is q for q in m.parameters()))
    torch.testing.assert_close(mod(x), before)


def test_strategy_resolution_most_specific_wins() -> None:
    s = Strategy(default=L(sharding="zero3"), layers=[
        L(unit="layers.1", sharding="replicate"), L(unit="layers.1.mlp.up", sharding="zero2"),
        L(unit="embedding", sharding="zero1"), L(unit="embed", sharding="zero2", split=2), L(unit="head", sharding="zero1")])
    assert resolve(s, "layers.1.attn.qkv.weight").sharding == "replicate"
    assert resolve(s, "layers.1.mlp.up.slices.0.weight").sharding == "zero2"
    assert resolve(s, "layers.0.mlp.up.weight").sharding == "zero3"
    assert resolve(s, "embed.tok.weight").sharding == "zero2"  # the operator beats its unit
    assert resolve(s, "embed.pos.weight").sharding == "zero2"
    assert resolve(s, "final_norm.weight").sharding == "zero1"
    ad = adapt(build(spec_for("hf-llama"))[0])
    assert graph_name(ad, "model.layers.2.self_attn.k_proj.weight") == "layers.2.attn.qkv"
    assert graph_name(ad, "model.layers.2.post_attention_layernorm.weight") == "layers.2.mlp_norm"
    assert graph_name(ad, "lm_head.weight") == "head"
    assert graph_name(ad, "model.embed_tokens.weight") == "embed"


def _problems(model: nn.Module, strategy: Strategy, world: int, **kw) -> str:
    with pytest.raises(PlanMismatchError) as e:
        check(adapt(model), strategy, world, "cpu", **kw)
    return str(e.value)


def test_validation_lists_every_difference() -> None:
    llama = Transformer(TINY_MODELS["tiny-llama"])
    msg = _problems(llama, Strategy(mesh=Mesh(tp=4, cp=2), cp_mode="ulysses", layers=[
        L(unit="layers.9", sharding="zero3"), L(unit="layers.0.mlp.gate", sharding="zero3")]), 4)
    assert "world size" in msg and "8 ranks" in msg
    assert "tp=4 does not divide the 2 KV heads" in msg
    assert "Ulysses splits the 1 heads of a tp rank over cp=2: not divisible" in msg
    assert "'layers.9'" in msg and "'layers.0.mlp.gate'" in msg
    msg = _problems(llama, Strategy(mesh=Mesh(dp_shard=2), layers=[
        L(unit="layers.1", split=3), L(unit="layers.2.attn_norm", split=2)]), 2)
    assert "'layers.1.attn.qkv': width 128 is not divisible by split=3" in msg
    assert "'layers.2.attn_norm' is a RMSNorm, which cannot be split" in msg
    check(adapt(llama), Strategy(mesh=Mesh(tp=2), default=L(split=2)), 2, "cpu")  # splits with TP run
    msg = _problems(llama, Strategy(mesh=Mesh(tp=4), layers=[L(unit="layers.0.attn.qkv", split=64)]), 4)
    assert "'layers.0.attn.qkv': width 128 is not divisible by split=64 x tp=4" in msg
    msg = _problems(llama, Strategy(mesh=Mesh(pp=2), stage_layers=[1, 2]), 2)
    assert "sum to 3" in msg
    assert "needs a mixture-of-experts model" in _problems(llama, Strategy(mesh=Mesh(dp_shard=2, ep=2)), 2)
    mixtral = Transformer(TINY_MODELS["tiny-mixtral"])
    msg = _problems(mixtral, Strategy(mesh=Mesh(dp_shard=8, ep=8, tp=2)), 16)
    assert "ep=8 does not divide the 4 experts" in msg and "tp=2 with mixture-of-experts blocks" in msg
    gpt = Transformer(TINY_MODELS["tiny-gpt"])
    msg = _problems(gpt, Strategy(mesh=Mesh(pp=2), layers=[L(unit="head", sharding="zero2")]), 2)
    assert "same sharding for 'embedding' and 'head'" in msg and "replicate and zero2" in msg
    check(adapt(gpt), Strategy(mesh=Mesh(dp_shard=2), layers=[L(unit="embedding", split=2)]), 2, "cpu")  # tied, split
    hf = build(spec_for("hf-gpt2"))[0]
    msg = _problems(hf, Strategy(mesh=Mesh(pp=2), layers=[L(unit="layers.1", split=2)]), 2)
    assert "reference model only" in msg
    check(adapt(hf), Strategy(mesh=Mesh(dp_shard=2, tp=2), sequence_parallel=True,
                              layers=[L(unit="layers.3.mlp.up", sharding="zero3")]), 4, "cpu")


def test_unknown_model_type_is_named() -> None:
    with pytest.raises(ShardplanError, match="TinyMLP"):
        from tests.fixtures_models import TinyMLP

        adapt(TinyMLP())


def test_tensor_parallel_plan_names_unexpected_module_type() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    from runtime.tensor_parallel import _expect

    m = Transformer(TINY_MODELS["tiny-gpt"])
    m.layers["0"].mlp.up = nn.Sequential(nn.Linear(64, 256))
    with pytest.raises(ShardplanError, match="'layers.0.mlp.up' is a torch.nn.modules.container.Sequential"):
        _expect(m, "layers.0.mlp.up", ColwiseParallel())
    with pytest.raises(ShardplanError, match="not a norm"):
        _expect(m, "layers.0.attn.qkv", SequenceParallel())


def test_plan_for_another_model_is_detected() -> None:
    plan = hand_plan("tiny-gpt", Strategy(mesh=Mesh(dp_shard=2)))
    gpt, llama = (adapt(Transformer(TINY_MODELS[n])) for n in ("tiny-gpt", "tiny-llama"))
    facts = {"name": "tiny-gpt", "hash": plan.inputs.model_hash, "seq_len": 32}
    assert model_problem(gpt, facts) is None
    msg = model_problem(llama, facts)
    assert msg and "tiny-gpt" in msg and "activation gelu vs swiglu" in msg
    with pytest.raises(PlanMismatchError, match="activation gelu vs swiglu"):
        check_plan(spec_for("tiny-llama"), plan, 2, "cpu")
    with pytest.raises(ShardplanError, match="learned positions"):
        check_plan(spec_for("tiny-gpt"), plan, 2, "cpu", seq_len=1000)
    check_plan(spec_for("tiny-gpt"), plan, 2, "cpu", seq_len=32)


def test_tensor_peak_counts_live_storage_like_the_cuda_allocator() -> None:
    from runtime.memory import TensorPeak

    w = torch.ones(25)  # alive before: 100 bytes
    with TensorPeak([w]) as tp:
        assert (tp.live, tp.peak) == (100, 100)
        wt = w.view(5, 5).t()  # a view of a storage seen before adds nothing
        x = torch.ones(1000)  # 4000 bytes
        y = x * 2  # 4000 more
        v = y.view(10, 100)
        assert (tp.live, tp.peak, tp.peak_op) == (8100, 8100, "aten.mul.Tensor")
        del y, v
        assert tp.live == 4100  # freed with its last reference
        st = torch.UntypedStorage(0)  # FSDP2 allocates and frees unsharded parameters by resizing
        st.resize_(2048)
        assert tp.live == 6148
        st.resize_(0)
        assert (tp.live, tp.peak) == (4100, 8100)
    assert x.sum().item() == 1000.0 and wt.shape == (5, 5)
    lin = nn.Linear(10, 10)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 10)).sum().backward()
    opt.step()
    with TensorPeak() as tp:  # everything alive in the process: at least the layer's training state
        n = 4 * 110
        assert tp.live >= n + n + 2 * n + 2 * 4  # params, grads, two moments, two step counters


def test_a_pipeline_needs_as_many_micro_batches_as_stages() -> None:
    from runtime.apply import check_plan

    plan = hand_plan("tiny-gpt", Strategy(mesh=Mesh(pp=2), micro_batch=8), global_batch=8)
    with pytest.raises(ShardplanError, match=r"2 stages needs at least 2 micro-batches .* micro-batch 8 gives 1"):
        check_plan(spec_for("tiny-gpt"), plan, 2, "cpu", global_batch=8)
    check_plan(spec_for("tiny-gpt"), plan, 2, "cpu", global_batch=16)


def test_searched_pipelines_have_at_least_as_many_micro_batches_as_stages() -> None:
    from profiler.hardware import parse_cluster
    from profiler.models import load_model
    from solvers.space import SPACES, mesh_configs
    from vocab.strategy import Workload

    g, w = load_model("gpt2", 128), Workload(seq_len=128, global_batch=8)
    cfgs = [c for c in mesh_configs(g, parse_cluster("8xh100"), w, SPACES["full"]) if c.pp > 1]
    assert cfgs and all(w.global_batch // (c.dp * c.micro_batch) >= c.pp for c in cfgs)
