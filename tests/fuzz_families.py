"""The fuzz families: generators of a :class:`~tests.fuzz_runner.Case` from ``rnd`` (an object with
:class:`random.Random`'s ``random``, ``randrange`` and ``choice``) and a ``FuzzEnv``, with their
constants: those of :data:`IN_PROCESS` call parsing functions directly, those of :data:`COMMAND_LINE`
run ``shardplan`` command lines."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz_inputs import BIG, CLUSTER_SPECS, batch_seeds, mutate_document, short
from tests.fuzz_runner import Case, FuzzEnv, Outcome, call, check_batch, check_output_file, run_cli, snapshot

PLAN_FOCUS = (("strategy",), ("inputs",), ("predicted",), ("schema_version",), ("solver",), ("alternatives",))


def _in_process(fn: Callable[..., Any], *args: Any, env: dict[str, str | None] | None = None
                ) -> Callable[[float | None], Outcome]:
    return lambda limit: call(fn, *args, limit=limit, env=env)


def _cli(argv: list[str], env: dict[str, str | None] | None = None) -> Callable[[float | None], Outcome]:
    return lambda limit: run_cli(argv, limit, env)


# ---- in-process families ----------------------------------------------------------------------

def gen_plan_doc(rnd: Any, fz: FuzzEnv) -> Case:
    """``vocab.plan.parse_plan`` (dict or text) and ``load_plan`` on a mutated plan."""
    from vocab.plan import load_plan, parse_plan

    name, doc, _ = rnd.choice(fz.plans)
    return _document_case(rnd, fz, "plan-doc", "vocab.plan.", doc, PLAN_FOCUS, parse_plan, load_plan,
                          [f"seed plan {name}"])


def _document_case(rnd: Any, fz: FuzzEnv, family: str, prefix: str, doc: Any, focus: tuple[tuple[Any, ...], ...],
                   parse: Callable[[Any], Any], load: Callable[[Path], Any], notes: list[str]) -> Case:
    """A mutated ``doc`` given to ``parse`` as a dict or as text, or to ``load`` as a file."""
    mode = rnd.choice(("dict", "text", "file"))
    tree, data, changes = mutate_document(rnd, doc, focus=focus, text_p=0.0 if mode == "dict" else 0.35)
    notes = [*notes, *changes]
    if mode == "dict":
        return Case(family, f"{prefix}{parse.__name__}(dict)", notes, _in_process(parse, tree), payload=data)
    if mode == "text":
        text = data.decode("utf-8", "surrogateescape")
        return Case(family, f"{prefix}{parse.__name__}(str)", notes, _in_process(parse, text), payload=data)
    path = fz.file(data)
    return Case(family, f"{prefix}{load.__name__}(path)", notes, _in_process(load, path), payload=data,
                cleanup=[path])


PROFILE_FOCUS = (("compute",), ("comm",), ("device",), ("model",))


def gen_profile_doc(rnd: Any, fz: FuzzEnv) -> Case:
    """``profiler.profile_schema.parse_profile`` (dict or text) and ``load_profile``."""
    from profiler.profile_schema import load_profile, parse_profile

    return _document_case(rnd, fz, "profile-doc", "", fz.profile, PROFILE_FOCUS, parse_profile, load_profile, [])


SEQ_LENS: list[Any] = [None, 128, 128, 512, 1, 0, -1, 10**7, 10**9, BIG]


def _load_graph(spec: Any, seq_len: Any) -> Any:
    from profiler.models import load_model

    return load_model(spec, seq_len)


def gen_hf_config(rnd: Any, fz: FuzzEnv) -> Case:
    """``profiler.models.load_model`` on a mutated config file (or dict) at a sequence length."""
    mode = rnd.choice(("file", "file", "dict"))
    # (a file of TransformerConfig fields is no Hugging Face config: transformers would trace it)
    name = rnd.choice(sorted(k for k in fz.configs if mode == "dict" or k != "tiny-native"))
    seq = rnd.choice(SEQ_LENS)
    tree, data, notes = mutate_document(rnd, fz.configs[name], text_p=0.0 if mode == "dict" else 0.3)
    notes = [f"seed config {name}", *notes, f"seq_len={short(seq)}"]
    if mode == "dict":
        return Case("hf-config", "load_model(dict, seq_len)", notes, _in_process(_load_graph, tree, seq), payload=data)
    path = fz.file(data, ".json", stem="config")
    return Case("hf-config", "load_model(path, seq_len)", notes, _in_process(_load_graph, str(path), seq),
                payload=data, cleanup=[path])


CLUSTER_SPEC_NASTY = ["0xh100", "-4xh100", "4x", "x", "", " ", "4xh100 ", "4 x h100", "99999999999999999999xh100",
                      "1" + "0" * 5000 + "xh100", "4xnope", "4x[red]h100", "4x\x1b[31mh100", "4.5xh100", "nanxh100",
                      "4xh100\n", "４xh100", "٤xh100", "4xh100x2", "4×cpu", "4*cpu", "8xH100-SXM", "3xh100",
                      "missing.yaml", "missing.json", "/", ".", "4xcpu.yaml"]


def _parse_cluster(spec: Any) -> Any:
    from profiler.hardware import parse_cluster

    return parse_cluster(spec)


def _accelerator_from_dict(d: Any) -> Any:
    from profiler.hardware import Accelerator

    return Accelerator.from_dict(d)


def gen_cluster(rnd: Any, fz: FuzzEnv) -> Case:
    """``profiler.hardware.parse_cluster`` on a spec string, a dict, or a YAML/JSON file;
    ``Accelerator.from_dict`` on a mutated accelerator."""
    mode = rnd.choice(("spec", "dict", "dict", "file", "file", "accelerator"))
    if mode == "spec":
        spec = rnd.choice(CLUSTER_SPEC_NASTY + CLUSTER_SPECS)
        if rnd.random() < 0.3:
            spec = f"{rnd.choice((0, 1, 3, 4, 7, 8, 9, 16, 1000, 10**6, 2**40))}x{rnd.choice(('h100', 'cpu', 'gb200', 'a100-80gb', 'mi300x'))}"
        return Case("cluster", "parse_cluster(str)", [f"spec {spec!r}"], _in_process(_parse_cluster, spec),
                    payload=spec.encode("utf-8", "surrogateescape"))
    if mode == "accelerator":
        tree, data, notes = mutate_document(rnd, fz.accelerator, text_p=0.0)
        return Case("cluster", "Accelerator.from_dict", notes, _in_process(_accelerator_from_dict, tree), payload=data)
    seed = rnd.choice(fz.clusters)
    if mode == "dict":
        tree, data, notes = mutate_document(rnd, seed, text_p=0.0)
        if not isinstance(tree, dict):
            tree = {"accelerator": tree}
        return Case("cluster", "parse_cluster(dict)", notes, _in_process(_parse_cluster, tree), payload=data)
    suffix = rnd.choice((".yaml", ".yml", ".json"))
    tree, data, notes = mutate_document(rnd, seed, yaml_text=suffix != ".json", text_p=0.4)
    path = fz.file(data, suffix, stem="cluster")
    return Case("cluster", f"parse_cluster(path{suffix})", notes, _in_process(_parse_cluster, str(path)),
                payload=data, cleanup=[path])


def _accelerator_dir(fz: FuzzEnv, rnd: Any) -> tuple[Path, bytes, list[str]]:
    suffix = rnd.choice((".yaml", ".json"))
    tree, data, notes = mutate_document(rnd, fz.accelerator, yaml_text=suffix == ".yaml", text_p=0.3)
    folder = fz.name("", stem="accdir")
    folder.mkdir()
    (folder / f"fuzzacc{suffix}").write_bytes(data)
    return folder, data, [f"accelerator file fuzzacc{suffix}", *notes]


def _accelerators_and_cluster() -> Any:
    from profiler.hardware import accelerators, parse_cluster

    accelerators()
    return parse_cluster("8xfuzzacc")


def gen_accelerator_file(rnd: Any, fz: FuzzEnv) -> Case:
    """A mutated accelerator file in a ``SHARDPLAN_ACCELERATOR_PATH`` folder: ``accelerators()``
    and ``parse_cluster('8xfuzzacc')``."""
    folder, data, notes = _accelerator_dir(fz, rnd)
    env = {"SHARDPLAN_ACCELERATOR_PATH": str(folder)}
    return Case("accelerator", "accelerators() + parse_cluster('8xfuzzacc')", notes,
                _in_process(_accelerators_and_cluster, env=env), env=env, payload=data, cleanup=[folder])


def _price(line: Any) -> Any:
    from planner.commands.estimate import price_args

    return price_args(line)


BATCH_FOCUS = (("model",), ("cluster",), ("seq_len",), ("global_batch",), ("tp",), ("pp",), ("cp",), ("ep",),
               ("micro_batch",), ("vpp",), ("memory_limit",), ("zero",), ("dp",), ("dp_shard",),
               ("dp_replicate",), ("schedule",), ("plan",))


def gen_batch_line(rnd: Any, fz: FuzzEnv) -> Case:
    """``planner.commands.estimate.price_args`` on a mutated batch line (a dict)."""
    seeds = batch_seeds(fz.plans[0][2])
    seed = rnd.choice(seeds)
    tree, data, notes = mutate_document(rnd, seed, focus=BATCH_FOCUS, text_p=0.0, ops=2)
    if not isinstance(tree, dict):
        tree = {"model": tree}
    return Case("batch-line", "price_args(dict)", notes, _in_process(_price, tree), payload=data)


# ---- command-line families ------------------------------------------------------------------

EXPORT_TARGETS = ("torchtitan", "torchtitan-0.3", "megatron", "deepspeed", "nanotron", "python")
PLOT_KINDS = ("memory", "timeline", "layers", "pareto")


def _plan_command(rnd: Any, fz: FuzzEnv, path: Path, seed_path: Path) -> tuple[list[str], list[Callable[[Outcome], str | None]], list[Path]]:
    """A command that reads the plan file ``path``, with its output rule."""
    cmd = rnd.choice(("explain", "explain", "estimate", "estimate", "export", "export", "compare", "plot"))
    checks: list[Callable[[Outcome], str | None]] = []
    extra: list[Path] = []
    if cmd == "explain":
        argv = ["explain", str(path)] + (["--json"] if rnd.random() < 0.5 else [])
    elif cmd == "estimate":
        argv = ["estimate", "--plan", str(path)] + (["--json"] if rnd.random() < 0.5 else [])
    elif cmd == "compare":
        argv = ["compare", str(path), str(seed_path)] + (["--json"] if rnd.random() < 0.5 else [])
    elif cmd == "export":
        argv = ["export", str(path), "--to", rnd.choice(EXPORT_TARGETS)]
        if rnd.random() < 0.5:
            out = fz.name(".out", stem="export")
            if rnd.random() < 0.5:
                out.write_bytes(b"previous contents\n")
            before = snapshot(out)
            argv += ["-o", str(out)]
            checks.append(lambda o, out=out, before=before: check_output_file(out, before, o, "text"))
            extra.append(out)
    else:
        suffix = rnd.choice((".svg", ".png"))
        out = fz.name(suffix, stem="plot")
        if rnd.random() < 0.5:
            out.write_bytes(b"previous contents\n")
        before = snapshot(out)
        argv = ["plot", str(path), "--kind", rnd.choice(PLOT_KINDS), "-o", str(out)]
        checks.append(lambda o, out=out, before=before: check_output_file(out, before, o, suffix[1:]))
        extra.append(out)
    return argv, checks, extra


def gen_cli_plan_file(rnd: Any, fz: FuzzEnv) -> Case:
    """explain / estimate --plan / export / compare / plot on a mutated plan file."""
    name, doc, seed_path = rnd.choice(fz.plans)
    _, data, notes = mutate_document(rnd, doc, focus=PLAN_FOCUS, text_p=0.3)
    path = fz.file(data, ".json", stem="plan")
    argv, checks, extra = _plan_command(rnd, fz, path, seed_path)
    return Case("cli-plan-file", f"shardplan {argv[0]}", [f"seed plan {name}", *notes], _cli(argv), argv=argv,
                payload=data, checks=checks, cleanup=[path, *extra])


ESTIMATE_BASE = ["--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8"]


def gen_cli_profile(rnd: Any, fz: FuzzEnv) -> Case:
    """estimate --profile (and now and then plan --profile) with a mutated profile file."""
    _, data, notes = mutate_document(rnd, fz.profile, focus=PROFILE_FOCUS, text_p=0.3)
    path = fz.file(data, ".json", stem="profile")
    if rnd.random() < 0.15:
        argv = ["plan", *ESTIMATE_BASE, "--space", "fsdp", "--profile", str(path)]
    else:
        flags = rnd.choice(([], ["--tp", "2"], ["--pp", "2", "--micro-batch", "2"], ["--zero", "3", "--json"],
                            ["--cp", "2", "--sequence-parallel"]))
        argv = ["estimate", *ESTIMATE_BASE, *flags, "--profile", str(path)]
    return Case("cli-profile", f"shardplan {argv[0]} --profile", notes, _cli(argv), argv=argv, payload=data,
                cleanup=[path])


def gen_cli_config(rnd: Any, fz: FuzzEnv) -> Case:
    """inspect --model / estimate --model with a mutated config.json."""
    name = rnd.choice(sorted(k for k in fz.configs if k != "tiny-native"))
    _, data, notes = mutate_document(rnd, fz.configs[name], text_p=0.3)
    path = fz.file(data, ".json", stem="config")
    if rnd.random() < 0.5:
        argv = ["inspect", "--model", str(path)] + rnd.choice(([], ["--json"], ["--seq-len", "256"]))
    else:
        argv = ["estimate", "--model", str(path), "--cluster", "8xh100", "--seq-len", "256", "--global-batch", "16",
                *rnd.choice(([], ["--tp", "2"], ["--pp", "2"], ["--zero", "3"]))]
    return Case("cli-config", f"shardplan {argv[0]} --model FILE", [f"seed config {name}", *notes], _cli(argv),
                argv=argv, payload=data, cleanup=[path])


def gen_cli_cluster(rnd: Any, fz: FuzzEnv) -> Case:
    """estimate --cluster with a mutated cluster file or spec; an accelerator file through
    SHARDPLAN_ACCELERATOR_PATH with hardware / estimate."""
    mode = rnd.choice(("file", "file", "spec", "accelerator"))
    tail = ["--seq-len", "128", "--global-batch", "8"]
    if mode == "spec":
        spec = rnd.choice(CLUSTER_SPEC_NASTY + CLUSTER_SPECS)
        argv = ["estimate", "--model", "gpt2", "--cluster", spec, *tail]
        return Case("cli-cluster", "shardplan estimate --cluster SPEC", [f"spec {spec!r}"], _cli(argv), argv=argv)
    if mode == "accelerator":
        folder, data, notes = _accelerator_dir(fz, rnd)
        env = {"SHARDPLAN_ACCELERATOR_PATH": str(folder)}
        argv = rnd.choice((["hardware", "--json"], ["hardware"], ["estimate", "--model", "gpt2", "--cluster", "8xfuzzacc", *tail]))
        return Case("cli-cluster", f"shardplan {argv[0]} (accelerator file)", notes, _cli(argv, env), argv=argv,
                    env=env, payload=data, cleanup=[folder])
    seed = rnd.choice(fz.clusters)
    suffix = rnd.choice((".yaml", ".json"))
    _, data, notes = mutate_document(rnd, seed, yaml_text=suffix == ".yaml", text_p=0.4)
    path = fz.file(data, suffix, stem="cluster")
    argv = ["estimate", "--model", "gpt2", "--cluster", str(path), *tail]
    return Case("cli-cluster", "shardplan estimate --cluster FILE", notes, _cli(argv), argv=argv, payload=data,
                cleanup=[path])


def gen_cli_batch(rnd: Any, fz: FuzzEnv) -> Case:
    """estimate --batch on a file of mutated lines (and odd line endings)."""
    seeds = batch_seeds(fz.plans[0][2])
    lines, notes = [], []
    for i in range(1 + rnd.randrange(4)):
        r = rnd.random()
        if r < 0.3:
            lines.append(json.dumps(rnd.choice(seeds)).encode())
            continue
        if r < 0.45:
            raw = rnd.choice((b"", b"   ", b"{", b"[]", b"null", b"42", b'"x"', b"NaN", b"{}", b"\xff\xfe",
                              b'{"model": "gpt2"}', b"{} {}", b'{"a": 1}\r', b"\x00", b'{"model": "gpt2\xe2\x80\xa8"}'))
            lines.append(raw)
            notes.append(f"line {i + 1} = {raw!r}")
            continue
        tree, data, n = mutate_document(rnd, rnd.choice(seeds), focus=BATCH_FOCUS, text_p=0.15, ops=2)
        lines.append(data.replace(b"\n", b" "))
        notes.append(f"line {i + 1}: " + "; ".join(n))
    sep = rnd.choice((b"\n", b"\n", b"\n", b"\r\n", b"\r", b"\x0b", b"\x0c", b"\x1c", "\u2028".encode(), "\x85".encode()))
    if sep != b"\n":
        notes.append(f"lines separated by {sep!r}")
    data = sep.join(lines) + (b"\n" if rnd.random() < 0.8 else b"")
    path = fz.file(data, ".jsonl", stem="batch")
    argv = ["estimate", "--batch", str(path)]
    return Case("cli-batch", "shardplan estimate --batch", notes, _cli(argv), argv=argv, payload=data,
                checks=[lambda o: check_batch(data, o)], cleanup=[path])


#: command-line values that must be refused (exit 2) for a count or a limit
BAD_NUMBERS = ["0", "-1", "-0", "nan", "NaN", "inf", "-inf", "1e400", "abc", "", " ", "0x10", "--", "1,5",
               "[red]1[/red]", "\x1b[31m1", "1\n2"]
HUGE_NUMBERS = ["1" + "0" * 30, "9" * 5000, "1e30", "18446744073709551617"]
ODD_NUMBERS = ["4.5", "1_000", "+3", " 8", "8 ", "８", "٣", "1e3", "3", "5", "7", "16", "64", "1024"]
#: name-like values: markup, escapes, newlines, odd paths
ODD_NAMES = ["[red]gp[/red]t2", "[/x]", "[bold]gpt2", "gpt2[/]", "\x1b[31mgpt2\x1b[0m", "\x1b]0;pwned\x07", "gpt2\n",
             "gp\nt2", "\x00gpt2", "\ud800", "GPT2", " gpt2 ", "gpt2 ", "", "-", "--json", "nonexistent.json",
             "/", ".", "/dev/null", "nonexistent_fuzz_module:factory", "tests.fixtures_models:does_not_exist",
             ":", "a:b:c", "x" * 5000, "é", "\u202egpt2"]

#: command: (base argv, {flag: kind}) where kind is count (>= 1), count0 (>= 0), limit (> 0, finite), name
CLI_TEMPLATES: dict[str, tuple[list[str], dict[str, str]]] = {
    "estimate": (["estimate", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8",
                  "--tp", "2", "--pp", "1", "--cp", "1", "--ep", "1", "--micro-batch", "1", "--vpp", "1",
                  "--memory-limit", "20", "--zero", "1", "--schedule", "1f1b", "--recompute", "none"],
                 {"--tp": "count", "--pp": "count", "--cp": "count", "--ep": "count", "--micro-batch": "count",
                  "--vpp": "count", "--seq-len": "count", "--global-batch": "count", "--memory-limit": "limit",
                  "--zero": "zero", "--model": "name", "--cluster": "name", "--schedule": "name",
                  "--recompute": "name", "--precision": "name", "--attention-kernel": "name",
                  "--dp": "count", "--dp-shard": "count", "--dp-replicate": "count", "--selective": "name"}),
    "plan": (["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8", "--space",
              "fsdp", "--top-k", "2"],
             {"--seq-len": "count", "--global-batch": "count", "--memory-limit": "limit", "--time-limit": "limit",
              "--top-k": "count0", "--model": "name", "--cluster": "name", "--space": "name", "--precision": "name",
              "--cross-entropy": "name"}),
    "inspect": (["inspect", "--model", "gpt2", "--seq-len", "128"], {"--seq-len": "count0", "--model": "name"}),
}


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def must_refuse(kind: str, value: str) -> bool:
    """Whether ``value`` is outside the range of a flag of ``kind`` (counts are positive integers,
    limits finite positive numbers): the command must then exit with code 2."""
    if kind not in ("count", "count0", "limit", "zero"):
        return False
    try:
        x = float(value.replace("_", "")) if kind == "limit" else int(value)
    except ValueError:
        return True
    if kind == "limit":
        return not math.isfinite(x) or x <= 0
    if kind == "zero":
        return x not in (0, 1, 2, 3)
    return x < (0 if kind == "count0" else 1)


def gen_cli_values(rnd: Any, fz: FuzzEnv) -> Case:
    """A command with one or two flag values replaced (bad counts and limits, markup and escape
    sequences in names); a value out of a flag's range must be refused with exit code 2."""
    cmd = rnd.choice(("estimate", "estimate", "plan", "inspect"))
    argv, flags = CLI_TEMPLATES[cmd]
    chosen: dict[str, str] = {}
    for _ in range(1 + rnd.randrange(2)):
        flag = rnd.choice(sorted(flags))
        if flags[flag] == "name":
            chosen[flag] = rnd.choice(ODD_NAMES + ["gpt2", "4xcpu", "8xh100", "interleaved", "zb", "full", "fp8",
                                                   "flash3"])
        else:
            chosen[flag] = rnd.choice(BAD_NUMBERS + HUGE_NUMBERS + ODD_NUMBERS)
    for flag, value in chosen.items():
        argv = set_flag(argv, flag, value)
    notes = [f"{flag} {value!r}" for flag, value in chosen.items()]
    must = [f"{flag} {value!r}" for flag, value in chosen.items() if must_refuse(flags[flag], value)]

    def refused(o: Outcome, must: list[str] = must) -> str | None:
        if must and o.rc == 0:
            return f"accepted out-of-range value(s) {', '.join(must)} (must exit 2)"
        return None

    return Case("cli-values", f"shardplan {cmd} (flag values)", notes, _cli(argv), argv=argv, checks=[refused])


