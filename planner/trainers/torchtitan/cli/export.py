"""torchtitan 0.3: a launch script, ``torchrun ... -m torchtitan.train --module M --config F`` with one flag
per plan fact, every token quoted by the shell's rules (:func:`shlex.quote`)."""

from __future__ import annotations

import shlex

from planner.trainers.exporting import Nearest, collapse, header
from planner.trainers.torchtitan import export as titan
from planner.trainers.torchtitan.cli.keys import (
    AC,
    AC_POLICIES,
    CONFIG_FLAG,
    ENTRY,
    FLAGS,
    FQN,
    MODULE_FLAG,
    PLACEHOLDERS,
    REGISTRY,
)
from planner.trainers.torchtitan.keys import TORCHTITAN_RESHARD, TORCHTITAN_SCHEDULES
from vocab.strategy import Strategy

SUFFIX = ".sh"


def adjust(n: Nearest) -> None:
    """Activation checkpointing covers every transformer block alike (no per-layer policy in 0.3)."""
    collapse(n, "recompute", "torchtitan 0.3 checkpoints all blocks alike", n.blocks, "per-layer recompute")


def fqns_per_part(s: Strategy, n_blocks: int) -> list[str]:
    """Each virtual stage's module names, comma-joined (one token per stage, as the flag takes them)."""
    return [",".join(p) for p in titan.fqns_per_part(s, n_blocks, FQN)]


def _flag(key: str, value: object) -> list[str]:
    """``--path value``; a boolean as torchtitan's tyro flags take it: ``--path`` or ``--section.no_key``."""
    path = FLAGS[key]
    if isinstance(value, bool):
        head, _, leaf = path.rpartition(".")
        return [f"--{path}" if value else f"--{head + '.' if head else ''}no_{leaf}"]
    values = value if isinstance(value, list) else [value]
    return [f"--{path}", *(str(v) for v in values)]


def _model(n: Nearest) -> list[str]:
    """``--module``/``--config`` of the registry function that builds the plan's model, or placeholders
    torchtitan refuses (with a note) where it has none."""
    found = REGISTRY.get(n.plan.inputs.model)
    if found is None:
        n.notes.append(f"torchtitan 0.3.0 has no registry function of {n.plan.inputs.model} in bf16: set --module "
                       "and --config to one of your own (a function returning its Trainer.Config)")
        found = ("SET-ME-module", "SET-ME-config")
    return [MODULE_FLAG, found[0], CONFIG_FLAG, found[1]]


def _parallelism(n: Nearest, s: Strategy) -> list[str]:
    m = s.mesh
    rep, shd, shard = titan.data_parallel(n, s)
    out = [*_flag("dp_replicate", rep), *_flag("dp_shard", shd),
           *_flag("reshard", TORCHTITAN_RESHARD.get(shard, "default")), *_flag("tp", m.tp)]
    if m.tp > 1:
        out += _flag("sequence_parallel", bool(s.sequence_parallel))
    out += _flag("pp", m.pp)
    if m.pp > 1:
        out += [*_flag("schedule", TORCHTITAN_SCHEDULES[s.schedule]), *_flag("pp_microbatch", s.micro_batch),
                *_flag("fqns_per_part", fqns_per_part(s, len(n.blocks)))]
    return out + [*_flag("cp", m.cp), *_flag("ep", m.ep)]


def render(n: Nearest, s: Strategy, cost: str) -> str:
    m, w = s.mesh, n.workload_model()
    n_mb = s.num_microbatches(w.global_batch)
    args = _model(n) + _parallelism(n, s)
    args += [*_flag("local_batch", s.micro_batch * (n_mb if m.pp > 1 else 1)), *_flag("global_batch", w.global_batch),
             *_flag("seq_len", w.seq_len), *_flag("mp_param", "bfloat16"),
             *_flag("cpu_offload", any(s.for_unit(u).offload != "none" for u in n.units))]
    if m.pp > 1 or m.ep > 1:  # Trainer.Config refuses CUDA graphs with either (trainer.py:183-210)
        args += _flag("no_cuda_graphs", True)
    for key, value in PLACEHOLDERS:
        args += _flag(key, value)
    policies = {s.for_unit(u).recompute for u in n.blocks} or {"none"}
    args.append(f"{AC}:{AC_POLICIES[policies.pop()]}")  # the subcommand comes after every flag
    c = n.plan.inputs.cluster
    lines = [f"exec torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} \"$@\" -m {ENTRY}"]
    lines += ["  " + " ".join(shlex.quote(a) for a in group) for group in _by_flag(args)]
    script = " \\\n".join(lines) + "\n"
    notes = ("# placeholders: set --hf_assets_path and --dataloader.dataset_path to the run's tokenizer and data "
             "(torchtitan stops on them once it builds the tokenizer and the dataloader)\n"
             "# launch: sh THIS_FILE [torchrun's rendezvous flags, e.g. --rdzv-backend c10d --rdzv-endpoint HOST:PORT]\n")
    return "#!/bin/sh\n" + header(n.plan, n.label, n.losses, cost) + notes + script


def _by_flag(args: list[str]) -> list[list[str]]:
    """The words one line each: a flag with its values, or the subcommand."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("--") or a.startswith(f"{AC}:") or not groups:
            groups.append([])
        groups[-1].append(a)
    return groups
