"""What every exporter shares: mapping a plan to the nearest plan a target (:mod:`vocab.targets`)
can express, recording what it lacks, and the priced result.

Mapping rules, in order: operator splits, recomputation outside the blocks, per-unit choices the
target cannot vary (collapsed to the most memory-saving value the plan uses, so that the nearest
plan still fits where the plan did), values the target lacks (the next more memory-saving one it
has; sharding also by what a pipeline and data parallelism beside model parallelism allow, and by
what an offload needs), HSDP, schedule and its stages per rank, uneven stages, context and expert
parallelism, TSP, sequence parallelism, fp8 and mxfp8; then the target's behaviour (cross-entropy kernel,
gradient dtype, pipeline receive buffers), which is re-priced but not something the target lacks. A
target module may then adjust further (``adjust``) before rendering.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import gcd
from typing import Any

from pydantic import ValidationError

from costmodel.kernels import experts_low_precision
from planner.compare import describe_diff, diff_strategies, label_units, unit_choices
from planner.reprice import Repriced, block_index, plan_graph
from planner.trainers.reading import inputs_line
from vocab.errors import ShardplanError
from vocab.names import escape_unprintable
from vocab.plan import Plan
from vocab.strategy import (
    FP8_PRECISIONS,
    OFFLOADS,
    RECOMPUTES,
    WORKLOAD_CHOICES,
    Strategy,
    Workload,
    split_blocks,
)
from vocab.targets import WORKLOAD_BEHAVIOUR, Target

ORDER: dict[str, tuple[str, ...]] = {"sharding": ("replicate", "zero1", "zero2", "zero3_keep", "zero3"),
                                     "recompute": RECOMPUTES, "offload": OFFLOADS}
UNIT_FIELDS = ("sharding", "recompute", "offload")


#: how a refusal names a sharding the target lacks
SHARDING_NAMES = {"replicate": "DDP (replicate)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                  "zero3_keep": "ZeRO-3 kept gathered (zero3_keep)"}


@dataclass
class Loss:
    """What the nearest plan changes: ``what`` (a heading), ``detail`` (from → to, and why), ``lacks``
    (what the target cannot express, as a refusal names it); a ``behaviour`` loss is how the target
    runs the plan (re-priced), not something it lacks."""

    what: str
    detail: str
    lacks: str = ""
    behaviour: bool = False


class Nearest:
    """A strategy under construction: global fields, per-unit choices, operator splits; and the losses."""

    def __init__(self, plan: Plan, units: list[str], target: Target):
        s = plan.strategy
        self.plan, self.units, self.target = plan, units, target  # the target the plan is mapped onto
        self.fields: dict[str, Any] = s.model_dump(exclude={"default", "layers"})
        self.choice = {u: {f: unit_choices(s, u)[f] for f in UNIT_FIELDS} for u in units}
        self.split = {u: unit_choices(s, u)["split"] for u in units}
        self.ops = [ls.model_dump() for ls in s.layers if ls.unit not in units and ls.unit != "*"]
        self.workload: dict[str, Any] = dict(plan.inputs.workload)  # every field, defaults included
        self.losses: list[Loss] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}  # target-specific facts for rendering

    @property
    def label(self) -> str:
        """The target's trainer and pinned version."""
        return self.target.label

    def lose(self, what: str, detail: str, lacks: str = "") -> None:
        self.losses.append(Loss(what, detail, lacks or what))

    def behave(self, what: str, detail: str) -> None:
        self.losses.append(Loss(what, detail, behaviour=True))

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


def collapse(n: Nearest, f: str, why: str, units: list[str] | None = None, lacks: str = "") -> None:
    """Give every unit (of ``units``) the most memory-saving value of ``f`` among them."""
    vals = n.values(f, units)
    if len(set(vals)) > 1:
        target = max(vals, key=ORDER[f].index)
        n.lose(f"per-layer {f}", f"{runs_text(n, f)} → {target} everywhere ({why})", lacks)
        n.set_all(f, target, units)


def normalize(plan: Plan, units: list[str], t: Target) -> Nearest:
    """The nearest plan ``t`` can express, with what it lacks (see the module's order of rules)."""
    n = Nearest(plan, units, t)
    _splits(n, t)
    _outside_blocks(n, t)
    _unit_fields(n, t)
    _hsdp(n, t)
    _schedule(n, t)
    _axes(n, t)
    _tensor_parallel(n, t)
    _precision(n, t)
    return n


