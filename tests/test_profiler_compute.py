"""A real (tiny) compute sweep on the CPU and the device checks around it."""

from __future__ import annotations

import pytest
import torch

from profiler.measure_compute import (
    Timing,
    attn_grid,
    bw_grid,
    gemm_grid,
    guess_accelerator,
    profile_compute,
    resolve_device,
    spread,
)
from profiler.profile_schema import Profile, parse_profile
from vocab.errors import ShardplanError

TINY = Timing(warmup=1, min_reps=2, max_reps=3, target_s=0.001)


def test_tiny_sweep_makes_a_valid_profile() -> None:
    cases = [("norm", "layernorm", (64, 32)), ("norm", "rmsnorm", (64, 32)), ("softmax", "softmax", (16, 64)),
             ("activation", "gelu", (16, 64)), ("activation", "swiglu", (16, 64)), ("elementwise", "add", (16, 32)),
             ("embedding", "lookup", (16, 100, 32)), ("cross_entropy", "cross_entropy", (8, 500))]
    info, comp = profile_compute("cpu", "fp32", gemm_shapes=[(32, 48, 16), (64, 64, 64, "sq")],
                                 attn_shapes=[(1, 2, 32, 16, False), (1, 2, 32, 16, True)], bw_cases=cases,
                                 timing=TINY, progress=False)
    assert info.kind == "cpu" and info.torch_version == torch.__version__ and info.accelerator == "cpu"
    assert comp.dtype == "fp32" and [(p.m, p.n, p.k) for p in comp.gemm] == [(32, 48, 16), (64, 64, 64)]
    g = comp.gemm[0]
    assert g.flops == 2 * 32 * 48 * 16 and g.flops_per_s == pytest.approx(3 * g.flops / (g.fwd_s + g.bwd_s))
    a = comp.attention[1]
    assert a.causal and a.flops == 4 * 1 * 2 * 32 * 32 * 16
    assert set(comp.bandwidth) == {"norm", "softmax", "activation", "elementwise", "embedding", "cross_entropy"}
    assert comp.bandwidth["norm"][0].bytes == 2 * 64 * 32 * 4  # read and write, fp32
    assert comp.bandwidth["activation"][1].bytes == 3 * 16 * 64 * 4  # swiglu: two inputs, one output
    d = comp.dtensor  # DTensor's dispatch: several times a tiny linear's own forward and backward
    assert d is not None and d.linear_fwd_s > 0 and d.linear_bwd_s > 0 and d.loss_traffic_ratio >= 1
    prof = Profile(device=info, compute=comp)
    again = parse_profile(prof.to_json())
    assert again == prof
    assert prof.gemm_flops_per_s(1e5) > 0 and prof.attention_flops_per_s(1e5) > 0 and prof.bytes_per_s("norm") > 0


def test_optimizer_step_is_measured_and_prices_the_cost_models_adam_bytes() -> None:
    """The AdamW step is timed over fp32 master weights; its bandwidth converts the cost model's
    36 bytes per parameter into that step's seconds; a profile without it prices the step by the
    elementwise add, and the step never stands in for a tensor op."""
    def prof(cases: list) -> Profile:
        info, comp = profile_compute("cpu", "fp32", gemm_shapes=[(32, 48, 16)], attn_shapes=[], bw_cases=cases,
                                     timing=TINY, progress=False, dtensor=False)
        return Profile(device=info, compute=comp)

    add = ("elementwise", "add", (16, 32))
    old, new = prof([add]), prof([add, ("optimizer", "adamw", (1 << 16,))])
    pt = new.compute.bandwidth["optimizer"][0]  # type: ignore[union-attr]
    assert pt.variant == "adamw" and pt.bytes == 36 * (1 << 16) and pt.bytes_per_s == pytest.approx(pt.bytes / pt.seconds)
    assert new.bytes_per_s("optimizer") == pt.bytes_per_s
    assert parse_profile(new.to_json()) == new  # the document validates with the step in it
    assert old.bytes_per_s("optimizer") == old.bytes_per_s("elementwise")
    assert new.bytes_per_s("norm") == new.bytes_per_s("elementwise")  # unmeasured: the tensor ops' median
    assert new.bwd_fwd_ratio("norm") == new.bwd_fwd_ratio("elementwise")


