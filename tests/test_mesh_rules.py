"""One owner per fact: a mesh's derived facts are the same in every form of a mesh, every validator
judges a strategy with the one rule list (:mod:`vocab.rules`), and the cost model refuses a layer
graph built for another sequence length than the workload's."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from costmodel.configs import ConfigArrays
from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.transformer import build_graph
from runtime.adapters import adapt
from runtime.model import TINY_MODELS, Transformer
from runtime.validate import PlanMismatchError, check
from solvers.space import SPACES, mesh_configs, restrict
from vocab.errors import ShardplanError
from vocab.rules import RULES, ModelShape, Subject, problems, require
from vocab.strategy import (
    LayerStrategy,
    Mesh,
    MeshConfig,
    Strategy,
    Workload,
    num_microbatches,
    sequence_chunks,
)
from vocab.targets import load_target

MESH = Mesh(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=4)


def test_every_form_of_a_mesh_derives_the_same_facts() -> None:
    s = Strategy(mesh=MESH, micro_batch=2)
    cfg = MeshConfig.of(s)
    arrays = ConfigArrays.of([cfg])
    facts = {"world_size": 64, "dp": 8, "shard": 8, "expert_shard": 2, "dp_all": 16}
    for name, value in facts.items():
        assert getattr(MESH, name) == getattr(cfg, name) == value
        assert getattr(arrays, name).tolist() == [value]
    assert MESH.parallel_axes == cfg.parallel_axes == {"pp": 2, "dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 2,
                                                        "ep": 4}
    assert Mesh(tp=8).parallel_axes == {"tp": 8} and Mesh().parallel_axes == {}
    assert s.num_microbatches(64) == cfg.num_microbatches(64) == num_microbatches(64, 8, 2) == 4
    assert arrays.num_microbatches(64).tolist() == [4.0]
    assert (arrays.shard_group.size, arrays.expert_shard_group.size) == (8, 2)
    assert arrays.pp_group.stride.tolist() == [32.0] and arrays.replicate_group.stride.tolist() == [16.0]
    assert [getattr(arrays, f).dtype for f in ("tp", "tsp")] == [np.dtype(float), np.dtype(bool)]


def test_folded_expert_ranks_are_carved_from_tensor_and_data_parallel_ranks() -> None:
    """etp unset: ep from dp_shard*cp, the experts split over tp; etp=1 (MoE parallel folding): the
    etp*ep expert ranks from tp*dp_shard*cp, in the order (edp, ep, etp), etp innermost."""
    default, folded = Mesh(tp=2, dp_shard=4, cp=2, ep=4), Mesh(tp=2, dp_shard=4, cp=2, ep=16, etp=1)
    assert (default.expert_tp, default.expert_shard) == (2, 2)
    assert (folded.expert_tp, folded.expert_shard) == (1, 1)
    arrays = ConfigArrays.of([MeshConfig.of(Strategy(mesh=m, sequence_parallel=True)) for m in (default, folded)])
    assert arrays.expert_tp.tolist() == [2.0, 1.0]
    assert arrays.ep_group.stride.tolist() == [2.0, 1.0] and arrays.expert_shard_group.stride.tolist() == [8.0, 16.0]
    assert arrays.expert_tp_group.size.tolist() == [2.0, 1.0]
    assert "etp" not in default.model_dump() and folded.model_dump()["etp"] == 1
    assert MeshConfig.of(Strategy(mesh=folded)).mesh == folded
    with pytest.raises(ValueError, match=r"etp\*ep = 1\*32 must divide tp\*dp_shard\*cp = 16"):
        Mesh(tp=2, dp_shard=4, cp=2, ep=32, etp=1)
    with pytest.raises(ValueError, match="ep=16 must divide dp_shard\\*cp = 8"):
        Mesh(tp=2, dp_shard=4, cp=2, ep=16)


def test_sequence_chunks() -> None:
    assert [sequence_chunks(1), sequence_chunks(2), sequence_chunks(1, 4, True), sequence_chunks(2, 4, True)] == \
        [1, 4, 8, 16]
    assert sequence_chunks(1, 4) == 1
    assert Strategy(mesh=Mesh(cp=2, tp=2), tp_mode="tsp").sequence_chunks == 8


def _s(**kw: object) -> Strategy:
    return Strategy(**kw)  # type: ignore[arg-type]


#: rule name -> (a subject that breaks only that rule, its message)
CASES: dict[str, tuple[Subject, str]] = {
    "world_size": (Subject(_s(mesh=Mesh(tp=2)), world=4),
                   "world size: mesh pp*dp_replicate*dp_shard*cp*tp = 1*1*1*1*2 = 2 ranks does not match the "
                   "cluster's 4 GPUs"),
    "tp_heads": (Subject(_s(mesh=Mesh(tp=3)), ModelShape(heads=8)), "tp=3 does not divide the 8 attention heads"),
    "tp_kv_heads": (Subject(_s(mesh=Mesh(tp=4)), ModelShape(heads=12, kv_heads=6)),
                    "tp=4 and the 6 KV heads: one must divide the other"),
    "tp_ffn": (Subject(_s(mesh=Mesh(tp=4)), ModelShape(heads=8, kv_heads=4, ffn_hidden=6), strict_tp=True),
               "tp=4 does not divide the FFN width 6"),
    "tp_experts": (Subject(_s(mesh=Mesh(tp=2)), ModelShape(experts=4), tp_experts=False),
                   "tp=2 with mixture-of-experts blocks: the runtime does not split experts over tensor-parallel ranks"),
    "ep_model": (Subject(_s(mesh=Mesh(dp_shard=2, ep=2)), ModelShape(name="gpt2")),
                 "expert parallelism (ep=2) needs a mixture-of-experts model; gpt2 has no experts"),
    "ep_experts": (Subject(_s(mesh=Mesh(dp_shard=4, ep=4)), ModelShape(experts=6)), "ep=4 does not divide the 6 experts"),
    "ep_ranks": (Subject(Strategy.model_construct(mesh=Mesh.model_construct(dp_shard=3, ep=2)), ModelShape(experts=4)),
                 "ep=2 must divide dp_shard*cp = 3 (expert ranks are data-parallel ranks)"),
    "etp": (Subject(_s(mesh=Mesh(tp=2, dp_shard=2, ep=4, etp=1)), ModelShape(experts=4)),
            "etp=1 beside tp=2 needs Megatron tensor parallelism with sequence parallelism: each tensor-parallel "
            "rank dispatches its own tokens to the experts"),
    "stages": (Subject(_s(mesh=Mesh(pp=4)), ModelShape(blocks=2)), "pp*vpp = 4*1 = 4 stages for only 2 layers"),
    "stage_layers": (Subject(_s(mesh=Mesh(pp=2), stage_layers=[1, 2]), ModelShape(blocks=4)),
                     "stage_layers [1, 2] sum to 3, the model has 4 layers"),
    "cp_sequence": (Subject(_s(mesh=Mesh(cp=2)), seq_len=6),
                    "context parallelism cuts each sequence into 2*cp = 4 chunks (head-tail load balancing): "
                    "seq_len 6 is not divisible by it"),
    "ulysses_heads": (Subject(_s(mesh=Mesh(tp=2, cp=2), cp_mode="ulysses"), ModelShape(heads=6)),
                      "Ulysses splits the 3 heads of a tp rank over cp=2: not divisible"),
    "tsp_sequence": (Subject(_s(mesh=Mesh(tp=2, cp=2), tp_mode="tsp"), seq_len=12),
                     "TSP cuts each sequence into 2*cp*tp = 8 chunks (head-tail load balancing): seq_len 12 is not "
                     "divisible by it"),
    "tsp_alone": (Subject(_s(mesh=Mesh(tp=2), tp_mode="tsp", sequence_parallel=True)),
                  "tp_mode 'tsp' already shards the sequence; drop sequence_parallel"),
    "sp_sequence": (Subject(_s(mesh=Mesh(tp=4), sequence_parallel=True), seq_len=6, sp_tokens=True),
                    "sequence parallelism splits each rank's 6 tokens over tp=4: not divisible"),
    "batch": (Subject(_s(mesh=Mesh(dp_shard=4), micro_batch=2), global_batch=12),
              "global batch 12 is not divisible by dp*micro_batch = 4*2 = 8"),
    "interleaved_microbatches": (Subject(_s(mesh=Mesh(pp=2), schedule="interleaved", vpp=2), global_batch=3),
                                 "interleaved schedule: 3 micro-batches must be a multiple of pp=2"),
    "pipeline_microbatches": (Subject(_s(mesh=Mesh(pp=4)), global_batch=2, pipelining=True),
                              "a pipeline of 4 stages needs at least 4 micro-batches per step "
                              "(torch.distributed.pipelining refuses fewer): global batch 2 / data-parallel 1 / "
                              "micro-batch 1 gives 2"),
    "zb_selective": (Subject(_s(mesh=Mesh(pp=2), schedule="zb", layers=[LayerStrategy(unit="layers.1", recompute="selective")]),
                             pipelining=True),
                     "the zero-bubble schedule (zb) with selective recomputation: torch.distributed.pipelining's "
                     "split backward (input, then weight gradients) recomputes a selectively checkpointed region "
                     "with inputs that no longer match its saved outputs; use full recomputation or another schedule"),
    "units": (Subject(_s(layers=[LayerStrategy(unit="layers.9")]), ModelShape(has_unit={"layers.0"}.__contains__)),
              "layer strategies name units the model does not have: ['layers.9']"),
    "activation_offload": (Subject(_s(layers=[LayerStrategy(unit="layers.0.mlp", offload="activations")])),
                           "offload 'activations' moves a unit's saved activations, not an operator's: "
                           "['layers.0.mlp'] name operators; give it to the unit ('layers.<i>', 'embedding', 'head' "
                           "or '*')"),
}


def test_every_rule_has_a_case() -> None:
    assert [r.name for r in RULES] == list(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_says_what_breaks_it(name: str) -> None:
    subject, message = CASES[name]
    assert problems(subject) == [message]
    with pytest.raises(ShardplanError, match=f"^{re.escape(message)}$"):
        require(subject)


def test_a_mesh_refuses_what_the_expert_ranks_rule_refuses() -> None:
    with pytest.raises(ValueError, match=re.escape(CASES["ep_ranks"][1])):
        Mesh(dp_shard=3, ep=2)


def test_what_a_validator_adds_and_does_not_know_breaks_nothing() -> None:
    assert problems(Subject(_s(mesh=Mesh(tp=4)), ModelShape(heads=8, kv_heads=2, ffn_hidden=6))) == []  # replicated KV
    assert problems(Subject(_s(mesh=Mesh(tp=4), tp_mode="tsp"), ModelShape(heads=8, kv_heads=2, ffn_hidden=6),
                            strict_tp=True)) == []  # TSP splits no heads
    assert problems(Subject(_s(mesh=Mesh(tp=2)), ModelShape(experts=4))) == []
    assert problems(Subject(_s(mesh=Mesh(pp=4)), global_batch=2)) == []
    assert problems(Subject(_s(mesh=Mesh(tp=4), sequence_parallel=True), seq_len=6)) == []
    assert problems(Subject(_s(mesh=Mesh(cp=2, tp=4, dp_shard=2, ep=2), sequence_parallel=True,
                               layers=[LayerStrategy(unit="layers.9")]), ModelShape(experts=2))) == []


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama", "tiny-mixtral"])
def test_the_search_space_yields_only_what_the_rules_keep(model: str) -> None:
    cfg = TINY_MODELS[model]
    opts = restrict(SPACES["full"], load_target("shardplan"))
    graph = build_graph(cfg, 32)
    w = Workload(seq_len=32, global_batch=8)
    shape = ModelShape(model, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.experts, cfg.layers)
    for world in (4, 8):
        found = list(mesh_configs(graph, parse_cluster(f"{world}xcpu"), w, opts))
        assert found
        for c in found:
            subject = Subject(c.strategy(), shape, 32, 8, world, strict_tp=opts.strict_tp,
                              tp_experts=opts.tp_experts, pipelining=True)
            assert problems(subject) == [], c


def test_cost_model_and_runtime_refuse_with_the_same_message() -> None:
    cfg = TINY_MODELS["tiny-llama"]
    s = Strategy(mesh=Mesh(tp=2, cp=2), tp_mode="tsp")
    message = "TSP cuts each sequence into 2*cp*tp = 8 chunks (head-tail load balancing): seq_len 12 is not divisible"
    with pytest.raises(ShardplanError, match=re.escape(message)):
        estimate(build_graph(cfg, 12), parse_cluster("4xcpu"), s, Workload(seq_len=12, global_batch=8))
    with torch.device("meta"):
        ad = adapt(Transformer(cfg))
    with pytest.raises(PlanMismatchError) as e:
        check(ad, s, 4, "cpu", seq_len=12)
    assert message in str(e.value)


def test_estimate_refuses_a_graph_built_for_another_sequence_length() -> None:
    graph = build_graph(TINY_MODELS["tiny-gpt"], 32)
    with pytest.raises(ShardplanError, match="^the layer graph of tiny-gpt is built for seq_len 32, the workload "
                                             "trains seq_len 16: build the graph at the workload's sequence length$"):
        estimate(graph, parse_cluster("1xcpu"), Strategy(), Workload(seq_len=16, global_batch=8))
    estimate(graph, parse_cluster("1xcpu"), Strategy(), Workload(seq_len=32, global_batch=8))


def test_ulysses_splits_the_kv_heads_of_a_tp_rank_too() -> None:
    """Llama 3.1 405B's 8 KV heads: tp4 leaves 2 per rank, which cp=16 cannot split (Transformer
    Engine's all-to-all CP asserts it); cp=2 can; a KV head replicated by tp counts once."""
    shape = ModelShape(heads=128, kv_heads=8)
    ulysses = {"cp_mode": "ulysses"}
    assert problems(Subject(_s(mesh=Mesh(tp=4, cp=16), **ulysses), shape)) == [
        "Ulysses splits the 2 KV heads of a tp rank over cp=16: not divisible (KV heads replicated across "
        "context-parallel ranks are not run)"]
    assert problems(Subject(_s(mesh=Mesh(tp=4, cp=2), **ulysses), shape)) == []
    assert problems(Subject(_s(mesh=Mesh(tp=16, cp=2), **ulysses), shape))[0].startswith(
        "Ulysses splits the 1 KV head of a tp rank over cp=2")
    assert problems(Subject(_s(mesh=Mesh(tp=4, cp=16)), shape)) == []  # ring CP splits the sequence, not heads