def _splits(n: Nearest, t: Target) -> None:
    if not t.osdp_split and (any(v > 1 for v in n.split.values()) or n.ops):
        split_units = [u for u in n.units if n.split[u] > 1]
        n.lose("OSDP operator splitting", f"split on {label_units(split_units)} → no split ({t.name} cannot "
                                          "slice operators; gathered weights grow)")
        n.split = dict.fromkeys(n.units, 1)
        n.ops = []


def _outside_blocks(n: Nearest, t: Target) -> None:
    """Targets that checkpoint transformer blocks only: the embedding and head recompute nothing
    (selective there recomputes nothing anyway)."""
    if t.recompute.scope != "blocks":
        return
    others = [u for u in n.units if block_index(u) is None]
    if any(v == "full" for v in n.values("recompute", others)):
        n.lose("recompute outside the blocks", f"full recompute of embedding/head → none ({t.name} recomputes "
                                               "transformer blocks only)", "recomputation outside the transformer blocks")
    n.set_all("recompute", "none", others)


def _unit_fields(n: Nearest, t: Target) -> None:
    per_layer = {"sharding": t.sharding.per_layer, "recompute": t.recompute.per_layer != "none",
                 "offload": t.offload.per_layer}
    shardings, why = t.sharding.on_mesh(n.mesh, replicas=False, no_shard_group=False)  # both: _hsdp
    allowed = {"sharding": tuple(shardings), "recompute": tuple(t.recompute.modes), "offload": tuple(t.offload.modes)}
    states = _activation_offload(n, t)  # the units whose offload is of states (or none)
    scope = {"offload": states, "recompute": n.blocks if t.recompute.scope == "blocks" else None}
    for f in UNIT_FIELDS:
        if not per_layer[f]:
            collapse(n, f, f"{t.name} sets {f} for the whole model", scope.get(f))
        for v in sorted(set(n.values(f)), key=ORDER[f].index):
            new = nearest_allowed(f, v, allowed[f])
            if new != v:
                extra = f" {why}" if f == "sharding" and v in t.sharding.modes else ""
                name = SHARDING_NAMES[v] if f == "sharding" else f"{v} {f}"
                n.lose(f, f"{v} → {new} ({t.name} has no {f} '{v}'{extra})", name + extra)
                n.set_all(f, new, [u for u in n.units if n.choice[u][f] == v])
    _offload_needs(n, t, allowed["sharding"])


def _activation_offload(n: Nearest, t: Target) -> list[str]:
    """Units offloading their activations keep it where ``t`` runs that layout (``offload.activations``:
    ``any`` unit, or Megatron's ``first_blocks``: the first N transformer blocks, N below their count, no
    recomputation anywhere: megatron-core 0.16.1 transformer_config.py:1137-1152); otherwise every such
    unit keeps its activations on the device. Returns the other units."""
    units = [u for u in n.units if n.choice[u]["offload"] == "activations"]
    if not units:
        return n.units
    blocks = sorted(b for b in (block_index(u) for u in units) if b is not None)
    n_blocks = sum(block_index(u) is not None for u in n.units)
    why = ""
    if "activations" not in t.offload.modes:
        why = f"{t.name} does not offload activations"
    elif t.offload.activations == "first_blocks":
        if len(blocks) != len(units) or blocks != list(range(len(blocks))) or len(blocks) >= n_blocks:
            why = f"{t.name} offloads the activations of its first N transformer blocks, N below {n_blocks}, only"
        elif any(v != "none" for v in n.values("recompute")):
            why = f"{t.name} offloads no activations beside recomputation"
    if not why:
        return [u for u in n.units if u not in units]
    n.lose("activation offload", f"{label_units(units)} activations in host memory → on the device ({why})")
    n.set_all("offload", "none", units)
    return n.units


def _offload_needs(n: Nearest, t: Target, shardings: tuple[str, ...]) -> None:
    """A unit whose offload needs another sharding takes the nearest one that allows it."""
    for off, needs in t.offload.needs.items():
        fits = tuple(v for v in shardings if v in needs)
        for u in [u for u in n.units if n.choice[u]["offload"] == off]:
            sh = n.choice[u]["sharding"]
            if sh not in needs and fits:
                new = nearest_allowed("sharding", sh, fits)
                n.lose("sharding", f"{sh} → {new} ({t.name} offloads {off} under {'/'.join(needs)} only)",
                       f"{off} offload under {SHARDING_NAMES[sh]}")
                n.set_all("sharding", new, [x for x in n.units if n.choice[x]["offload"] == off
                                            and n.choice[x]["sharding"] == sh])


