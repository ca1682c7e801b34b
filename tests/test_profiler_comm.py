"""Collective timing: the α-β fit, size parsing, one real gloo run, and a rank that dies."""

from __future__ import annotations

import os

import psutil
import pytest

from profiler.measure_comm import check_backend, fit_alpha_beta, parse_sizes, profile_comm
from profiler.profile_schema import COLLECTIVES, Profile, parse_profile
from vocab.errors import ShardplanError


def test_fit_recovers_alpha_beta_exactly() -> None:
    a, b = 37e-6, 1 / 3.2e9
    pts = [(float(x), a + b * x) for x in (1024, 65536, 1 << 20, 16 << 20, 256 << 20)]
    fa, fb, err = fit_alpha_beta(pts)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-9) and err < 1e-9


def test_fit_keeps_alpha_and_beta_non_negative() -> None:
    fa, fb, _ = fit_alpha_beta([(1e3, 1e-6), (1e6, 1e-3), (1e7, 1e-2)])  # pure bandwidth
    assert fa == pytest.approx(0, abs=1e-12) and fb == pytest.approx(1e-9)
    fa, fb, _ = fit_alpha_beta([(1e3, 2e-4), (1e6, 1e-4)])  # time falls with size: latency only
    assert fb == 0 and 1e-4 <= fa <= 2e-4
    fa, fb, _ = fit_alpha_beta([(1e3, 1e-3)])
    assert fa == 0 and fb == pytest.approx(1e-6)


def test_parse_sizes() -> None:
    assert parse_sizes("1K, 64k,1MiB") == [1024, 65536, 1 << 20]
    assert parse_sizes("1K,64K,1M,256M,4096") == [1024, 4096, 65536, 1 << 20, 256 << 20]
    assert parse_sizes("1.5K") == [1536]
    for bad in ("1X", "", "2"):
        with pytest.raises(ShardplanError, match="--sizes"):
            parse_sizes(bad)


def test_backends_that_cannot_start() -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ShardplanError, match="backend 'nccl' cannot start"):
            check_backend("nccl", 2)
    with pytest.raises(ShardplanError, match="not gloo or nccl"):
        check_backend("mpi", 2)
    with pytest.raises(ShardplanError, match="at least 2"):
        check_backend("gloo", 1)


def _our_children() -> list[psutil.Process]:
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.slow
def test_real_gloo_run_with_two_processes() -> None:
    info, fits = profile_comm(2, "gloo", sizes=[1024, 16384, 262144], progress=False, timeout_s=120)
    assert info.kind == "cpu"
    assert [f.collective for f in fits] == list(COLLECTIVES)
    for f in fits:
        assert f.world == 2 and f.backend == "gloo" and [p[0] for p in f.points] == [1024, 16384, 262144]
        assert all(t > 0 for _, t in f.points) and all(m <= t for (_, m), (_, t) in zip(f.min_points, f.points, strict=True))
        assert f.alpha_s >= 0 and f.beta_s_per_byte >= 0 and f.median_rel_error >= 0
    assert len({f.wait_s for f in fits}) == 1 and fits[0].wait_s >= 0  # one wait under load per run
    if (os.cpu_count() or 1) >= 2:  # two ranks, two cores: nothing shared, nothing measured
        assert {f.sharing_efficiency for f in fits} == {1.0}
    prof = parse_profile(Profile(device=info, comm=fits).to_json())
    a, b = prof.comm_alpha_beta("all_reduce", 2)
    assert a + b * 1e6 > 0
    assert not _our_children()


def test_the_wait_under_load_is_priced_per_collective() -> None:
    """A profile's measured wait adds to every collective the cost model prices with it."""
    from costmodel.configs import ConfigArrays
    from costmodel.device import DeviceModel
    from profiler.hardware import parse_cluster
    from profiler.profile_schema import CommFit, DeviceInfo
    from vocab.strategy import Mesh, Strategy

    info = DeviceInfo(kind="cpu", name="test cpu", torch_version="x", threads=1, hostname="h", created="now")

    def prof(wait: float) -> Profile:
        return Profile(device=info, comm=[CommFit(collective="all_reduce", world=2, backend="gloo", alpha_s=1e-4,
                                                  beta_s_per_byte=1e-9, median_rel_error=0.0,
                                                  points=[(1.0, 1e-4)], wait_s=wait)])
    cl = parse_cluster("2xcpu")
    grp = ConfigArrays.of_strategy(Strategy(mesh=Mesh(tp=2))).tp_group
    base = DeviceModel(cl, prof(0.0)).collective_time("all_reduce", 1e6, grp)
    assert base == pytest.approx(1e-4 + 1e-3)
    assert DeviceModel(cl, prof(2e-3)).collective_time("all_reduce", 1e6, grp) == pytest.approx(base + 2e-3)


def test_the_wait_is_the_loops_extra_beyond_what_the_model_already_prices() -> None:
    """The under-load loop's extra time per all-reduce, less the world-2 all-reduce fit at the
    loop's size (else less the barrier-synced all-reduce); never negative; 0 without a loop."""
    from profiler.measure_comm import LOAD_BYTES, wait_beyond
    from profiler.profile_schema import CommFit

    def fit(coll: str, world: int) -> CommFit:
        return CommFit(collective=coll, world=world, backend="gloo", alpha_s=5e-4, beta_s_per_byte=1e-9,
                       median_rel_error=0.0, points=[(1.0, 5e-4)])
    own = 5e-4 + 1e-9 * LOAD_BYTES
    assert wait_beyond([3e-3, 2e-3], [fit("all_gather", 2), fit("all_reduce", 2)]) == pytest.approx(3e-3 - own)
    assert wait_beyond([3e-3, 2e-3], [fit("all_reduce", 4)]) == pytest.approx(1e-3)  # no world-2 fit
    assert wait_beyond([3e-4, 2e-3], [fit("all_reduce", 2)]) == 0.0
    assert wait_beyond(None, [fit("all_reduce", 2)]) == 0.0


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_run_cleanly() -> None:
    with pytest.raises(ShardplanError, match=r"rank 1 exited with code 7 during all_gather of 4 KiB at world 2"):
        profile_comm(2, "gloo", sizes=[1024, 4096], collectives=["all_reduce", "all_gather"], progress=False,
                     timeout_s=120, fail_at=(1, "all_gather", 4096))
    assert not _our_children()
