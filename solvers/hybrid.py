"""The search: mesh enumeration, uniform plans priced at once, then the exact per-mesh solvers.

1. Every mesh configuration of the space (:func:`solvers.space.mesh_configs`) gets a lower bound
   (:func:`costmodel.vectorized.compute_bound`: compute and the TP/CP/EP traffic no option
   hides); in increasing order of it, the
   configurations are priced with every uniform layer strategy at once
   (:func:`costmodel.vectorized.price_grid`) until the bound reaches the best plan so far.
2. Spaces with per-layer choices then solve each configuration exactly, in increasing order of a
   tighter bound (every unit at its fastest option, stages balanced, the memory limit priced by a
   Lagrange multiplier), until that
   bound reaches the incumbent: without a pipeline the OSDP chain (:mod:`solvers.osdp_ilp`), with
   one the stage DP of each uniform (sharding, offload) (:mod:`solvers.stages`), or, in the
   ``staged`` space, a MIP where every unit inside the stages takes its own sharding, offload and
   recomputation (:mod:`solvers.stage_ilp`). The bounds are in
   :mod:`solvers.bounds`.
3. The best plans are re-priced by :func:`costmodel.estimate.estimate` and returned with the
   runners-up and a throughput/memory Pareto frontier.

Nothing is pruned that could beat the incumbent, so without a time limit the result is the
optimum of the space. With one, whatever remains unsolved caps the proven bound.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from costmodel.device import DeviceModel
from costmodel.estimate import estimate
from costmodel.report import GIB
from costmodel.vectorized import (
    GridOption,
    GridReport,
    block_classes,
    compute_bound,
    price_grid,
    unit_classes,
    unit_names,
)
from profiler.graph import LayerGraph
from profiler.hardware import Cluster
from solvers.bounds import (
    MeshRows,
    flat_lagrange,
    grid_bounds,
    interleaved_lagrange,
    pipeline_lagrange,
    sub_grid,
)
from solvers.chain import chain_strategy, large_ops, mesh_problems
from solvers.mip import DEFAULT_SOLVER, HINTED
from solvers.osdp_ilp import solve_ilp
from solvers.result import Found, SearchResult, family_of, proven_bound
from solvers.space import (
    MeshConfig,
    SpaceOptions,
    blocks_recompute,
    for_device,
    grid_mask,
    grid_options,
    mesh_list,
    operator_options,
    pipeline_combos,
    space_options,
)
from solvers.stage_bound import mixed_bound
from solvers.stage_ilp import solve_layers
from solvers.stage_tables import Combo
from solvers.stages import PipelineProblem, UnitView, pipeline_strategy, solve_pipeline
from vocab.errors import ShardplanError
from vocab.strategy import Strategy, Workload

Progress = Callable[[str, int, int], None]
CHUNK = 4096
PARETO_POINTS = 8
#: meshes without a pipeline whose per-layer problems are priced in one call: the one due and the
#: next ones the incumbent does not yet prune (a few may be pruned by the time they are due)
CHAIN_BATCH = 16


class _Pool:
    """The best plan seen of each mesh configuration (objective, key, lazy strategy, solver).

    ``best`` is the incumbent; ``cut`` the objective of the ``keep + 1``-th best mesh so far: the
    search prunes at ``cut``, not at ``best``, so that the ``keep`` runners-up it returns are
    exactly the next best meshes of the space (each at its optimum), not merely the best found.
    Keys are ``(kind, configuration index, ...)``."""

    def __init__(self, keep: int, cut: float = np.inf):
        self.keep = keep
        self.by_mesh: dict[int, tuple[float, tuple, Callable[[], Strategy], str]] = {}
        self.best = np.inf
        self.limit = self.cut = cut  # nothing at or above ``limit`` is wanted

    def add(self, obj: float, key: tuple, build: Callable[[], Strategy], solver: str) -> None:
        mesh = key[1]
        old = self.by_mesh.get(mesh)
        if old is not None and (old[0], old[1]) <= (obj, key):
            return
        self.by_mesh[mesh] = (obj, key, build, solver)
        self.best = min(self.best, obj)
        if len(self.by_mesh) > self.keep:
            self.cut = min(self.limit, heapq.nsmallest(self.keep + 1, (v[0] for v in self.by_mesh.values()))[-1])
            if len(self.by_mesh) > 4 * self.keep + 16:  # forget meshes that can no longer place
                for m in [m for m, v in self.by_mesh.items() if v[0] > self.cut]:
                    del self.by_mesh[m]

    def ranked(self) -> list[tuple[float, tuple, Callable[[], Strategy], str]]:
        return sorted(self.by_mesh.values(), key=lambda x: (x[0], x[1]))


@dataclass(frozen=True)
class SearchControls:
    """How :func:`search` runs beyond its time limit and runners-up: ``cutoff`` (seconds: no plan
    slower than it is searched, and none faster is an error), ``solver`` (the back-end of the
    per-layer MIPs, :data:`solvers.mip.SOLVERS`) and ``frontier_plans`` (also return the
    throughput/memory frontier's plans among the alternatives, for the Pareto plot)."""

    cutoff: float | None = None
    solver: str = DEFAULT_SOLVER
    frontier_plans: bool = True


def search(graph: LayerGraph, cluster: Cluster, w: Workload, space: str | SpaceOptions = "full",
           memory_limit_gib: float | None = None, device: DeviceModel | None = None,
           time_limit: float | None = None, top_k: int = 5, progress: Progress | None = None,
           controls: SearchControls | None = None) -> SearchResult:
    """The fastest plan of ``space`` that fits ``memory_limit_gib`` per GPU (the GPU's memory by
    default). Raises :class:`ShardplanError` when no plan fits (see :mod:`solvers.infeasible`), or,
    given a ``controls.cutoff``, when no plan is faster than that (what is slower is not searched)."""
    t0 = time.perf_counter()
    opts = for_device(space if isinstance(space, SpaceOptions) else space_options(space), cluster.accelerator.kind)
    limit = memory_limit_gib if memory_limit_gib is not None else cluster.memory_bytes / GIB
    if limit <= 0:
        raise ShardplanError(f"memory limit must be positive, got {limit} GiB")
    run = _Search(graph, cluster, w, opts, device or DeviceModel(cluster), limit,
                  (time_limit, top_k, progress), controls or SearchControls(), t0)
    run.price_uniform()
    run.solve_per_layer()
    return run.result()


class _Search:
    """One search's state: the space, the incumbents (:class:`_Pool`), the priced grids (parts),
    the throughput/memory frontier and what is left unproven."""

    def __init__(self, graph: LayerGraph, cluster: Cluster, w: Workload, opts: SpaceOptions, dev: DeviceModel,
                 limit: float, how: tuple[float | None, int, Progress | None], controls: SearchControls, t0: float):
        self.graph, self.cluster, self.w, self.opts, self.dev, self.limit = graph, cluster, w, opts, dev, limit
        self.time_limit, self.top_k, self.progress = how
        self.controls, self.t0 = controls, t0
        self.configs = mesh_list(graph, cluster, w, opts)
        if not self.configs:
            raise ShardplanError(
                f"no mesh of the '{opts.name}' space is valid for {cluster.world_size} GPUs, global batch "
                f"{w.global_batch} and seq_len {w.seq_len}: the global batch must be divisible by the "
                f"data-parallel degree (and seq_len by 2*cp)")
        self.uopts, self.lopts = grid_options(opts)  # lopts: for the bounds of meshes without a pipeline
        self.col = {o: j for j, o in enumerate(self.uopts)}  # grid columns of the options
        self.lcol = {o: j for j, o in enumerate(self.lopts)}
        self.units = unit_names(graph) if opts.recompute_blocks_only else []  # grid plans recompute blocks only
        self.pool = _Pool(max(self.top_k, 1), np.inf if controls.cutoff is None else controls.cutoff)
        self.parts: list[Part] = []
        self.frontier: list[tuple[float, float, int, int, int]] = []  # (memory, step, part, i, j)
        self.priced, self.timed_out = 0, False
        self.bound_left: list[float] = []
        self.memo: dict[tuple, Any] = {}  # pipeline sub-problems solved, by signature
        self.chains: dict[MeshConfig, Any] = {}  # per-layer problems of meshes without a pipeline, priced ahead

    def out_of_time(self) -> bool:
        return self.time_limit is not None and time.perf_counter() - self.t0 > self.time_limit

    def price_uniform(self) -> None:
        """Step 1: the configurations in increasing order of their compute bound, priced with every
        uniform layer strategy a chunk at a time, until the bound reaches the pool's cut."""
        lb0 = compute_bound(self.graph, self.cluster, self.w, self.configs, device=self.dev)
        order = np.argsort(lb0, kind="stable")
        pruned_at = len(order)
        for start in range(0, len(order), CHUNK):
            chunk = order[start:start + CHUNK]
            if start and self.out_of_time():
                pruned_at, self.timed_out = start, True
                break
            live = chunk[lb0[chunk] < self.pool.cut]
            if not len(live):
                pruned_at = start
                break
            self._price_chunk(live)
            if self.progress:
                self.progress("pricing uniform plans", min(start + CHUNK, len(order)), len(order))
        self.bound_left = [float(lb0[order[pruned_at]])] if pruned_at < len(order) else []

    def _price_chunk(self, live: np.ndarray) -> None:
        """Price the configurations ``live`` (indices) with every uniform option, and the large-operator
        options where the bounds need them; the best cells join the pool, all the frontier."""
        opts, uopts = self.opts, self.uopts
        rows = [self.configs[i] for i in live]
        gr = price_grid(self.graph, self.cluster, self.w, rows, uopts, memory_limit_gib=self.limit, device=self.dev,
                        large_ops=large_ops, recompute_blocks_only=opts.recompute_blocks_only)
        self.priced += gr.size
        mask = grid_mask(rows, uopts, opts)
        step = np.where(gr.fits if mask is None else gr.fits & mask, gr.step_time_s, np.inf)
        part = len(self.parts)
        # the large-operator options bound the per-operator choices: of meshes without a pipeline,
        # and in the staged space of pipelines too
        large_rows = [self.configs[i] for i in live if self.configs[i].pp == 1 or opts.mix_stages]
        gl = price_grid(self.graph, self.cluster, self.w, large_rows, self.lopts, memory_limit_gib=self.limit,
                        device=self.dev, large_ops=large_ops) if (large_rows and self.lopts) else None
        self.parts.append((live, gr, gl))
        # the pool keeps one plan per configuration: each row's best fitting option (the first of
        # equal ones), then the rows that can place among the best keep + 1 meshes. (The best cells
        # of the whole grid are often options of one mesh, which left the pool a mesh or two short.)
        if step.shape[1]:
            cols = np.argmin(step, axis=1)
            best = step[np.arange(len(live)), cols]
            for i in np.argsort(best, kind="stable")[:self.pool.keep + 1]:
                if np.isfinite(best[i]):
                    j = int(cols[i])
                    self.pool.add(float(best[i]), (0, int(live[i]), j), _grid_builder(gr, int(i), j, self.units),
                                  "grid")
        self.frontier = _pareto(self.frontier + _chunk_frontier(gr.memory_peak_gib, step, part))

    def solve_per_layer(self) -> None:
        """Step 2: spaces with per-layer choices solve each configuration exactly, in increasing order
        of its bound, until the bound reaches the pool's cut."""
        if not self.opts.per_layer:
            return
        items = _items(self.graph, self.parts, self.configs, self.opts, self.uopts, self.w, self.dev,
                       _layout(self.graph), self.limit, self.pool.cut)
        for n, (lb, key, part, i, sub) in enumerate(items):
            if lb >= self.pool.cut:
                break
            if self.out_of_time():
                self.timed_out = True
                self.bound_left.append(lb)
                break
            cfg = self.configs[int(self.parts[part][0][i])]
            left = None if self.time_limit is None else max(self.time_limit - (time.perf_counter() - self.t0), 0.05)
            if sub is None:
                self._solve_chain(items[n:n + 4 * CHAIN_BATCH], key, (part, i), cfg, left)
            else:
                self._solve_pipeline(key, (part, i), sub, cfg, left)
            if self.progress and n % 8 == 0:
                self.progress("solving per-layer plans", n + 1, len(items))

    def _solve_chain(self, ahead: list[tuple], key: tuple, at: tuple[int, int], cfg: MeshConfig,
                     left: float | None) -> None:
        """A mesh without a pipeline: its OSDP chain (priced with the next ones of ``ahead`` still in reach)."""
        part, i = at
        if cfg not in self.chains:  # this mesh and the next ones still in reach, priced together
            due = [self.configs[int(self.parts[pt][0][ii])] for lb2, _, pt, ii, sb in ahead
                   if sb is None and lb2 < self.pool.cut][:CHAIN_BATCH]
            self.chains.update(zip(due, mesh_problems(self.graph, self.dev, due, self.w, self.opts, self.limit),
                                   strict=True))
        prob = self.chains.pop(cfg)
        self.priced += sum(len(o) for o in prob.options)
        solver = self.controls.solver
        sol = solve_ilp(prob, time_limit=left, cutoff=self.pool.cut, solver=solver,
                        hint=_grid_hint(self.parts[part][1], i, self.uopts) if solver in HINTED else None)
        if sol.status == "time_limit":
            self.bound_left.append(sol.bound)
            self.timed_out = True
        if sol.choice is not None:
            self.pool.add(sol.objective, (1,) + key, _chain_builder(self.graph, cfg, prob, sol.choice), "ilp")

    def _solve_pipeline(self, key: tuple, at: tuple[int, int], sub: tuple, cfg: MeshConfig, left: float | None) -> None:
        """A pipeline mesh whose stages choose among the (sharding, offload) pairs ``sub``: solved
        once per signature (another mesh with the same costs has the same optimum)."""
        opts, part, i = self.opts, *at
        gr, gl = self.parts[part][1], self.parts[part][2]
        js = [[self.col[GridOption(sh, rc, off)] for rc in opts.recomputes] for sh, off in sub]
        # inside the stages of the staged space: OSDP's operator options too (mesh-specific)
        ops = operator_options(opts, cfg.shard) if opts.mix_stages else []
        sig = (sub, cfg if ops else None) + _signature(gr, i, [j for pair in js for j in pair], cfg, self.w,
                                                       self.dev, self.limit)
        if sig in self.memo:  # an identical problem (another mesh with the same costs) was solved
            psol = self.memo[sig]
        else:
            qs = self._problems(at, sub, js, ops, cfg)
            splits = [PipelineProblem.lazy(self.graph, self.dev, cfg, self.w, Combo(sh, off, k, mx), opts.recomputes,
                                           self.limit) for sh, off, k, mx in ops if k > 1 or gl is None]
            stopped = len(self.bound_left)
            psol = self.memo[sig] = _solve_stages(qs, splits, self.pool.cut, opts, self.graph, left, self.bound_left,
                                                  self.controls.solver)
            self.timed_out = self.timed_out or len(self.bound_left) > stopped  # a MIP stopped by the time limit
        if psol is not None:
            self.pool.add(psol.objective, (1,) + key, _pipe_builder(self.graph, cfg, psol),
                          "stage_ilp" if opts.mix_stages else "stages")

    def _problems(self, at: tuple[int, int], sub: tuple, js: list[list[int]], ops: list[tuple],
                  cfg: MeshConfig) -> list[PipelineProblem]:
        """The pipeline problems of grid row ``at`` priced on the grid: one per (sharding, offload) of
        ``sub`` (grid columns ``js``), and the operator options ``ops`` whose large operators take
        ZeRO-3 (priced on the large-operator grid)."""
        (part, i), opts = at, self.opts
        gr, gl = self.parts[part][1], self.parts[part][2]
        qs = []
        for (sh, off), pair in zip(sub, js, strict=True):
            views = {k: [_view(u, i, j) for j in pair] for k, u in enumerate(gr.units)}
            qs.append(PipelineProblem(self.graph, self.dev, cfg, self.w, Combo(sh, off), opts.recomputes, self.limit,
                                      views))
        for sh, off, k, _ in ops:  # k == 1: large operators under ZeRO-3, priced on the grid
            if k == 1 and gl is not None:
                lj = [self.lcol[GridOption(sh, rc, off, large=True)] for rc in opts.recomputes]
                views = {c: [_view(u, i, j) for j in lj] for c, u in enumerate(gl.units)}
                qs.append(PipelineProblem(self.graph, self.dev, cfg, self.w, Combo(sh, off, mixed=True),
                                          opts.recomputes, self.limit, views))
        return qs

    def result(self) -> SearchResult:
        """Step 3: the best plans re-priced, the runners-up and the frontier, the proven bound."""
        opts, pool, cutoff = self.opts, self.pool, self.controls.cutoff
        if cutoff is not None and not pool.best < cutoff:
            raise ShardplanError(f"no plan of the '{opts.name}' space is faster than {cutoff:.4g} s")
        if not np.isfinite(pool.best):
            from solvers.infeasible import explain

            raise explain(self.graph, self.cluster, self.w, opts, self.limit, self.dev, self.configs)
        frontier = self.frontier if self.controls.frontier_plans else []
        (best, best_solver), alternatives = _materialise(self.graph, self.cluster, self.w, pool, frontier, self.parts,
                                                         self.limit, self.dev, self.top_k, self.units)
        objective = best.step_time_s
        bound = proven_bound(objective, self.bound_left)
        optimal = bound is not None and bound >= objective * (1 - 1e-12)
        status = "optimal" if optimal else ("time_limit" if self.timed_out else "feasible")
        if status == "optimal":
            bound = objective
        return SearchResult(best=best, objective=objective, bound=bound, status=status, space=opts.name,
                            solver=best_solver, candidates=self.priced,
                            time_s=time.perf_counter() - self.t0, alternatives=alternatives,
                            options={"configurations": len(self.configs), "global_batch": self.w.global_batch,
                                     "configurations_priced": int(sum(len(p[0]) for p in self.parts)),
                                     "memory_limit_gib": self.limit})


def _solve_stages(qs: list[PipelineProblem], splits: list[Callable[[], PipelineProblem]], cut: float,
                  opts: SpaceOptions, graph: LayerGraph, left: float | None, bound_left: list[float],
                  solver: str = DEFAULT_SOLVER) -> Any:
    """One pipeline mesh: the stage DP of its one (sharding, offload), or with ``mix_stages`` the
    MIP where every unit takes its own (:mod:`solvers.stage_ilp`); a MIP stopped by the time limit
    leaves its bound.

    ``splits`` price the options that split large operators (unit by unit, slowly) only when the
    MIP without them but with no gathered ZeRO-3 parameters at all — a relaxation of both MIPs:
    splitting only shrinks the gathered slices and adds time — finds a plan better than ``cut``."""
    if not opts.mix_stages:
        return solve_pipeline(qs, cut, opts.stage_boundaries)
    tied = bool(graph.config.get("tied_embeddings"))
    if mixed_bound(qs, opts.stage_boundaries) >= cut:  # holds for the split options too
        return None
    if splits:  # the relaxation also bounds the MIP without them
        relaxed = solve_layers([q.relaxed() for q in qs], cut, opts.stage_boundaries, tied, left, solver)
        if relaxed.solution is None and relaxed.status != "time_limit":
            return None
        qs = qs + [make() for make in splits]
    mix = solve_layers(qs, cut, opts.stage_boundaries, tied, left, solver)
    if mix.status == "time_limit":
        bound_left.append(mix.bound)
    return mix.solution


def _grid_hint(gr: GridReport, i: int, uopts: list[GridOption]) -> list[tuple]:
    """The chain options of mesh ``i``'s best uniform plan of the grid, the warm start of its MIP:
    every unit under its (sharding, recomputation, offload); units outside the blocks recompute
    nothing where the target checkpoints blocks only."""
    step = np.where(gr.fits[i], gr.step_time_s[i], np.inf)
    if not np.isfinite(step).any():
        return []
    o = uopts[int(np.argmin(step))]
    return [(o.sharding, o.recompute, o.offload, 1, False), (o.sharding, "none", o.offload, 1, False)]


def _layout(graph: LayerGraph) -> tuple:
    """(embedding class, the block class when all blocks are alike, head class, blocks)."""
    _, index = unit_classes(graph)
    names = unit_names(graph)
    blocks = set(block_classes(graph))
    return (index[0] if names[0] == "embedding" else None, next(iter(blocks)) if len(blocks) == 1 else None,
            index[-1] if names[-1] == "head" else None, graph.num_blocks)


Part = tuple[np.ndarray, GridReport, GridReport | None]  # priced rows, their grid, large-op options


def _items(graph: LayerGraph, parts: list[Part], configs: list[MeshConfig],
           opts: SpaceOptions, uopts: list[GridOption], w: Workload, dev: DeviceModel, layout: tuple,
           limit: float, best: float) -> list[tuple]:
    """Per-layer work (bound, key, part, row, sub-problem) that could beat ``best``, by increasing bound."""
    items = []
    names = unit_names(graph)
    block_cls = block_classes(graph)
    for part, (live, gr, gl) in enumerate(parts):
        rows = [configs[int(ci)] for ci in live]
        flat = np.flatnonzero([c.pp == 1 for c in rows])
        deep = np.flatnonzero([c.pp > 1 for c in rows])
        head = gr.unit_index[-1] if names[-1] == "head" else None
        # gl: the large-operator options of the meshes without a pipeline, or of all (staged space)
        gl_flat, gl_deep = (gl, None) if not opts.mix_stages or gl is None else (sub_grid(gl, flat), sub_grid(gl, deep))
        if len(flat):
            sub, sub_rows = sub_grid(gr, flat, gl_flat), MeshRows.of([rows[i] for i in flat], w, dev, limit)
            lb = np.maximum(grid_bounds(sub, sub_rows, dev, layout, best=best), flat_lagrange(sub, sub_rows, dev, head))
            for i in flat[lb < best]:
                items.append((float(lb[np.searchsorted(flat, i)]), (int(live[i]), 0), part, int(i), None))
        if not len(deep):
            continue
        sub, sub_rows = sub_grid(gr, deep, gl_deep), MeshRows.of([rows[i] for i in deep], w, dev, limit)
        large = np.ones(0 if gl_deep is None else len(gl_deep.options), bool)  # per-operator options
        # the (sharding, offload) pairs the stages choose from depend on the mesh only through
        # whether it has a shard group: pairs -> the rows they serve
        grouped = np.array([c.shard > 1 for c in sub_rows.cfgs])
        problems: dict[tuple, np.ndarray] = {}
        for g in (True, False):
            if (grouped == g).any():
                cfg = sub_rows.cfgs[int(np.flatnonzero(grouped == g)[0])]
                for pairs in pipeline_combos(graph, cfg, opts):
                    problems[tuple(pairs)] = problems.get(tuple(pairs), np.zeros(len(grouped), bool)) | (grouped == g)
        for s_i, pairs in enumerate(sorted(problems)):
            serves = problems[pairs]
            masks = [np.r_[[(o.sharding, o.offload) == pair for o in uopts], ~large] for pair in pairs]
            both = np.logical_or.reduce(masks) | np.r_[np.zeros(len(uopts), bool), large]
            lb = grid_bounds(sub, sub_rows, dev, layout, both, best, serves)
            # with per-layer options inside the stages a rank may mix pairs: one mask for them all
            lb = np.maximum(lb, interleaved_lagrange(sub, sub_rows, dev, layout, block_cls,
                                                     [both] if opts.mix_stages else masks, serves & (lb < best)))
            lb = np.maximum(lb, pipeline_lagrange(sub, sub_rows, dev, head, both, serves & (lb < best)))
            for r in np.flatnonzero(serves & (lb < best)):
                i = int(deep[r])
                items.append((float(lb[r]), (int(live[i]), s_i + 1), part, i, pairs))
    items.sort(key=lambda x: (x[0], x[1]))
    return items


_SIG_FIELDS = ("time", "activations", "remat", "states", "gathered", "step_comm", "window", "optim",
               "offload", "bwd_weight", "pending", "host_bytes")


def _signature(gr: GridReport, i: int, cols: list[int], cfg: MeshConfig, w: Workload, dev: DeviceModel,
               limit: float) -> tuple:
    """Everything a pipeline sub-problem depends on: equal signatures, equal optima (the pipeline
    group's stride is world/pp, so the stage-to-stage send time follows from pp and the bytes)."""
    from solvers.chain import memory_budget

    cache = gr.__dict__.setdefault("_packed", {})
    if i not in cache:  # (options, fields): every number a sub-problem of this row reads
        cache[i] = (np.stack([getattr(u, f)[i] for u in gr.units for f in _SIG_FIELDS], axis=1),
                    np.array([u.out_bytes[i] for u in gr.units]))
    packed = cache[i]
    raw = packed[0][cols].tobytes() + packed[1].tobytes()
    return (cfg.pp, cfg.vpp, cfg.schedule, w.global_batch // (cfg.dp * cfg.micro_batch),
            memory_budget(dev, cfg, limit), cfg.dp > 1, raw)


def _view(u: Any, i: int, j: int) -> UnitView:
    f = (u.time, u.activations, u.remat, u.states, u.gathered, u.step_comm, u.window, u.optim)
    return UnitView(*(float(x[i, j]) for x in f),
                    float(u.offload[i, j]), float(u.bwd_weight[i, j]), float(u.out_bytes[i]), float(u.pending[i, j]),
                    float(u.host_bytes[i, j]))


def _grid_builder(gr: GridReport, i: int, j: int, units: list[str]) -> Callable[[], Strategy]:
    """A uniform plan of the grid; with ``units``, those outside the blocks recompute nothing (as priced)."""
    return lambda: blocks_recompute(gr.strategy(i, j), units)


def _chain_builder(graph: LayerGraph, cfg: MeshConfig, prob: Any, choice: list[int]
                   ) -> Callable[[], Strategy]:
    return lambda: chain_strategy(graph, cfg, prob, choice)


def _pipe_builder(graph: LayerGraph, cfg: MeshConfig, sol: Any) -> Callable[[], Strategy]:
    return lambda: pipeline_strategy(graph, cfg, sol)


def _chunk_frontier(mem: np.ndarray, step: np.ndarray, part: int) -> list[tuple[float, float, int, int, int]]:
    """The fitting cells of one grid that no other cell beats in both memory and step time."""
    cells = np.flatnonzero(np.isfinite(step.ravel()))
    if not len(cells):
        return []
    mm, st = mem.ravel()[cells], step.ravel()[cells]
    order = np.lexsort((st, mm))
    keep = st[order] < np.minimum.accumulate(np.concatenate([[np.inf], st[order][:-1]]))
    out = []
    for f in cells[order[keep]]:
        i, j = divmod(int(f), step.shape[1])
        out.append((float(mem[i, j]), float(step[i, j]), part, i, j))
    return out


def _pareto(points: list[tuple[float, float, int, int, int]]) -> list[tuple[float, float, int, int, int]]:
    """Plans no other plan beats in both memory and step time (least memory first)."""
    out: list[tuple[float, float, int, int, int]] = []
    for pt in sorted(points):
        if not out or pt[1] < out[-1][1]:
            out.append(pt)
    return out


def _materialise(graph: LayerGraph, cluster: Cluster, w: Workload, pool: _Pool, frontier: list,
                 parts: list, limit: float, dev: DeviceModel, top_k: int, units: list[str]
                 ) -> tuple[tuple[Found, str], list[Found]]:
    """Re-price the best plans with estimate(): the winner, then top-k, the frontier, family bests."""
    seen: set[str] = set()
    ranked: list[tuple[Found, str]] = []
    built = [(obj, key, build(), solver) for obj, key, build, solver in pool.ranked()[:top_k + 12]]
    # equal step times (to 12 digits): the simpler plan first (fewer entries, no offload)
    built.sort(key=lambda x: (float(f"{x[0]:.12g}"), len(x[2].layers) + (x[2].default.offload != "none"),
                              x[1]))
    for _obj, _, s, solver in built:
        sig = s.model_dump_json()
        if sig in seen:
            continue
        seen.add(sig)
        rep = estimate(graph, cluster, s, w, memory_limit_gib=limit, device=dev)
        if not rep.fits:  # a plan the solvers thought fits must fit: never hand out one that does not
            continue
        ranked.append((Found(s, rep, family_of(s)), solver))
        if len(ranked) >= top_k + 1:
            break
    if not ranked:
        raise ShardplanError("internal error: no plan the search found fits when re-priced")
    best = ranked[0]
    alts = [f for f, _ in ranked[1:top_k + 1]]
    extra: list[Found] = []
    picks = frontier if len(frontier) <= PARETO_POINTS else [
        frontier[round(k * (len(frontier) - 1) / (PARETO_POINTS - 1))] for k in range(PARETO_POINTS)]
    for _, _, part, i, j in picks:
        s = blocks_recompute(parts[part][1].strategy(i, j), units)
        sig = s.model_dump_json()
        if sig not in seen:
            seen.add(sig)
            rep = estimate(graph, cluster, s, w, memory_limit_gib=limit, device=dev)
            extra.append(Found(s, rep, family_of(s)))
    alts += extra
    return best, alts
