"""Fuzz families of what users and attackers hand to ``export`` and ``import``: plan strings that
carry injection payloads (``export-injection``) and trainer files with mutated keys, values and
header lines (``import-injection``). Both are command-line families (``planner.cli.main``
in-process); :mod:`tests.fuzz_judges` judges the files."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from tests.fuzz_families import EXPORT_TARGETS
from tests.fuzz_inputs import NASTY_STRINGS, TINY_GPT2, TINY_LLAMA, fmt_path, mutate_text, mutate_tree
from tests.fuzz_judges import judge_export, watch_opens
from tests.fuzz_runner import Case, FuzzEnv, Outcome, check_output_file, run_cli

#: what is put into a string (``{m}``: the marker file a successful injection makes)
PAYLOADS = ["\n", "\r", "\x0c\n", '"""', "'", '"', "$(touch {m})", "`touch {m}`", ";touch {m}", "\u2028", "\x85",
            '\n[job]\ndump_folder = "{m}"', "\ncheckpoints_path: {m}", "--save {m}", "#", "\\", "\r\n--save {m}",
            "\n--load {m}\n#", "\x1b[2J", "\x00", "\u202e", " --save {m}", "\n# shardplan-inputs: {{}}"]
#: what follows the payload: code that makes the marker in the language the string may break into
TAILS = ["", "__import__('os').system('touch {m}') #", "; __import__('os').system('touch {m}') #",
         "\nimport os; os.system(\"touch {m}\")\n#", " touch {m}", "\n--save {m}\n"]
#: the plan's string fields an export may write, tried more often than the others
FOCUS = (("inputs", "model"), ("inputs", "cluster", "accelerator"), ("inputs", "profile"), ("inputs", "target"),
         ("strategy", "layers"), ("strategy", "default", "unit"), ("solver",), ("predicted", "notes"),
         ("inputs", "model_graph", "config"), ("inputs", "model_graph", "source"), ("inputs", "model_hash"))
#: string fields a seed may lack, added with this value when chosen
EXTRA_SLOTS: dict[tuple[Any, ...], Any] = {("inputs", "profile"): "fuzz-profile.json",
                                          ("predicted", "notes"): ["fuzz note"],
                                          ("solver", "options", "fuzz"): "fuzz option"}
HARMLESS = "fuzzsafe"


def export_plans(fz: FuzzEnv) -> list[tuple[str, dict[str, Any], Path]]:
    """The seed plans and one made from a config dict (it records its layer graph: config strings
    and node names)."""
    cached = fz.__dict__.get("_export_plans")
    if cached is None:
        from planner.api import plan

        path = fz.root / "seed-inline-graph.json"
        if not path.exists():
            plan(dict(TINY_LLAMA), "4xcpu", 128, 8, space="fsdp").save(path)
        cached = [*fz.plans, ("inline-graph", json.loads(path.read_text()), path)]
        fz.__dict__["_export_plans"] = cached
    return cached


def string_paths(doc: Any) -> list[tuple[Any, ...]]:
    """Every path of ``doc`` that holds a string (lists of up to 64 items walked)."""
    out, stack = [], [((), doc)]
    while stack:
        p, node = stack.pop()
        if isinstance(node, str):
            out.append(p)
        elif isinstance(node, dict):
            stack.extend((p + (k,), v) for k, v in node.items())
        elif isinstance(node, list) and len(node) <= 64:
            stack.extend((p + (i,), v) for i, v in enumerate(node))
    return sorted(out, key=repr)