#: the kinds of ``-o`` target :func:`output_target` makes
OUTPUT_KINDS = ("dir", "under-file", "missing-dir", "existing", "new", "odd-suffix", "newline", "long", "dot")


def output_target(base: Path, cmd: str, kind: str) -> Path:
    """An ``-o`` of ``kind`` for ``cmd`` (plan, export or plot) inside the folder ``base``, which gets a
    regular file and a subfolder to aim at (and the file an ``existing`` target replaces)."""
    (base / "file.json").write_text("{}\n")
    (base / "sub").mkdir()
    suffix = {"plan": ".json", "export": ".toml", "plot": ".svg"}[cmd]
    target = {
        "dir": base / "sub",
        "under-file": base / "file.json" / f"out{suffix}",
        "missing-dir": base / "a" / "b" / f"out{suffix}",
        "existing": base / f"exists{suffix}",
        "new": base / f"out{suffix}",
        "odd-suffix": base / "out.JSON" if cmd == "plan" else base / "out.txt",
        "newline": base / f"o\nut{suffix}",
        "long": base / ("x" * 300 + suffix),
        "dot": base / ".",
    }[kind]
    if kind == "existing":
        target.write_bytes(b"previous contents\n")
    return target


def gen_cli_output(rnd: Any, fz: FuzzEnv) -> Case:
    """-o onto a folder, under a regular file, into a missing folder, onto an existing file, with odd
    names; a failed command must leave the target as it was, a successful one a whole file."""
    cmd = rnd.choice(("plan", "export", "plot"))
    name, _, seed_path = rnd.choice(fz.plans)
    base = fz.name("", stem="outdir")
    base.mkdir()
    kind = rnd.choice(OUTPUT_KINDS)
    target = output_target(base, cmd, kind)
    before = snapshot(target)
    if cmd == "plan":
        argv = ["plan", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch",
                rnd.choice(("8", "8", "0", "7")), "--space", "fsdp", "-o", str(target)]
        check_kind = "plan"
    elif cmd == "export":
        argv = ["export", str(seed_path), "--to", rnd.choice((*EXPORT_TARGETS, "nope")), "-o", str(target)]
        check_kind = "text"
    else:
        argv = ["plot", str(seed_path), "--kind", rnd.choice((*PLOT_KINDS, "nope")), "-o", str(target)]
        check_kind = "svg" if target.suffix == ".svg" else "text"
    checks = [lambda o: check_output_file(target, before, o, check_kind)] if kind not in ("dir", "dot") else []
    return Case("cli-output", f"shardplan {cmd} -o", [f"-o {kind}: {target}", f"seed plan {name}"], _cli(argv),
                argv=argv, checks=checks, cleanup=[base])


