"""Plans in Jupyter: ``PlanView(plan)`` (or the mixin on any class with a plan) gives a per-unit
DataFrame, the report, plots and exports, and renders as an HTML summary.

>>> view = PlanView(plan)             # a Plan, a plan dict, or a path to a plan JSON
>>> view.to_dataframe()               # one row per unit: stage, sharding, recompute, ... memory, time
>>> view.plot("timeline")             # a matplotlib Figure
>>> view.export("megatron").text

A strategy you give becomes a plan with :func:`plan_from_strategy` (no search), or with
:func:`planner.reprice.price` from a graph and cluster you already hold.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.reprice import GIB, memory_limit_gib, plan_from_strategy, predicted_dict, unit_stages, units_of
from vocab.errors import ShardplanError
from vocab.plan import Plan, load_plan, parse_plan

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from planner.trainers.exporting import Exported

__all__ = ["PlanView", "PlanViewMixin", "plan_from_strategy"]


class PlanViewMixin:
    """Notebook helpers over ``self._plan`` (a :class:`~vocab.plan.Plan` mixing this in is its own plan)."""

    @property
    def _plan(self) -> Plan:
        return self  # type: ignore[return-value]

    @property
    def report(self) -> dict[str, Any]:
        """The cost model's prediction (step time, throughput, MFU, memory, time and stage breakdowns)."""
        return predicted_dict(self._plan)

    def explain(self) -> dict[str, Any]:
        from planner.explain import explain_data

        return explain_data(self._plan)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per unit: stage, rank, sharding, recompute, offload, split, parameters; and per GPU and
        micro-batch, when the model loads: state memory (GiB), saved activations (GiB), times (ms)."""
        import pandas as pd

        from planner.compare import unit_choices
        from planner.reprice import priced_units, try_graph

        plan = self._plan
        s = plan.strategy
        graph = try_graph(plan)
        units = units_of(plan, graph)
        where = unit_stages(s, units)
        params = {u: sum(n.params for n in nodes) for u, nodes in graph.blocks()} if graph else {}
        try:
            costs = {u.name: u for st in priced_units(plan) for u in st}
        except (ShardplanError, ImportError, OSError):
            costs = {}
        rows = []
        for u in units:
            c = costs.get(u)
            rows.append({
                "unit": u, "stage": where[u][0], "rank": where[u][1], **unit_choices(s, u),
                "params": params.get(u, math.nan),
                "state_gib": c.states / GIB if c else math.nan,
                "activations_gib": c.activations / GIB if c else math.nan,
                "fwd_ms": c.fwd * 1e3 if c else math.nan,
                "bwd_ms": (c.bwd + c.recompute) * 1e3 if c else math.nan,
                "comm_ms": sum(c.comm.values()) * 1e3 if c else math.nan,
            })
        return pd.DataFrame(rows).set_index("unit")

    def stages_dataframe(self) -> pd.DataFrame:
        """Per pipeline stage memory (GiB) against the limit."""
        import pandas as pd

        from planner.explain import stage_info

        return pd.DataFrame(stage_info(self._plan)).drop(columns=["strategies"]).set_index("stage")

    def time_breakdown(self) -> pd.Series:
        import pandas as pd

        from planner.explain import time_breakdown

        parts = time_breakdown(self.report)["components"]
        return pd.Series({p["name"]: p["seconds"] for p in parts}, name="seconds per step")

    def plot(self, kind: str = "memory", ax: Axes | None = None) -> Figure:
        from planner.plots import plot

        return plot(self._plan, kind, ax)

    def export(self, target: str, nearest: bool = False) -> Exported:
        """The plan as ``target``'s configuration, refused as ``shardplan export`` refuses it (a
        :class:`ShardplanError`, the same line): where the target cannot express the plan, unless
        ``nearest`` (then the nearest plan it can, re-priced), and where the plan as the target runs it
        does not fit the memory limit, even with ``nearest``. :func:`planner.trainers.export` gives the
        mapping without refusing anything."""
        from planner.trainers import checked_export

        return checked_export(self._plan, target, nearest=nearest)

    def compare(self, *others: Plan | PlanViewMixin, names: list[str] | None = None) -> pd.DataFrame:
        """This plan next to others: a DataFrame, rows that differ first."""
        import pandas as pd

        from planner.compare import compare

        plans = [self._plan] + [o._plan if isinstance(o, PlanViewMixin) else o for o in others]
        names = names or ["this"] + [f"other {i + 1}" for i in range(len(others))]
        data = compare(plans, names)
        rows = [{"field": r["field"], "differs": True, **dict(zip(names, r["values"], strict=True))}
                for r in data["differences"]]
        rows += [{"field": r["field"], "differs": False, **dict(zip(names, r["values"], strict=True))}
                 for r in data["same"]]
        return pd.DataFrame(rows).set_index("field")

    def _repr_html_(self) -> str:
        from planner.compare import describe_run, runs, short_strategy

        plan, pred = self._plan, self.report
        c, w = plan.inputs.cluster, plan.inputs.workload
        e = html.escape
        limit = memory_limit_gib(plan)
        fits = pred.get("fits", pred["memory_peak_gib"] <= limit)
        verdict = "fits" if fits else "<b style='color:red'>does not fit</b>"
        head = (f"<b>{e(plan.inputs.model)}</b> on {c.world_size}x {e(c.accelerator)} ({c.nodes} nodes x "
                f"{c.gpus_per_node}), seq {w.seq_len}, global batch {w.global_batch}, {w.precision} "
                f"&mdash; solver {e(plan.solver.name)} ({e(plan.solver.status)})")
        metrics = [("strategy", e(short_strategy(plan.strategy))), ("step time", f"{pred['step_time_s']:.4g} s"),
                   ("tokens/s per GPU", f"{pred['tokens_per_s_per_gpu']:,.0f}"), ("MFU", f"{pred['mfu']:.1%}"),
                   ("peak memory", f"{pred['memory_peak_gib']:.1f} / {limit:.1f} GiB {verdict}"),
                   ("alternatives kept", str(len(plan.alternatives)))]
        rows = "".join(f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{v}</td></tr>"
                       for k, v in metrics)
        layers = "".join(f"<li>{e(r['units'])}: {e(describe_run(r))}</li>" for r in runs(plan.strategy, units_of(plan)))
        stages = ""
        if pred.get("stages"):
            cells = "".join(f"<tr><td>{st['stage']}</td><td>{st['params_gib'] + st['grads_gib'] + st['optimizer_gib']:.1f}"
                            f"</td><td>{st['activations_gib']:.1f}</td><td>{st['total_gib']:.1f}</td></tr>"
                            for st in pred["stages"])
            stages = ("<table><tr><th>stage</th><th>states GiB</th><th>activations GiB</th><th>total GiB</th></tr>"
                      f"{cells}</table>")
        return f"<div><p>{head}</p><table>{rows}</table><p>layers:</p><ul>{layers}</ul>{stages}</div>"


class PlanView(PlanViewMixin):
    """A plan for notebooks: ``PlanView(plan_or_path_or_dict)``."""

    def __init__(self, plan: Plan | dict[str, Any] | str | Path):
        if isinstance(plan, Plan):
            self.plan = plan
        elif isinstance(plan, dict):
            self.plan = parse_plan(plan)
        else:
            self.plan = load_plan(plan)

    @property
    def _plan(self) -> Plan:
        return self.plan

    def __repr__(self) -> str:
        from planner.compare import short_strategy

        p = self.plan
        return f"PlanView({p.inputs.model}, {short_strategy(p.strategy)}, {p.predicted.step_time_s:.4g} s/step)"
