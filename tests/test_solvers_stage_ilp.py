"""Per-layer sharding inside pipeline stages (the ``staged`` space): the MIP against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.models import load_model
from solvers.exhaustive import space_plans
from solvers.space import SPACES, mesh_configs, operator_options
from solvers.stage_bound import mixed_bound
from solvers.stage_ilp import solve_layers
from solvers.stage_tables import Combo
from solvers.stages import PipelineProblem, pipeline_strategy, solve_pipeline
from vocab.strategy import Workload

BASE = {"name": "small", "hidden": 4096, "heads": 16, "vocab": 32000, "max_seq": 512}


def _instance(schedule: str, shardings: tuple = ("zero1", "zero2"), recomputes: tuple = ("none", "full"),
              splits: tuple = (1,), **model: object) -> tuple:
    """A 2-stage mesh of a small model and every plan of it (brute force, priced)."""
    layers = 4 if schedule == "interleaved" else 3
    g = load_model({**BASE, "layers": layers, **model}, 512)
    cl, w = parse_cluster("4xh100"), Workload(seq_len=512, global_batch=32)
    opts = SPACES["staged"].with_(tp=False, cp=False, ep=False, dp_replicate=False, shardings=shardings,
                                  recomputes=recomputes, offloads=("none",), max_micro_batch_sizes=1,
                                  schedules=(schedule,), splits=splits)
    cfg = next(c for c in mesh_configs(g, cl, w, opts) if c.pp == 2 and c.schedule == schedule)
    dev = DeviceModel(cl)
    plans = [s for s in space_plans(g, cl, w, opts) if s.mesh == cfg.strategy().mesh and s.schedule == schedule]
    reps = [estimate(g, cl, s, w, device=dev) for s in plans]
    return g, cl, w, opts, cfg, dev, plans, reps


def _problems(g, dev, cfg, w, opts, limit: float) -> list[PipelineProblem]:  # type: ignore[no-untyped-def]
    """One problem per (sharding, offload) and per operator option (split, ZeRO-3 on large operators)."""
    return [PipelineProblem(g, dev, cfg, w, Combo(sh), opts.recomputes, limit) for sh in opts.shardings] + [
        PipelineProblem(g, dev, cfg, w, Combo(sh, off, k, mx), opts.recomputes, limit)
        for sh, off, k, mx in operator_options(opts, cfg.dp_shard * cfg.cp)]


def _per_stage(s, g) -> bool:  # type: ignore[no-untyped-def]
    """Every rank's units share one (sharding, offload), none splits or shards its operators apart."""
    from costmodel.estimate import stage_units

    if any(ls.split > 1 or ls.unit.count(".") > 1 for ls in s.layers):
        return False
    pairs = {(ls.unit, (ls.sharding, ls.offload)) for ls in s.layers}
    by_unit = dict(pairs)
    per_rank: dict[int, set] = {}
    for k, units in enumerate(stage_units(g, s)):
        per_rank.setdefault(k % s.mesh.pp, set()).update(by_unit[n] for n, _ in units)
    return all(len(v) == 1 for v in per_rank.values())


