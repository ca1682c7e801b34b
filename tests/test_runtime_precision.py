"""Mixed precision for every unit of a plan (:mod:`runtime.precision`): bf16 parameters beside fp32
masters and fp32 gradient buffers wherever FSDP2 does not shard, FSDP2's policy where it does; the
check before any rank starts; bf16 runs of every family against a bf16 run in one process, holding
the state bytes a bf16 workload prices; and the parity tolerance per family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runtime.apply import check_plan
from runtime.launch import Job, launch
from runtime.model import spec_for
from runtime.precision import Precision, to_dtype
from runtime.train import TrainSettings, parity_tolerance
from runtime.zero import ReplicatedParams
from tests.runtime_checks import assert_parity, predicted_state_bytes, state_bytes
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

BF16 = TrainSettings(steps=3, global_batch=8, seq_len=32, seed=0, precision="bf16")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _grads(model: nn.Module, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 sums of each batch's bf16 gradients, computed apart on a bf16 copy."""
    copy = _model().to(torch.bfloat16)
    copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    total = [torch.zeros_like(p, dtype=torch.float32) for p in copy.parameters()]
    for x in xs:
        copy.zero_grad()
        copy(x).float().pow(2).sum().backward()
        for t, p in zip(total, copy.parameters(), strict=True):
            t += p.grad.float()
    return total


def test_replicated_parameters_become_bf16_beside_fp32_masters_and_gradients() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    rp = ReplicatedParams(0, params, None, None, 1, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert list(model.parameters()) == params  # the same Parameter objects, now bf16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    masters = rp.optimizer_params()
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m, b) for m, b in zip(masters, before, strict=True))  # fp32 values kept whole
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    want = _grads(_model(), xs)  # the same starting values in bf16
    for x in xs:  # two micro-batches: each bf16 gradient moves to the fp32 buffer as it is made
        model(x).float().pow(2).sum().backward()
        assert all(p.grad is None for p in model.parameters())
    rp.reduce_grads()
    for m, w in zip(masters, want, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, w)
    assert sum(t.numel() * t.element_size() for t in rp.held_grads()) == 4 * sum(p.numel() for p in params)
    opt = torch.optim.SGD(masters, lr=0.5)
    opt.step()
    rp.gather_params()
    for p, m in zip(model.parameters(), masters, strict=True):
        assert torch.equal(p, m.detach().to(torch.bfloat16))  # the stepped master, cast back
    assert rp.held_grads() == []


def test_a_parameter_made_bf16_keeps_its_gradient_hooks() -> None:
    """Tensor parallelism's gradient-layout hooks are registered before the parameters become bf16."""
    p = nn.Parameter(torch.randn(3))
    seen: list[str] = []
    p.register_hook(lambda g: seen.append("grad"))
    p.register_post_accumulate_grad_hook(lambda t: seen.append("accumulated"))
    to_dtype([p], torch.bfloat16)
    (p.float() * 2).sum().backward()
    assert (p.dtype, seen) == (torch.bfloat16, ["grad", "accumulated"])


def test_a_gradient_assigned_without_accumulation_is_reduced_too() -> None:
    """The zero-bubble schedule's weight pass sets ``.grad`` itself: no post-accumulate hook runs."""
    model = _model()
    rp = ReplicatedParams(0, list(model.parameters()), None, None, 1, compute_dtype=torch.bfloat16)
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()  # through the hooks
    hooked = [m.grad for m in rp.optimizer_params()]
    assert all(g is None for g in hooked)
    rp.reduce_grads()
    first = [m.grad.clone() for m in rp.optimizer_params()]
    rp.gather_params()
    for p, g in zip(model.parameters(), first, strict=True):
        p.grad = g.to(torch.bfloat16)  # as torch.distributed.pipelining's weight pass does
    rp.reduce_grads()
    for m, g in zip(rp.optimizer_params(), first, strict=True):
        assert torch.equal(m.grad, g.to(torch.bfloat16).float())
    assert all(p.grad is None for p in model.parameters())


def test_bf16_gradient_buffers_stay_16_bit_when_the_plan_says_so() -> None:
    model = _model()
    rp = ReplicatedParams(0, list(model.parameters()), None, None, 1, compute_dtype=torch.bfloat16,
                          reduce_dtype=torch.bfloat16)
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    rp.reduce_grads()
    for p, m in zip(model.parameters(), rp.optimizer_params(), strict=True):
        assert torch.equal(m.grad, p.grad.float())