def test_default_grids_hold_tp_shrunk_shapes() -> None:
    for quick in (True, False):
        for kind in ("cpu", "gpu"):
            g = gemm_grid(quick, kind)
            tags = {t for *_, t in g}
            assert any("tp8" in t for t in tags) and "square" in tags
            assert len({(m, n, k) for m, n, k, _ in g}) == len(g)
            assert {c for *_, c in attn_grid(quick, kind)} == {False, True}
            assert {op for op, *_ in bw_grid(quick, kind)} == {"norm", "softmax", "activation", "elementwise",
                                                               "embedding", "cross_entropy", "optimizer"}
    shapes = {(m, n, k) for m, n, k, _ in gemm_grid(True, "cpu")}
    assert (512, 1024, 4096 // 8) in shapes  # mlp.down is row-parallel: TP 8 shrinks k
    assert (512, 4096 // 8, 1024) in shapes  # mlp.up is column-parallel: TP 8 shrinks n


@pytest.mark.parametrize("spec", ["cuda", "cuda:7", "CUDA:0", "mps", "cuda:x"])
def test_missing_devices_are_errors(spec: str) -> None:
    if torch.cuda.is_available() and spec in ("cuda", "CUDA:0"):
        pytest.skip("a GPU is present")
    with pytest.raises(ShardplanError, match=f"device '{spec}'"):
        resolve_device(spec)


def test_spread_and_accelerator_names() -> None:
    assert spread([1.0, 1.0, 1.0]) == 0
    assert spread([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    assert guess_accelerator("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert guess_accelerator("NVIDIA H100 PCIe") == "h100-pcie"
    assert guess_accelerator("NVIDIA H200") == "h200"
    assert guess_accelerator("NVIDIA A100-SXM4-40GB", 42) == "a100-40gb"
    assert guess_accelerator("Tesla T4") is None


def test_past_the_budget_points_get_a_single_run() -> None:
    _, comp = profile_compute("cpu", "fp32", gemm_shapes=[(16, 16, 16), (32, 32, 32)], attn_shapes=[], bw_cases=[],
                              timing=Timing(warmup=1, min_reps=5, max_reps=5, target_s=1.0, budget_s=0.0),
                              progress=False, dtensor=False)
    assert [p.spread for p in comp.gemm] == [0.0, 0.0]  # one timed run each: no spread


def test_past_the_deadline_only_unmeasured_ops_run() -> None:
    cases = [("norm", "layernorm", (8, 16)), ("softmax", "softmax", (8, 16)), ("norm", "layernorm", (16, 16))]
    _, comp = profile_compute("cpu", "fp32", gemm_shapes=[(16, 16, 16), (32, 32, 32)], attn_shapes=[],
                              bw_cases=cases, timing=Timing(deadline_s=0.0), progress=False, dtensor=False)
    assert len(comp.gemm) == 1 and {k: len(v) for k, v in comp.bandwidth.items()} == {"norm": 1, "softmax": 1}
    assert comp.skipped == 2


def test_auto_dtype_is_fp32_on_a_cpu_without_bf16_matrix_units(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import profiler.measure_compute as mc

    cpu = torch.device("cpu")
    monkeypatch.setattr(mc, "cpu_has_fast_bf16", lambda: False)
    assert mc.resolve_dtype(None, cpu) == "fp32" and mc.resolve_dtype("auto", cpu) == "fp32"
    monkeypatch.setattr(mc, "cpu_has_fast_bf16", lambda: True)
    assert mc.resolve_dtype("auto", cpu) == "bf16"
    assert mc.resolve_dtype("fp32", cpu) == "fp32" and mc.resolve_dtype("auto", torch.device("cuda", 0)) == "bf16"
    with pytest.raises(ShardplanError, match="not one of"):
        mc.resolve_dtype("int4", cpu)
