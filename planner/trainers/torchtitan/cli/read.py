"""torchtitan 0.3: a launch script (or a file of its flags) read back into a plan.

The tokens after ``-m torchtitan.train`` (all of them where the file names no entry point) are split by
the shell's rules (:mod:`shlex`, comments and line continuations as ``sh`` reads them). ``--module`` and
``--config`` name a registry function: where the key snapshot records it, its defaults are what the
flags leave out, its model is checked against the model being priced, and its converters and token
dispatcher must be ones shardplan prices; a function of the user's own is read with ``Trainer.Config``'s
defaults, no low-precision converters and the all-to-all dispatcher assumed (:func:`assumed` says so).
Every other flag must be one torchtitan 0.3.0 accepts, with a value of its type. The plan is read as torchtitan 0.2.2's job config is (:mod:`planner.trainers.torchtitan.read`),
with 0.3's differences: sequence parallelism is ``enable_sequence_parallel``; checkpointing is the
``activation_checkpoint:<policy>`` subcommand, every block alike; expert ranks always fold over tp.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from planner.trainers.reading import ConfigError, Context, count
from planner.trainers.torchtitan import read as titan
from planner.trainers.torchtitan.cli.keys import AC, CONFIG_FLAG, DISPATCHERS, ENTRY, FLAGS, FQN, MODULE_FLAG
from vocab.digits import is_digits, read_float
from vocab.errors import shown
from vocab.targets import Target, by_exporter, key_snapshot

SUFFIXES = (".sh",)
EXPORTER = "torchtitan-0.3"
#: the flags whose values the price reads (every other accepted flag is listed as not priced)
PRICED = {*FLAGS.values(), "parallelism.context_parallel_load_balancer"} - {"dataloader.dataset_path", "hf_assets_path"}


def _tokens(text: str, origin: str) -> list[str]:
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as e:
        raise ConfigError(f"{origin} is not a shell command line: {e}") from None
    return tokens[tokens.index(ENTRY) + 1:] if ENTRY in tokens else tokens


def _path(name: str) -> str:
    return name.replace("-", "_")


def parse(text: str, origin: str, t: Target | None = None) -> dict[str, Any]:
    """``{"module", "config", "flags": {path: value}, "policy"}`` of the launch's torchtitan flags, with the
    registry function's record (``entry``; ``recorded``: whether the snapshot has it) and the launch as
    0.2.2's job config (``job``)."""
    snap = key_snapshot(t or by_exporter(EXPORTER))
    types, subcommands = snap["flags"], snap["subcommands"]
    doc: dict[str, Any] = {"module": None, "config": None, "flags": {}, "policy": None}
    tokens, i = _tokens(text, origin), 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, value = tok.partition("=")
        field, colon, choice = tok.partition(":")
        if name in (MODULE_FLAG, CONFIG_FLAG):
            if not eq:
                i += 1
                value = tokens[i] if i < len(tokens) else ""
            doc[name[2:]] = value
        elif not tok.startswith("--") and colon and _path(field) in subcommands:
            if choice not in subcommands[_path(field)]:
                raise ConfigError(f"{origin}: {shown(tok)}: torchtitan 0.3.0's {field} is one of "
                                  f"{', '.join(subcommands[_path(field)])}")
            doc["policy"] = choice
        elif tok.startswith("--"):
            i = _flag(tokens, i, types, doc["flags"], origin, set(subcommands))
            continue
        else:
            raise ConfigError(f"{origin}: {shown(tok)} is neither a flag of torchtitan 0.3.0 nor a subcommand")
        i += 1
    for key in ("module", "config"):
        if not doc[key]:
            raise ConfigError(f"{origin} gives no --{key} (torchtitan 0.3 requires --module and --config)")
    doc["recorded"] = doc["config"] in snap["registry"].get(doc["module"], {})
    doc["entry"] = _registry(doc, snap, origin)
    doc["job"] = _job(doc, origin)
    return doc


def _flag(tokens: list[str], i: int, types: dict[str, str], flags: dict[str, Any], origin: str,
          subcommands: set[str]) -> int:
    """Read the flag at ``tokens[i]`` (and its values, up to the next flag or subcommand) into ``flags``;
    the index after it."""
    name, eq, value = tokens[i][2:].partition("=")
    path, flag = _path(name), shown(f"--{name}")
    head, _, leaf = path.rpartition(".")
    negated = f"{head + '.' if head else ''}{leaf[3:]}" if leaf.startswith("no_") else None
    if types.get(path) == "bool" or (negated and types.get(negated) == "bool"):
        if eq:
            raise ConfigError(f"{origin}: {flag} is a switch: torchtitan 0.3 takes it bare, or as --...no_...")
        flags[negated if types.get(path) != "bool" else path] = types.get(path) == "bool"
        return i + 1
    if path not in types:
        raise ConfigError(f"{origin}: {flag} is not a flag of torchtitan 0.3.0")
    values = [value] if eq else []
    j = i + 1
    while not eq and j < len(tokens) and not tokens[j].startswith("--") \
            and _path(tokens[j].partition(":")[0]) not in subcommands:
        values.append(tokens[j])
        j += 1
    if not values:
        raise ConfigError(f"{origin}: {flag} has no value")
    flags[path] = _typed(flag, types[path], values, origin)
    return j


