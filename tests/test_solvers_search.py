"""The searches find exactly what brute force over the same space finds, and plans that fit."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.chain import mesh_problem
from solvers.exhaustive import search_space, space_plans
from solvers.hybrid import SearchControls, search
from solvers.osdp_dp import solve_dp
from solvers.space import SPACES, mesh_configs
from vocab.errors import ShardplanError
from vocab.strategy import Workload

SMALL = {"name": "small", "layers": 3, "hidden": 1024, "heads": 8, "vocab": 8192, "max_seq": 1024}
LIMITED = dict(
    shardings=("replicate", "zero3"),
    recomputes=("none", "full"),
    offloads=("none",),
    max_micro_batch_sizes=2,
    tp_modes=("megatron",),
    cp_modes=("ring",),
)


@pytest.fixture(scope="module")
def setup() -> tuple:
    g = load_model(SMALL, 1024)
    return g, parse_cluster("2xh100"), Workload(seq_len=1024, global_batch=4)


def _limits(g, cl, w, opts) -> list[float | None]:  # type: ignore[no-untyped-def]
    mems = sorted(estimate(g, cl, s, w).memory_peak_gib for s in list(space_plans(g, cl, w, opts))[::37])
    # just above a plan's peak: a limit equal to it is a floating-point tie the solvers' safety margin
    # (a plan must fit when re-priced) resolves the other way
    return [mems[len(mems) // 10] * (1 + 1e-9), None]


@pytest.mark.parametrize("space", ["osdp", "hybrid", "staged", "megatron", "fsdp"])
def test_search_equals_exhaustive(setup: tuple, space: str) -> None:
    g, cl, w = setup
    kw = dict(LIMITED, splits=(1,))
    if space == "osdp":  # every sharding, splitting and per-operator ZeRO-3; small models only
        g = load_model(dict(SMALL, layers=2), 1024)
        kw.update(shardings=("replicate", "zero1", "zero3"), recomputes=("none",), splits=(1, 2))
    if space == "fsdp":
        kw.pop("shardings")
    if space in ("hybrid", "staged"):
        kw.update(max_micro_batch_sizes=1, schedules=("1f1b", "zb"))
    if space == "staged":  # inside the stages operators split and sharded apart too
        kw.update(recomputes=("none",), splits=(1, 2))
    opts = SPACES[space].with_(**kw)
    for limit in _limits(g, cl, w, opts):
        best, plan, n = search_space(g, cl, w, opts, limit)
        assert n > 10 and plan is not None
        res = search(g, cl, w, opts, memory_limit_gib=limit)
        assert res.status == "optimal" and res.gap == 0.0
        assert res.objective == pytest.approx(best, rel=1e-9)
        rep = estimate(g, cl, res.best.strategy, w, memory_limit_gib=limit)
        assert rep.fits and rep.step_time_s == pytest.approx(res.objective, rel=1e-12)
        if space == "osdp":  # the DP, mesh by mesh, finds the same optimum
            dev = DeviceModel(cl)
            dps = [
                solve_dp(mesh_problem(g, dev, c, w, opts, limit if limit else cl.memory_bytes / 2**30))
                for c in mesh_configs(g, cl, w, opts)
            ]
            assert min(d.objective for d in dps) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("space", ["hybrid", "staged"])
def test_infeasible_names_memory_and_cause(setup: tuple, space: str) -> None:
    g, cl, w = setup
    opts = SPACES[space].with_(**LIMITED, splits=(1, 2))
    with pytest.raises(ShardplanError) as e:
        search(g, cl, w, opts, memory_limit_gib=2.0)
    msg = str(e.value)
    assert f"no plan in the '{space}' space fits 2.00 GiB" in msg
    assert "smallest per-GPU memory any plan needs is" in msg and "dominated by" in msg
    need = float(msg.split("needs is ")[1].split(" GiB")[0])
    feasible = search(g, cl, w, opts, memory_limit_gib=need + 0.01)
    assert feasible.best.memory_gib <= need + 0.01
    with pytest.raises(ShardplanError):
        search(g, cl, w, opts, memory_limit_gib=need - 0.01)


@pytest.mark.parametrize("space", ["full", "staged"])
def test_time_limit_reports_gap(space: str) -> None:
    g, cl = load_model("llama3-8b", 4096), parse_cluster("64xh100")
    res = search(g, cl, Workload(seq_len=4096, global_batch=256), space, time_limit=0.5)
    assert res.status in ("optimal", "time_limit")
    assert res.bound <= res.objective and (res.status == "optimal") == (res.gap == 0.0)
    assert estimate(g, cl, res.best.strategy, Workload(seq_len=4096, global_batch=256)).fits
    assert np.isfinite(res.objective)


def test_pipeline_three_recompute_options_equal_exhaustive() -> None:
    """Eager attention keeps selective recomputation worth having: three options per block."""
    g = load_model(
        dict(
            SMALL,
            hidden=512,
            layers=3,
            vocab=4096,
            activation="gelu",
            norm="layernorm",
            position="learned",
            bias=True,
            attention_impl="eager",
            dropout=0.1,
        ),
        1024,
    )
    cl, w = parse_cluster("2xh100"), Workload(seq_len=1024, global_batch=4)
    opts = SPACES["hybrid"].with_(
        tp=False,
        cp=False,
        shardings=("replicate",),
        offloads=("none",),
        max_micro_batch_sizes=1,
        schedules=("1f1b", "zb"),
        splits=(1,),
    )
    for limit in _limits(g, cl, w, opts):
        best, _, _ = search_space(g, cl, w, opts, limit)
        res = search(g, cl, w, opts, memory_limit_gib=limit)
        assert res.objective == pytest.approx(best, rel=1e-9) and res.status == "optimal"


def test_infeasible_description_names_every_choice() -> None:
    from solvers.infeasible import _describe
    from vocab.strategy import LayerStrategy, Mesh, Strategy

    g = load_model("llama3-8b", 4096)
    s = Strategy(mesh=Mesh(pp=2, dp_shard=4), micro_batch=2, schedule="1f1b",
                 default=LayerStrategy(sharding="zero2", offload="params", recompute="full"),
                 layers=[LayerStrategy(unit="layers.0", sharding="zero3", offload="params", recompute="full", split=2)])
    text = _describe(s, g)
    assert text == ("pp=2 dp_shard=4, 1f1b, micro-batch 2, zero2 on 33 units, zero3 on 1 units, offload params, "
                    "recompute full, operator splits on 1 units")
    plain = Strategy(mesh=Mesh(dp_shard=8), default=LayerStrategy(sharding="zero3"))
    assert _describe(plain, g) == "dp_shard=8, micro-batch 1, zero3, recompute none"


def test_interleaved_bound_never_exceeds_the_exact_stage_optimum() -> None:
    """The memory-priced bound of interleaved meshes is below (or at) what the stage solver finds,
    infinite only where the solver finds nothing, and tighter than the memory-free bound somewhere."""
    from itertools import product

    from costmodel.vectorized import GridOption, price_grid, unit_classes, unit_names
    from solvers.bounds import MeshRows, grid_bounds, interleaved_lagrange
    from solvers.hybrid import _layout, _view
    from solvers.stage_ilp import solve_layers
    from solvers.stage_tables import Combo
    from solvers.stages import PipelineProblem, solve_pipeline

    g = load_model(dict(SMALL, layers=8), 1024)
    cl, w = parse_cluster("8xh100"), Workload(seq_len=1024, global_batch=16)
    opts = SPACES["hybrid"].with_(schedules=("interleaved",), max_micro_batch_sizes=2, offloads=("none",),
                                  recomputes=("none", "selective", "full"), tp_modes=("megatron",),
                                  cp_modes=("ring",), splits=(1,))
    rows = [c for c in mesh_configs(g, cl, w, opts) if c.pp > 1 and c.vpp > 1]
    assert len(rows) >= 6
    dev = DeviceModel(cl)
    uopts = [GridOption(sh, rc, off) for sh, rc, off in product(opts.shardings, opts.recomputes, opts.offloads)]
    gr = price_grid(g, cl, w, rows, uopts, device=dev)
    layout = _layout(g)
    names, (_, index) = unit_names(g), unit_classes(g)
    block_cls = [k for k, n in zip(index, names, strict=True) if n.startswith("layers.")]
    mems = np.sort(gr.memory_peak_gib.ravel())
    tighter = finite = mixed = 0
    for limit in (mems[len(mems) // 8], mems[len(mems) // 3], mems[-1]):
        for sh in opts.shardings:
            mask = np.array([o.sharding == sh for o in uopts])
            cols = [j for j, o in enumerate(uopts) if o.sharding == sh]
            mr = MeshRows.of(rows, w, dev, limit)
            lb = interleaved_lagrange(gr, mr, dev, layout, block_cls, [mask], np.ones(len(rows), bool))
            free = grid_bounds(gr, mr, dev, layout, mask)
            for i, cfg in enumerate(rows):
                views = {k: [_view(u, i, j) for j in cols] for k, u in enumerate(gr.units)}
                pp = PipelineProblem(g, dev, cfg, w, Combo(sh), opts.recomputes, limit, views)
                sol = solve_pipeline(pp)
                exact = sol.objective if sol is not None else np.inf
                assert lb[i] <= exact * (1 + 1e-9)
                finite += bool(np.isfinite(exact))
                tighter += bool(lb[i] > free[i] * (1 + 1e-6))
        # every unit its own sharding (the staged space): one mask for all, below the MIP's optimum
        mr = MeshRows.of(rows, w, dev, limit)
        every = np.ones(len(uopts), bool)
        lb = interleaved_lagrange(gr, mr, dev, layout, block_cls, [every], np.ones(len(rows), bool))
        free = grid_bounds(gr, mr, dev, layout, every)
        for i, cfg in enumerate(rows):
            qs = [PipelineProblem(g, dev, cfg, w, Combo(sh), opts.recomputes, limit,
                                  {k: [_view(u, i, j) for j, o in enumerate(uopts) if o.sharding == sh]
                                   for k, u in enumerate(gr.units)}) for sh in opts.shardings]
            mix = solve_layers(qs)
            exact = mix.solution.objective if mix.solution is not None else np.inf
            assert lb[i] <= exact * (1 + 1e-9)
            mixed += bool(np.isfinite(exact) and lb[i] > free[i] * (1 + 1e-6))
    assert finite > 10 and tighter > 10 and mixed > 3


def test_pipeline_bound_never_exceeds_the_exact_stage_optimum() -> None:
    """The 1F1B / zero-bubble memory-priced bound stays below the stage solver's optimum."""
    from itertools import product

    from costmodel.vectorized import GridOption, price_grid
    from solvers.bounds import MeshRows, pipeline_lagrange
    from solvers.hybrid import _view
    from solvers.stage_tables import Combo
    from solvers.stages import PipelineProblem, solve_pipeline

    g = load_model(dict(SMALL, layers=6), 1024)
    cl, w = parse_cluster("8xh100"), Workload(seq_len=1024, global_batch=16)
    opts = SPACES["hybrid"].with_(schedules=("1f1b", "zb"), max_micro_batch_sizes=2, offloads=("none", "optimizer"),
                                  tp_modes=("megatron",), cp_modes=("ring",), splits=(1,))
    rows = [c for c in mesh_configs(g, cl, w, opts) if c.pp > 1]
    dev = DeviceModel(cl)
    uopts = [GridOption(sh, rc, off) for sh, rc, off in product(opts.shardings, opts.recomputes, opts.offloads)]
    gr = price_grid(g, cl, w, rows, uopts, device=dev)
    head = gr.unit_index[-1]
    mems = np.sort(gr.memory_peak_gib.ravel())
    finite = bites = 0
    for limit in (mems[len(mems) // 8], mems[len(mems) // 2]):
        mr = MeshRows.of(rows, w, dev, limit)
        for sh, off in product(opts.shardings, opts.offloads):
            cols = [j for j, o in enumerate(uopts) if (o.sharding, o.offload) == (sh, off)]
            mask = np.isin(np.arange(len(uopts)), cols)
            lb = pipeline_lagrange(gr, mr, dev, head, mask, np.ones(len(rows), bool))
            for i, cfg in enumerate(rows):
                views = {k: [_view(u, i, j) for j in cols] for k, u in enumerate(gr.units)}
                sol = solve_pipeline(PipelineProblem(g, dev, cfg, w, Combo(sh, off), opts.recomputes, limit, views))
                exact = sol.objective if sol is not None else np.inf
                assert lb[i] <= exact * (1 + 1e-9)
                finite += bool(np.isfinite(exact))
                bites += bool(np.isinf(lb[i]))
    assert finite > 10 and bites > 0


def test_parameters_are_offloaded_only_under_zero3() -> None:
    """DeepSpeed and FSDP2 offload parameters only where ZeRO-3 shards them: no space yields it
    with another sharding; without a shard group a ZeRO-3 label stands for the replicated unit."""
    from solvers.space import sharding_offloads, unit_options

    for name in ("fsdp", "osdp", "full"):
        for group in (1, 8):
            opts = SPACES[name]
            for sh, off in sharding_offloads(opts, group):
                assert off != "params" or sh in ("zero3", "zero3_keep")
            for sh, _, off, _, mixed in unit_options(opts, group):
                assert off != "params" or (sh in ("zero3", "zero3_keep") and not mixed)
            assert ("params" in opts.offloads) == any(off == "params" for _, off in sharding_offloads(opts, group))
    assert sharding_offloads(SPACES["fsdp"], 1) == [("zero2", "none"), ("zero3", "params")]


def test_time_shared_cores_let_pipeline_bubbles_lend_their_cores() -> None:
    """Ranks sharing a host's cores (CPU clusters): a rank idle in a bubble leaves its cores to the
    others. The estimator, the vectorised grid and the stage solver agree, and the search is still
    exact."""
    from costmodel.pipeline import pipeline_time
    from costmodel.vectorized import compute_bound, price_grid, strategies_grid
    from vocab.strategy import LayerStrategy, Mesh, Strategy

    total, bubble = pipeline_time("1f1b", [1.0, 1.0], 4, share=0.5)  # 4 ranks' worth of work on 2 cores
    assert (total, bubble) == (4.0, 0.0)  # not 0.5 x 5 = 2.5: the node's work, 2 x 4 x 1 s, takes 4 s
    # 0.9: fill and drain (one rank busy) at full speed, 2 x 0.9 s; the plateau's 3 x 0.9 s with both
    # ranks busy on 1.8 ranks' worth of cores at 0.9 of that speed, 3 s
    assert pipeline_time("1f1b", [1.0, 1.0], 4, share=0.9)[0] == pytest.approx(4.8)
    g = load_model(SMALL, 1024)
    cl, w = parse_cluster("4xh100"), Workload(seq_len=1024, global_batch=8)
    dev = DeviceModel(cl)
    dev.share = 0.5
    opts = SPACES["hybrid"].with_(**dict(LIMITED, shardings=("replicate",), splits=(1,), max_micro_batch_sizes=1,
                                         schedules=("1f1b", "zb", "interleaved")))
    strategies = [Strategy(mesh=Mesh(pp=2, dp_shard=2), micro_batch=1, schedule=sch, default=LayerStrategy())
                  for sch in ("1f1b", "zb")]
    configs, options, cells = strategies_grid(strategies)
    gr = price_grid(g, cl, w, configs, options, device=dev)
    lb = compute_bound(g, cl, w, configs, device=dev)
    for s, (i, j) in zip(strategies, cells, strict=True):
        r = estimate(g, cl, s, w, device=dev)
        assert gr.step_time_s[i, j] == pytest.approx(r.step_time_s, rel=1e-9) and lb[i] <= r.step_time_s
        assert r.step_time_s < estimate(g, cl, s, w, device=DeviceModel(cl)).step_time_s / 0.5
    for limit in _limits(g, cl, w, opts):
        best, _, _ = search_space(g, cl, w, opts, limit, device=dev)
        res = search(g, cl, w, opts, memory_limit_gib=limit, device=dev)
        assert res.objective == pytest.approx(best, rel=1e-9) and res.status == "optimal"


def test_runners_up_are_exactly_the_next_best_meshes(setup: tuple) -> None:
    """The search prunes at the (k+1)-th best mesh, so its k alternatives are the k best other
    meshes of the space, each at its optimum — what brute force over every plan finds."""
    from vocab.strategy import MeshConfig

    g, cl, w = setup
    opts = SPACES["hybrid"].with_(**dict(LIMITED, splits=(1,), max_micro_batch_sizes=1, schedules=("1f1b", "zb")))
    k = 3
    dev = DeviceModel(cl)  # one device model: plans priced one after another share their units
    for limit in _limits(g, cl, w, opts):
        per_mesh: dict[MeshConfig, float] = {}
        for s in space_plans(g, cl, w, opts):
            rep = estimate(g, cl, s, w, memory_limit_gib=limit, device=dev)
            if rep.fits:
                m = MeshConfig.of(s)
                per_mesh[m] = min(per_mesh.get(m, np.inf), rep.step_time_s)
        expected = sorted(per_mesh.values())[: k + 1]
        assert len(expected) == k + 1
        res = search(g, cl, w, opts, memory_limit_gib=limit, top_k=k)
        got = [res.objective] + [a.report.step_time_s for a in res.alternatives[:k]]
        assert got == pytest.approx(expected, rel=1e-9)
        assert len({MeshConfig.of(a.strategy) for a in res.alternatives[:k]} | {MeshConfig.of(res.best.strategy)}) == k + 1


def test_a_narrowed_space_and_a_cutoff_search_exactly_what_they_keep() -> None:
    """``max_axes`` keeps the meshes of at most that many degrees above one; a search narrowed so
    equals the brute force over those meshes, and a ``cutoff`` at or below its optimum finds nothing."""
    g, cl = load_model(dict(SMALL, layers=2), 1024), parse_cluster("4xh100")
    w = Workload(seq_len=1024, global_batch=4)
    opts = SPACES["hybrid"].with_(**{**LIMITED, "max_micro_batch_sizes": 1, "recomputes": ("none",)},
                                  schedules=("1f1b",), pp=False, cp=False)
    every = list(mesh_configs(g, cl, w, opts))
    one = list(mesh_configs(g, cl, w, opts.with_(max_axes=1)))
    axes = [sum(d > 1 for d in (c.pp, c.dp_replicate, c.dp_shard, c.cp, c.tp, c.ep)) for c in every]
    assert max(axes) > 1 and one == [c for c, a in zip(every, axes, strict=True) if a <= 1]
    narrow = opts.with_(max_axes=1)
    best, _, _ = search_space(g, cl, w, narrow, None)
    res = search(g, cl, w, narrow, top_k=1)
    assert res.objective == pytest.approx(best, rel=1e-9)
    assert search(g, cl, w, narrow, top_k=1, controls=SearchControls(cutoff=best * 1.01)).objective == pytest.approx(best, rel=1e-9)
    with pytest.raises(ShardplanError, match="faster than"):
        search(g, cl, w, narrow, top_k=1, controls=SearchControls(cutoff=best))
