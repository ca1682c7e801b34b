"""What every exporter shares: a target's capabilities, mapping a plan to the nearest plan the target
can express (recording what was lost), and the priced result.

Mapping rules, in order: operator splits, per-unit choices the target cannot vary (collapsed to the
most memory-saving value the plan uses, so that the nearest plan still fits where the plan did),
values the target lacks (the next more memory-saving one it has), sharding with pipelines and with
HSDP, schedule, uneven stages, context parallelism, TSP and sequence parallelism. A target module
may then adjust further (``adjust``) before rendering.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from planner.compare import describe_diff, diff_strategies, label_units, unit_choices
from planner.reprice import Repriced, block_index
from vocab.errors import ShardplanError
from vocab.plan import Plan
from vocab.strategy import OFFLOADS, RECOMPUTES, SCHEDULES, SHARDINGS, Strategy, Workload, split_blocks

ORDER: dict[str, tuple[str, ...]] = {"sharding": ("replicate", "zero1", "zero2", "zero3_keep", "zero3"),
                                     "recompute": RECOMPUTES, "offload": OFFLOADS}
UNIT_FIELDS = ("sharding", "recompute", "offload")


@dataclass(frozen=True)
class Caps:
    """What a target can express."""

    tool: str
    shardings: tuple[str, ...] = SHARDINGS
    pp_shardings: tuple[str, ...] = SHARDINGS  # allowed with pp > 1
    hsdp_shardings: tuple[str, ...] = SHARDINGS  # allowed with dp_replicate > 1 and dp_shard > 1
    recomputes: tuple[str, ...] = RECOMPUTES
    offloads: tuple[str, ...] = OFFLOADS
    per_layer: frozenset[str] = frozenset()  # unit fields that may differ between units
    schedules: tuple[str, ...] = SCHEDULES
    uneven_stages: bool = True
    cp_modes: tuple[str, ...] = ("ring", "ulysses")  # empty: no context parallelism
    tsp: bool = False
    sequence_parallel: bool = True
    split: bool = False


@dataclass
class Loss:
    what: str
    detail: str


class Nearest:
    """A strategy under construction: global fields, per-unit choices, operator splits; and the losses."""

    def __init__(self, plan: Plan, units: list[str]):
        s = plan.strategy
        self.plan, self.units = plan, units
        self.fields: dict[str, Any] = s.model_dump(exclude={"default", "layers"})
        self.choice = {u: {f: unit_choices(s, u)[f] for f in UNIT_FIELDS} for u in units}
        self.split = {u: unit_choices(s, u)["split"] for u in units}
        self.ops = [ls.model_dump() for ls in s.layers if ls.unit not in units and ls.unit != "*"]
        self.workload = plan.inputs.workload.model_dump()
        self.losses: list[Loss] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}  # target-specific facts for rendering

    def lose(self, what: str, detail: str) -> None:
        self.losses.append(Loss(what, detail))

    @property
    def mesh(self) -> dict[str, int]:
        return self.fields["mesh"]

    @property
    def blocks(self) -> list[str]:
        return [u for u in self.units if block_index(u) is not None]

    def stage_sizes(self) -> list[int]:
        """Blocks per virtual stage under the current fields (:meth:`Strategy.stage_layout`'s rule)."""
        return split_blocks(len(self.blocks), self.mesh["pp"] * self.fields["vpp"], self.fields["stage_layers"])

    def values(self, f: str, units: list[str] | None = None) -> list[Any]:
        return [self.choice[u][f] for u in (self.units if units is None else units)]

    def set_all(self, f: str, value: Any, units: list[str] | None = None) -> None:
        for u in self.units if units is None else units:
            self.choice[u][f] = value

    def strategy(self) -> Strategy:
        if not self.losses:
            return self.plan.strategy
        combos = [tuple(self.choice[u][f] for f in UNIT_FIELDS) for u in self.units]
        default = Counter(combos).most_common(1)[0][0] if combos else ("replicate", "none", "none")
        layers = []
        for u, combo in zip(self.units, combos, strict=True):
            if combo != default or self.split[u] > 1:
                layers.append({"unit": u, **dict(zip(UNIT_FIELDS, combo, strict=True)), "split": self.split[u]})
        layers += self.ops
        data = {**self.fields, "default": dict(zip(UNIT_FIELDS, default, strict=True)), "layers": layers}
        try:
            return Strategy.model_validate(data)
        except ValidationError as e:
            raise ShardplanError(f"the nearest plan for {self.fields} is not a valid strategy: {e}") from None

    def workload_model(self) -> Workload:
        return Workload.model_validate(self.workload)


def runs_text(n: Nearest, f: str) -> str:
    """``embedding none, layers.0-1 full, ...``: the current values of ``f`` by unit range."""
    out, group, prev = [], [], None
    for u in [*n.units, None]:
        v = None if u is None else n.choice[u][f]
        if group and v != prev:
            out.append(f"{label_units(group)} {prev}")
            group = []
        if u is not None:
            group.append(u)
        prev = v
    return ", ".join(out)


def nearest_allowed(f: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if allowed, else the next more memory-saving allowed value, else the most saving one."""
    if value in allowed:
        return value
    order = ORDER[f]
    above = [v for v in order[order.index(value):] if v in allowed]
    return above[0] if above else max(allowed, key=order.index)


def collapse(n: Nearest, f: str, why: str, units: list[str] | None = None) -> None:
    """Give every unit (of ``units``) the most memory-saving value of ``f`` among them."""
    vals = n.values(f, units)
    if len(set(vals)) > 1:
        target = max(vals, key=ORDER[f].index)
        n.lose(f"per-layer {f}", f"{runs_text(n, f)} → {target} everywhere ({why})")
        n.set_all(f, target, units)


def normalize(plan: Plan, units: list[str], caps: Caps) -> Nearest:
    n = Nearest(plan, units)
    tool = caps.tool
    if not caps.split and (any(v > 1 for v in n.split.values()) or n.ops):
        split_units = [u for u in units if n.split[u] > 1]
        n.lose("OSDP operator splitting", f"split on {label_units(split_units)} → no split ({tool} cannot slice "
                                          "operators; gathered weights grow)")
        n.split = dict.fromkeys(units, 1)
        n.ops = []
    for f in UNIT_FIELDS:
        if f not in caps.per_layer:
            collapse(n, f, f"{tool} sets {f} for the whole model")
        allowed = {"sharding": caps.shardings, "recompute": caps.recomputes, "offload": caps.offloads}[f]
        if f == "sharding" and n.mesh["pp"] > 1:
            allowed = tuple(v for v in allowed if v in caps.pp_shardings)
        for v in sorted(set(n.values(f)), key=ORDER[f].index):
            new = nearest_allowed(f, v, allowed)
            if new != v:
                extra = " with pipeline parallelism" if f == "sharding" and v in caps.shardings else ""
                n.lose(f, f"{v} → {new} ({tool} has no {f} '{v}'{extra})")
                n.set_all(f, new, [u for u in units if n.choice[u][f] == v])
    m = n.mesh
    if m["dp_replicate"] > 1 and m["dp_shard"] > 1:
        bad = sorted({v for v in n.values("sharding") if v != "replicate" and v not in caps.hsdp_shardings})
        if bad:
            n.lose("HSDP", f"dp_replicate={m['dp_replicate']} x dp_shard={m['dp_shard']} → dp_shard="
                           f"{m['dp_replicate'] * m['dp_shard']} ({tool} shards {'/'.join(bad)} over all "
                           "data-parallel ranks)")
            n.extra["hsdp_shard"] = m["dp_shard"]
            m["dp_shard"], m["dp_replicate"] = m["dp_shard"] * m["dp_replicate"], 1
    sched = n.fields["schedule"]
    if m["pp"] > 1 and sched not in caps.schedules:
        new = "1f1b" if "1f1b" in caps.schedules else caps.schedules[0]
        n.lose("schedule", f"{sched} → {new} ({tool} has no '{sched}' schedule)")
        n.fields["schedule"] = new
        if sched == "interleaved":
            n.fields.update(vpp=1, stage_layers=None)
    elif m["pp"] == 1 and sched == "interleaved":
        n.fields.update(schedule="1f1b", vpp=1)
    sl = n.fields["stage_layers"]
    if sl is not None and not caps.uneven_stages:
        n.fields["stage_layers"] = None
        even = n.stage_sizes()
        if list(sl) != even:
            n.lose("uneven pipeline stages", f"{sl} → {even} ({tool} splits layers evenly)")
    if m["cp"] > 1 and not caps.cp_modes:
        n.lose("context parallelism", f"cp={m['cp']} → folded into dp_shard={m['dp_shard'] * m['cp']} "
                                      f"({tool} cannot split the sequence)")
        m["dp_shard"], m["cp"] = m["dp_shard"] * m["cp"], 1
    elif m["cp"] > 1 and n.fields["cp_mode"] not in caps.cp_modes:
        n.lose("context-parallel mode", f"{n.fields['cp_mode']} → {caps.cp_modes[0]} ({tool} has no "
                                        f"{n.fields['cp_mode']} attention)")
        n.fields["cp_mode"] = caps.cp_modes[0]
    if n.fields["tp_mode"] == "tsp" and not caps.tsp:
        n.lose("TSP", f"tp_mode tsp → megatron{' with sequence parallelism' if caps.sequence_parallel else ''} "
                      f"({tool} has no tensor-sequence parallelism)")
        n.fields.update(tp_mode="megatron", sequence_parallel=caps.sequence_parallel and m["tp"] > 1)
    if n.fields["sequence_parallel"] and not caps.sequence_parallel:
        n.lose("sequence parallelism", f"on → off ({tool} has no Megatron-style sequence parallelism)")
        n.fields["sequence_parallel"] = False
    return n


@dataclass
class Exported:
    """An export: the text, the strategy it encodes, and what was lost on the way, with its price."""

    target: str
    tool_version: str
    text: str
    suffix: str
    strategy: Strategy
    losses: list[Loss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repriced: Repriced | None = None
    changes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.losses

    def cost_line(self) -> str:
        r = self.repriced
        if r is None:
            return ""
        if r.original is None or r.variant is None:
            return f"predicted cost unknown: {r.error}"
        a, b = r.original, r.variant
        dt = b["step_time_s"] - a["step_time_s"]
        fit = "fits" if b.get("fits", True) else "DOES NOT FIT"
        return (f"predicted cost: step time {a['step_time_s']:.4g} s → {b['step_time_s']:.4g} s ({dt:+.4g} s, "
                f"{dt / a['step_time_s']:+.1%}); peak memory {a['memory_peak_gib']:.1f} → "
                f"{b['memory_peak_gib']:.1f} GiB ({fit} in {b['memory_limit_gib']:.1f} GiB)")

    def warnings(self) -> list[str]:
        if not self.losses:
            return []
        out = [f"{self.target} ({self.tool_version}) cannot express this plan exactly; exported the nearest "
               "plan it can:"]
        out += [f"  - {x.what}: {x.detail}" for x in self.losses]
        out.append(f"  {self.cost_line()}")
        return out

    def to_dict(self) -> dict[str, Any]:
        r = self.repriced
        return {"target": self.target, "tool_version": self.tool_version, "exact": self.exact,
                "losses": [{"what": x.what, "detail": x.detail} for x in self.losses], "notes": self.notes,
                "changes": self.changes, "strategy": self.strategy.model_dump(mode="json"),
                "step_time_s": r.original["step_time_s"] if r and r.original else None,
                "nearest_step_time_s": r.variant["step_time_s"] if r and r.variant else None,
                "step_time_delta_s": r.delta_s if r else 0.0,
                "nearest_memory_peak_gib": r.variant["memory_peak_gib"] if r and r.variant else None,
                "reprice_error": r.error if r else None}


def change_lines(plan: Plan, s: Strategy, units: list[str]) -> list[str]:
    return [describe_diff(d) for d in diff_strategies(plan.strategy, s, units)]


def header(plan: Plan, version: str, losses: list[Loss], cost: str = "", comment: str = "#") -> str:
    """Comment lines naming the tool version, the plan, and what the export does not keep."""
    c, w, pr = plan.inputs.cluster, plan.inputs.workload, plan.predicted
    lines = [f"shardplan export for {version}",
             f"{plan.inputs.model} on {c.world_size}x {c.accelerator} ({c.nodes} nodes x {c.gpus_per_node}), "
             f"seq_len {w.seq_len}, global batch {w.global_batch}, {w.precision}",
             f"plan: predicted {pr.step_time_s:.4g} s/step, {pr.memory_peak_gib:.1f} GiB peak per GPU"]
    if losses:
        lines.append("NOT exactly the plan: the nearest plan this tool can express:")
        lines += [f"  - {x.what}: {x.detail}" for x in losses]
        if cost:
            lines.append(f"  {cost}")
    return "\n".join(f"{comment} {x}" for x in lines) + "\n"
