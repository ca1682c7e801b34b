"""Every plan the ``shardplan`` target's space holds runs in the runtime.

The runtime's check refuses nothing the space contains (every mesh configuration and unit option
of the tiny models at worlds 2, 4 and 8), and plans drawn from the space (hypothesis: mesh, schedule,
micro-batch, modes, and per unit sharding, recomputation, OSDP's operator splits and per-operator
sharding) train
like one process and hold the state bytes the cost model predicts; so do drawn combinations of the
features the headline plans combine (nested ZeRO-3 under selective recomputation, interleaved
pipelines of experts, TSP with split operators, bf16).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from profiler.graph import LayerGraph
from profiler.hardware import parse_cluster
from profiler.transformer import build_graph
from runtime.adapters import adapt
from runtime.apply import check_plan
from runtime.launch import Job, launch
from runtime.model import TINY_MODELS, Transformer, spec_for
from runtime.train import TrainSettings
from runtime.validate import check
from solvers.chain import option_allowed, option_strategy
from solvers.space import SPACES, mesh_configs, mesh_shardings, restrict, unit_options
from tests.runtime_checks import assert_parity, predicted_state_bytes, state_bytes
from vocab.strategy import LayerStrategy, Mesh, MeshConfig, Strategy, Workload
from vocab.targets import load_target

SETTINGS = TrainSettings(steps=3, global_batch=8, seq_len=32, seed=0)
MODELS = ("tiny-gpt", "tiny-llama", "tiny-mixtral", "tiny-deepseek")
OPTS = restrict(SPACES["full"], load_target("shardplan"))
WORKLOAD = Workload(seq_len=SETTINGS.seq_len, global_batch=SETTINGS.global_batch, precision="fp32")


@cache
def graph(model: str) -> LayerGraph:
    return build_graph(TINY_MODELS[model], SETTINGS.seq_len)


@cache
def space(model: str, world: int) -> list[MeshConfig]:
    return list(mesh_configs(graph(model), parse_cluster(f"{world}xcpu"), WORKLOAD, OPTS))


def choices(cfg: MeshConfig) -> list[tuple[str, str, str, int, bool]]:
    """(sharding, recompute, offload, split, mixed) a unit of ``cfg`` may take in the space."""
    allowed = mesh_shardings(OPTS, cfg)
    out = [key for key in unit_options(OPTS, cfg.dp_shard * cfg.cp)
           if key[0] in allowed or (cfg.dp_shard * cfg.cp == 1 and allowed)]
    return list(dict.fromkeys(out))


def plan_of(model: str, cfg: MeshConfig, picks: list[tuple[str, str, str, int, bool]]) -> Strategy:
    """``cfg`` with a choice per unit (embedding, blocks, head) as the search writes it
    (:func:`solvers.chain.option_strategy`: operator entries where it splits them or shards them
    apart); a pipeline shares one sharding and offload (the full space's rule), recomputation
    stays per unit."""
    units = list(graph(model).blocks())
    if cfg.pp > 1:
        sh, off = picks[0][0], picks[0][2]
        picks = [(sh, rc, off, 1, False) for _, rc, _, _, _ in picks]
    if TINY_MODELS[model].tied_embeddings:  # the tied head takes the embedding's choice
        picks = [*picks[:-1], picks[0]]
    layers = [e for (name, nodes), key in zip(units, picks, strict=True)
              for e in option_strategy(name, nodes, key if option_allowed(nodes, key) else (*key[:3], 1, False))]
    return cfg.strategy(layers=layers)


# ---- the runtime refuses nothing the space holds ------------------------------------------------
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_the_runtime_refuses_nothing_the_space_holds(model: str, world: int) -> None:
    configs = space(model, world)
    assert configs
    with torch.device("meta"):
        ad = adapt(Transformer(TINY_MODELS[model]))
    for cfg in configs:
        units = 2 + TINY_MODELS[model].layers
        for choice in choices(cfg):
            s = plan_of(model, cfg, [choice] * units)
            check(ad, s, world, "cpu")
        check_plan(spec_for(model), cfg.strategy(), world, "cpu", SETTINGS.seq_len, SETTINGS.global_batch)


def test_the_space_holds_every_runtime_feature() -> None:
    """What the space of the tiny models offers at 4 and 8 ranks: every axis, schedule and mode."""
    cfgs = [c for m in MODELS for w in (4, 8) for c in space(m, w)]
    seen = {"pp", "tp", "cp", "ep", "dp_replicate", "dp_shard"} & {
        a for c in cfgs for a in ("pp", "tp", "cp", "ep", "dp_replicate", "dp_shard") if getattr(c, a) > 1}
    assert seen == {"pp", "tp", "cp", "ep", "dp_replicate", "dp_shard"}
    assert {c.schedule for c in cfgs if c.pp > 1} == {"1f1b", "interleaved"}  # zb: not with selective (zb_selective)
    assert {c.cp_mode for c in cfgs if c.cp > 1} == {"ring", "ulysses"} and any(c.sequence_parallel for c in cfgs)
    assert {c.tp_mode for c in cfgs if c.tp > 1} == {"megatron", "tsp"} and any(c.tp_mode == "tsp" and c.cp > 1 for c in cfgs)
    assert {x for c in cfgs for x in choices(c)} >= {("zero3", "full", "params", 1, False),
                                                      ("zero1", "selective", "none", 1, True),
                                                      ("zero3", "none", "none", 4, False), ("zero1", "none", "none", 2, True)}


# ---- drawn plans train like one process ----------------------------------------------------------
def _draw(data: Any, world: int) -> dict[str, tuple[str, Strategy]]:
    out = {}
    for model in MODELS:
        cfg = data.draw(st.sampled_from(space(model, world)), label=f"{model} mesh")
        opts = choices(cfg)
        units = 2 + TINY_MODELS[model].layers
        picks = [data.draw(st.sampled_from(opts), label=f"{model} unit {u}") for u in range(units)]
        out[f"{model}/{world}"] = (model, plan_of(model, cfg, picks))
    return out


def _train(plans: dict[str, tuple[str, Strategy]], world: int) -> None:
    jobs = [Job(model=spec_for(m), plan_json=s.model_dump_json(), settings=SETTINGS.to_dict(), name=name,
                reference=True) for name, (m, s) in plans.items()]
    for res in launch(jobs, world):
        model, s = plans[res["name"]]
        assert_parity(res, s)
        assert state_bytes(res) == predicted_state_bytes(model, s, world, SETTINGS), (res["name"], s)


#: a fixed set (derandomized), generated only: no explicit or shrunk examples unless one fails
DRAWS = settings(max_examples=3, deadline=None, derandomize=True, database=None, phases=[Phase.generate, Phase.shrink],
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@DRAWS
@given(data=st.data())
def test_drawn_plans_train_like_one_process(world: int, data: Any) -> None:
    _train(_draw(data, world), world)


# ---- drawn combinations of the features the headline plans combine ------------------------------
OPS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
KINDS = ("pp_ep", "tsp_split", "nested")


@st.composite
def combination(draw: Any, j: int = 0) -> tuple[str, Strategy, str]:
    """(model, plan on 4 ranks, precision) of one of: an interleaved (or 1F1B / zero-bubble) pipeline
    of MoE blocks with expert parallelism; TSP with split operators and selective recomputation;
    ZeRO-3 operators nested in units that recompute selectively (ZeRO-0/1/2, under FSDP, TSP or
    Megatron TP); in bf16 or fp32. Every first choice is a feature (the simplest draw is rich), and
    plan ``j`` starts from the ``j``-th kind."""
    kind = draw(st.sampled_from(KINDS[j:] + KINDS[:j]), label="kind")
    precision = draw(st.sampled_from(["bf16", "fp32"]), label="precision")
    if kind == "pp_ep":
        model = draw(st.sampled_from(["tiny-mixtral", "tiny-deepseek"]), label="model")
        sched = draw(st.sampled_from(["interleaved", "1f1b", "zb"]), label="schedule")
        sharding = draw(st.sampled_from(["zero2", "zero3", "zero1", "replicate"]), label="sharding")
        recompute = draw(st.sampled_from(["selective", "full", "none"] if sched != "zb" else ["full", "none"]),
                         label="recompute")  # zero bubble runs no selective recomputation (rule zb_selective)
        return model, Strategy(mesh=Mesh(pp=2, dp_shard=2, ep=2), schedule=sched, vpp=2 if sched != "1f1b" else 1,
                               micro_batch=1, default=LayerStrategy(sharding=sharding, recompute=recompute)), precision
    model = draw(st.sampled_from(["tiny-gpt", "tiny-llama"]), label="model")
    tsp = kind == "tsp_split" or draw(st.booleans(), label="tsp")
    mesh = Mesh(dp_shard=2, tp=2) if tsp or draw(st.booleans(), label="tp") else Mesh(dp_shard=4)
    base = draw(st.sampled_from(["replicate", "zero1", "zero2", "zero3"]), label="unit sharding")
    layers = []
    for i in range(TINY_MODELS[model].layers):
        for op in OPS:
            if not draw(st.booleans(), label=f"layers.{i}.{op} with its unit"):
                split = draw(st.sampled_from([2, 1]), label="split") if tsp else 1
                layers.append(LayerStrategy(unit=f"layers.{i}.{op}", sharding="zero3", split=split))
    return model, Strategy(mesh=mesh, tp_mode="tsp" if tsp else "megatron", micro_batch=2,
                           sequence_parallel=mesh.tp > 1 and not tsp,
                           default=LayerStrategy(sharding=base, recompute="selective"), layers=layers), precision


COMBINED = settings(DRAWS, max_examples=2)


@pytest.mark.slow
@COMBINED
@given(data=st.data())
def test_drawn_feature_combinations_train_like_one_process(data: Any) -> None:
    plans = {str(j): data.draw(combination(j), label=f"plan {j}") for j in range(2)}
    two = {**SETTINGS.to_dict(), "steps": 2}  # the second step is the first after an update
    jobs = [Job(model=spec_for(m), plan_json=s.model_dump_json(), reference=True, name=name,
                settings={**two, "precision": p}) for name, (m, s, p) in plans.items()]
    for res in launch(jobs, 4):
        model, s, p = plans[res["name"]]
        settings_p = TrainSettings(**{**two, "precision": p})
        assert_parity(res, s)
        assert state_bytes(res) == predicted_state_bytes(model, s, 4, settings_p), (res["name"], s, p)