def gen_cli_paths(rnd: Any, fz: FuzzEnv) -> Case:
    """Every file-taking argument given a folder, a FIFO, a missing file, a name with a newline or NUL,
    a too-long name, a symlink loop, an empty file."""
    folder = fz.name("", stem="paths")
    folder.mkdir()
    kind = rnd.choice(("dir", "fifo", "missing", "newline", "nul", "long", "loop", "empty", "markup"))
    if kind == "dir":
        p = folder / "d.json"
        p.mkdir()
    elif kind == "fifo":
        p = folder / "pipe.json"
        os.mkfifo(p)
    elif kind == "missing":
        p = folder / "missing.json"
    elif kind == "newline":
        p = folder / "bad\nname.json"
    elif kind == "nul":
        p = Path(str(folder / "nul") + "\x00.json")
    elif kind == "long":
        p = folder / ("y" * 300 + ".json")
    elif kind == "loop":
        p = folder / "loop.json"
        p.symlink_to(p)
    elif kind == "empty":
        p = folder / "empty.json"
        p.write_bytes(b"")
    else:
        p = folder / "[red]x[/red].json"
    use = rnd.choice(("explain", "estimate-plan", "profile", "batch", "model", "cluster", "compare", "export", "inspect"))
    s = str(p)
    argv = {
        "explain": ["explain", s],
        "estimate-plan": ["estimate", "--plan", s],
        "profile": ["estimate", *ESTIMATE_BASE, "--profile", s],
        "batch": ["estimate", "--batch", s],
        "model": ["estimate", "--model", s, "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8"],
        "cluster": ["estimate", "--model", "gpt2", "--cluster", s if kind != "missing" else s[:-5] + ".yaml",
                    "--seq-len", "128", "--global-batch", "8"],
        "compare": ["compare", s, str(fz.plans[0][2])],
        "export": ["export", s, "--to", "megatron"],
        "inspect": ["inspect", "--model", s],
    }[use]
    return Case("cli-paths", f"shardplan {argv[0]} ({use}: {kind})", [f"{use} path is {kind}: {s!r}"], _cli(argv),
                argv=argv, cleanup=[folder])


IN_PROCESS = {
    "plan-doc": gen_plan_doc,
    "profile-doc": gen_profile_doc,
    "hf-config": gen_hf_config,
    "cluster": gen_cluster,
    "accelerator": gen_accelerator_file,
    "batch-line": gen_batch_line,
}
COMMAND_LINE = {
    "cli-plan-file": gen_cli_plan_file,
    "cli-profile": gen_cli_profile,
    "cli-config": gen_cli_config,
    "cli-cluster": gen_cli_cluster,
    "cli-batch": gen_cli_batch,
    "cli-values": gen_cli_values,
    "cli-output": gen_cli_output,
    "cli-paths": gen_cli_paths,
}