def _hsdp(n: Nearest, t: Target) -> None:
    """Data-parallel replicas (``dp_replicate > 1``) become one flat group where the target does not run
    them: with no shard group (``dp_shard = cp = 1``) every sharding is plain DDP, so where the target
    rules DDP out (``ShardingCaps.on_mesh``: torchtitan beside model parallelism) the replicas become the shard
    group, as :func:`solvers.space.mesh_shardings` rules such a mesh out of a search; otherwise where
    the target runs the shardings not across replicas (``sharding.with_hsdp``, or no ``dp_replicate``
    axis). Plain replicas without a shard group price the same either way: no loss."""
    m = n.mesh
    if m["dp_replicate"] == 1:
        return
    flat = m["dp_replicate"] * m["dp_shard"]
    if m["dp_shard"] * m["cp"] == 1 and not t.sharding.on_mesh(m, replicas=False)[0]:
        # no shard group: every sharding runs as DDP, which the target does not run beside this parallelism
        n.lose("DDP", f"dp_replicate={m['dp_replicate']} → dp_shard={flat} ({t.name} runs no DDP beside model "
                      "parallelism: its data parallelism is a shard group)", "DDP beside model parallelism")
        m["dp_shard"], m["dp_replicate"] = flat, 1
        return
    allowed = t.sharding.with_hsdp if t.has("dp_replicate") else []
    bad = sorted({v for v in n.values("sharding") if v not in allowed})
    if not bad:
        return
    if m["dp_shard"] * m["cp"] > 1 or bad != ["replicate"]:
        n.lose("HSDP", f"dp_replicate={m['dp_replicate']} x dp_shard={m['dp_shard']} → dp_shard={flat} ({t.name} "
                       "runs " + "/".join(SHARDING_NAMES[b] for b in bad) + " over one flat data-parallel group)",
               f"data-parallel replicas with {'/'.join(SHARDING_NAMES[b] for b in bad)}")
        n.extra["hsdp_shard"] = m["dp_shard"]
    m["dp_shard"], m["dp_replicate"] = flat, 1


def _schedule(n: Nearest, t: Target) -> None:
    m, sched, vpp = n.mesh, n.fields["schedule"], n.fields["vpp"]
    rules = t.pipeline.schedules
    if m["pp"] == 1:
        if sched == "interleaved":
            n.fields.update(schedule="1f1b", vpp=1)
        return
    rule = rules.get(sched)  # type: ignore[call-overload]
    if rule is None or vpp < rule.min or (rule.max is not None and vpp > rule.max):
        new = "1f1b" if "1f1b" in rules else next(iter(rules))
        per_rank = "" if rule is None else f" with {vpp} stage(s) per rank"
        reason = (f"{t.name} has no '{sched}' schedule" if rule is None else
                  f"{t.name} runs '{sched}' with {rule.min}{'' if rule.max == rule.min else ' or more'} stages per rank")
        n.lose("schedule", f"{sched} → {new} ({reason})", f"schedule {sched}{per_rank}")
        n.fields["schedule"] = new
        if vpp > 1:
            n.fields.update(vpp=1, stage_layers=None)
    sl = n.fields["stage_layers"]
    if sl is not None and t.pipeline.stage_split == "even":
        n.fields["stage_layers"] = None
        even = n.stage_sizes()
        if list(sl) != even:
            n.lose("uneven pipeline stages", f"{sl} → {even} ({t.name} splits layers evenly)")


def _axes(n: Nearest, t: Target) -> None:
    m = n.mesh
    if m["cp"] > 1 and not t.context_parallel:
        n.lose("context parallelism", f"cp={m['cp']} → folded into dp_shard={m['dp_shard'] * m['cp']} "
                                      f"({t.name} cannot split the sequence)")
        m["dp_shard"], m["cp"] = m["dp_shard"] * m["cp"], 1
    elif m["cp"] > 1 and n.fields["cp_mode"] not in t.context_parallel:
        mode = n.fields["cp_mode"]
        n.lose("context-parallel mode", f"{mode} → {t.context_parallel[0]} ({t.name} has no {mode} attention)",
               f"context parallelism mode {mode}")
        n.fields["cp_mode"] = t.context_parallel[0]
    if m["ep"] > 1 and not t.has("ep"):
        n.lose("expert parallelism", f"ep={m['ep']} → 1 (every rank holds all experts; {t.name} has no expert "
                                     "parallelism)")
        m["ep"] = 1
    etp = m.get("etp", 0)
    if etp and etp != m["tp"] and (etp != 1 or not t.tensor_parallel.expert_folding or not t.has("ep")):
        ep = gcd(m["ep"], m["dp_shard"] * m["cp"])
        n.lose("MoE parallel folding", f"etp={etp} ep={m['ep']} → ep={ep}, the experts split over tp={m['tp']} "
                                       f"({t.name} folds expert ranks over tp with etp=1 only, or not at all)",
               f"expert-tensor parallelism etp={etp} beside tp={m['tp']}")
        m["ep"], m["etp"] = ep, 0
    elif (m["ep"] > 1 and m["tp"] > 1 and (not etp or etp == m["tp"])
          and t.tensor_parallel.expert_split == "without_ep" and t.tensor_parallel.expert_folding):
        n.lose("experts split over tp", f"ep={m['ep']} with the experts split over tp={m['tp']} → etp=1 "
                                        f"({t.name} folds expert ranks over tp whenever ep > 1)",
               f"experts split over tp={m['tp']} beside ep={m['ep']}")
        m["etp"] = 1


