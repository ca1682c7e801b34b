"""Brute force, for tests: every choice of a chain, every plan of a (small) search space."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

import numpy as np

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from profiler.graph import LayerGraph
from profiler.hardware import Cluster
from solvers.chain import ChainProblem, ChainSolution, option_allowed, option_strategy
from solvers.space import SpaceOptions, mesh_configs, pipeline_combos, sharding_offloads, unit_options
from vocab.strategy import LayerStrategy, Strategy, Workload


def solve_chain(prob: ChainProblem) -> ChainSolution:
    """The optimum of a chain problem by trying every choice (units × options must be tiny)."""
    best: tuple[float, list[int]] | None = None
    for choice in product(*(range(len(prob.unit_options(i))) for i in range(prob.units))):
        if not prob.fits(choice):
            continue
        obj = prob.objective(choice)
        if best is None or obj < best[0]:
            best = (obj, list(choice))
    if best is None:
        return ChainSolution(None, np.inf, np.inf, "infeasible")
    return ChainSolution(best[1], best[0], best[0], "optimal")


def compositions(total: int, parts: int) -> list[list[int]]:
    """Every way to split ``total`` blocks into ``parts`` stages of at least one block."""
    if parts == 1:
        return [[total]] if total >= 1 else []
    return [[n] + rest for n in range(1, total - parts + 2) for rest in compositions(total - n, parts - 1)]


def space_plans(graph: LayerGraph, cluster: Cluster, w: Workload, opts: SpaceOptions) -> Iterator[Strategy]:
    """Every plan of a search space, as :mod:`solvers.hybrid` defines it (tiny models only)."""
    names = [n for n, _ in graph.blocks()]
    units = list(graph.blocks())
    for cfg in mesh_configs(graph, cluster, w, opts):
        shard_group = cfg.shard
        if not opts.per_layer:
            for (sh, off), rc in product(sharding_offloads(opts, shard_group), opts.recomputes):
                ls = LayerStrategy(sharding=sh, recompute=rc, offload=off)  # type: ignore[arg-type]
                yield cfg.strategy(default=ls)
        elif cfg.pp == 1 or opts.mix_stages:  # every unit its own option (and, piped, the boundaries)
            keys = list(unit_options(opts, shard_group))
            per_unit = [
                [k for k in keys if option_allowed(nodes, k)] for _, nodes in units
            ]
            layouts: list[list[int] | None] = [None]
            if cfg.pp > 1 and opts.stage_boundaries and cfg.vpp == 1:
                layouts = compositions(graph.num_blocks, cfg.pp)  # type: ignore[assignment]
            tied = bool(graph.config.get("tied_embeddings")) and names[0] == "embedding" and names[-1] == "head"
            for choice, layout in product(product(*per_unit), layouts):
                if cfg.pp > 1 and tied and _operators(choice[0]) != _operators(choice[-1]):
                    continue  # a head tied to the embedding is sharded alike
                layers = [
                    e
                    for (name, nodes), key in zip(units, choice, strict=True)
                    for e in option_strategy(name, nodes, key)
                ]
                yield cfg.strategy(layers=layers, stage_layers=layout)
        else:
            layouts = [None]
            if opts.stage_boundaries and cfg.vpp == 1:
                layouts = compositions(graph.num_blocks, cfg.pp)  # type: ignore[assignment]
            for (pair,), layout in product(list(pipeline_combos(graph, cfg, opts)), layouts):
                for rcs in product(opts.recomputes, repeat=len(names)):
                    layers = [LayerStrategy(unit=n, sharding=pair[0], recompute=rc, offload=pair[1])  # type: ignore[arg-type]
                              for n, rc in zip(names, rcs, strict=True)]
                    yield cfg.strategy(default=LayerStrategy(), layers=layers, stage_layers=layout)


def _operators(key: tuple) -> tuple:
    """A unit option without its recomputation: (sharding, offload, split, mixed)."""
    return key[0], key[2], key[3], key[4]


def search_space(
    graph: LayerGraph,
    cluster: Cluster,
    w: Workload,
    opts: SpaceOptions,
    memory_limit_gib: float | None = None,
    device: DeviceModel | None = None,
) -> tuple[float, Strategy | None, int]:
    """(least step time of a plan that fits, that plan, plans tried) by pricing every plan."""
    dev = device or DeviceModel(cluster)
    best: tuple[float, Strategy | None] = (np.inf, None)
    n = 0
    for s in space_plans(graph, cluster, w, opts):
        n += 1
        rep = estimate(graph, cluster, s, w, memory_limit_gib=memory_limit_gib, device=dev)
        if rep.fits and rep.step_time_s < best[0]:
            best = (rep.step_time_s, s)
    return best[0], best[1], n
