"""The profile document: round trip, bad files, and the lookups the cost model makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiler.profile_schema import (
    SCHEMA_PATH,
    AttnPoint,
    BwPoint,
    CommFit,
    ComputeProfile,
    DeviceInfo,
    GemmPoint,
    LayerMeasurement,
    Profile,
    ProfileError,
    json_schema_text,
    load_profile,
    parse_profile,
)
from vocab.errors import ShardplanError

DEV = DeviceInfo(kind="cpu", name="test cpu", torch_version="2.13.0", threads=2, hostname="h",
                 created="2026-01-01T00:00:00+00:00")


def gemm(flops: float, rate: float, m: int = 8) -> GemmPoint:
    total = 3 * flops / rate  # fwd takes a third, bwd two thirds: every phase runs at `rate`
    return GemmPoint(m=m, n=8, k=8, fwd_s=total / 3, bwd_s=2 * total / 3, flops=flops, flops_per_s=rate)


def attn(flops: float, rate: float, causal: bool) -> AttnPoint:
    total = 3 * flops / rate
    return AttnPoint(batch=1, heads=1, seq=8, head_dim=8, causal=causal, fwd_s=total / 3, bwd_s=2 * total / 3,
                     flops=flops, flops_per_s=rate)


def bw(nbytes: float, rate: float, variant: str = "") -> BwPoint:
    return BwPoint(bytes=nbytes, seconds=nbytes / rate, bytes_per_s=rate, bwd_s=2 * nbytes / rate, variant=variant)


def fit(coll: str, world: int, a: float, b: float) -> CommFit:
    return CommFit(collective=coll, world=world, backend="gloo", alpha_s=a, beta_s_per_byte=b,
                   median_rel_error=0.0, points=[(1024.0, a + b * 1024)])


@pytest.fixture
def prof() -> Profile:
    compute = ComputeProfile(
        dtype="bf16",
        gemm=[gemm(1e6, 1e9), gemm(1e8, 3e9), gemm(1e10, 4e9, m=1), gemm(1e10, 6e9, m=2)],
        attention=[attn(1e6, 1e9, False), attn(1e8, 2e9, False), attn(1e6, 4e9, True)],
        bandwidth={"norm": [bw(1e6, 1e9, "layernorm"), bw(2e6, 2e9, "rmsnorm"), bw(3e6, 3e9, "layernorm"),
                            bw(4e6, 5e9, "rmsnorm")],
                   "softmax": [bw(1e6, 2e9)]},
    )
    return Profile(device=DEV, compute=compute,
                   comm=[fit("all_reduce", 2, 1e-4, 1e-9), fit("all_reduce", 4, 2e-4, 2e-9),
                         fit("all_reduce", 8, 3e-4, 3e-9), fit("send_recv", 2, 5e-5, 5e-10)],
                   model=[LayerMeasurement(model="gpt2", layer="layers.0.attn.qkv", micro_batch=1, seq_len=128,
                                           fwd_s=1e-3, bwd_s=2e-3, saved_bytes=196608)])


def test_gemm_interpolation_is_exact(prof: Profile) -> None:
    f = prof.gemm_flops_per_s
    assert f(1e5) == pytest.approx(1e9)  # clamped below
    assert f(1e6) == pytest.approx(1e9)
    assert f(1e7) == pytest.approx(2e9)  # halfway in log(flops)
    assert f(1e9) == pytest.approx(4e9)  # halfway between 3e9 and the median (5e9) of the two 1e10 points
    assert f(1e10) == pytest.approx(5e9)
    assert f(1e12) == pytest.approx(5e9)  # clamped above
    assert f(1e7, phase="fwd") == pytest.approx(2e9) and f(1e7, phase="bwd") == pytest.approx(2e9)


def test_attention_interpolation_reads_non_causal_by_default(prof: Profile) -> None:
    assert prof.attention_flops_per_s(1e7) == pytest.approx(1.5e9)
    assert prof.attention_flops_per_s(1e9) == pytest.approx(2e9)
    assert prof.attention_flops_per_s(1e7, causal=True) == pytest.approx(4e9)


def test_bandwidth_lookup(prof: Profile) -> None:
    assert prof.bytes_per_s("norm") == pytest.approx(4e9)  # median of the larger half: 3e9, 5e9
    assert prof.bytes_per_s("norm", variant="layernorm") == pytest.approx(3e9)
    assert prof.bytes_per_s("softmax") == pytest.approx(2e9)
    assert prof.bytes_per_s("embedding") == pytest.approx(3e9)  # not measured: median over ops
    assert prof.bytes_per_s("loss") == pytest.approx(3e9)
    assert prof.bwd_fwd_ratio("norm") == pytest.approx(2.0)


def test_comm_lookup_takes_the_nearest_world(prof: Profile) -> None:
    assert prof.comm_alpha_beta("all_reduce", 2) == (1e-4, 1e-9)
    assert prof.comm_alpha_beta("all_reduce", 3) == (2e-4, 2e-9)  # tie: the larger world
    assert prof.comm_alpha_beta("allreduce", 64) == (3e-4, 3e-9)
    assert prof.comm_alpha_beta("all_reduce") == (3e-4, 3e-9)
    assert prof.comm_alpha_beta("send_recv", 8) == (5e-5, 5e-10)
    with pytest.raises(ProfileError, match="no 'all_to_all' measurement"):
        prof.comm_alpha_beta("all_to_all", 2)


def test_missing_sections_are_clear_errors() -> None:
    p = Profile(device=DEV)
    with pytest.raises(ShardplanError, match="no compute section"):
        p.gemm_flops_per_s(1e9)
    with pytest.raises(ShardplanError, match="no comm measurements"):
        p.comm_alpha_beta("all_reduce", 2)


def test_round_trip_and_atomic_save(prof: Profile, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p.json"
    prof.save(path)
    assert load_profile(path) == prof
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no temporary left behind
    assert json.loads(path.read_text())["kind"] == "shardplan-profile"


def test_merge_and_device_kind(prof: Profile) -> None:
    gpu = DEV.model_copy(update={"kind": "gpu", "name": "H200"})
    with pytest.raises(ShardplanError, match="measured on a cpu"):
        prof.check_kind("gpu")
    with pytest.raises(ShardplanError, match="measured on a gpu"):
        prof.merged(Profile(device=gpu))
    new = Profile(device=DEV, comm=[fit("all_reduce", 2, 9e-4, 9e-9)])
    m = prof.merged(new)
    assert m.compute == prof.compute and m.comm_alpha_beta("all_reduce", 2) == (9e-4, 9e-9)
    assert len(m.comm) == len(prof.comm) and m.model == prof.model


def test_schema_file_is_in_sync() -> None:
    assert SCHEMA_PATH.read_text() == json_schema_text(), "run: python -m profiler.profile_schema"


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t[: len(t) // 2], "truncated"),
    (lambda t: "", "is empty"),
    (lambda t: t.replace('"1.0"', '"0.9"'), "schema_version '0.9' is not supported"),
    (lambda t: t.replace('"shardplan-profile"', '"shardplan-plan"'), "not a shardplan profile"),
    (lambda t: t.replace('"micro_batch": 1', '"micro_batch": "one"'), "model.0.micro_batch"),
    (lambda t: t.replace('"dtype": "bf16"', '"dtype": "bf16", "colour": "red"'), "compute.colour"),
    (lambda t: "[1, 2]", "must hold a JSON object"),
    (lambda t: "{nope}", "not valid JSON"),
])
def test_bad_files_are_clear_errors(prof: Profile, tmp_path: Path, mutate, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(mutate(prof.to_json()))
    with pytest.raises(ShardplanError, match=message) as e:
        load_profile(path)
    assert "bad.json" in str(e.value)


def test_missing_file() -> None:
    with pytest.raises(ShardplanError, match="cannot read profile"):
        load_profile("/nonexistent/p.json")
    with pytest.raises(ShardplanError, match="is not a valid profile"):
        parse_profile({"schema_version": "1.0", "kind": "shardplan-profile"})


@pytest.mark.parametrize("frac", [0.05, 0.3, 0.5, 0.77, 0.999])
def test_a_profile_cut_anywhere_reads_as_truncated(prof: Profile, tmp_path: Path, frac: float) -> None:
    text = prof.to_json()
    path = tmp_path / "cut.json"
    path.write_text(text[: int(len(text) * frac)])
    with pytest.raises(ShardplanError, match="is truncated"):
        load_profile(path)


def test_gemm_rate_by_shape_prefers_the_nearest_measured_shapes() -> None:
    """Equal FLOPs, different shapes: a thin GEMM is priced from the thin measurements."""
    from profiler.profile_schema import GemmPoint

    def pt(m: int, n: int, k: int, rate: float) -> GemmPoint:
        f = 2.0 * m * n * k
        return GemmPoint(m=m, n=n, k=k, fwd_s=f / rate, bwd_s=2 * f / rate, flops=f, flops_per_s=rate)

    comp = ComputeProfile(dtype="fp32", gemm=[pt(128, 4096, 1024, 5e10), pt(1024, 512, 1024, 1e11)])
    prof = Profile(device=DEV, compute=comp)
    assert prof.gemm_flops_per_s(1.07e9, "fwd", (128, 4096, 1024)) == pytest.approx(5e10)
    assert prof.gemm_flops_per_s(1.07e9, "fwd", (1024, 512, 1024)) == pytest.approx(1e11)
    near_thin = prof.gemm_flops_per_s(1.07e9, "fwd", (128, 3000, 1024))
    assert 5e10 < near_thin < 7.07e10  # nearer the thin point than the geometric mean of the two
    assert prof.gemm_flops_per_s(1.07e9, "fwd") == pytest.approx(7.5e10)  # without a shape: by FLOPs


def test_ranks_sharing_cores_run_at_their_share_and_gloo_hides_nothing(prof: Profile) -> None:
    """On a CPU host (cpu.yaml: 2 cores) four ranks profiled with 2 threads each get a quarter of
    the measured speed; the accelerator file's physics sets every overlap to 0."""
    from costmodel.device import DeviceModel
    from profiler.hardware import parse_cluster

    one, four = DeviceModel(parse_cluster("1xcpu"), prof), DeviceModel(parse_cluster("4xcpu"), prof)
    assert (one.share, four.share) == (1.0, 0.25)
    assert four.gemm_time(1e8) == pytest.approx(4 * one.gemm_time(1e8), rel=1e-12)
    assert four.memory_time(1e6, "softmax") == pytest.approx(4 * one.memory_time(1e6, "softmax"), rel=1e-12)
    assert DeviceModel(parse_cluster("4xcpu")).share == 1.0  # spec sheet: the host's peak as given
    assert four.c.fsdp_overlap == four.c.dp_overlap == four.c.tp_overlap == four.c.pp_overlap == 0.0
    assert DeviceModel(parse_cluster("8xh100")).c.fsdp_overlap > 0


