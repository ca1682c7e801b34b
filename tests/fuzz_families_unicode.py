"""Fuzz families of the public API called with values of the wrong type (``api-types``), and of
control characters and odd Unicode in every string of the documents (``doc-unicode`` in-process,
``cli-unicode`` on the command line, where nothing raw may reach the terminal either)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
from pathlib import Path
from typing import Any

from tests.fuzz_families import EXPORT_TARGETS, PLOT_KINDS, _in_process
from tests.fuzz_inputs import (
    TINY_GPT2,
    TINY_LLAMA,
    batch_seeds,
    fmt_path,
    short,
    to_json_bytes,
    to_yaml_bytes,
)
from tests.fuzz_runner import Case, FuzzEnv, Outcome, call, run_cli

# ---- the public API with values of the wrong type ----------------------------------------------

#: values of the wrong type (or range) for an argument: strings, floats, booleans, None, lists and
#: mappings where a count or a name belongs, bytes, NaN, infinities, huge and negative integers
WRONG: list[Any] = ["8", "128", "", "\x00", "gpt2", 8.0, 8.5, -1, 0, 2**70, -(2**70), True, False, None, [8], [],
                    ["gpt2"], {"x": 8}, {}, b"8", float("nan"), float("inf"), -float("inf"), (8,), Path("nowhere")]
#: arguments left alone: a callback, processes to start, a device model, a plan object
UNTOUCHED = ("progress", "workers", "device", "plan", "graph")


def _options() -> dict[str, type]:
    """The dataclass whose fields a public function takes as keyword options (``**options``)."""
    from planner.request import Request
    from planner.sweep import SweepOptions

    return {"planner.api.plan": Request, "planner.sweep.sweep": SweepOptions}


def _api_calls(fz: FuzzEnv) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Public functions and valid arguments of each (quick ones: GPT-2 on 4 CPUs)."""
    from planner.request import Request
    from vocab.plan import load_plan

    seed_path = fz.plans[0][2]
    doc = fz.plans[0][1]
    return {
        "planner.api.plan": (("gpt2", "4xcpu", 128, 8), {"space": "fsdp", "top_k": 1}),
        "planner.api.search_plan": ((Request("gpt2", "4xcpu", 128, 8, space="fsdp", top_k=1),), {}),
        "planner.request.Request": (("gpt2", "4xcpu", 128, 8), {"space": "fsdp", "top_k": 1}),
        "planner.sweep.sweep": (("gpt2", [4]), {"accelerator": "cpu", "global_batch": 8, "seq_len": 128,
                                                "space": "fsdp", "workers": 1}),
        "planner.trainers.export": ((load_plan(seed_path), "megatron"), {}),
        "planner.trainers.lacks": ((load_plan(seed_path), "torchtitan"), {}),
        "planner.trainers.import_plan": ((str(_megatron_export(fz)),), {"model": "gpt2", "cluster": "4xcpu"}),
        "vocab.plan.parse_plan": ((copy.deepcopy(doc),), {}),
        "vocab.plan.load_plan": ((str(seed_path),), {}),
        "profiler.models.load_model": (("gpt2", 128), {}),
        "profiler.hardware.parse_cluster": (("4xcpu",), {}),
        "planner.commands.estimate.price_args": ((dict(batch_seeds()[0]),), {}),
    }


def _megatron_export(fz: FuzzEnv) -> Path:
    path = fz.root / "seed-gpt2.args"
    if not path.exists():
        out = run_cli(["export", str(fz.plans[0][2]), "--to", "megatron", "-o", str(path)])
        assert out.rc == 0, out.summary()
    return path


