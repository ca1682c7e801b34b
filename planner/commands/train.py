"""``shardplan train``: run a plan on N local processes and report loss, step time and memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from planner.cli import app, console, guard, print_json
from planner.options import Opt, Values, command, count_option, int_option, number_option
from vocab.errors import ShardplanError

WATCHDOG_S = 300.0  # runtime.launch.WATCHDOG_S (not imported here: that would import torch at start-up)


def _is_dir(name: str) -> bool:
    """Whether ``--model`` names a folder (of weights); a name no file system takes (too long, a NUL) is none."""
    try:
        return Path(name).is_dir()
    except (OSError, ValueError):
        return False


def _settings(plan: Any, steps: int, seed: int, seq_len: int, global_batch: int) -> Any:
    from runtime.train import TrainSettings
    from vocab.rules import batch_problem  # not at start-up: pydantic

    w = plan.inputs.workload
    s = TrainSettings(steps=steps, global_batch=global_batch or w.global_batch, seq_len=seq_len or w.seq_len, seed=seed)
    st = plan.strategy
    problem = batch_problem(s.global_batch, st.mesh.dp, st.micro_batch)
    if problem:
        raise ShardplanError(problem)
    return s


def _files(s: Any, spec: dict[str, Any], data: Path | None, resume: Path | None, save: Path | None) -> None:
    """The token file, the checkpoint to resume and the one to write, checked before any rank starts."""
    from runtime import dcp
    from runtime.data import open_tokens

    if data is not None:
        if spec["kind"] != "reference" and "vocab_size" not in spec["config"]:
            raise ShardplanError("--data needs a model whose vocabulary is known")
        vocab = spec["config"]["vocab"] if spec["kind"] == "reference" else spec["config"]["vocab_size"]
        open_tokens(str(data), int(vocab), s.seq_len)
        s.data = str(data)
    if resume is not None or save is not None:
        if spec["kind"] != "reference":
            raise ShardplanError("checkpoints (--resume, --save) need the runtime's reference model, not a Hugging Face one")
        s.resume = str(dcp.check_source(resume)) if resume is not None else None
        s.save = str(dcp.check_target(save)) if save is not None else None


def _parity(losses: list[float], ref: list[float], rtol: float) -> tuple[bool, float]:
    diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
    ok = all(d <= rtol * abs(b) for d, b in zip(diffs, ref, strict=True))
    return ok, max(diffs, default=0.0)


_CAPTION = ("per rank: its process's CPU seconds over the step; memory in MB: parameters, gradients, optimizer "
            "state (local shards), process peak, and the peak of live tensors (GPU: max allocated; CPU: measured "
            "on the step marked *, which runs slower for it)")
_STEP_COLUMNS = ["step", "loss", "ref loss", "time s"]
_RANK_COLUMNS = ["rank", "cpu s", "params", "grads", "optim", "peak", "tensors"]


def _cells(report: dict[str, Any]) -> list[dict[str, str]]:
    """Every step's rank as named cells; the step's own cells only on its first rank."""
    ref = report.get("reference_losses") or []
    out = []
    for st in report["steps"]:
        for j, r in enumerate(st["ranks"]):
            first = j == 0
            out.append({
                "step": f"{st['step']}{'*' if st.get('memory_tracked') else ''}" if first else "",
                "loss": f"{st['loss']:.5f}" if first else "",
                "ref loss": f"{ref[st['step']]:.5f}" if first and ref else "",
                "time s": f"{st['step_time_s']:.3f}" if first else "", "rank": str(r["rank"]),
                "cpu s": f"{r['cpu_time_s']:.3f}", "params": f"{r['param_bytes'] / 1e6:.2f}",
                "grads": f"{r['grad_bytes'] / 1e6:.2f}", "optim": f"{r['optim_bytes'] / 1e6:.2f}",
                "peak": f"{r['peak_bytes'] / 1e6:.0f}",
                "tensors": "-" if r.get("tensor_peak_bytes") is None else f"{r['tensor_peak_bytes'] / 1e6:.1f}"})
    return out


def _grid(title: Any, columns: list[str], rows: list[dict[str, str]], caption: str | None = None) -> Any:
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for col in columns:
        t.add_column(col, justify="right", no_wrap=True, min_width=7 if "loss" in col else None)
    for row in rows:
        t.add_row(*(row[c] for c in columns))
    return t


def _table(report: dict[str, Any]) -> None:
    """One table where it fits the console; at 80 columns or piped, the steps' losses and then each
    rank's times and memory, one under the other."""
    from planner.layout import fits, literal, styled

    title = styled("shardplan train: ", literal(report["model"]),
                   f" on {report['nproc']} processes ({report['device']})")
    steps = _STEP_COLUMNS if report.get("reference_losses") else [c for c in _STEP_COLUMNS if c != "ref loss"]
    cells = _cells(report)
    wide = _grid(title, steps + _RANK_COLUMNS, cells, _CAPTION)
    if fits(console, wide):
        console.print(wide)
    else:
        console.print(_grid(title, steps, [c for c in cells if c["loss"]]))
        step_of, per_rank = "", []
        for c in cells:  # each rank row names its step
            step_of = c["step"] or step_of
            per_rank.append({**c, "step": step_of})
        console.print(_grid("per rank", ["step", *_RANK_COLUMNS], per_rank, _CAPTION))
    if "parity" in report:
        verdict = "[green]parity[/]" if report["parity"] else "[red]NO parity[/]"
        console.print(f"{verdict}: largest loss difference {report['max_loss_diff']:.3g} (rtol {report['parity_rtol']:g})")


