"""``shardplan import``: a trainer's configuration read back into a plan, priced for its target.

Reads a torchtitan TOML, Megatron-LM flags, a DeepSpeed JSON, a nanotron YAML or a script of
``export --to python`` (:mod:`planner.trainers`); keys the trainer's pinned release does not know,
settings that make no plan and a model or cluster that cannot be found are one line and exit 2,
with nothing written.
"""

from __future__ import annotations

from pathlib import Path

import typer

from planner.cli import app, console, err_console, guard
from planner.layout import literal
from planner.options import int_option, positive_option
from vocab.errors import ShardplanError


@app.command("import")
@guard
def import_cmd(
    config: Path = typer.Argument(..., help="the trainer's configuration: .toml, .args, .json, .yaml or .py"),
    trainer: str | None = typer.Option(None, "--from", help="torchtitan | megatron | deepspeed | nanotron | "
                                       "shardplan (default: from the file's suffix)"),
    model: str | None = typer.Option(None, "--model", "-m", help="preset or config path (default: the model "
                                     "the export's header names)"),
    cluster: str | None = typer.Option(None, "--cluster", "-c", help="e.g. 1024xh100 (default: the header's)"),
    seq_len: int | None = int_option(None, "--seq-len", minimum=1, help="tokens per sample, where the file has none"),
    memory_limit: float | None = positive_option(None, "--memory-limit", help="GiB per GPU the plan must fit"),
    ep: int | None = int_option(None, "--ep", minimum=1, help="expert parallelism, for a DeepSpeed JSON (DeepSpeed "
                                "sets it in the model code)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="write the plan JSON here"),
) -> None:
    """Read a trainer's configuration into a plan and price it (then explain, compare, or search a better one)."""
    from planner.trainers import read_config
    from vocab.io import check_writable

    if output is not None and output.suffix.lower() != ".json":
        raise ShardplanError(f"-o must name a .json file, got '{output}'")
    if output is not None:
        check_writable(output, "-o")
    from planner.reprice import predicted_dict

    plan, unread, assumed = read_config(config, trainer, model, cluster, seq_len, memory_limit, ep)
    pr, s = predicted_dict(plan), plan.strategy
    mesh = " ".join(f"{k}={v}" for k, v in s.mesh.shown_degrees().items())
    fits = "fits" if pr.get("fits", True) else "does NOT fit"
    t = plan.inputs.target
    console.print(literal(f"{config.name} ({t.name} {t.version or ''}): {mesh or 'one GPU'}, micro-batch "
                          f"{s.micro_batch}, {s.schedule}{f'/vpp{s.vpp}' if s.vpp > 1 else ''}; predicted "
                          f"{pr['step_time_s']:.4g} s/step, {pr['memory_peak_gib']:.1f} GiB peak per GPU ({fits} "
                          f"{pr.get('memory_limit_gib', 0):.1f} GiB)"), soft_wrap=True)
    if unread:
        shown = ", ".join(unread[:10]) + (f" and {len(unread) - 10} more" if len(unread) > 10 else "")
        err_console.print(literal(f"not priced (accepted, no price depends on them): {shown}"), soft_wrap=True)
    for line in assumed:
        err_console.print(literal(f"assumed: {line}"), soft_wrap=True)
    if output is not None:
        plan.save(output)
        err_console.print(literal(f"wrote {output}"), soft_wrap=True)