def _tensor_parallel(n: Nearest, t: Target) -> None:
    tp, sp_rule = n.mesh["tp"] > 1, t.tensor_parallel.sequence_parallel
    if n.fields["tp_mode"] == "tsp" and "tsp" not in t.tensor_parallel.modes:
        sp = sp_rule != "never" and tp
        n.lose("TSP", f"tp_mode tsp → megatron{' with sequence parallelism' if sp else ''} "
                      f"({t.name} has no tensor-sequence parallelism)", "TSP (tensor-sequence parallelism)")
        n.fields.update(tp_mode="megatron", sequence_parallel=sp)
    allowed = t.tensor_parallel.tsp_context
    if n.fields["tp_mode"] == "tsp" and n.mesh["cp"] > 1 and n.fields["cp_mode"] not in allowed:
        mode = n.fields["cp_mode"]
        if allowed:
            n.lose("context-parallel mode", f"{mode} → {allowed[0]} ({t.name} runs TSP beside "
                                            f"{', '.join(allowed)} attention only)", f"TSP with {mode} attention")
            n.fields["cp_mode"] = allowed[0]
        else:
            n.lose("TSP", f"tp_mode tsp → megatron ({t.name} runs no TSP beside context parallelism)",
                   "TSP with context parallelism")
            n.fields.update(tp_mode="megatron", sequence_parallel=sp_rule != "never")
    if n.fields["sequence_parallel"] and sp_rule == "never":
        n.lose("sequence parallelism", f"on → off ({t.name} has no Megatron-style sequence parallelism)")
        n.fields["sequence_parallel"] = False
    elif tp and not n.fields["sequence_parallel"] and n.fields["tp_mode"] == "megatron" and sp_rule == "always":
        n.lose("sequence parallelism", f"off → on ({t.name} always shards the sequence with tensor parallelism)",
               "tensor parallelism without sequence parallelism")
        n.fields["sequence_parallel"] = True
    elif (tp and not n.fields["sequence_parallel"] and n.fields["tp_mode"] == "megatron"
          and t.tensor_parallel.experts_need_sp and _may_have_experts(n)):
        n.lose("sequence parallelism", f"off → on ({t.name} trains mixture-of-experts blocks beside tensor "
                                       "parallelism only with it)", "MoE with tensor parallelism without sequence parallelism")
        n.fields["sequence_parallel"] = True


def _may_have_experts(n: Nearest) -> bool:
    """Whether the plan's model has experts, or may have them where its graph cannot be loaded."""
    try:
        return plan_graph(n.plan).has_experts
    except ShardplanError:
        return True


def _experts_differ(n: Nearest, mine: str, theirs: str) -> bool:
    """Whether the plan's model has experts that two ``low_precision_experts`` values run in different
    precisions on its mesh (:func:`costmodel.kernels.experts_low_precision`)."""
    prec, pp, cp = n.workload["precision"], n.mesh["pp"], n.mesh["cp"]
    if bool(experts_low_precision(prec, mine, pp, cp)) == bool(experts_low_precision(prec, theirs, pp, cp)):
        return False
    return plan_graph(n.plan).has_experts


