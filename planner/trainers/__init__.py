"""The trainers shardplan writes configurations for and reads them back from: one folder per trainer
(``planner/trainers/<name>/``: ``torchtitan``, ``megatron``, ``deepspeed``, ``nanotron``, ``python``),
each with its key names (``keys.py``), its exporter (``export.py``) and its importer (``read.py``).

Export (``shardplan export``): each trainer's ``export`` writes for the target whose file names it
(``vocab/targets/<name>.yaml``, ``exporter:``; ``python`` writes for ``shardplan``), with ``SUFFIX``,
``adjust(n)`` (target-specific mapping to the nearest expressible plan) and ``render(n, s, cost)``; what
every exporter shares is :mod:`planner.trainers.exporting`. :func:`export` maps the plan to the nearest
plan the target can express and, where that differs, re-prices it with the cost model; :func:`refusal`
says why such an export is not written: the plan uses what the target lacks (unless the nearest plan is
asked for), or the nearest plan does not fit; :func:`checked_export` is the two together, the one rule
``shardplan export`` and ``Plan.export`` (``PlanView.export``) both apply.

Import (``shardplan import``): each trainer's ``read`` decodes its files (what every importer shares
is :mod:`planner.trainers.reading`). The model and the cluster come from ``--model`` and
``--cluster``, or from the ``shardplan-inputs`` line that every export except DeepSpeed's JSON carries
in its header (:func:`~planner.trainers.reading.inputs_line`). The header names them for the record: it
may give a preset and a cluster like ``8xh100`` (or a mapping), but a file it names is not opened; that
takes ``--model`` / ``--cluster`` on the command line. The result is a plan for the trainer's target,
priced with that target's behaviour: ``export`` then ``import`` gives back the plan's strategy and its
predicted step time.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

from planner.reprice import recorded_graph, reprice, units_of
from planner.trainers.exporting import EXPORT_TITLE, Exported, Loss, change_lines, normalize
from planner.trainers.reading import INPUTS_TAG, ConfigError, Context, read_inputs
from profiler.graph import LayerGraph
from vocab.arguments import typed
from vocab.errors import ShardplanError, UnknownNameError, shown
from vocab.io import read_text, validate_document
from vocab.plan import Plan, TargetRef
from vocab.rules import batch_problem
from vocab.strategy import Strategy, Workload, even_split
from vocab.targets import WORKLOAD_BEHAVIOUR, Target, by_exporter, targets

#: the exporters, by the name their target gives as its ``exporter``: the package (under this one) of
#: its ``export`` and ``read`` modules, one folder per trainer; a release whose configuration format
#: changed is a subpackage of its trainer's folder
PACKAGES = {"torchtitan": "torchtitan", "torchtitan-0.3": "torchtitan.cli", "megatron": "megatron",
            "megatron-0.19": "megatron",
            "deepspeed": "deepspeed", "nanotron": "nanotron", "python": "python"}
TRAINERS = tuple(PACKAGES)
TARGETS = TRAINERS  # the exporters
#: the importers, by the exporter (and target) they read
IMPORTERS = TRAINERS


@typed
def check_target(target: str) -> str:
    """The exporter for ``target``: an exporter name, or the name of a target that has one."""
    key = target.strip().lower()
    if key in TARGETS:
        return key
    t = targets().get(key)
    if t is not None and t.exporter in TARGETS:
        return t.exporter
    known = dict.fromkeys([*TARGETS, *(n for n, t in targets().items() if t.exporter)])
    raise UnknownNameError("export target", target, known)


def target_of(exporter: str) -> Target:
    """The target an exporter writes for."""
    return by_exporter(check_target(exporter))


@typed
def lacks(plan: Plan, target: str) -> list[Loss]:
    """What ``plan`` uses that ``target`` (an exporter or target name) cannot express, and how the
    target would run it differently (``behaviour`` losses): empty when it exports as it is."""
    key = check_target(target)
    mod = importlib.import_module(f"{__name__}.{PACKAGES[key]}.export")
    n = normalize(plan, units_of(plan), by_exporter(key))
    mod.adjust(n)
    return n.losses


@typed
def export(plan: Plan, target: str, graph: LayerGraph | None = None) -> Exported:
    """The plan as ``target``'s configuration text, or the nearest plan the target can express,
    re-priced with the plan's model (its preset, config file or recorded graph) or ``graph``."""
    key = check_target(target)
    t = by_exporter(key)
    mod = importlib.import_module(f"{__name__}.{PACKAGES[key]}.export")
    recorded_graph(plan)  # a plan whose recorded graph is broken is refused, not exported without it
    units = units_of(plan)
    n = normalize(plan, units, t)
    mod.adjust(n)
    s = n.strategy()
    rep = reprice(plan, s, n.workload_model(), graph) if n.losses else None
    e = Exported(target=key, tool_version=t.label, text="", suffix=mod.SUFFIX, strategy=s,
                 losses=n.losses, notes=n.notes, repriced=rep, changes=change_lines(plan, s, units))
    if rep is not None:
        e.notes += rep.notes
    e.text = mod.render(n, s, e.cost_line())
    return e


