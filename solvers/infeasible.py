"""When nothing fits: the least per-GPU memory any plan of the space needs, and what dominates it.

Per mesh configuration the memory-minimal plan is found exactly:

* without a pipeline, the OSDP chain with memory as the objective: under each cap on the
  transient maxima every unit takes its smallest option (:func:`chain_min_memory`);
* with one, per stage the least memory of its units (all blocks recompute fully, or all take the
  smallest other option — mixing only adds the transient of full recomputation), then the stage
  boundaries that minimise the largest stage (a min-max DP over blocks), for every uniform
  (sharding, offload).

Configurations are visited in increasing order of a lower bound (every unit's smallest states and
activations, spread evenly over the stages) until it passes the best found.
"""

from __future__ import annotations

from itertools import product

import numpy as np

from costmodel.device import DeviceModel
from costmodel.estimate import UnitPricer, estimate, stage_units
from costmodel.report import GIB, Report
from costmodel.state_groups import grads_held
from costmodel.vectorized import price_grid
from profiler.graph import LayerGraph
from profiler.hardware import Cluster
from solvers.chain import ChainProblem, chain_strategy, large_ops, mesh_problem
from solvers.osdp_ilp import least_memory
from solvers.space import SpaceOptions, grid_options, operator_options, pipeline_combos
from solvers.stage_tables import Combo
from solvers.stages import PipelineProblem, PipelineSolution, pipeline_strategy, unit_problems, with_problems
from vocab.errors import ShardplanError
from vocab.strategy import MeshConfig, Strategy, Workload, rank_blocks


def chain_min_memory(prob: ChainProblem) -> tuple[float, list[int]]:
    """(least Σ mem + max g + max r, the choice) of a chain problem; with the end of backward's
    constraint too (a ``tail``), the least of the larger of both, by :func:`least_memory`."""
    if prob.tail is not None:
        return least_memory(prob)
    opts = [o for row in prob.options for o in row]
    best: tuple[float, list[int]] = (np.inf, [])
    for G, R in product(sorted({0.0} | {o.g for o in opts}), sorted({0.0} | {o.r for o in opts})):
        pick = []
        for row in prob.options:
            ok = [(o.mem, j) for j, o in enumerate(row) if o.g <= G and o.r <= R]
            pick.append(min(ok) if ok else None)
        if any(p is None for p in pick):
            continue
        total = sum(pick[k][0] for k in prob.classes) + G + R  # type: ignore[index]
        if total < best[0]:
            best = (total, [pick[k][1] for k in prob.classes])  # type: ignore[index]
    return best


def _pipeline_min(qs: list[PipelineProblem], boundaries: bool) -> tuple[float, PipelineSolution] | None:
    """Least largest-stage memory (bytes before context and slack) and the plan that has it; each
    stage takes the (sharding, offload) of ``qs`` that needs the least."""
    pp = qs[0]
    L, p = len(pp.block_cls), pp.p
    if not pp.single:
        return None

    def stage(r: int, n: int) -> tuple[float, tuple]:
        best = min((_stage_min(q, r, n) + (s,) for s, q in enumerate(qs)), key=lambda x: x[0])
        return best[0], best[1] + (best[2],)

    def _stage_min(pp: PipelineProblem, r: int, n: int) -> tuple[float, tuple]:
        k = pp.kinds[0]
        rc = range(len(pp.recomputes))
        fly = pp.held(r)
        fx = pp.fixed({k: n}, r == 0, r == p - 1)
        best = (np.inf, ())
        emb = [pp.costs[pp.emb][e] for e in rc] if r == 0 and pp.emb is not None else [None]
        head = [pp.costs[pp.head][h] for h in rc] if r == p - 1 and pp.head is not None else [None]
        for (e, ue), (h, uh), b in product(enumerate(emb), enumerate(head), rc):
            ub = pp.costs[k][b]
            units = [u for u in (ue, uh) if u is not None] + [ub]
            acts = n * ub.held(*fly) + pp.ends_held(ue, uh, *fly)
            x = fx.states + fx.gathered + pp.bucket + max(u.recompute_peak for u in units) + acts + pp.recv(r)
            if x < best[0]:
                best = (x, (e if ue else None, h if uh else None, b))
        return best

    if pp.v > 1 or not boundaries or p == 1:
        layout = None
        per = [stage(r, len(held)) for r, held in enumerate(rank_blocks(L, p, pp.v))]
    else:
        table = [[stage(r, n) if 1 <= n <= L else (np.inf, ()) for n in range(L + 1)] for r in range(p)]
        best = np.full(L + 1, np.inf)
        best[0] = 0.0
        choice = []
        for r in range(p):
            nb, arg = np.full(L + 1, np.inf), np.zeros(L + 1, dtype=int)
            for j in range(1, L + 1):
                for n in range(1, j + 1):
                    v = max(best[j - n], table[r][n][0])
                    if v < nb[j]:
                        nb[j], arg[j] = v, n
            best = nb
            choice.append(arg)
        layout, j = [], L
        for r in range(p - 1, -1, -1):
            layout.append(int(choice[r][j]))
            j -= layout[-1]
        layout.reverse()
        per = [table[r][layout[r]] for r in range(p)]
    if not all(np.isfinite(x) for x, _ in per):
        return None
    recompute: list[str] = []
    if pp.emb is not None:
        recompute.append(pp.recomputes[per[0][1][0]])
    ranks = rank_blocks(L, p, pp.v, layout)
    blocks = [""] * L
    for r, idx in enumerate(ranks):
        for i in idx:
            blocks[i] = pp.recomputes[per[r][1][2]]
    recompute += blocks
    if pp.head is not None:
        recompute.append(pp.recomputes[per[-1][1][1]])
    units = unit_problems([qs[per[r][1][3]] for r in range(p)], ranks)
    return max(x for x, _ in per), with_problems(PipelineSolution(0.0, layout, recompute), units)


