"""A few real layers: node names follow the layer graph, saved bytes are exact where they must be."""

from __future__ import annotations

import pytest
import torch

from costmodel.compute import with_predicted_times
from profiler.hardware import accelerator
from profiler.measure_model import (
    accelerator_for,
    build_stack,
    check_fits,
    cut_config,
    layers_graph,
    measure_layers,
)
from profiler.model_config import TransformerConfig
from profiler.models import preset
from profiler.transformer import build_graph
from vocab.errors import ShardplanError

GPT = TransformerConfig(name="tiny-gpt", layers=4, hidden=64, heads=4, vocab=100, bias=True, dropout=0.1,
                        attention_impl="eager")
LLAMA = TransformerConfig(name="tiny-llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=100, ffn_hidden=96,
                          activation="swiglu", norm="rmsnorm", position="rope")
MOE = TransformerConfig(name="tiny-moe", layers=2, hidden=64, heads=4, vocab=100, activation="swiglu",
                        norm="rmsnorm", experts=4, top_k=2, moe_ffn_hidden=32, shared_experts=1)


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MOE], ids=lambda c: c.name)
def test_stack_modules_are_the_graph_nodes(cfg: TransformerConfig) -> None:
    cut = cut_config(cfg, 2)
    graph = build_graph(cut, 16)
    stack = build_stack(cut, torch.device("cpu"), torch.float32)
    names = set(dict(stack.named_modules()))
    assert {n.name for n in graph.nodes if n.block is not None} <= names
    graph_params = sum(n.params for n in graph.nodes if n.block is not None)
    assert sum(p.numel() for p in stack.parameters()) == graph_params


@pytest.mark.parametrize("cfg", [GPT, LLAMA, MOE], ids=lambda c: c.name)
def test_measure_layers(cfg: TransformerConfig) -> None:
    rows = measure_layers(cfg, torch.device("cpu"), layers=1, micro_batch=2, seq_len=16, repeats=2, warmup=1)
    by = {r.layer: r for r in rows}
    graph = build_graph(cut_config(cfg, 1), 16)
    assert [r.layer for r in rows] == [n.name for n in graph.nodes if n.block is not None] + ["layers.0"]
    for r in rows:
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.micro_batch == 2 and r.seq_len == 16 and r.dtype == "bf16"
        assert r.predicted_fwd_s is None and r.predicted_bwd_s is None  # the profiler measures only
    # a linear keeps exactly its input (bf16, parameters excluded), as the graph says
    for name in ("layers.0.attn.qkv", "layers.0.attn.out"):
        assert by[name].saved_bytes == by[name].predicted_saved_bytes == 2 * 16 * 64 * 2
    block = by["layers.0"]
    assert block.kind == "block"
    nodes_saved = sum(r.saved_bytes for r in rows if r.kind != "block")
    # the shared expert's activation is no graph node: only the block row sees what it keeps
    assert block.saved_bytes == nodes_saved if not cfg.experts else block.saved_bytes > nodes_saved
    assert block.fwd_s >= max(r.fwd_s for r in rows if r.kind != "block")


def test_the_cost_model_predicts_the_measured_rows() -> None:
    """``with_predicted_times`` adds a time to every row; a block's is the sum of its nodes'."""
    rows = measure_layers(LLAMA, torch.device("cpu"), layers=1, micro_batch=2, seq_len=16, repeats=1, warmup=1)
    acc = accelerator_for(torch.device("cpu"))
    assert acc == accelerator("cpu")
    out = with_predicted_times(rows, layers_graph(LLAMA, 1, 16), acc)
    assert [r.layer for r in out] == [r.layer for r in rows]
    assert all(r.predicted_fwd_s > 0 and r.predicted_bwd_s > 0 for r in out)
    by = {r.layer: r for r in out}
    nodes = [r for r in out if r.kind != "block"]
    assert by["layers.0"].predicted_fwd_s == pytest.approx(sum(r.predicted_fwd_s for r in nodes))
    assert with_predicted_times([], layers_graph(LLAMA, 1, 16), acc) == []


def test_too_wide_models_are_refused() -> None:
    big = cut_config(preset("llama3.1-405b"), 8)
    with pytest.raises(ShardplanError, match="GiB is free"):
        check_fits(build_graph(big, 128), 1, "bf16", torch.device("cpu"))
    with pytest.raises(ShardplanError, match="at least 1"):
        cut_config(GPT, 0)