@typed
def refusal(e: Exported, nearest: bool = False) -> str | None:
    """Why ``e`` is not written, in one line, or None: the plan uses what the target lacks (unless
    ``nearest``), or the plan as the target can run it does not fit its memory limit."""
    lacking = list(dict.fromkeys(x.lacks for x in e.losses if not x.behaviour))
    if lacking and not nearest:
        return (f"{e.tool_version} cannot express: {'; '.join(lacking)} (--nearest exports the nearest plan it "
                "can, re-priced)")
    r = e.repriced
    if r is not None and r.variant is not None and not r.variant.get("fits", True):
        what = "the nearest plan it can express" if lacking else "the plan as it runs it"
        return (f"{e.tool_version}: {what} needs {r.variant['memory_peak_gib']:.1f} GiB per GPU, over the "
                f"{r.variant['memory_limit_gib']:.1f} GiB limit; nothing written")
    return None


@typed
def checked_export(plan: Plan, target: str, graph: LayerGraph | None = None, nearest: bool = False) -> Exported:
    """:func:`export`, refused as ``shardplan export`` refuses it: a :class:`ShardplanError` with
    :func:`refusal`'s line where the plan uses what the target lacks (unless ``nearest``: then the nearest
    plan it can express) or where the plan as the target runs it does not fit. The command line and
    ``Plan.export`` both call this, so the two refuse the same plans with the same message."""
    e = export(plan, target, graph)
    problem = refusal(e, nearest)
    if problem is not None:
        raise ShardplanError(problem)
    return e


@typed
def importer_for(path: Path, trainer: str | None) -> str:
    """The importer named by ``trainer`` (an importer or target name), or the one whose suffix ``path`` has."""
    if trainer is not None:
        key = trainer.strip().lower()
        if key == "shardplan":
            key = "python"
        if key not in IMPORTERS:
            raise UnknownNameError("trainer", trainer, [*IMPORTERS[:-1], "shardplan"])
        return key
    for name in IMPORTERS:
        if path.suffix.lower() in _module(name).SUFFIXES:
            return name
    firsts = {PACKAGES[n]: n for n in reversed(IMPORTERS)}  # one line per folder: its first importer
    known = ", ".join(f"{'/'.join(_module(n).SUFFIXES)} ({'shardplan' if n == 'python' else n})" for n in IMPORTERS
                      if firsts[PACKAGES[n]] == n)
    raise ConfigError(f"cannot tell the trainer of '{path.name}' from its suffix: {known}; shardplan import "
                      f"also takes --from {'|'.join([*IMPORTERS[:-1], 'shardplan'])}")


def _module(name: str) -> Any:
    """A trainer's importer (its ``read`` module)."""
    return importlib.import_module(f"{__name__}.{PACKAGES[name]}.read")


@typed
def import_plan(path: str | Path, trainer: str | None = None, model: str | None = None,
                cluster: str | dict[str, Any] | None = None, seq_len: int | None = None,
                memory_limit_gib: float | None = None, ep: int | None = None) -> Plan:
    """The plan a trainer's configuration file runs, priced for that trainer's target; ``ep`` is the
    expert parallelism of a trainer whose file does not hold it (DeepSpeed sets it in the model code)."""
    return read_config(path, trainer, model, cluster, seq_len, memory_limit_gib, ep)[0]