def min_memory(
    graph: LayerGraph,
    cluster: Cluster,
    w: Workload,
    opts: SpaceOptions,
    dev: DeviceModel,
    configs: list[MeshConfig],
) -> tuple[float, Strategy]:
    """(GiB, plan): the least per-GPU peak memory of any plan in the space, and a plan that has it."""
    c = dev.c
    uniform, large = grid_options(opts)
    uopts = uniform + large  # per-operator ZeRO-3 may need less: bound it too
    gr = price_grid(graph, cluster, w, configs, uopts, device=dev, large_ops=large_ops)
    counts = np.bincount(np.array(gr.unit_index), minlength=len(gr.units))
    pp_deg = np.array([cf.pp for cf in configs], dtype=float)
    unheld = np.array([not grads_held(cf.pp, w.global_batch // (cf.dp * cf.micro_batch)) for cf in configs])[:, None]
    low = sum(counts[k] * ((u.states - np.where(unheld, u.state_grads, 0.0)).min(axis=1) + u.activations.min(axis=1))
              for k, u in enumerate(gr.units))
    lb = (c.context_bytes + (1 + c.fragmentation) * low / pp_deg) / GIB
    plain = np.where(np.array([not o.large for o in uopts])[None, :], gr.memory_peak_gib, np.inf)
    i0, j0 = np.unravel_index(int(np.argmin(plain)), plain.shape)
    best = (float(gr.memory_peak_gib[i0, j0]), gr.strategy(int(i0), int(j0)))
    for i in np.argsort(lb, kind="stable"):
        if lb[i] >= best[0]:
            break
        cfg = configs[int(i)]
        if cfg.pp == 1 and opts.per_layer:
            prob = mesh_problem(graph, dev, cfg, w, opts, 1e9)
            x, choice = chain_min_memory(prob)
            cand = [(x, lambda cfg=cfg, prob=prob, choice=choice: chain_strategy(graph, cfg, prob, choice))]
        elif cfg.pp > 1 and opts.per_layer:
            cand = []
            tied = bool(graph.config.get("tied_embeddings"))
            ops = operator_options(opts, cfg.shard) if opts.mix_stages else []
            for combos in pipeline_combos(graph, cfg, opts):
                # the leanest plan: each stage one pair or operator option (one for all when the head
                # is tied); the staged space lets units of a stage differ too, which the leanest plan
                # does not need when every unit's leanest option is the same
                every = [(sh, off, 1, False) for sh, off in combos] + ops
                for group in ([[c] for c in every] if tied else [every]):
                    qs = [PipelineProblem(graph, dev, cfg, w, Combo(sh, off, k, mx), opts.recomputes, 1e9)
                          for sh, off, k, mx in group]
                    res = _pipeline_min(qs, opts.stage_boundaries)
                    if res is not None:
                        cand.append((res[0], lambda cfg=cfg, sol=res[1]: pipeline_strategy(graph, cfg, sol)))
        else:
            continue
        for x, build in cand:
            gib = (c.context_bytes + (1 + c.fragmentation) * x) / GIB
            if gib < best[0] - 1e-9:
                s = build()
                best = (estimate(graph, cluster, s, w, device=dev).memory_peak_gib, s)
    return best


def dominant(
    graph: LayerGraph, cluster: Cluster, s: Strategy, w: Workload, rep: Report, dev: DeviceModel
) -> str:
    """What dominates the worst stage's memory: ``model states of the embedding on stage 0``."""
    st = max(rep.stages, key=lambda x: x.total)
    parts = {
        "model states (parameters, gradients, optimizer)": st.params + st.grads + st.optimizer,
        "activations": st.activations,
        "transient buffers (gathered parameters, recomputation, logits)": st.buffers,
        "CUDA context and allocator slack": st.overhead,
    }
    what = max(parts, key=lambda k: parts[k])
    price = UnitPricer(dev, s, w)
    units = [u for k, vst in enumerate(stage_units(graph, s)) if k % s.mesh.pp == st.stage for u in vst]
    costs = [(price(n, nodes), n) for n, nodes in units]
    if what.startswith("model states") or what == "activations":
        # the embedding, the head, or the blocks together: whichever holds the most of it
        groups: dict[str, float] = {}
        blocks = [n for _, n in costs if n.startswith("layers.")]
        for u, name in costs:
            key = name if not name.startswith("layers.") else (
                f"{len(blocks)} blocks ({blocks[0]}..{blocks[-1].split('.')[-1]})" if len(blocks) > 1 else name)
            val = (u.state_params + u.state_grads + u.state_optim) if what != "activations" else u.activations
            groups[key] = groups.get(key, 0.0) + val
        name = max(groups, key=lambda k: groups[k])
        share = groups[name] if what != "activations" else parts[what] * groups[name] / max(sum(groups.values()), 1)
        the = "the " if name in ("embedding", "head") else ""
        return f"{what} of {the}{name} on stage {st.stage} ({share / GIB:.2f} of {st.total / GIB:.2f} GiB)"
    return f"{what} on stage {st.stage} ({parts[what] / GIB:.2f} of {st.total / GIB:.2f} GiB)"


def explain(
    graph: LayerGraph,
    cluster: Cluster,
    w: Workload,
    opts: SpaceOptions,
    limit: float,
    dev: DeviceModel,
    configs: list[MeshConfig],
) -> ShardplanError:
    gib, s = min_memory(graph, cluster, w, opts, dev, configs)
    rep = estimate(graph, cluster, s, w, device=dev)
    host = (f"{rep.host_per_node_gib:.0f} GiB of offloaded states per node, where a node's host memory holds "
            f"{rep.host_limit_per_node_gib:.0f} GiB for them")
    if gib <= limit and rep.host_per_node_gib > rep.host_limit_per_node_gib > 0:
        return ShardplanError(
            f"no plan in the '{opts.name}' space fits {limit:.2f} GiB per GPU and the host memory of a node: the "
            f"least per-GPU memory, {gib:.2f} GiB ({_describe(s, graph)}), takes {host}")
    why = dominant(graph, cluster, s, w, rep, dev)
    if rep.host_per_node_gib > rep.host_limit_per_node_gib > 0:
        why += f"; and it takes {host}"
    return ShardplanError(
        f"no plan in the '{opts.name}' space fits {limit:.2f} GiB per GPU: the smallest per-GPU memory any "
        f"plan needs is {gib:.2f} GiB ({_describe(s, graph)}), dominated by {why}"
    )


def _choices(values: list[str], what: str) -> str:
    """``zero3`` when every unit agrees, else ``zero3 on 70 units, zero1 on 2``."""
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) == 1:
        return f"{what}{values[0]}"
    return ", ".join(f"{what}{v} on {n} units" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _describe(s: Strategy, graph: LayerGraph) -> str:
    """Mesh, micro-batch, and every choice of the plan (sharding, offload, recompute, splits)."""
    m = s.mesh
    axes = " ".join(f"{k}={v}" for k, v in m.axes().items() if v > 1) or "1 GPU"
    units = [name for name, _ in graph.blocks()]
    per = [s.for_unit(u) for u in units]
    parts = [axes, *([s.schedule] if m.pp > 1 else []), f"micro-batch {s.micro_batch}",
             _choices([p.sharding for p in per], ""), _choices([p.offload for p in per], "offload "),
             _choices([p.recompute for p in per], "recompute ")]
    splits = [p.split for p in per if p.split > 1]
    if splits:
        parts.append(f"operator splits on {len(splits)} units")
    return ", ".join(x for x in parts if x != "offload none")
