"""Every strategy family trains like one process (fp32, rtol 1e-6: runtime.train.parity_tolerance)
and holds exactly the state bytes its sharding implies. Multi-process (gloo): one launch per world
size runs many plans."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.launch import Job, launch
from runtime.model import TINY_MODELS, spec_for
from runtime.train import TrainSettings, reference_losses
from tests.runtime_checks import assert_parity, predicted_state_bytes, state_bytes
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

pytestmark = pytest.mark.slow
SETTINGS = TrainSettings(steps=3, global_batch=8, seq_len=32, seed=0)
F = 4  # fp32 bytes

# ---- plans --------------------------------------------------------------------------------------
MIXED = [L(unit="layers.0", sharding="replicate"), L(unit="layers.2", sharding="zero2"),
         L(unit="embedding", sharding="zero1"), L(unit="layers.3.mlp.up", sharding="replicate")]
SPLITS = [L(unit="layers.1", sharding="zero3", split=2), L(unit="layers.2.mlp.up", sharding="zero3", split=2),
          L(unit="layers.0.attn.qkv", split=2), L(unit="head", sharding="zero3", split=2)]
W2_GPT = {
    "ddp": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="replicate")),
    "zero1": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero1")),
    "zero2": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero2")),
    "zero3": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3")),
    "zero3_keep": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3_keep")),
    "mixed": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3"), layers=MIXED),
    "split": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3"), layers=[
        L(unit="layers.1", sharding="zero3", split=4), L(unit="layers.2.mlp.up", sharding="zero3", split=2),
        L(unit="layers.0.attn.qkv", sharding="replicate", split=2)]),
    "checkpoint": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3", recompute="full"), layers=[
        L(unit="layers.1", sharding="replicate", recompute="selective"),
        L(unit="layers.2", sharding="zero3", recompute="selective")]),
    "tp_sp": Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    "pp_1f1b": Strategy(mesh=Mesh(pp=2), schedule="1f1b"),
    "pp_gpipe": Strategy(mesh=Mesh(pp=2), schedule="gpipe", stage_layers=[1, 3]),
    # context parallelism: learned positions and the tied embedding over a sequence split two ways
    "cp_ring_zero3": Strategy(mesh=Mesh(cp=2), default=L(sharding="zero3")),
    # TSP: every weight (the tied table, positions, biases, norms) on the ring, tokens split
    "tsp": Strategy(mesh=Mesh(tp=2), tp_mode="tsp", default=L(sharding="replicate", recompute="selective")),
    # the tied table split in slices, each its own FSDP unit's worth; the head sums the slices
    "tied_split": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3"), layers=[
        L(unit="embedding", sharding="zero3", split=2), L(unit="layers.1", sharding="zero3", split=2)]),
}
W2_LLAMA = {
    "zero2": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero2")),
    "zero3_selective": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3", recompute="selective")),
    "split": Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3", split=2)),
    "tp": Strategy(mesh=Mesh(tp=2)),
    "tp_sp": Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    "pp_interleaved": Strategy(mesh=Mesh(pp=2), schedule="interleaved", vpp=2),
    "pp_zb": Strategy(mesh=Mesh(pp=2), schedule="zb", default=L(recompute="full")),
    "cp_ring": Strategy(mesh=Mesh(cp=2), default=L(sharding="zero2")),  # RoPE at the global positions
    "cp_ring_p2p": Strategy(mesh=Mesh(cp=2), cp_rotate="alltoall", default=L(sharding="zero3")),  # K/V round the ring
    "cp_ulysses": Strategy(mesh=Mesh(cp=2), cp_mode="ulysses", default=L(sharding="zero1", recompute="full")),
    "tsp_full": Strategy(mesh=Mesh(tp=2), tp_mode="tsp", default=L(sharding="zero2", recompute="full")),
    # splits under Megatron TP: column-parallel slices hold a part of each rank's rows
    "split_tp_sp": Strategy(mesh=Mesh(tp=2), sequence_parallel=True, layers=SPLITS),
}
# mixture of experts: routing, shared experts, dense first blocks; experts split over EP ranks
W2_MOE = {
    ("tiny-mixtral", "dp"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3")),
    ("tiny-mixtral", "ep"): Strategy(mesh=Mesh(dp_shard=2, ep=2), default=L(sharding="zero3")),
    ("tiny-deepseek", "ep_zero2"): Strategy(mesh=Mesh(dp_shard=2, ep=2), default=L(sharding="zero2")),
    ("tiny-mixtral", "ep_cp"): Strategy(mesh=Mesh(cp=2, ep=2), default=L(sharding="zero1", recompute="full")),
}
W2_HF = {
    ("hf-llama", "tp_sp"): Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    ("hf-llama", "mixed"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3", recompute="full"), layers=MIXED),
    ("hf-gpt2", "tp_sp"): Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    ("hf-gpt2", "tp"): Strategy(mesh=Mesh(tp=2)),
    ("hf-gpt2", "zero3"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3", recompute="selective")),
}
W4 = {
    ("tiny-gpt", "hsdp"): Strategy(mesh=Mesh(dp_replicate=2, dp_shard=2), default=L(sharding="zero3")),
    ("tiny-gpt", "hsdp_zero2"): Strategy(mesh=Mesh(dp_replicate=2, dp_shard=2), default=L(sharding="zero2")),
    ("tiny-gpt", "tp_fsdp"): Strategy(mesh=Mesh(dp_shard=2, tp=2), default=L(sharding="zero3"), sequence_parallel=True),
    ("tiny-gpt", "pp_fsdp"): Strategy(mesh=Mesh(pp=2, dp_shard=2), default=L(sharding="zero3")),  # tied copies
    # TP inside pipeline stages; the last stage's loss is vocabulary-parallel (loss_parallel)
    ("tiny-llama", "pp_tp"): Strategy(mesh=Mesh(pp=2, tp=2), schedule="interleaved", vpp=2),
    # what the staged space plans: every unit of a stage its own sharding, operators apart or split
    ("tiny-llama", "pp_mixed"): Strategy(mesh=Mesh(pp=2, dp_shard=2), schedule="1f1b", stage_layers=[3, 1],
                                         default=L(sharding="zero1"), layers=[
        L(unit="embedding", sharding="zero2"), L(unit="layers.0", sharding="zero3", recompute="full"),
        L(unit="layers.1", sharding="replicate"), L(unit="layers.1.mlp.up", sharding="zero3"),
        L(unit="layers.2", sharding="zero3", split=2), L(unit="head", sharding="zero3")]),
    # context parallelism with the other axes: states sharded over dp_shard x cp, TP+SP inside the
    # cp ranks, pipeline stages of sequence chunks, Ulysses beside replicas
    ("tiny-llama", "cp_fsdp"): Strategy(mesh=Mesh(dp_shard=2, cp=2), default=L(sharding="zero3")),
    ("tiny-llama", "cp_tp_sp"): Strategy(mesh=Mesh(cp=2, tp=2), sequence_parallel=True),
    ("tiny-llama", "cp_pp"): Strategy(mesh=Mesh(pp=2, cp=2), schedule="1f1b"),
    ("tiny-gpt", "cp_ulysses_hsdp"): Strategy(mesh=Mesh(dp_replicate=2, cp=2), cp_mode="ulysses",
                                              default=L(sharding="zero3")),
    # experts: FSDP over their replicas, HSDP, pipelines, one expert group of four
    ("tiny-mixtral", "ep_fsdp"): Strategy(mesh=Mesh(dp_shard=4, ep=2), default=L(sharding="zero3")),
    ("tiny-deepseek", "ep_hsdp"): Strategy(mesh=Mesh(dp_replicate=2, dp_shard=2, ep=2), default=L(sharding="zero3")),
    ("tiny-mixtral", "ep_pp"): Strategy(mesh=Mesh(pp=2, dp_shard=2, ep=2), default=L(sharding="zero1")),
    ("tiny-deepseek", "ep4"): Strategy(mesh=Mesh(dp_shard=4, ep=4), default=L(sharding="zero1")),
    # TSP with FSDP per unit and operator, with ring context parallelism (tokens over cp x tp), in
    # pipeline stages (the tied table's copy on the ring too), and over four ranks
    ("tiny-llama", "tsp_fsdp"): Strategy(mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", default=L(sharding="zero3"),
                                         layers=MIXED),
    ("tiny-llama", "tsp_cp"): Strategy(mesh=Mesh(cp=2, tp=2), tp_mode="tsp", default=L(sharding="zero3")),
    ("tiny-gpt", "tsp_pp"): Strategy(mesh=Mesh(pp=2, tp=2), tp_mode="tsp", schedule="1f1b",
                                     default=L(sharding="replicate", recompute="full")),
    ("tiny-gpt", "tsp4"): Strategy(mesh=Mesh(tp=4), tp_mode="tsp", default=L(sharding="zero1")),
    # splits with TP x FSDP, with TSP, and of a tied table over pipeline stages with TP
    ("tiny-llama", "split_tp_fsdp"): Strategy(mesh=Mesh(dp_shard=2, tp=2), default=L(sharding="zero3"), layers=SPLITS),
    ("tiny-llama", "split_tsp"): Strategy(mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", default=L(sharding="zero3"),
                                          layers=SPLITS),
    ("tiny-gpt", "tied_split_pp_tp"): Strategy(mesh=Mesh(pp=2, tp=2), schedule="1f1b", layers=[
        L(unit="embedding", split=2), L(unit="layers.3", split=2)]),
}


def _one_microbatch(s: Strategy) -> Strategy:
    """Whole per-rank batches (fewer collectives: each costs a scheduler slice on 2 cores);
    pipelines keep 4 micro-batches."""
    rows = SETTINGS.global_batch // s.mesh.dp
    return s.model_copy(update={"micro_batch": rows // 4 if s.mesh.pp > 1 else rows})


def _run(jobs: dict[tuple[str, str], Strategy], nproc: int, extra: tuple[Job, ...] = ()) -> dict[tuple[str, str], dict[str, Any]]:
    js = [Job(model=spec_for(m), plan_json=_one_microbatch(s).model_dump_json(), settings=SETTINGS.to_dict(),
              name=f"{m}/{n}", reference=True) for (m, n), s in jobs.items()]
    js += list(extra)
    return {tuple(r["name"].split("/")): r for r in launch(js, nproc)}  # type: ignore[misc]


@pytest.fixture(scope="module")
def w2() -> dict:
    """All two-process plans in one launch (start-up paid once)."""
    jobs = {("tiny-gpt", k): v for k, v in W2_GPT.items()}
    jobs.update({("tiny-llama", k): v for k, v in W2_LLAMA.items()})
    jobs.update(W2_HF)
    jobs.update(W2_MOE)
    return _run(jobs, 2, extra=tuple(
        Job(model=spec_for("tiny-llama"), name=f"tiny-llama/zero3_{p}", reference=True,
            plan_json=_one_microbatch(W2_LLAMA["zero3_selective"]).model_dump_json(),
            settings={**SETTINGS.to_dict(), "precision": p}) for p in ("bf16", "fp8")))


@pytest.fixture(scope="module")
def w4() -> dict:
    return _run(W4, 4)


def test_reference_is_independent_of_the_launch(w2: dict) -> None:
    assert w2[("tiny-llama", "zero2")]["reference_losses"] == reference_losses(spec_for("tiny-llama"), SETTINGS)


# ---- expected state bytes --------------------------------------------------------------------
FACTORS = {"replicate": (1, 1, 2), "zero1": (1, 1, 1), "zero2": (1, 0.5, 1), "zero3": (0.5, 0.5, 1),
           "zero3_keep": (0.5, 0.5, 1)}  # (params, grads, Adam moments) per parameter at dp_shard=2


def _unit(path: str) -> str:
    return "embedding" if path.startswith("embed") else ("head" if path.startswith(("final_norm", "head")) else path)


def _numels(model: str) -> dict[str, int]:
    import torch

    from runtime.model import Transformer

    with torch.device("meta"):
        m = Transformer(TINY_MODELS[model])
    return {n: p.numel() for n, p in m.named_parameters()}  # tied weight once, as embed.tok.weight


def _expected(model: str, s: Strategy) -> tuple[int, int, int]:
    """Bytes per rank for a dp_shard=2 plan, resolving units by longest prefix (independently of runtime)."""
    out = [0.0, 0.0, 0.0]
    for path, n in _numels(model).items():
        value = s.default.sharding
        best = -1
        for ls in s.layers:
            hit = ls.unit == _unit(path) or path.startswith(ls.unit + ".")
            if hit and len(ls.unit) > best:
                value, best = ls.sharding, len(ls.unit)
        for i, f in enumerate(FACTORS[value]):
            out[i] += F * n * f
    return int(out[0]), int(out[1]), int(out[2])


TP_SHARDED = ("embed.tok.", "attn.qkv.", "attn.out.weight", "mlp.up.", "mlp.down.weight", "head.weight")


def _tp_local(model: str, tp: int) -> int:
    return sum(n // tp if any(k in p for k in TP_SHARDED) else n for p, n in _numels(model).items())


# ---- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(W2_GPT))
def test_tiny_gpt_families_match_single_process(w2: dict, family: str) -> None:
    res = w2[("tiny-gpt", family)]
    assert_parity(res, "tiny-gpt")
    s = W2_GPT[family]
    if s.mesh.dp_shard == 2:
        assert state_bytes(res) == [_expected("tiny-gpt", s)] * 2, family
    if s.tp_mode == "tsp":  # every parameter, norms and biases too, cut over the two ranks
        n = sum(_numels("tiny-gpt").values())
        assert state_bytes(res) == [(F * n // 2, F * n // 2, F * n)] * 2


def test_tiny_gpt_bytes_of_simple_families(w2: dict) -> None:
    n = sum(_numels("tiny-gpt").values())
    assert state_bytes(w2[("tiny-gpt", "ddp")])[0] == (F * n, F * n, 2 * F * n)
    assert state_bytes(w2[("tiny-gpt", "zero3")])[0] == (F * n // 2, F * n // 2, F * n)  # Adam = 2 x params
    local = F * _tp_local("tiny-gpt", 2)
    assert state_bytes(w2[("tiny-gpt", "tp_sp")]) == [(local, local, 2 * local)] * 2
    cfg = TINY_MODELS["tiny-gpt"]
    per_block = (F * n - F * (cfg.vocab + cfg.max_seq + 2) * cfg.hidden) // cfg.layers
    emb, head_copy, final_norm = F * (cfg.vocab + cfg.max_seq) * cfg.hidden, F * cfg.vocab * cfg.hidden, F * 2 * cfg.hidden
    gp = state_bytes(w2[("tiny-gpt", "pp_gpipe")])  # stages of 1 and 3 blocks; the tied head is copied
    assert [b[0] for b in gp] == [emb + per_block, 3 * per_block + final_norm + head_copy]
    assert "embedding" not in w2[("tiny-gpt", "zero3")]["fsdp_units"]  # tied: in the root unit
    assert "layers.1.mlp.up.slices.3" in w2[("tiny-gpt", "split")]["fsdp_units"]


@pytest.mark.parametrize("family", list(W2_LLAMA))
def test_tiny_llama_families_match_single_process(w2: dict, family: str) -> None:
    res = w2[("tiny-llama", family)]
    assert_parity(res, "tiny-llama")
    s = W2_LLAMA[family]
    if s.mesh.dp_shard == 2:
        assert state_bytes(res) == [_expected("tiny-llama", s)] * 2, family
    if s.mesh.tp == 2 and s.tp_mode == "megatron":
        local = F * _tp_local("tiny-llama", 2)
        assert state_bytes(res) == [(local, local, 2 * local)] * 2
    if s.mesh.pp == 2:
        assert sum(b[0] for b in state_bytes(res)) == F * sum(_numels("tiny-llama").values())


def test_bf16_mixed_precision_keeps_fp32_master_weights(w2: dict) -> None:
    res = w2[("tiny-llama", "zero3_bf16")]
    assert_parity(res)  # against one process in bf16
    fp32 = w2[("tiny-llama", "zero3_selective")]
    assert res["steps"][0]["loss"] != fp32["steps"][0]["loss"]  # bf16 compute (close to fp32 at this size)
    assert state_bytes(res) == state_bytes(fp32)  # FSDP2: the sharded fp32 parameter is the master


def test_fp8_on_cpu_trains_bf16_and_says_so(w2: dict) -> None:
    res = w2[("tiny-llama", "zero3_fp8")]
    assert any("fp8 requested: a no-op on cpu" in n for n in res["notes"])
    assert [s["loss"] for s in res["steps"]] == [s["loss"] for s in w2[("tiny-llama", "zero3_bf16")]["steps"]]


@pytest.mark.parametrize("key", list(W2_MOE), ids=lambda k: "-".join(k))
def test_mixture_of_experts_match_single_process(w2: dict, key: tuple[str, str]) -> None:
    assert_parity(w2[key], key[0])
    assert state_bytes(w2[key]) == _predicted(key[0], W2_MOE[key], 2)  # experts split over EP ranks as priced


def test_expert_parallelism_holds_a_share_of_the_experts(w2: dict) -> None:
    n = sum(_numels("tiny-mixtral").values())
    dp, ep = state_bytes(w2[("tiny-mixtral", "dp")])[0][0], state_bytes(w2[("tiny-mixtral", "ep")])[0][0]
    assert dp == ep == F * n // 2  # experts: sharded by zero3 over 2 ranks, or held whole by 2 EP ranks


@pytest.mark.parametrize("key", list(W2_HF), ids=lambda k: "-".join(k))
def test_hugging_face_models_match_single_process(w2: dict, key: tuple[str, str]) -> None:
    assert_parity(w2[key], key[0])


@pytest.mark.parametrize("key", list(W4), ids=lambda k: "-".join(k))
def test_four_process_meshes_match_single_process(w4: dict, key: tuple[str, str]) -> None:
    res = w4[key]
    assert_parity(res, key[0])
    n = sum(_numels(key[0]).values())
    b = state_bytes(res)
    if key[1] == "hsdp":
        assert b == [(F * n // 2, F * n // 2, F * n)] * 4
    elif key[1] == "hsdp_zero2":
        assert b == [(F * n, F * n // 2, F * n)] * 4
    elif key[1] == "tp_fsdp":
        local = F * _tp_local("tiny-gpt", 2) // 2
        assert b == [(local, local, 2 * local)] * 4
    elif key[1] in ("pp_tp", "pp_mixed"):  # the two ranks of a stage hold equal shares; the stages differ
        assert b[0] == b[1] and b[2] == b[3] and b[0] != b[2]
    elif key[1] == "pp_fsdp":  # two stages, each sharded over 2 ranks; the last holds a copy of the tied embedding
        cfg = TINY_MODELS["tiny-gpt"]
        assert sum(x[0] for x in b) == F * (n + cfg.vocab * cfg.hidden)
    elif key[1] in ("cp_fsdp", "cp_ulysses_hsdp"):  # sharded over dp_shard x cp: 4 and 2 ways
        shards = 4 if key[1] == "cp_fsdp" else 2
        assert sum(x[0] for x in b) == 4 // shards * F * n and len(set(b)) <= 2


# ---- the cost model predicts the same bytes ----------------------------------------------------
def _predicted(model: str, s: Strategy, world: int) -> list[tuple[int, int, int]]:
    """Per-rank bytes the cost model predicts for the plan as the launch runs it."""
    return predicted_state_bytes(model, _one_microbatch(s), world, SETTINGS)


COSTED = [("tiny-gpt", k) for k in W2_GPT] + [("tiny-llama", k) for k in W2_LLAMA]


@pytest.mark.parametrize("key", COSTED, ids=lambda k: "-".join(k))
def test_state_bytes_equal_the_cost_model_prediction(w2: dict, key: tuple[str, str]) -> None:
    s = (W2_GPT if key[0] == "tiny-gpt" else W2_LLAMA)[key[1]]
    assert state_bytes(w2[key]) == _predicted(key[0], s, 2)


@pytest.mark.parametrize("key", list(W4), ids=lambda k: "-".join(k))
def test_four_process_state_bytes_equal_the_cost_model_prediction(w4: dict, key: tuple[str, str]) -> None:
    assert state_bytes(w4[key]) == _predicted(key[0], W4[key], 4)