def _typed(flag: str, kind: str, values: list[str], origin: str) -> Any:
    """A flag's value as its annotation (``kind``, the snapshot's text) reads it: an int, a number, one of
    a Literal's choices, a list of comma-split lists, or text; ``None`` where the annotation allows it."""
    if kind.startswith("list[list["):
        return None if values == ["None"] else [v.split(",") for v in values]
    if len(values) > 1 and not kind.startswith("list["):
        raise ConfigError(f"{origin}: {flag} takes one value, got {len(values)}")
    v = values[0]
    if v == "None" and "None" in kind:
        return None
    if kind.startswith("int"):
        sign = v.startswith("-")
        if not is_digits(v[sign:]):
            raise ConfigError(f"{origin}: {flag} takes an integer, got {shown(v)}")
        return int(v)
    if kind.startswith("float"):
        try:
            return read_float(v)
        except ValueError:
            raise ConfigError(f"{origin}: {flag} takes a number, got {shown(v)}") from None
    choices = re.findall(r"'([^']*)'", kind) if kind.startswith("Literal[") else []
    if choices and v not in choices:
        raise ConfigError(f"{origin}: {flag} is one of {', '.join(choices)}, got {shown(v)}")
    return values if kind.startswith("list[") else v


def _registry(doc: dict[str, Any], snap: dict[str, Any], origin: str) -> dict[str, Any]:
    """The snapshot's record of ``--module``/``--config``; for a function it has not recorded (one of the
    user's own), ``Trainer.Config``'s defaults, no model to check, no converters, the all-to-all dispatcher."""
    entry = snap["registry"].get(doc["module"], {}).get(doc["config"])
    refused = snap["refused_on_cpu"].get(f"{doc['module']}.{doc['config']}")
    if refused is not None:  # a function that turns on low-precision converters (checked at call time)
        raise ConfigError(f"{origin}: --config {shown(doc['config'])} is not priced: calling it needs the GPU its "
                          f"converters need ({refused.split(':')[0]}: {refused.split(':', 1)[1].strip()[:80]}...), "
                          "and low precision is not priced for torchtitan 0.3")
    if entry is None:
        return {**snap["base"], "name": None, "flavor": None, "converters": [], "token_dispatchers": []}
    return entry


def _job(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    """The launch as torchtitan 0.2.2's job config sections (the registry's defaults under the flags)."""
    entry = doc["entry"]
    values = {**entry["defaults"], **doc["flags"]}
    job: dict[str, Any] = {"model": {"name": entry["name"], "flavor": entry["flavor"]}}
    for path, value in values.items():
        section, _, key = path.partition(".")
        if section in ("parallelism", "training") and value is not None:
            job.setdefault(section, {})[key] = value
    policy = doc["policy"] or entry["activation_checkpoint"]
    if policy not in ("none", "selective", "full"):
        raise ConfigError(f"{origin}: {AC}:{policy} is not priced (none, selective and full are)")
    job["activation_checkpoint"] = {"mode": policy, "selective_ac_option": "op"}
    return job


def workload(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    entry = doc["entry"]
    if entry["converters"]:
        raise ConfigError(f"{origin}: {shown(doc['config'])} trains with {', '.join(entry['converters'])}; low precision "
                          "is not priced for torchtitan 0.3")
    dispatch = [DISPATCHERS.get(d) for d in entry["token_dispatchers"]]
    if None in dispatch:
        raise ConfigError(f"{origin}: {shown(doc['config'])}'s token dispatcher {', '.join(entry['token_dispatchers'])} "
                          f"is not priced for torchtitan 0.3 (only {', '.join(DISPATCHERS)})")
    train = doc["job"].get("training", {})
    out: dict[str, Any] = {"seq_len": count(train.get("seq_len"), "training.seq_len", origin)}
    if train.get("global_batch_size", -1) != -1:
        out["global_batch"] = count(train["global_batch_size"], "training.global_batch_size", origin)
    out["precision"] = titan.PRECISIONS[train.get("mixed_precision_param", "bfloat16")]
    if dispatch:
        out["moe_dispatch"] = dispatch[0]
    return out


def strategy(doc: dict[str, Any], ctx: Context) -> dict[str, Any]:
    job = doc["job"]
    fields = titan.strategy(job, ctx, FQN)
    par = job.get("parallelism", {})
    fields["sequence_parallel"] = fields["mesh"]["tp"] > 1 and par.get("enable_sequence_parallel", True) is True
    return fields


def assumed(doc: dict[str, Any]) -> list[str]:
    """What the import assumed: a registry function the key snapshot does not record is read with
    ``Trainer.Config``'s defaults, without low-precision converters, with the all-to-all dispatcher and no
    model check."""
    if doc["recorded"]:
        return []
    return [f"--module {shown(doc['module'])} --config {shown(doc['config'])} is not a registry function shardplan has recorded: "
            "read with Trainer.Config's defaults where the flags say nothing, no low-precision converters, the "
            "all-to-all token dispatcher, its model not checked against the one priced"]


def unread(doc: dict[str, Any]) -> list[str]:
    """The flags given that torchtitan accepts and no price depends on."""
    return [f"--{p}" for p in doc["flags"] if p not in PRICED]