def _function(name: str) -> Any:
    mod, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def gen_api_types(rnd: Any, fz: FuzzEnv) -> Case:
    """A public function with one argument (given or defaulted) replaced by a value of the wrong
    type: it returns, or raises ShardplanError; a TypeError, AttributeError... is a failure."""
    if "_api_calls" not in fz.__dict__:
        fz.__dict__["_api_calls"] = _api_calls(fz)
    calls = fz.__dict__["_api_calls"]
    name = rnd.choice(sorted(calls))
    args, kwargs = calls[name]
    fn = _function(name)
    params = [(i, p.name) for i, p in enumerate(inspect.signature(fn).parameters.values())
              if p.name not in UNTOUCHED and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if name in _options():  # a function taking the fields of a dataclass as its keyword options
        params += [(len(args) + 1, f.name) for f in dataclasses.fields(_options()[name])
                   if f.name not in UNTOUCHED and f.name not in {n for _, n in params}]
    args, kwargs = list(args), dict(kwargs)
    notes = [f"{name}"]
    for _ in range(1 + (rnd.random() < 0.2)):
        i, param = rnd.choice(params)
        value = rnd.choice(WRONG)
        if i < len(args):
            args[i] = value
        else:
            kwargs[param] = value
        notes.append(f"{param}={short(value)}")
    a, k = tuple(args), kwargs
    return Case("api-types", name, notes, lambda limit: call(lambda: fn(*a, **k), limit=limit))


# ---- control characters and odd Unicode in every document string --------------------------------

#: characters that are not what they look like: fullwidth and Arabic-Indic digits, bidirectional
#: marks and overrides, line and paragraph separators, NEL, NUL, ESC, zero-width and no-break spaces,
#: a byte order mark, a lone surrogate, DEL, a combining accent, tabs and line breaks
ODD_CHARS = ["\uff18", "\u0668", "\u200f", "\u202e", "\u2066", "\u2028", "\u2029", "\x85", "\x00", "\x1b",
             "\x1b[31m", "\x1b]0;pwned\x07", "\u200b", "\ufeff", "\ud800", "\x7f", "\u0301", "\t", "\r", "\n",
             "\x0b", "\x0c", "\u00a0", "\u3000", "\U0001f600", "\x9b31m"]
FULLWIDTH = str.maketrans("0123456789.-", "０１２３４５６７８９．－")
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


def _scalars(doc: Any) -> list[tuple[Any, ...]]:
    out, stack = [], [((), doc)]
    while stack:
        p, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((p + (k,), v) for k, v in node.items())
        elif isinstance(node, list) and len(node) <= 64:
            stack.extend((p + (i,), v) for i, v in enumerate(node))
        elif isinstance(node, str | int | float) and p:
            out.append(p)
    return sorted(out, key=repr)


def unicode_mutation(rnd: Any, doc: Any) -> tuple[Any, str]:
    """``doc`` (a copy) with one string, number or key given odd characters."""
    doc = copy.deepcopy(doc)
    paths = _scalars(doc)
    if not paths:
        return doc, "unchanged"
    path = rnd.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, value = path[-1], parent[path[-1]]
    ch = rnd.choice(ODD_CHARS)
    if isinstance(key, str) and rnd.random() < 0.15:
        new_key = rnd.choice((key + ch, ch + key, key.translate(FULLWIDTH), key[:1].upper() + key[1:]))
        parent[new_key] = parent.pop(key)
        return doc, f"key {fmt_path(path)} renamed {new_key!r}"
    if isinstance(value, bool) or not isinstance(value, str):
        text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
        new = rnd.choice((text.translate(FULLWIDTH), text.translate(ARABIC_INDIC), text + ch, ch + text))
    else:
        i = rnd.randrange(len(value) + 1)
        new = rnd.choice((value + ch, ch + value, value[:i] + ch + value[i:], ch, value.translate(FULLWIDTH)))
    parent[key] = new
    return doc, f"set {fmt_path(path)} = {new[:120]!r}"


def _seed_documents(fz: FuzzEnv) -> dict[str, Any]:
    from tests.fuzz_inputs import accelerator_seed

    return {"plan": fz.plans[0][1], "profile": fz.profile, "config": TINY_GPT2, "config-llama": TINY_LLAMA,
            "cluster": fz.clusters[2], "accelerator": accelerator_seed(), "batch-line": batch_seeds()[1]}


def _reader(kind: str) -> Any:
    if kind == "plan":
        from vocab.plan import parse_plan

        return parse_plan
    if kind == "profile":
        from profiler.profile_schema import parse_profile

        return parse_profile
    if kind.startswith("config"):
        from profiler.models import load_model

        return lambda d: load_model(d, 128)
    if kind == "cluster":
        from profiler.hardware import parse_cluster

        return parse_cluster
    if kind == "accelerator":
        from profiler.hardware import Accelerator

        return Accelerator.from_dict
    from planner.commands.estimate import price_args

    return price_args


def gen_doc_unicode(rnd: Any, fz: FuzzEnv) -> Case:
    """A plan, profile, model config, cluster, accelerator or batch line with odd characters in one
    string, number or key, read from a dict (and plans and profiles also from text)."""
    if "_unicode_docs" not in fz.__dict__:
        fz.__dict__["_unicode_docs"] = _seed_documents(fz)
    docs = fz.__dict__["_unicode_docs"]
    kind = rnd.choice(sorted(docs))
    doc = docs[kind] if kind != "plan" else rnd.choice(fz.plans)[1]
    tree, note = unicode_mutation(rnd, doc)
    data = to_json_bytes(tree)
    reader = _reader(kind)
    as_text = kind in ("plan", "profile") and rnd.random() < 0.4
    arg = data.decode("utf-8", "surrogatepass") if as_text else tree
    return Case("doc-unicode", f"{kind} ({'text' if as_text else 'dict'})", [note], _in_process(reader, arg),
                payload=data)


def raw_controls(text: str) -> list[str]:
    """Characters of ``text`` a terminal acts on or shows as something else (as ``U+XXXX``): C0 but
    tab and newline, DEL, C1, line and paragraph separators, bidirectional controls, lone surrogates."""
    bad = set()
    for c in text:
        o = ord(c)
        if (o < 32 and c not in "\n\t") or 0x7F <= o <= 0x9F or c in "\u2028\u2029\u200e\u200f\u061c" \
                or 0x202A <= o <= 0x202E or 0x2066 <= o <= 0x2069 or 0xD800 <= o <= 0xDFFF:
            bad.add(f"U+{o:04X}")
    return sorted(bad)


def _stdout_printable(o: Outcome) -> str | None:
    bad = raw_controls(o.stdout)
    return f"raw control characters on stdout ({', '.join(bad[:5])}): {o.stdout[:160]!r}" if bad else None


def gen_cli_unicode(rnd: Any, fz: FuzzEnv) -> Case:
    """explain / compare / export / estimate / plot / inspect on documents with odd characters in
    one string, number or key: exit 0 or 2 in one line, and no raw control character on stdout or
    stderr."""
    kind = rnd.choice(("plan", "plan", "plan", "profile", "config", "cluster"))
    name, plan_doc, seed_path = rnd.choice(fz.plans)
    doc = {"plan": plan_doc, "profile": fz.profile, "config": rnd.choice((TINY_GPT2, TINY_LLAMA)),
           "cluster": rnd.choice(fz.clusters[:4])}[kind]
    tree, note = unicode_mutation(rnd, doc)
    yaml_file = kind == "cluster" and rnd.random() < 0.5
    data = to_yaml_bytes(tree) if yaml_file else to_json_bytes(tree)
    path = fz.file(data, ".yaml" if yaml_file else ".json", stem=kind)
    p = str(path)
    cleanup = [path]
    if kind == "plan":
        cmd = rnd.choice(("explain", "explain-json", "compare", "export", "estimate", "plot"))
        argv = {"explain": ["explain", p], "explain-json": ["explain", p, "--json"], "compare": ["compare", p, str(seed_path)],
                "export": ["export", p, "--to", rnd.choice(EXPORT_TARGETS)], "estimate": ["estimate", "--plan", p],
                "plot": ["plot", p, "--kind", rnd.choice(PLOT_KINDS), "-o", str(fz.name(".svg"))]}[cmd]
        if cmd == "plot":
            cleanup.append(Path(argv[-1]))
    elif kind == "profile":
        argv = ["estimate", "--model", "gpt2", "--cluster", "4xcpu", "--seq-len", "128", "--global-batch", "8",
                "--profile", p]
    elif kind == "config":
        argv = rnd.choice((["inspect", "--model", p], ["estimate", "--model", p, "--cluster", "4xcpu", "--seq-len",
                                                        "128", "--global-batch", "8"]))
    else:
        argv = ["estimate", "--model", "gpt2", "--cluster", p, "--seq-len", "128", "--global-batch", "8"]
    return Case("cli-unicode", f"shardplan {argv[0]} ({kind})", [f"seed {name if kind == 'plan' else kind}", note],
                lambda limit: run_cli(argv, limit), argv=argv, payload=data, checks=[_stdout_printable],
                cleanup=cleanup)


IN_PROCESS = {"api-types": gen_api_types, "doc-unicode": gen_doc_unicode}
COMMAND_LINE = {"cli-unicode": gen_cli_unicode}