def set_path(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    node = doc
    for k in path[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node[path[-1]] = value


def _pick_path(rnd: Any, doc: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """A string field of ``doc`` (or an extra slot, added to ``doc``) and its value."""
    if rnd.random() < 0.2:
        slot = rnd.choice(sorted(EXTRA_SLOTS, key=repr))
        value = copy.deepcopy(EXTRA_SLOTS[slot])
        set_path(doc, slot, value)
        return (slot + (0,), value[0]) if isinstance(value, list) else (slot, value)
    paths = string_paths(doc)
    focused = [p for p in paths if any(p[: len(f)] == f for f in FOCUS)]
    names = [p for p in paths if p[:3] == ("inputs", "model_graph", "nodes") and p[-1] == "name"]
    r = rnd.random()
    path = rnd.choice(focused if r < 0.7 else names if r < 0.8 and names else paths)
    node = doc
    for k in path:
        node = node[k]
    return path, node


def injected_value(rnd: Any, original: str, marker: Path) -> str:
    """``original`` with a payload and a tail that makes ``marker`` if the string breaks out."""
    m = str(marker)
    payload = rnd.choice(PAYLOADS).format(m=m)
    tail = rnd.choice(TAILS).format(m=m)
    where = rnd.random()
    if where < 0.7:
        return original + payload + tail
    if where < 0.85:
        return payload + tail + original
    return payload + tail


def _clean_export(fz: FuzzEnv, seed_path: Path, target: str, nearest: bool) -> str | None:
    """The export of an unchanged seed plan (None when refused), made once."""
    cache = fz.__dict__.setdefault("_clean_exports", {})
    key = (str(seed_path), target, nearest)
    if key not in cache:
        out = fz.name(".out", stem="clean")
        o = run_cli(["export", str(seed_path), "--to", target, "-o", str(out), *(["--nearest"] if nearest else [])])
        cache[key] = out.read_text(encoding="utf-8") if o.rc == 0 and out.is_file() else None
        out.unlink(missing_ok=True)
    return cache[key]


def gen_export_injection(rnd: Any, fz: FuzzEnv) -> Case:
    """``export --to T -o FILE`` of a seed plan with a payload in one string field; refused in one
    line, or a file that reads back as its trainer reads it with the shape of the reference export
    (the same plan with a harmless string there) and makes no marker file when run or loaded."""
    name, seed_doc, seed_path = rnd.choice(export_plans(fz))
    target = rnd.choice(EXPORT_TARGETS)
    nearest = rnd.random() < 0.5
    folder = fz.name("", stem="inject")
    folder.mkdir()
    marker = folder / "pwned"
    doc = copy.deepcopy(seed_doc)
    path, original = _pick_path(rnd, doc)
    value = injected_value(rnd, original, marker)
    benign = copy.deepcopy(doc)
    set_path(benign, path, original + HARMLESS)
    set_path(doc, path, value)
    plan_file, ref_file = folder / "plan.json", folder / "reference.json"
    data = json.dumps(doc, ensure_ascii=rnd.random() < 0.5).encode("utf-8", "surrogatepass")
    plan_file.write_bytes(data)
    ref_file.write_text(json.dumps(benign))
    out = folder / f"export.{target}"
    flags = ["--nearest"] if nearest else []
    argv = ["export", str(plan_file), "--to", target, "-o", str(out), *flags]

    def check(o: Outcome) -> str | None:
        problem = check_output_file(out, None, o, "text")
        if problem or o.rc != 0:
            return problem
        text = out.read_bytes().decode("utf-8", "surrogateescape")
        ref_out = folder / f"reference.{target}"
        r = run_cli(["export", str(ref_file), "--to", target, "-o", str(ref_out), *flags])
        reference = ref_out.read_text(encoding="utf-8") if r.rc == 0 else _clean_export(fz, seed_path, target, nearest)
        return judge_export(target, text, reference, marker, folder)

    notes = [f"seed plan {name}", f"{fmt_path(path)} = {value!r}", f"--to {target}{' --nearest' if nearest else ''}"]
    return Case("export-injection", f"shardplan export --to {target}", notes, lambda limit: run_cli(argv, limit),
                argv=argv, payload=data, checks=[check], cleanup=[folder])


# ---- import ------------------------------------------------------------------------------------

IMPORT_SUFFIX = {"torchtitan": ".toml", "torchtitan-0.3": ".sh", "megatron": ".args", "deepspeed": ".json",
                 "nanotron": ".yaml", "python": ".py"}
#: the command-line --model, --cluster and --seq-len of each seed plan
SEED_INPUTS = {"gpt2-4xcpu": ("gpt2", "4xcpu", "128"), "llama3-8b-pp": ("llama3-8b", "16xh100", "4096"),
               "mixtral-ep": ("mixtral-8x7b", "16xh100", "4096")}


def inputs_flags(name: str, target: str) -> list[str]:
    """--model and --cluster of seed plan ``name`` (and --seq-len, which a DeepSpeed JSON lacks)."""
    model, cluster, seq = SEED_INPUTS[name]
    return ["--model", model, "--cluster", cluster] + (["--seq-len", seq] if target == "deepspeed" else [])


def import_sources(fz: FuzzEnv) -> list[tuple[str, str, str]]:
    """(seed plan, exporter, text) of every seed plan export that is written (with --nearest where
    needed)."""
    cached = fz.__dict__.get("_import_sources")
    if cached is None:
        cached = []
        for name, _, path in fz.plans:
            for t in EXPORT_TARGETS:
                text = _clean_export(fz, path, t, False) or _clean_export(fz, path, t, True)
                if text is not None:
                    cached.append((name, t, text))
        fz.__dict__["_import_sources"] = cached
    return cached


def _markers(folder: Path, token: str) -> dict[str, Path]:
    """Files a header may name that the command line does not: a model config, a cluster file, a
    profile; each holds ``token``."""
    files = {"model": folder / "fuzzmark-model.json", "cluster": folder / "fuzzmark-cluster.yaml",
             "profile": folder / "fuzzmark-profile.json"}
    files["model"].write_text(json.dumps({**TINY_GPT2, "fuzz_token": token}))
    files["cluster"].write_text(f"accelerator: cpu\ngpus: 4\n# {token}\n")
    files["profile"].write_text(json.dumps({"schema_version": "1.0", "kind": "shardplan-profile", "token": token}))
    return files


def _header_mutation(rnd: Any, lines: list[str], markers: dict[str, Path], value: str) -> str:
    """A mutated ``shardplan-inputs`` header line (or a new one); its description."""
    inputs = {"model": "gpt2", "cluster": {"accelerator": "cpu", "nodes": 1, "gpus_per_node": 4}}
    op = rnd.choice(("marker-model", "marker-cluster", "marker-both", "payload-model", "payload-accelerator",
                     "not-json", "twice", "drop", "limit"))
    if op == "marker-model":
        inputs["model"] = str(markers["model"])
    elif op == "marker-cluster":
        inputs["cluster"] = str(markers["cluster"])
    elif op == "marker-both":
        inputs.update(model=str(markers["model"]), cluster=str(markers["cluster"]), profile=str(markers["profile"]))
    elif op == "payload-model":
        inputs["model"] = value
    elif op == "payload-accelerator":
        inputs["cluster"]["accelerator"] = value  # type: ignore[index]
    elif op == "limit":
        inputs["memory_limit_gib"] = rnd.choice((0, -1, "x", 1e400, None, [1], True, 10**30))
    kept = [ln for ln in lines if "shardplan-inputs:" not in ln]
    line = "# shardplan-inputs: " + (json.dumps(inputs) if op != "not-json" else "{" + value)
    if op == "drop":
        lines[:] = kept
    elif op == "twice":
        lines[:] = [line, *lines]
    else:
        lines[:] = [line, *kept]
    return f"header: {op} ({line[:160]!r})"


def _body_mutation(rnd: Any, target: str, lines: list[str], value: str) -> str:
    """One body line changed, dropped, doubled, or a line added."""
    body = [i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")]
    op = rnd.choice(("value", "value", "key", "drop", "double", "add", "comment"))
    if not body or op == "add":
        extra = {"megatron": rnd.choice(("--save {v}", "--load {v}", "--data-path {v}", "{v}")),
                 "torchtitan": rnd.choice(('[job]\ndump_folder = "{v}"', "x = {v}", "[{v}]")),
                 "torchtitan-0.3": rnd.choice(("  --dump_folder {v}", "  {v}", "  activation_checkpoint:{v}",
                                              "$({v})")),
                 "nanotron": rnd.choice(("checkpoints_path: {v}", "{v}: 1", "parallelism: {v}")),
                 "deepspeed": "{v}", "python": rnd.choice(("{v}", "import os; os.system({v!r})"))}[target]
        lines.append(extra.format(v=value))
        return f"line added: {lines[-1][:120]!r}"
    i = rnd.choice(body)
    old = lines[i]
    if op == "drop":
        del lines[i]
    elif op == "double":
        lines.insert(i, old)
    elif op == "comment":
        lines[i] = "# " + value + "\n" + old
    else:
        for sep in (" = ", ": ", " "):
            if sep in old.strip():
                k, _, v = old.partition(sep) if sep != " " else old.strip().partition(" ")
                lines[i] = (k + sep + value) if op == "value" else (value + sep + v)
                break
        else:
            lines[i] = value if op == "value" else old + value
    if op == "drop":
        return f"line {i + 1} dropped: {old[:80]!r}"
    return f"line {i + 1} {op}: {old[:80]!r} -> {lines[i][:120]!r}"


def _mutated_config(rnd: Any, target: str, text: str, markers: dict[str, Path], marker: Path) -> tuple[bytes, list[str]]:
    value = rnd.choice([injected_value(rnd, rnd.choice(("gpt2", "8", "true", "cpu", "")), marker),
                        rnd.choice(NASTY_STRINGS), str(markers["model"]), str(markers["cluster"])])
    notes = []
    if target in ("deepspeed", "python") and rnd.random() < 0.4:
        if target == "deepspeed":
            tree, muts = mutate_tree(rnd, json.loads(text), 2)
            text = json.dumps(tree, allow_nan=True)
            notes += muts
        else:
            text += f"\nimport os; os.system('touch {marker}')\n"
            notes.append("a line that runs a command appended")
    lines = text.split("\n")
    for _ in range(1 + rnd.randrange(2)):
        if rnd.random() < 0.4 and target != "deepspeed":
            notes.append(_header_mutation(rnd, lines, markers, value))
        else:
            notes.append(_body_mutation(rnd, target, lines, value))
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    if rnd.random() < 0.15:
        data, note = mutate_text(rnd, data, yaml_text=target == "nanotron")
        notes.append(note)
    return data, notes


def gen_import_injection(rnd: Any, fz: FuzzEnv) -> Case:
    """``import FILE`` of a mutated export (keys, values, header lines, payloads; header lines that
    name marker files): exit 0, or 2 in one line; no file opened that the command line did not name,
    no marker's content printed, no marker made."""
    name, target, text = rnd.choice(import_sources(fz))
    folder = fz.name("", stem="import")
    folder.mkdir()
    token = f"FUZZTOKEN{rnd.randrange(10**9)}"
    markers = _markers(folder, token)
    pwned = folder / "pwned"
    data, notes = _mutated_config(rnd, target, text, markers, pwned)
    path = folder / f"config{IMPORT_SUFFIX[target]}"
    path.write_bytes(data)
    argv = ["import", str(path)]
    if rnd.random() < 0.7:
        argv += inputs_flags(name, target)
    if rnd.random() < 0.2:
        argv += ["--from", rnd.choice((target, "shardplan", "nope", target.upper()))]
    out = folder / "imported.json"
    if rnd.random() < 0.3:
        argv += ["-o", str(out)]
    opened: list[str] = []

    def run(limit: float | None) -> Outcome:
        with watch_opens([m.name for m in markers.values()]) as seen:
            o = run_cli(argv, limit)
        opened[:] = seen
        return o

    def check(o: Outcome) -> str | None:
        if opened:
            return f"opened {Path(opened[0]).name}, a file only the config's header names"
        if token in o.stdout or token in o.stderr:
            return "printed the content of a file only the config's header names"
        if pwned.exists():
            return "the import made the marker file (ran code from the config)"
        return check_output_file(out, None, o, "plan") if "-o" in argv else None

    return Case("import-injection", f"shardplan import ({target})", [f"export of seed plan {name} to {target}", *notes],
                run, argv=argv, payload=data, checks=[check], cleanup=[folder])


COMMAND_LINE = {"export-injection": gen_export_injection, "import-injection": gen_import_injection}