def _precision(n: Nearest, t: Target) -> None:
    w = n.workload
    if w["precision"] == "mxfp8" and not t.mxfp8:
        to = "fp8" if t.fp8 else "bf16"
        n.lose("mxfp8", f"mxfp8 → {to} ({t.name} has no mxfp8 training)")
        w["precision"] = to
    if w["precision"] == "fp8" and not t.fp8:
        n.lose("fp8", f"fp8 → bf16 ({t.name} has no fp8 training)")
        w["precision"] = "bf16"
    if n.mesh["pp"] == 1:  # no pipeline, no receive buffers: how the target keeps them changes nothing
        w["recv_buffers"] = t.behaviour.recv_buffers[0]
    if w["precision"] == "fp32" or not any(str(v).startswith("zero3") for v in n.values("sharding")):
        w["zero3_master"] = t.behaviour.zero3_master[0]  # no 16-bit ZeRO-3 shard: where the master lives changes nothing
    if w.get("moe_capacity_factor") is not None and not t.moe_capacity:
        n.lose("capacity factor", f"{w['moe_capacity_factor']:g} → dropless ({t.name} drops no tokens)")
        w["moe_capacity_factor"] = None
    if "selective" not in n.values("recompute"):  # no selective recomputation: what its policy keeps changes nothing
        w["selective"] = t.behaviour.selective[0]
    if not _experts_differ(n, w["low_precision_experts"], t.behaviour.low_precision_experts[0]):
        w["low_precision_experts"] = t.behaviour.low_precision_experts[0]  # experts in one precision either way
    rotate = t.behaviour.cp_rotate
    if n.mesh["cp"] > 1 and n.fields["cp_mode"] == "ring" and n.fields["cp_rotate"] not in rotate:
        n.behave("ring rotation", f"{n.fields['cp_rotate']} → {rotate[0]} (how {t.name} moves K/V round its ring)")
        n.fields["cp_rotate"] = rotate[0]
    if w["moe_tp"] not in t.behaviour.moe_tp and (n.mesh["tp"] == 1 or not _may_have_experts(n)):
        w["moe_tp"] = t.behaviour.moe_tp[0]  # no MoE layer under tp: how the two meet changes nothing
    if w["precision"] not in FP8_PRECISIONS:  # no fp8 linear layer: what it keeps of its input changes nothing
        w["fp8_saved_inputs"] = t.behaviour.fp8_saved_inputs[0]
    for key in WORKLOAD_BEHAVIOUR:
        what, allowed = WORKLOAD_CHOICES[key][0], getattr(t.behaviour, key)
        if w[key] not in allowed:
            n.behave(what, f"{w[key]} → {allowed[0]} (how {t.name} runs it)")
            w[key] = allowed[0]


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
        if any(not x.behaviour for x in self.losses):
            head = f"{self.tool_version} cannot express this plan exactly; exported the nearest plan it can:"
        else:
            head = f"{self.tool_version} runs this plan otherwise than it was priced; re-priced as it runs it:"
        return [head, *(f"  - {x.what}: {x.detail}" for x in self.losses), f"  {self.cost_line()}"]

    def to_dict(self) -> dict[str, Any]:
        r = self.repriced
        return {"target": self.target, "tool_version": self.tool_version, "exact": self.exact,
                "losses": [{"what": x.what, "detail": x.detail, "lacks": x.lacks, "behaviour": x.behaviour}
                           for x in self.losses], "notes": self.notes,
                "changes": self.changes, "strategy": self.strategy.model_dump(mode="json"),
                "step_time_s": r.original["step_time_s"] if r and r.original else None,
                "nearest_step_time_s": r.variant["step_time_s"] if r and r.variant else None,
                "step_time_delta_s": r.delta_s if r else 0.0,
                "nearest_memory_peak_gib": r.variant["memory_peak_gib"] if r and r.variant else None,
                "reprice_error": r.error if r else None}


def change_lines(plan: Plan, s: Strategy, units: list[str]) -> list[str]:
    return [describe_diff(d) for d in diff_strategies(plan.strategy, s, units)]


#: the first line of an export's header, before the release it was written for (``import`` reads it back)
EXPORT_TITLE = "shardplan export for "


def header(plan: Plan, version: str, losses: list[Loss], cost: str = "", comment: str = "#") -> str:
    """Comment lines naming the tool version, the plan, and what the export does not keep. Each line
    is one comment line: what is not printable on one line is written escaped
    (:func:`vocab.names.escape_unprintable`), so no document string can end a comment."""
    c, w, pr = plan.inputs.cluster, plan.inputs.workload, plan.predicted
    lines = [f"{EXPORT_TITLE}{version}",
             f"{plan.inputs.model} on {c.world_size}x {c.accelerator} ({c.nodes} nodes x {c.gpus_per_node}), "
             f"seq_len {w.seq_len}, global batch {w.global_batch}, {w.precision}",
             f"plan: predicted {pr.step_time_s:.4g} s/step, {pr.memory_peak_gib:.1f} GiB peak per GPU",
             inputs_line(plan.inputs.model, c.model_dump(), plan.inputs.memory_limit_gib)]
    if losses:
        lines.append("NOT exactly the plan: the nearest plan this tool can express:")
        lines += [f"  - {x.what}: {x.detail}" for x in losses]
        if cost:
            lines.append(f"  {cost}")
    return "".join(f"{comment} {escape_unprintable(x)}\n" for x in lines)