def test_the_measured_sharing_efficiency_scales_the_fair_share(prof: Profile) -> None:
    """A comm profile that measured ranks getting 90% of their fair share of the cores: four ranks
    of 2 threads on 2 cores run at 0.25 x 0.9 of the measured speed; a rank alone keeps all of it."""
    from costmodel.device import DeviceModel
    from profiler.hardware import parse_cluster
    from profiler.profile_schema import CommFit

    fit = CommFit(collective="all_reduce", world=2, backend="gloo", alpha_s=1e-4, beta_s_per_byte=1e-9,
                  median_rel_error=0.0, points=[(1.0, 1e-4)], sharing_efficiency=0.9)
    shared = prof.model_copy(update={"comm": [fit]})
    assert DeviceModel(parse_cluster("4xcpu"), shared).share == pytest.approx(0.225, rel=1e-12)
    assert DeviceModel(parse_cluster("1xcpu"), shared).share == 1.0
    assert parse_profile(shared.to_json()).comm[0].sharing_efficiency == 0.9  # round-trips
    noisy = prof.model_copy(update={"comm": [fit.model_copy(update={"sharing_efficiency": 1.006})]})
    assert DeviceModel(parse_cluster("4xcpu"), noisy).share == pytest.approx(0.25, rel=1e-12)  # never above fair