#: ``shardplan train``'s options
TRAIN_OPTIONS = (
    Opt("model", str, typer.Option(
        ..., "--model", "-m", help="tiny-gpt, tiny-llama, tiny-mixtral, tiny-deepseek, hf-llama, hf-gpt2, a preset "
        "(built on the meta device, each rank initialising its shards), or a Hugging Face checkpoint directory "
        "(config.json, *.safetensors; Llama-style or GPT-2), each rank reading its shards")),
    Opt("plan_path", Path, typer.Option(..., "--plan", "-p", help="plan JSON (shardplan plan ... -o plan.json)")),
    Opt("nproc", int, count_option(None, "--nproc", "-n", help="local processes (default: the plan's world size)",
                                   maximum=1024)),
    Opt("steps", int, count_option(3, "--steps", help="optimizer steps", maximum=1_000_000)),
    Opt("check_parity", bool, typer.Option(False, "--check-parity", help="also train in one process and compare "
                                           "losses")),
    Opt("seed", int, int_option(0, "--seed", minimum=0, maximum=2**63 - 1, help="seed of the weights and the "
                                "synthetic tokens")),
    Opt("seq_len", int, count_option(None, "--seq-len", help="tokens per sample (default: the plan's)")),
    Opt("global_batch", int, count_option(None, "--global-batch", help="samples per step (default: the plan's)")),
    Opt("precision", str, typer.Option(
        "fp32", "--precision", help="fp32, bf16 (every unit: bf16 compute, fp32 master weights, gradients reduced in "
        "the plan's grad_dtype), or fp8 (bf16 with the blocks' Linear GEMMs in fp8 through torchao; CUDA only)")),
    Opt("data", Path | None, typer.Option(None, "--data", help="a token file (.npy, or nanoGPT's uint16 .bin) to "
                                          "read the batches from (default: seeded uniform tokens)")),
    Opt("resume", Path | None, typer.Option(None, "--resume", help="a checkpoint directory to start from (written "
                                            "by --save with this plan or another plan of the same model)")),
    Opt("save", Path | None, typer.Option(None, "--save", help="write a checkpoint directory after the last step "
                                          "(torch.distributed.checkpoint)")),
    Opt("output", Path | None, typer.Option(None, "--output", "-o", help="also write the JSON report here "
                                            "(atomically)")),
    Opt("watchdog_s", float, number_option(WATCHDOG_S, "--watchdog-s", help="end the run when a rank is silent this "
                                           "long (its process stops responding, or no rank makes progress); 0: "
                                           "never")),
    Opt("as_json", bool, typer.Option(False, "--json", help="machine-readable output")),
)


@app.command()
@guard
@command(TRAIN_OPTIONS)
def train(o: Values) -> None:
    """Train a model with a plan on N local processes (gloo on CPU, NCCL on GPUs); report loss, time, memory."""
    from vocab.io import canonical_json, check_writable, write_atomic

    if o.output is not None:
        check_writable(o.output, "output")  # before torch is imported and any rank started
    from runtime.apply import check_plan
    from runtime.launch import Job, launch
    from runtime.mesh import device_type
    from runtime.model import spec_for, spec_for_weights
    from vocab.plan import load_plan

    if o.steps < 1:
        raise ShardplanError(f"--steps must be at least 1, got {o.steps}")
    if not o.watchdog_s >= 0:
        raise ShardplanError(f"--watchdog-s must be at least 0 (0: no watchdog), got {o.watchdog_s}")
    plan = load_plan(o.plan_path)
    world = plan.strategy.mesh.world_size
    nproc = o.nproc or world
    if nproc != world:
        raise ShardplanError(f"the plan's mesh {plan.strategy.mesh.axes()} needs {world} processes; --nproc is {nproc}")
    spec = spec_for_weights(o.model) if _is_dir(o.model) else spec_for(o.model, init="seeded")
    s = _settings(plan, o.steps, o.seed, o.seq_len, o.global_batch)
    s.precision, s.grad_dtype = o.precision, plan.inputs.workload.grad_dtype
    _files(s, spec, o.data, o.resume, o.save)
    dev = device_type()
    check_plan(spec, plan, nproc, dev, seq_len=s.seq_len, global_batch=s.global_batch, precision=s.mixed())
    results = launch([Job(model=spec, plan_json=plan.to_json(), settings=s.to_dict(), name=o.model,
                          reference=o.check_parity)], nproc, watchdog_s=o.watchdog_s)
    res = results[0]
    report: dict[str, Any] = {"model": o.model, "plan": str(o.plan_path), "nproc": nproc, "device": dev,
                              "precision": o.precision, "settings": s.to_dict(), "steps": res["steps"],
                              "fsdp_units": res["fsdp_units"], "notes": res["notes"]}
    if o.check_parity:  # rank 0 trained the same model in one process after the distributed run
        ref, rtol = res["reference_losses"], res["parity_rtol"]  # runtime.train.parity_tolerance
        ok, diff = _parity([st["loss"] for st in res["steps"]], ref[res["steps"][0]["step"]:], rtol)
        report.update(reference_losses=ref, parity=ok, max_loss_diff=diff, parity_rtol=rtol)
    if o.output is not None:
        write_atomic(o.output, canonical_json(report))
    if o.as_json:
        print_json(report)
    else:
        _table(report)