@typed
def read_config(path: str | Path, trainer: str | None = None, model: str | None = None,
                cluster: str | dict[str, Any] | None = None, seq_len: int | None = None,
                memory_limit_gib: float | None = None, ep: int | None = None) -> tuple[Plan, list[str], list[str]]:
    """:func:`import_plan`'s plan, the keys of the file that the trainer accepts and no price depends on
    (where its importer says which: Megatron-LM's flags, torchtitan 0.3's; else none listed), and what
    the importer assumed where the file does not say (torchtitan 0.3: a registry function of the
    user's own)."""
    from planner.reprice import load_named_model, price
    from profiler.hardware import parse_cluster

    path = Path(path)
    origin = f"'{path.name}'"
    key = importer_for(path, trainer)
    text = read_text(path, f"{by_exporter(key).trainer} configuration", ConfigError)
    if trainer is None:
        key = _release_named(text, key)
    mod, t = _module(key), by_exporter(key)
    head = read_inputs(text, origin)
    model = model or _header_model(head.get("model"), origin)
    if not model:
        raise ConfigError(f"{origin} does not name its model: give --model")
    spec = cluster or _header_cluster(head.get("cluster"), origin)
    if not spec:
        raise ConfigError(f"{origin} does not name its cluster: give --cluster")
    cl = parse_cluster(spec)
    limit = memory_limit_gib if memory_limit_gib is not None else head.get("memory_limit_gib")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 < limit < 1e9):
        raise ConfigError(f"{origin}: the memory limit must be a positive number of GiB, got {limit!r}")
    doc = mod.parse(text, origin, t)
    found = mod.workload(doc, origin)
    seq = seq_len or found.get("seq_len")
    if not seq:
        raise ConfigError(f"{origin} does not say the sequence length: give --seq-len")
    if seq_len and found.get("seq_len") and seq_len != found["seq_len"]:
        raise ConfigError(f"{origin} trains {found['seq_len']} tokens per sample, not --seq-len {seq_len}")
    graph = load_named_model(model, seq)
    units = [u for u, _ in graph.blocks()]
    ctx = Context(origin, units, graph.num_blocks, cl.world_size, dict(graph.config), ep)
    fields = mod.strategy(doc, ctx)
    if ep is not None and not getattr(mod, "EP_FROM_COMMAND_LINE", False):
        raise ConfigError(f"{origin} says its own expert parallelism; --ep is for a DeepSpeed JSON")
    implied_batch = fields.pop("global_batch", None)  # what the trainer derives when the file leaves it out
    strategy = _validated(Strategy, fields, origin)
    if strategy.stage_layers is not None and strategy.stage_layers == even_split(ctx.blocks, strategy.num_stages):
        strategy = strategy.model_copy(update={"stage_layers": None})  # the even split, said as the plan says it
    if strategy.mesh.world_size != cl.world_size:
        raise ConfigError(f"{origin} lays out {strategy.mesh.world_size} GPUs ({_mesh_text(strategy)}), the cluster "
                          f"has {cl.world_size}")
    gb = found.get("global_batch", implied_batch)
    if gb is None:
        raise ConfigError(f"{origin} does not say the global batch")
    problem = batch_problem(gb, strategy.mesh.dp, strategy.micro_batch)
    if problem:
        raise ConfigError(f"{origin}: {problem}")
    said = {f: found[f] for f in WORKLOAD_BEHAVIOUR if f in found}  # what the file says; else how the target runs
    w = _validated(Workload, {"seq_len": seq, "global_batch": gb, "precision": found.get("precision", "bf16"),
                              "moe_capacity_factor": found.get("moe_capacity_factor"),
                              **t.behaviour.workload(**said)}, origin)
    plan = price(graph, cl, strategy, w, limit, model=model)
    unread = mod.unread(doc) if hasattr(mod, "unread") else []
    assumed = mod.assumed(doc) if hasattr(mod, "assumed") else []
    return plan.model_copy(update={"inputs": plan.inputs.model_copy(
        update={"target": TargetRef(name=t.name, version=t.version or None)})}), unread, assumed


def _release_named(text: str, key: str) -> str:
    """The importer of the release an export's header names (``shardplan export for megatron-core 0.19.2``)
    among those of ``key``'s folder; ``key`` where the header names none of them."""
    m = re.search(rf"^# {re.escape(EXPORT_TITLE)}(.+)$", text, re.MULTILINE)
    if m is None:
        return key
    same = [n for n in IMPORTERS if PACKAGES[n] == PACKAGES[key] and by_exporter(n).label == m.group(1).strip()]
    return same[0] if same else key


def _header_model(model: str | None, origin: str) -> str | None:
    """The header's model where it loads without a file (a preset, or a Hugging Face id a preset lists)."""
    from planner.reprice import loadable_by_name

    if model and not loadable_by_name(model):
        raise ConfigError(f"{origin}: its {INPUTS_TAG} line names model {shown(model)}, a file path, not a preset; "
                          "pass --model PATH to load it")
    return model


def _header_cluster(spec: Any, origin: str) -> Any:
    """The header's cluster where it needs no file (``8xh100``, or a mapping of fields)."""
    from profiler.hardware import names_cluster_file

    if isinstance(spec, str) and names_cluster_file(spec):
        raise ConfigError(f"{origin}: its {INPUTS_TAG} line names cluster file {shown(spec)}; pass --cluster PATH "
                          "to load it")
    return spec


def _validated(cls: Any, data: dict[str, Any], origin: str) -> Any:
    return validate_document(cls, data, f"the plan {origin} describes", cls.__name__.lower(), ConfigError)


def _mesh_text(s: Strategy) -> str:
    return " ".join(f"{k}={v}" for k, v in s.mesh.shown_degrees().items()) or "one GPU"


__all__ = ["IMPORTERS", "TARGETS", "TRAINERS", "ConfigError", "Context", "Exported", "check_target", "checked_export",
           "export",
           "import_plan", "importer_for", "lacks", "read_config", "refusal", "target_of"]