def _check(g, cl, w, opts, cfg, dev, reps, limits, tied=False) -> None:  # type: ignore[no-untyped-def]
    for limit in limits:
        best = min((r.step_time_s for r in reps if r.memory_peak_gib <= limit), default=np.inf)
        qs = _problems(g, dev, cfg, w, opts, limit)
        assert mixed_bound(qs) <= best * (1 + 1e-9)  # the search's bound before each MIP
        mix = solve_layers(qs, tied=tied)
        if not np.isfinite(best):
            assert mix.solution is None
            continue
        assert mix.status == "optimal" and mix.solution is not None
        assert mix.solution.objective == pytest.approx(best, rel=1e-9)
        assert mix.bound == pytest.approx(best, rel=1e-3)  # the MIP's own objective, not only its plan re-priced
        rep = estimate(g, cl, pipeline_strategy(g, cfg, mix.solution), w, memory_limit_gib=limit, device=dev)
        assert rep.fits and rep.step_time_s == pytest.approx(mix.solution.objective, rel=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved"])
def test_layers_inside_stages_match_brute_force(schedule: str) -> None:
    """Every unit its own (sharding, recompute) and the stage boundaries: the MIP finds brute
    force's optimum at limits just above every few plans' peaks, and somewhere a stage that mixes
    shardings beats every plan whose stages each keep one (the per-stage DP's space)."""
    g, cl, w, opts, cfg, dev, plans, reps = _instance(schedule)
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})
    staged = [_per_stage(s, g) for s in plans]
    mixed_wins = []
    for limit in limits:
        fit = [(r.step_time_s, st) for r, st in zip(reps, staged, strict=True) if r.memory_peak_gib <= limit]
        if min(t for t, _ in fit) < min((t for t, st in fit if st), default=np.inf) * (1 - 1e-9):
            mixed_wins.append(limit)
    assert mixed_wins
    _check(g, cl, w, opts, cfg, dev, reps, mixed_wins[:3] + limits[::max(1, len(limits) // 10)] + [limits[0] * 0.9])
    # the bound that spares most MIPs is close, not just valid: within 15% at most limits (its
    # relaxation keeps the blocks' least transient, not each option's: with gradients accumulating
    # in a pipeline a replicated block's largest new gradient is one)
    ratios = [mixed_bound(_problems(g, dev, cfg, w, opts, x))
              / min(r.step_time_s for r in reps if r.memory_peak_gib <= x) for x in limits[::max(1, len(limits) // 10)]]
    assert np.median(ratios) >= 0.85, ratios
    # the DP over stages that each keep one pair is the MIP restricted to those plans
    for limit in mixed_wins[:2] + limits[::max(1, len(limits) // 6)]:
        sol = solve_pipeline([PipelineProblem(g, dev, cfg, w, Combo(sh), opts.recomputes, limit)
                              for sh in opts.shardings])
        best = min((r.step_time_s for r, st in zip(reps, staged, strict=True) if st and r.memory_peak_gib <= limit),
                   default=np.inf)
        assert (sol.objective if sol else np.inf) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved"])
def test_time_shared_cores_match_brute_force(schedule: str) -> None:
    """Ranks time-sharing cores (CPU hosts): the MIP's linearised stretch of the fill, drain and
    plateau (:func:`costmodel.pipeline.time_shared`) is the estimator's, optimum for optimum, and
    the search's bound stays below it."""
    g, cl, w, opts, cfg, _, plans, _ = _instance(schedule)
    dev = DeviceModel(cl)
    dev.share = 0.75  # 1.5 ranks' worth of cores per pipeline: fill and drain at full speed, plateau not
    reps = [estimate(g, cl, s, w, device=dev) for s in plans]
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})
    _check(g, cl, w, opts, cfg, dev, reps, limits[::max(1, len(limits) // 6)] + [limits[0] * 0.9])


def test_tied_head_and_embedding_stay_alike() -> None:
    """A head tied to the embedding takes the embedding's sharding; the blocks still mix."""
    g, cl, w, opts, cfg, dev, plans, reps = _instance("1f1b", tied_embeddings=True)
    assert all(len({ls.sharding for ls in s.layers if ls.unit in ("embedding", "head")}) == 1 for s in plans)
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})
    _check(g, cl, w, opts, cfg, dev, reps, limits[::max(1, len(limits) // 12)], tied=True)
    sol = solve_layers(_problems(g, dev, cfg, w, opts, limits[len(limits) // 3]), tied=True).solution
    assert sol is not None and sol.combos is not None and sol.combos[0] == sol.combos[-1]


def test_several_block_classes_place_boundaries_exactly() -> None:
    """A dense first block before MoE blocks: which classes a stage holds follows from where its
    boundaries fall (the MIP places each block), and the optimum is brute force's."""
    g, cl, w, opts, cfg, dev, plans, reps = _instance("1f1b", experts=4, top_k=2, moe_ffn_hidden=2048,
                                                     dense_layers=1)
    assert not PipelineProblem(g, dev, cfg, w, Combo("zero1"), opts.recomputes, 80.0).single
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})
    _check(g, cl, w, opts, cfg, dev, reps, limits[::max(1, len(limits) // 8)])


def test_cutoff_and_infeasible() -> None:
    """Nothing better than the incumbent: status ``cutoff`` and no plan; no plan fits: ``infeasible``."""
    g, cl, w, opts, cfg, dev, plans, reps = _instance("1f1b")
    limit = max(r.memory_peak_gib for r in reps)
    qs = _problems(g, dev, cfg, w, opts, limit)
    best = solve_layers(qs)
    assert best.solution is not None
    again = solve_layers(qs, incumbent=best.solution.objective)
    assert again.solution is None and again.status == "cutoff"
    assert solve_layers(_problems(g, dev, cfg, w, opts, 0.5)).status == "infeasible"


def test_operators_split_and_sharded_apart_inside_stages() -> None:
    """OSDP's operator options inside the stages: a unit's large operators split into slices under
    ZeRO-3, or under ZeRO-3 while the rest of the unit keeps ZeRO-1; brute force agrees, and
    somewhere the best plan uses one of them."""
    g, cl, w, opts, cfg, dev, plans, reps = _instance("1f1b", shardings=("zero1", "zero3"), recomputes=("none",),
                                                     splits=(1, 2))
    limits = sorted({r.memory_peak_gib * (1 + 1e-6) for r in reps})
    _check(g, cl, w, opts, cfg, dev, reps, limits[::max(1, len(limits) // 12)])
    used = set()
    for limit in limits[::max(1, len(limits) // 40)]:
        sol = solve_layers(_problems(g, dev, cfg, w, opts, limit)).solution
        used |= set(sol.operators or []) if sol is not None else set()
    assert used - {(1, False)}


def test_best_splits_is_brute_force_over_contiguous_splits() -> None:
    """Every entry a split reaches (ranks k.. holding blocks j.. with j >= k) is the least sum or
    maximum over the contiguous splits that give each rank at least one block, brute-forced."""
    from itertools import combinations

    from solvers.stage_tables import best_splits

    rng = np.random.default_rng(1)
    for _ in range(200):
        p = int(rng.integers(1, 5))
        L = int(rng.integers(p, 9))
        t = rng.uniform(0.1, 5.0, size=(p, L + 1))
        t[:, 0] = np.inf
        for r in range(p):  # some ranks fit only so many blocks
            if rng.random() < 0.4:
                t[r, int(rng.integers(1, L + 1)) + 1:] = np.inf
        for join, reduce in ((np.add, sum), (np.maximum, max)):
            got = best_splits(t, join)
            for k in range(p):
                for j in range(k, L + 1):
                    best = np.inf
                    for cuts in combinations(range(j + 1, L), p - k - 1):
                        sizes = np.diff([j, *cuts, L])
                        best = min(best, reduce(t[k + i, n] for i, n in enumerate(sizes)))
                    assert got[k, j] == pytest.approx(best) if np.isfinite(best) else got[k, j] == np.inf