def test_fp32_keeps_the_parameters_as_the_optimizer_steps_them() -> None:
    model = _model()
    params = list(model.parameters())
    rp = ReplicatedParams(0, params, None, None, 1)
    assert rp.optimizer_params() == params and all(p.dtype == torch.float32 for p in params)


@pytest.mark.parametrize("strategy", [
    Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="replicate")),
    Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero2"), layers=[L(unit="layers.0.attn.qkv", sharding="zero3")]),
    Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    Strategy(mesh=Mesh(tp=2), tp_mode="tsp"),
    Strategy(mesh=Mesh(pp=2), schedule="1f1b"),
    Strategy(mesh=Mesh(cp=2), default=L(sharding="zero1")),
], ids=["replicate", "zero2_nested_zero3", "tp_sp", "tsp", "pp", "cp"])
def test_check_plan_accepts_bf16_for_every_family(strategy: Strategy) -> None:
    check_plan(spec_for("tiny-llama"), strategy, strategy.mesh.world_size, "cpu", 32, 8, precision=Precision("bf16"))


def test_check_plan_refuses_an_unknown_precision_before_any_rank_starts() -> None:
    s = Strategy(mesh=Mesh(dp_shard=2))
    with pytest.raises(ShardplanError, match=r"^precision 'fp16' is not one of fp32, bf16, fp8$"):
        check_plan(spec_for("tiny-llama"), s, 2, "cpu", precision=Precision("fp16"))
    with pytest.raises(ShardplanError, match=r"^gradient dtype 'fp8' is not one of fp32, bf16$"):
        check_plan(spec_for("tiny-llama"), s, 2, "cpu", precision=Precision("bf16", "fp8"))


def test_parity_tolerances() -> None:
    """float32's rounding of reordered sums (which may flip a token's expert), or bf16's of each rank's."""
    assert [parity_tolerance(p) for p in ("fp32", "bf16", "fp8")] == [1e-6, 1e-4, 1e-4]
    assert [parity_tolerance(p, moe=True) for p in ("fp32", "bf16")] == [2e-5, 1e-4]


# ---- every family in bf16, against one process in bf16 --------------------------------------------
FAMILIES: dict[tuple[str, str], Strategy] = {
    ("tiny-llama", "replicate"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="replicate")),
    ("tiny-llama", "zero1"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero1")),
    ("tiny-llama", "zero2"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero2")),
    ("tiny-llama", "zero3"): Strategy(mesh=Mesh(dp_shard=2), default=L(sharding="zero3")),
    ("tiny-llama", "tp_sp"): Strategy(mesh=Mesh(tp=2), sequence_parallel=True),
    ("tiny-gpt", "tsp_selective"): Strategy(mesh=Mesh(tp=2), tp_mode="tsp", default=L(recompute="selective")),
    ("tiny-llama", "cp_ring"): Strategy(mesh=Mesh(cp=2), default=L(sharding="zero2")),
    ("tiny-llama", "pp_1f1b"): Strategy(mesh=Mesh(pp=2), schedule="1f1b"),
    ("tiny-mixtral", "ep_zero1"): Strategy(mesh=Mesh(dp_shard=2, ep=2), default=L(sharding="zero1")),
}


def _whole_batches(s: Strategy) -> Strategy:
    rows = BF16.global_batch // s.mesh.dp
    return s.model_copy(update={"micro_batch": rows // 4 if s.mesh.pp > 1 else rows})


@pytest.fixture(scope="module")
def bf16_runs() -> dict[tuple[str, str], dict[str, Any]]:
    jobs = [Job(model=spec_for(m), plan_json=_whole_batches(s).model_dump_json(), settings=BF16.to_dict(),
                name=f"{m}/{n}", reference=True) for (m, n), s in FAMILIES.items()]
    return {tuple(r["name"].split("/")): r for r in launch(jobs, 2)}  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FAMILIES), ids=lambda k: k[1])
def test_every_family_trains_in_bf16_like_one_process_with_the_priced_bytes(bf16_runs: dict, key: tuple[str, str]) -> None:
    res = bf16_runs[key]
    assert_parity(res)
    assert state_bytes(res) == predicted_state_bytes(key[0], _whole_batches(FAMILIES[key]), 2, BF16)
