"""The ``shardplan`` command line.

Every command turns bad input into one line on stderr and exit code 2, and anything unexpected
into one line and exit code 70 (see :func:`guard` and :func:`main`); user text is printed
literally. Commands import heavy packages (torch, solvers) only when they run.
"""

from __future__ import annotations

from planner import sigint  # isort: skip  (first of all: Ctrl-C while the command line loads)

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.layout import literal
from planner.options import int_option
from vocab.errors import ShardplanError, first_line

#: exit code of an unexpected exception (BSD sysexits' EX_SOFTWARE); bad input exits with 2
BUG_EXIT = 70
#: tokens per sample ``inspect`` shows a model at by default (its max where that is shorter)
INSPECT_SEQ_LEN = 4096

app = typer.Typer(
    name="shardplan",
    help="Find the fastest way to train a model on a GPU cluster: profile, price, search, plan, run.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def version() -> str:
    """The installed distribution's version, else (a source tree run without installing) the
    ``version`` of the ``pyproject.toml`` beside the package, else ``unknown``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("shardplan")
    except PackageNotFoundError:
        pass
    import tomllib
    from pathlib import Path

    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"shardplan {version()}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                      help="Print the version and exit."),
) -> None:
    pass


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr (literally) and return the exit to raise."""
    err_console.print(Text("error: ", style="bold red") + literal(message), highlight=False, soft_wrap=True)
    return typer.Exit(code)


def guard(fn: F) -> F:
    """Run a command: a :class:`ShardplanError` becomes one line ``error: ...`` and exit code 2;
    any other exception one line naming it as a bug, exit code 70 (``SHARDPLAN_DEBUG=1`` re-raises
    it, with its traceback); Ctrl-C goes on to the parser, whose exit code 130 :func:`main` reports."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardplanError as e:
            raise fail(str(e)) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):  # Ctrl-C: the parser's exit code 130 (see main)
            raise
        except RecursionError:
            raise fail("the input nests too deeply to read") from None
        except MemoryError:
            raise fail("out of memory: the input is too large", 2) from None
        except Exception as e:
            if sigint.received:  # Ctrl-C, which a library reported as its own error
                raise KeyboardInterrupt from None
            if os.environ.get("SHARDPLAN_DEBUG"):
                raise
            raise fail(f"internal error in '{fn.__name__}': {type(e).__name__}: {first_line(e)} -- this is a bug, "
                       "please report it (SHARDPLAN_DEBUG=1 shows the traceback)", BUG_EXIT) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def _fmt(x: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {suffix}{unit}"
    return f"{x:.0f} {unit}".strip()


@app.command()
@guard
def models(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List the preset models."""
    from profiler.models import presets
    from profiler.transformer import parameter_count

    rows = []
    for name, cfg in presets().items():
        rows.append({"name": name, "arch": cfg.arch, "layers": cfg.layers, "hidden": cfg.hidden,
                     "heads": cfg.heads, "kv_heads": cfg.kv_heads, "experts": cfg.experts,
                     "total_params": parameter_count(cfg), "source": cfg.source})
    if as_json:
        print_json(rows)
        return
    t = Table(title="preset models")
    for col in ("name", "arch", "layers", "hidden", "heads", "kv", "experts", "params"):
        t.add_column(col, justify="right" if col not in ("name", "arch") else "left")
    for r in rows:
        t.add_row(literal(r["name"]), r["arch"], str(r["layers"]), str(r["hidden"]), str(r["heads"]),
                  str(r["kv_heads"]), str(r["experts"] or "-"), _fmt(r["total_params"]))
    console.print(t)


@app.command()
@guard
def hardware(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List the accelerators (one data file each)."""
    from planner.layout import fits
    from profiler.hardware import accelerators

    accs = list(accelerators().values())
    if as_json:
        print_json([a.to_dict() for a in accs])
        return
    cols = {"name": lambda a: literal(a.name), "bf16 TFLOP/s": lambda a: f"{a.peak_tflops['bf16']:g}",
            "fp8 TFLOP/s": lambda a: f"{a.peak_tflops['fp8']:g}", "HBM GB": lambda a: f"{a.hbm_gb:g}",
            "HBM TB/s": lambda a: f"{a.hbm_tbps:g}", "scale-up GB/s": lambda a: f"{a.scale_up.gbps:g}",
            "domain": lambda a: str(a.scale_up.domain), "scale-out GB/s": lambda a: f"{a.scale_out.gbps:g}",
            "GEMM eff": lambda a: f"{a.gemm_efficiency:.2f}"}

    def table(title: str, names: list[str]) -> Table:
        t = Table(title=title)
        for col in names:  # no cell wraps: a table too wide for the terminal gives way to a narrower layout
            t.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
        for a in accs:
            t.add_row(*(cols[c](a) for c in names))
        return t

    wide = table("accelerators", list(cols))
    if fits(console, wide):  # a wide terminal: one table
        console.print(wide)
        return
    split = [table("accelerators: compute and memory", ["name", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB", "HBM TB/s",
                                                        "GEMM eff"]),
             table("accelerators: network", ["name", "scale-up GB/s", "domain", "scale-out GB/s"])]
    if all(fits(console, t) for t in split):  # 80 columns, or a pipe: the columns in two tables
        for t in split:
            console.print(t)
        return
    kv = Table(title="accelerators", show_header=False)  # narrower still: a few lines per accelerator
    kv.add_column("name", style="bold", no_wrap=True)
    kv.add_column("value", overflow="fold")
    for i, a in enumerate(accs):
        if i:
            kv.add_section()
        kv.add_row(literal(a.name), f"bf16 {cols['bf16 TFLOP/s'](a)} TFLOP/s\nfp8 {cols['fp8 TFLOP/s'](a)} TFLOP/s\n"
                   f"HBM {a.hbm_gb:g} GB, {a.hbm_tbps:g} TB/s\nscale-up {a.scale_up.gbps:g} GB/s, domain "
                   f"{a.scale_up.domain}\nscale-out {a.scale_out.gbps:g} GB/s\nGEMM eff {a.gemm_efficiency:.2f}")
    console.print(kv)


@app.command()
@guard
def inspect(
    model: str = typer.Option(
        ..., "--model", "-m", help="preset name, Hugging Face id, config.json path or pkg.module:factory"
    ),
    seq_len: int = int_option(
        None, "--seq-len", minimum=1, help=f"tokens per sample (default: {INSPECT_SEQ_LEN}, or the model's max where "
        "shorter)"
    ),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Show a model's layer graph: parameters, FLOPs and activations per token."""
    from profiler.models import default_seq_len, load_model

    g = load_model(model, seq_len if seq_len is not None else default_seq_len(model, INSPECT_SEQ_LEN))
    s = g.seq_len
    layers = [
        {"name": n.name, "kind": n.kind, "block": n.block, "params": n.params,
         "fwd_flops_per_token": n.fwd_flops / s, "train_flops_per_token": (n.fwd_flops + n.bwd_flops) / s,
         "act_bytes_per_token": n.act_saved_bytes / s, "tp": n.tp}
        for n in g.nodes
    ]
    if as_json:
        print_json({**g.summary(), "layers": layers})
        return
    t = Table(title=literal(f"{g.model_id} at seq_len {s}{' (default; --seq-len sets it)' if seq_len is None else ''}: "
                            f"{_fmt(g.total_params)} parameters, {_fmt(g.train_flops / s, 'FLOP')}/token (fwd+bwd)"))
    for col in ("layer", "kind", "params", "fwd FLOP/token", "saved act B/token"):
        t.add_column(col, justify="left" if col in ("layer", "kind") else "right")
    shown = _collapse_blocks(layers)
    for r in shown:
        t.add_row(literal(r["name"]), r["kind"], _fmt(r["params"]), _fmt(r["fwd_flops_per_token"]),
                  _fmt(r["act_bytes_per_token"]))
    console.print(t)


def _collapse_blocks(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """First block in full, identical later blocks folded into one row each."""
    out: list[dict[str, Any]] = []
    first_block = next((r["block"] for r in layers if r["block"] is not None), None)
    folded: dict[str, Any] | None = None
    for r in layers:
        if r["block"] is None or r["block"] == first_block:
            if folded:
                out.append(folded)
                folded = None
            out.append(r)
            continue
        if folded is None:
            folded = {"name": f"layers.{r['block']}..", "kind": "block", "params": 0,
                      "fwd_flops_per_token": 0.0, "act_bytes_per_token": 0.0, "blocks": set()}
        folded["blocks"].add(r["block"])
        for k in ("params", "fwd_flops_per_token", "act_bytes_per_token"):
            folded[k] += r[k]
    if folded:
        out.append(folded)
    for row in out:  # name each folded row once its blocks are known
        if row["kind"] == "block" and "blocks" in row:
            row["name"] = f"layers.{min(row['blocks'])}-{max(row['blocks'])} (each like layers.{first_block})"
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return its exit code:
    0, 2 for bad input (a usage error too, in one line naming the valid form), 70 for a bug, 130
    when interrupted."""
    from planner import commands  # noqa: F401  (registers the commands of later stages)

    try:
        rc = app(args=argv, standalone_mode=False, prog_name="shardplan")
    except (typer.Abort, KeyboardInterrupt):
        rc = sigint.INTERRUPTED_EXIT
    except typer.Exit as e:
        rc = int(e.exit_code or 0)
    except Exception as e:
        if not _is_click_error(e):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # bare ``shardplan``: the help
            e.show()  # type: ignore[attr-defined]
            return 0
        from planner.options import usage_line

        path, params = _command_of(e, sys.argv[1:] if argv is None else argv)
        err_console.print(Text("error: ", style="bold red") + literal(usage_line(e, path, params)),
                          highlight=False, soft_wrap=True)
        return 2
    if rc == sigint.INTERRUPTED_EXIT:  # Ctrl-C, which the parser turns into this code without a word
        err_console.print(sigint.INTERRUPTED)
    return rc if isinstance(rc, int) else 0


def _is_click_error(e: BaseException) -> bool:
    """Whether ``e`` is the command-line parser's (click's, vendored by recent typer) usage error."""
    return hasattr(e, "format_message") and hasattr(e, "exit_code") and hasattr(e, "show")


def _command_of(e: BaseException, argv: list[str]) -> tuple[str, list[Any]]:
    """The path (``shardplan plan``) and parameters of the command a usage error is about: its
    context's, else (an option without its value is reported without one) the command ``argv``
    names."""
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        return ctx.command_path, list(ctx.command.params)
    command: Any = typer.main.get_command(app)
    path = ["shardplan"]
    for arg in argv:
        sub = getattr(command, "commands", None)
        if sub is None:
            break
        if arg.startswith("-") or arg not in sub:
            continue
        command = sub[arg]
        path.append(arg)
    return " ".join(path), list(getattr(command, "params", []))


def run() -> None:
    """The ``shardplan`` console script: :func:`main`'s exit code; Ctrl-C at any moment, one line
    and exit code 130 (see :mod:`planner.sigint`)."""
    try:
        sigint.running()
        code = main()
    except KeyboardInterrupt:  # outside a command (loading the commands, parsing)
        sigint.finished()
        err_console.print(sigint.INTERRUPTED)
        code = sigint.INTERRUPTED_EXIT
    sigint.finished()
    sys.exit(code)


sigint.loaded()

if __name__ == "__main__":  # python -m planner.cli: run the imported module, where commands register
    from planner.cli import run as _run

    _run()
