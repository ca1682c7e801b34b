"""Inputs and oracles of the input fuzz suite (``tests/test_fuzz.py``, ``benchmarks/fuzz.py``).

Valid seed documents (plans, profiles, Hugging Face configs, clusters, accelerator files, batch
lines, command lines), mutations of them (keys dropped or added, values swapped for other types,
non-finite, negative, zero or huge numbers, deep nesting, truncation, random or non-UTF-8 bytes),
and a harness that runs one input, in-process or as a ``python -m planner.cli`` subprocess, under a
time limit and classifies what happened.

The rule checked: an input ends in success or in a rejection — in-process a
:class:`~vocab.errors.ShardplanError`, on the command line exit code 2 with one line
``error: ...`` on stderr — never another exception, a traceback, exit code 70, more than
:data:`HANG_S` seconds, a half-written ``-o`` file, or a batch output that does not have one line
per input line.

Every generator takes ``rnd``: an object with :class:`random.Random`'s ``random``, ``randrange``
and ``choice`` (a seeded ``random.Random`` in the benchmark, hypothesis' ``st.randoms()`` in the
tests) and returns a :class:`Case`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vocab.errors import ShardplanError

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
#: a call that runs longer than this is a hang
HANG_S = 30.0
#: the outcome kinds, in the order of the benchmark's table
KINDS = ("accepted", "rejected", "exception", "exit70", "hang", "multiline", "other")
BAD_KINDS = ("exception", "exit70", "hang", "multiline", "other")

# ---------------------------------------------------------------------------------------------
# Valid seeds
# ---------------------------------------------------------------------------------------------

TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 1000,
             "n_positions": 256, "n_inner": 256, "resid_pdrop": 0.1, "tie_word_embeddings": True}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
              "max_position_embeddings": 512, "tie_word_embeddings": False, "head_dim": 16,
              "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
                "max_position_embeddings": 512, "num_local_experts": 4, "num_experts_per_tok": 2}
TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                  "vocab_size": 1000, "max_position_embeddings": 512, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64}
#: TransformerConfig fields (``load_model`` reads a dict with ``layers`` and ``hidden`` as these)
TINY_NATIVE = {"name": "fuzz-native", "layers": 2, "hidden": 64, "heads": 4, "vocab": 1000, "kv_heads": 2,
               "ffn_hidden": 256, "max_seq": 512, "activation": "swiglu", "norm": "rmsnorm",
               "position": "rope", "experts": 0}


def hf_configs() -> dict[str, dict[str, Any]]:
    """Valid model configs by name: small ones written here and the Hugging Face files of tests/data."""
    out = {"tiny-gpt2": TINY_GPT2, "tiny-llama": TINY_LLAMA, "tiny-mixtral": TINY_MIXTRAL,
           "tiny-qwen3-moe": TINY_QWEN3_MOE, "tiny-native": TINY_NATIVE}
    for name in ("gpt2-config", "llama3-8b-config", "mixtral-8x7b-config", "qwen2-7b-config"):
        out[name] = json.loads((DATA / f"{name}.json").read_text())
    return copy.deepcopy(out)


def valid_profile() -> dict[str, Any]:
    """A CPU profile document with every section (compute, DTensor overhead, comm fits, layers)."""

    def gemm(m: int, n: int, k: int, rate: float) -> dict[str, Any]:
        flops = 2.0 * m * n * k
        return {"m": m, "n": n, "k": k, "fwd_s": flops / rate, "bwd_s": 2 * flops / rate, "flops": flops,
                "flops_per_s": rate, "spread": 0.02, "tag": "square"}

    def attn(s: int, causal: bool, rate: float) -> dict[str, Any]:
        flops = 4.0 * 2 * 4 * s * s * 64
        return {"batch": 2, "heads": 4, "seq": s, "head_dim": 64, "causal": causal, "fwd_s": flops / rate,
                "bwd_s": 2 * flops / rate, "flops": flops, "flops_per_s": rate, "spread": 0.01}

    def bw(nbytes: float, rate: float, variant: str = "", shape: list[int] | None = None) -> dict[str, Any]:
        return {"bytes": nbytes, "seconds": nbytes / rate, "bytes_per_s": rate, "bwd_s": 2 * nbytes / rate,
                "variant": variant, "shape": shape or [], "spread": 0.0}

    def fit(coll: str, world: int, a: float, b: float) -> dict[str, Any]:
        pts = [[float(x), a + b * x] for x in (1024, 1 << 20, 1 << 24)]
        return {"collective": coll, "world": world, "backend": "gloo", "alpha_s": a, "beta_s_per_byte": b,
                "median_rel_error": 0.02, "stat": "median", "points": pts, "min_points": pts,
                "wait_s": 0.001, "sharing_efficiency": 0.9}

    bandwidth = {
        "norm": [bw(1e6, 2e9, "layernorm"), bw(1e8, 4e9, "layernorm"), bw(1e8, 5e9, "rmsnorm")],
        "softmax": [bw(1e6, 2e9), bw(1e8, 3e9)],
        "activation": [bw(1e6, 2e9, "gelu"), bw(1e8, 3e9, "swiglu")],
        "elementwise": [bw(1e6, 3e9, "add"), bw(1e8, 4e9, "dropout")],
        "embedding": [bw(1e6, 1e9, "", [8, 1000, 64]), bw(1e8, 2e9, "", [512, 1000, 64])],
        "cross_entropy": [bw(1e6, 1e9), bw(1e8, 2e9)],
        "optimizer": [bw(1e6, 2e9), bw(1e8, 3e9)],
    }
    return {
        "schema_version": "1.0",
        "kind": "shardplan-profile",
        "device": {"kind": "cpu", "name": "fuzz cpu", "torch_version": "2.13.0", "cuda_version": None,
                   "threads": 2, "hostname": "fuzz", "created": "2026-01-01T00:00:00+00:00", "index": None,
                   "accelerator": "cpu", "load_before": 0.5},
        "compute": {
            "dtype": "fp32",
            "gemm": [gemm(64, 64, 64, 5e10), gemm(256, 256, 256, 1.2e11), gemm(1024, 1024, 1024, 1.8e11),
                     gemm(8, 1024, 1024, 6e10)],
            "attention": [attn(128, False, 5e10), attn(512, False, 8e10), attn(128, True, 4e10),
                          attn(512, True, 7e10)],
            "bandwidth": bandwidth,
            "wall_s": 12.5,
            "skipped": 0,
            "dtensor": {"linear_fwd_s": 1e-4, "linear_bwd_s": 2e-4, "norm_fwd_s": 5e-5, "norm_bwd_s": 1e-4,
                        "loss_fwd_s": 1e-4, "loss_bwd_s": 2e-4, "loss_traffic_ratio": 1.5},
        },
        "comm": [fit(c, w, 1e-4 * w, 1e-9 * w) for c in ("all_reduce", "all_gather", "reduce_scatter",
                                                           "all_to_all", "send_recv") for w in (2, 4)],
        "model": [{"model": "gpt2", "layer": "layers.0", "micro_batch": 1, "seq_len": 128, "fwd_s": 1e-3,
                   "bwd_s": 2e-3, "saved_bytes": 196608.0, "predicted_fwd_s": 9e-4, "predicted_bwd_s": 1.9e-3,
                   "predicted_saved_bytes": 190000.0, "kind": "block", "dtype": "fp32",
                   "allocated_bytes": None}],
    }


def accelerator_seed() -> dict[str, Any]:
    """The H100 SXM accelerator file as a dict, renamed ``fuzzacc`` (no aliases)."""
    d = yaml.safe_load((REPO / "profiler" / "data" / "accelerators" / "h100-sxm.yaml").read_text())
    d["name"], d["aliases"] = "fuzzacc", []
    return d


def cluster_seeds() -> list[dict[str, Any]]:
    """Valid cluster mappings (as a cluster file or ``parse_cluster`` dict holds)."""
    cpu = yaml.safe_load((REPO / "profiler" / "data" / "accelerators" / "cpu.yaml").read_text())
    cpu["name"], cpu["aliases"] = "fuzzcpu", []
    return [
        {"accelerator": "h100", "nodes": 2},
        {"accelerator": "cpu", "gpus": 4},
        {"accelerator": "h100-sxm", "gpus": 16, "gpus_per_node": 8, "memory_gb": 70.0,
         "scale_out": {"name": "ib", "gbps": 50.0, "latency_us": 5.0}, "scale_up": {"domain": 8}},
        {"accelerator": "a100-80gb", "nodes": 1, "gpus_per_node": 4},
        {"accelerator": cpu, "nodes": 1},
    ]


CLUSTER_SPECS = ["4xcpu", "8xh100", "64 x h100", "16×a100-80gb", "2*cpu", "72xgb200", "1xh200", "8xH100",
                 "4xhost"]


def batch_seeds(plan_path: Path | None = None) -> list[dict[str, Any]]:
    """Valid ``shardplan estimate --batch`` lines (each prices to a report)."""
    out: list[dict[str, Any]] = [
        {"model": "gpt2", "cluster": "4xcpu", "seq_len": 128, "global_batch": 8, "tp": 2},
        {"model": "gpt2", "cluster": "8xh100", "seq_len": 1024, "global_batch": 16, "zero": 3, "pp": 2,
         "micro_batch": 2, "schedule": "1f1b", "recompute": "selective", "memory_limit": 60.0},
        {"model": dict(TINY_LLAMA), "cluster": {"accelerator": "h100", "nodes": 1}, "seq_len": 256,
         "global_batch": 8, "tp": 2, "cp": 2, "sequence_parallel": True, "precision": "bf16",
         "attention_kernel": "flash2", "cross_entropy": "fused", "grad_dtype": "bf16"},
        {"model": dict(TINY_MIXTRAL), "cluster": "8xh100", "seq_len": 256, "global_batch": 16, "ep": 2,
         "zero": 1, "dp_shard": 8, "dp_replicate": 1, "tp_mode": "megatron", "cp_mode": "ring"},
        {"model": "gpt2", "cluster": "8xh100", "seq_len": 512, "global_batch": 32, "pp": 4, "vpp": 3,
         "schedule": "interleaved", "dp": 2, "micro_batch": 1, "memory_limit_gib": 40},
    ]
    if plan_path is not None:
        out.append({"plan": str(plan_path)})
    return out


#: (name, model, cluster, keyword arguments of ``planner.api.plan``): quick plans of several shapes
PLAN_SEEDS = [
    ("gpt2-4xcpu", "gpt2", "4xcpu", {"seq_len": 128, "global_batch": 8}),
    ("llama3-8b-pp", "llama3-8b", "16xh100", {"seq_len": 4096, "global_batch": 32, "memory_limit_gib": 20,
                                              "space": "megatron"}),
    ("mixtral-ep", "mixtral-8x7b", "16xh100", {"seq_len": 4096, "global_batch": 32, "space": "megatron"}),
]


def make_plans(folder: Path) -> list[tuple[str, dict[str, Any], Path]]:
    """The seed plans (made with ``planner.api.plan``) as (name, document, file in ``folder``)."""
    from planner.api import plan

    out = []
    for name, model, cluster, kw in PLAN_SEEDS:
        path = folder / f"seed-{name}.json"
        if not path.exists():
            plan(model, cluster, **kw).save(path)
        out.append((name, json.loads(path.read_text()), path))
    return out


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------

BIG = 10**30
NAN, INF = float("nan"), float("inf")
NASTY_NUMBERS: list[Any] = [0, -1, 1, 2, 3, 7, -(2**63), 2**31, 2**63, 2**64 + 1, 10**12, BIG, -BIG, 10**400,
                            0.0, -0.0, 0.5, 4.5, -4.5, 1e-300, 5e-324, 1e308, NAN, INF, -INF]
NASTY_STRINGS: list[str] = ["", " ", "0", "1", "8", "-1", "4.5", "1e3", "nan", "NaN", "Infinity", "inf", "true",
                            "null", "None", "x", "h100", "gpt2", "[red]x[/red]", "[/x]", "[bold]", "[link=x]y",
                            "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "a\nb", "a\rb", "tab\there", "\x00",
                            "\ud800", "é", "日本", "😀", "\u202eRTL", "\u2028", "x" * 5000, "../../etc/passwd",
                            "%s%n{0}{}", "~", "$HOME"]
NASTY_OTHER: list[Any] = [None, True, False, [], {}, [None], [1, 2], {"": None}, {"a": {"b": {}}}, [[[]]]]
NASTY: list[Any] = NASTY_NUMBERS + NASTY_STRINGS + NASTY_OTHER


def nest(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


def swap(rnd: Any, v: Any) -> Any:
    """A value of another type or range in place of ``v`` (the typical wrong value for its slot)."""
    if isinstance(v, bool):
        cands: list[Any] = [int(v), str(v).lower(), None, "yes", [v], 2]
    elif isinstance(v, int):
        cands = [str(v), -v, 0, -1, v * 10**20, BIG, True, None, [v], {"value": v}, NAN, INF, -INF, f"{v}.0",
                 f" {v} ", v - 1, v + 1, 2 * v, 10**400]
        if abs(v) < 2**1000:
            cands += [float(v), v + 0.5]
    elif isinstance(v, float):
        cands = [str(v), -v, 0.0, NAN, INF, -INF, 1e308, 5e-324, None, True, [v], v * 1e30, v / 1e30, "1e3"]
        if math.isfinite(v):
            cands.append(int(v))
    elif isinstance(v, str):
        cands = [len(v), "", v.upper(), " " + v, v + "\x00", f"[red]{v}[/red]", v * 200, None, [v], {"name": v},
                 "\x1b[2J" + v, v + "\n" + v, v + "x", v[:-1], 0, 4.5]
    elif isinstance(v, list):
        cands = [{}, [], (v * 50)[:5000] or [None] * 50, v[:1], v[::-1], [None, *v], "list", nest(v, 40),
                 [v], len(v)]
    elif isinstance(v, dict):
        cands = [[], {}, list(v.values()), "dict", None, nest(v, 40), {k: None for k in v}]
    else:
        cands = [0, "", [], {}, False, -1, NAN]
    return rnd.choice(cands)


def _walk(doc: Any) -> list[tuple[Any, ...]]:
    """Every path below the root (keys and list indices)."""
    out, stack = [], [((), doc)]
    while stack:
        p, node = stack.pop()
        if p:
            out.append(p)
        if isinstance(node, dict):
            stack.extend((p + (k,), v) for k, v in node.items())
        elif isinstance(node, list) and len(node) <= 64:
            stack.extend((p + (i,), v) for i, v in enumerate(node))
    out.sort(key=repr)
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def fmt_path(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".") or "(root)"


def short(value: Any, limit: int = 80) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**40:
        return f"10**{len(str(abs(value))) - 1}" if value > 0 else f"-10**{len(str(-value)) - 1}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 20] + f"...<{len(text)} chars>"


def mutate_tree(rnd: Any, doc: Any, ops: int = 2, focus: tuple[tuple[Any, ...], ...] = ()) -> tuple[Any, list[str]]:
    """``doc`` with 1..``ops`` structural mutations (a deep copy) and their descriptions. With
    ``focus``, most mutations land under those path prefixes."""
    doc = copy.deepcopy(doc)
    notes: list[str] = []
    for _ in range(1 + rnd.randrange(ops)):
        if not isinstance(doc, dict | list):
            break
        paths = _walk(doc)
        focused = [p for p in paths if any(p[: len(f)] == f for f in focus)]
        pool = focused if focused and rnd.random() < 0.75 else paths
        if not pool:
            break
        path = rnd.choice(pool)
        parent, key = _get(doc, path[:-1]), path[-1]
        op = rnd.choice(("set", "set", "set", "set", "nasty", "nasty", "drop", "drop", "add", "nest", "grow"))
        if op == "set":  # (a copy: the value may be shared, e.g. by a grown list)
            parent[key] = copy.deepcopy(swap(rnd, parent[key]))
            notes.append(f"set {fmt_path(path)} = {short(parent[key])}")
        elif op == "nasty":
            parent[key] = copy.deepcopy(rnd.choice(NASTY))
            notes.append(f"set {fmt_path(path)} = {short(parent[key])}")
        elif op == "drop":
            del parent[key]
            notes.append(f"drop {fmt_path(path)}")
        elif op == "add":
            target = parent if isinstance(parent, dict) else doc if isinstance(doc, dict) else None
            if target is None:
                continue
            name = rnd.choice(("fuzz", "", " ", "Model", "schema_version", "kind", "extra", "__proto__",
                               str(key).upper() if isinstance(key, str) else "0"))
            target[name] = copy.deepcopy(rnd.choice(NASTY))
            notes.append(f"add key {name!r} = {short(target[name])} next to {fmt_path(path)}")
        elif op == "nest":
            depth = rnd.choice((2, 33, 200))
            parent[key] = nest(parent[key], depth)
            notes.append(f"nest {fmt_path(path)} in {depth} lists")
        else:  # grow
            v = parent[key]
            if isinstance(v, list) and v:
                parent[key] = (v * (2000 // len(v) + 1))[:2000]
                notes.append(f"grow {fmt_path(path)} to 2000 items")
            elif isinstance(v, dict):
                parent[key] = {**v, **{f"k{i}": i for i in range(2000)}}
                notes.append(f"grow {fmt_path(path)} by 2000 keys")
            else:
                parent[key] = [v] * 2000
                notes.append(f"replace {fmt_path(path)} by 2000 copies of it in a list")
    return doc, notes


def to_json_bytes(doc: Any) -> bytes:
    """JSON text of ``doc`` (NaN and infinities as the non-standard literals json writes)."""
    return json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass")


def to_yaml_bytes(doc: Any) -> bytes:
    try:
        return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode("utf-8", "surrogatepass")
    except (yaml.YAMLError, ValueError, RecursionError):
        return to_json_bytes(doc)


_NUMBER_CHARS = set(b"0123456789")


def mutate_text(rnd: Any, data: bytes, yaml_text: bool = False) -> tuple[bytes, str]:
    """One mutation of a document's bytes (truncation, bad bytes, non-standard literals, nesting...)."""
    ops = ["truncate", "truncate", "empty", "blank", "random", "flip", "non-utf8", "bom", "utf16", "nan",
           "huge-number", "deep", "wrap-deep", "dup-key", "trailing", "scalar", "comment", "nul"]
    if yaml_text:
        ops += ["yaml-alias-bomb", "yaml-tag", "yaml-timestamp", "yaml-multi", "yaml-merge", "yaml-nan",
                "yaml-tabs", "yaml-unhashable"]
    op = rnd.choice(ops)
    n = len(data)
    if op == "truncate":
        cut = rnd.randrange(n + 1) if n else 0
        return data[:cut], f"truncated to {cut} of {n} bytes"
    if op == "empty":
        return b"", "empty file"
    if op == "blank":
        return b"  \n\t \n", "whitespace only"
    if op == "random":
        k = 1 + rnd.randrange(64)
        return bytes(rnd.randrange(256) for _ in range(k)), f"{k} random bytes"
    if op == "flip" and n:
        i, b = rnd.randrange(n), rnd.randrange(256)
        return data[:i] + bytes([b]) + data[i + 1:], f"byte {i} set to {b:#04x}"
    if op == "non-utf8":
        i = rnd.randrange(n + 1) if n else 0
        bad = rnd.choice((b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xe9t\xe9"))
        return data[:i] + bad + data[i:], f"non-UTF-8 bytes {bad!r} at {i}"
    if op == "bom":
        return b"\xef\xbb\xbf" + data, "UTF-8 byte order mark prefixed"
    if op == "utf16":
        return data.decode("utf-8", "replace").encode("utf-16"), "encoded as UTF-16"
    if op in ("nan", "huge-number"):
        starts = [i for i in range(n) if data[i] in _NUMBER_CHARS and (i == 0 or data[i - 1] in b" :[,")]
        if starts:
            i = rnd.choice(starts)
            j = i
            while j < n and data[j] in b"0123456789.eE+-":
                j += 1
            lit = (rnd.choice((b"NaN", b"Infinity", b"-Infinity", b".nan", b".inf")) if op == "nan"
                   else rnd.choice((b"9" * 5000, b"1e999999", b"-1e999999", b"1" + b"0" * 40, b"0.0000001e-400")))
            return data[:i] + lit + data[j:], f"number at byte {i} replaced by {lit[:12]!r}{'...' if len(lit) > 12 else ''}"
        return data + b"NaN", "NaN appended"
    if op == "deep":
        k = rnd.choice((40, 1000, 100000))
        return b"[" * k + b"]" * k, f"{k} nested lists"
    if op == "wrap-deep":
        k = rnd.choice((40, 1000, 100000))
        return b'{"a":' * k + data + b"}" * k, f"document nested {k} deep"
    if op == "dup-key":
        text = data.decode("utf-8", "replace")
        i = text.find('{"')
        if i >= 0:
            j = text.find('"', i + 2)
            k = text[i + 2:j]
            dup = f'"{k}": {rnd.choice(["null", "0", "-1", "[]", "{}", "4.5", json.dumps("x")])}, '
            return (text[: i + 1] + dup + text[i + 1:]).encode("utf-8", "surrogatepass"), f"key {k!r} duplicated"
        return data, "unchanged (no key to duplicate)"
    if op == "trailing":
        tail = rnd.choice((b",", b"}", b"\n{}", b" garbage", b"\x00"))
        return data + tail, f"{tail!r} appended"
    if op == "scalar":
        lit = rnd.choice((b"null", b"[]", b"{}", b'"plan"', b"0", b"true", b"-1", b"[{}]", b"NaN"))
        return lit, f"document replaced by {lit!r}"
    if op == "comment":
        return b"// comment\n" + data, "a // comment line prefixed"
    if op == "nul":
        i = rnd.randrange(n + 1) if n else 0
        return data[:i] + b"\x00" + data[i:], f"NUL byte at {i}"
    if op == "yaml-alias-bomb":
        lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
        for i in range(1, 9):
            lines.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 9) + "]")
        return "\n".join(lines).encode() + b"\n", "YAML alias bomb (9^9 values)"
    if op == "yaml-tag":
        tag = rnd.choice(("!!python/object/apply:os.getcwd []", "!!binary aGVsbG8=", "!!set {a, b}",
                          "!!float x", "!!int x", "!custom 3"))
        return b"accelerator: " + tag.encode() + b"\nnodes: 1\n", f"YAML tag {tag!r}"
    if op == "yaml-timestamp":
        stamp = rnd.choice(("2001-13-45", "2001-02-30", "0000-01-01", "9999-12-31 25:61:61"))
        return data + f"\ncreated: {stamp}\n".encode(), f"YAML timestamp {stamp} appended"
    if op == "yaml-multi":
        return b"---\n" + data + b"\n---\nnodes: 1\n", "two YAML documents"
    if op == "yaml-merge":
        return b"base: &b {accelerator: h100, nodes: 1}\n<<: *b\nmore: *b\n", "YAML merge key"
    if op == "yaml-nan":
        return b"accelerator: h100\nnodes: .nan\ngpus_per_node: .inf\nmemory_gb: -.inf\n", "YAML .nan/.inf values"
    if op == "yaml-tabs":
        return b"accelerator: h100\n\tnodes: 1\n", "tab indentation"
    if op == "yaml-unhashable":
        return b"? [1, 2]\n: 3\naccelerator: h100\n", "unhashable YAML key"
    return data, "unchanged"


def mutate_document(rnd: Any, doc: Any, *, focus: tuple[tuple[Any, ...], ...] = (), yaml_text: bool = False,
                    text_p: float = 0.35, ops: int = 3) -> tuple[Any, bytes, list[str]]:
    """(mutated tree, its bytes, descriptions): tree mutations, then with probability ``text_p``
    one byte-level mutation of the serialised text (the tree is then only approximate)."""
    tree, notes = mutate_tree(rnd, doc, ops, focus) if rnd.random() < 0.9 else (copy.deepcopy(doc), [])
    data = to_yaml_bytes(tree) if yaml_text else to_json_bytes(tree)
    if rnd.random() < text_p:
        data, note = mutate_text(rnd, data, yaml_text)
        notes.append(note)
    return tree, data, notes or ["unchanged"]


# ---------------------------------------------------------------------------------------------
# Running one input and judging the outcome
# ---------------------------------------------------------------------------------------------

class FuzzTimeout(BaseException):
    """Raised in the main thread when a call runs over its limit (a BaseException: no handler
    of the code under test catches it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`FuzzTimeout` after ``seconds`` (main thread only)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise FuzzTimeout(f"still running after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def environment(env: dict[str, str | None] | None) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the block."""
    env = {"SHARDPLAN_DEBUG": None, **(env or {})}
    old = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def log_to(stream: io.StringIO) -> Iterator[None]:
    """Log records of level WARNING and above to ``stream`` as bare messages for the block: what
    Python's last-resort handler writes to stderr in a ``shardplan`` process (in-process, pytest's
    log capture would otherwise swallow them)."""
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


@dataclass
class Outcome:
    """What one input did: ``kind`` is one of :data:`KINDS`."""

    kind: str
    detail: str = ""
    where: str = ""
    seconds: float = 0.0
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.kind in ("accepted", "rejected")

    def summary(self) -> str:
        at = f" at {self.where}" if self.where else ""
        rc = f" (exit {self.rc})" if self.rc is not None else ""
        return f"{self.kind}{rc}{at}: {self.detail}"[:600]


def where(exc: BaseException) -> str:
    """The innermost frame of the product code in ``exc``'s traceback (``file:line in function``)."""
    found = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        try:
            rel = Path(fr.filename).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts and (rel.parts[0] in ("tests", "benchmarks") or rel.parts[0].startswith(".")
                          or "site-packages" in rel.parts):
            continue
        found = f"{rel}:{fr.lineno} in {fr.name}"
    return found


def call(fn: Callable[..., Any], *args: Any, limit: float | None = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``fn(*args)`` in-process (what it prints is dropped): ``accepted`` if it returns, ``rejected``
    on a ShardplanError, ``hang`` past ``limit``, ``exception`` on anything else."""
    t0 = time.perf_counter()
    try:
        with environment(env), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                time_limit(limit):
            fn(*args)
    except FuzzTimeout as e:
        return Outcome("hang", str(e), seconds=time.perf_counter() - t0)
    except ShardplanError as e:
        out = Outcome("rejected", str(e)[:300], seconds=time.perf_counter() - t0)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (anything else is what the fuzzer looks for)
        return Outcome("exception", f"{type(e).__name__}: {str(e)[:300]}", where(e), time.perf_counter() - t0)
    else:
        out = Outcome("accepted", seconds=time.perf_counter() - t0)
    if limit and out.seconds > limit:
        return Outcome("hang", f"took {out.seconds:.1f} s (limit {limit:g} s)", seconds=out.seconds)
    return out


def _judge_cli(rc: Any, stdout: str, stderr: str, seconds: float, limit: float | None) -> Outcome:
    out = Outcome("accepted", rc=rc if isinstance(rc, int) else None, stdout=stdout, stderr=stderr, seconds=seconds)
    lines = [line for line in stderr.splitlines() if line.strip()]
    if limit and seconds > limit:
        out.kind, out.detail = "hang", f"took {seconds:.1f} s (limit {limit:g} s)"
    elif "Traceback (most recent call last)" in stderr:
        out.kind, out.detail = "exception", "a traceback on stderr: " + (lines[-1] if lines else "")
    elif rc == 70:
        out.kind, out.detail = "exit70", lines[-1] if lines else "(no message)"
    elif rc == 2:
        out.kind, out.detail = "rejected", lines[0] if lines else ""
        if len(lines) != 1:
            out.kind = "multiline"
            out.detail = f"{len(lines)} non-empty stderr lines: " + " | ".join(lines[:4])
        elif not lines[0].startswith("error: "):
            out.kind, out.detail = "other", f"rejection line does not start with 'error: ': {lines[0]}"
    elif rc != 0:
        out.kind, out.detail = "other", f"exit code {rc}: " + " | ".join(lines[-3:])
    if out.ok:
        bad = sorted({f"{ord(c):#04x}" for c in stderr if ord(c) < 32 and c not in "\n\t"} |
                     ({"a lone surrogate"} if any(0xD800 <= ord(c) <= 0xDFFF for c in stderr) else set()))
        if bad:
            out.kind, out.detail = "other", f"control characters printed raw on stderr ({', '.join(bad)}): {stderr[:200]!r}"
    return out


def run_cli(argv: list[str], limit: float | None = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``planner.cli.main(argv)`` in-process with stdout and stderr captured, judged."""
    from planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    rc: Any = None
    try:
        with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), log_to(err), \
                time_limit(limit):
            rc = main(list(argv))
    except FuzzTimeout as e:
        return Outcome("hang", str(e), seconds=time.perf_counter() - t0, stdout=out.getvalue(), stderr=err.getvalue())
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        return Outcome("exception", f"main() raised {type(e).__name__}: {str(e)[:300]}", where(e),
                       time.perf_counter() - t0, None, out.getvalue(), err.getvalue())
    return _judge_cli(rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0, limit)


def locate_cli(argv: list[str], env: dict[str, str | None] | None = None, limit: float | None = HANG_S) -> str:
    """Where an exit-70 command fails: run it again with ``SHARDPLAN_DEBUG=1`` (the exception
    then leaves ``main``) and name the innermost product frame."""
    from planner.cli import main

    try:
        with environment({**(env or {}), "SHARDPLAN_DEBUG": "1"}), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), time_limit(limit):
            main(list(argv))
    except (FuzzTimeout, SystemExit):
        return ""
    except BaseException as e:  # noqa: BLE001
        return where(e)
    return ""


def run_cli_subprocess(argv: list[str], limit: float = HANG_S, env: dict[str, str | None] | None = None) -> Outcome:
    """``python -m planner.cli *argv`` as a process (``timeout=limit``), judged."""
    full = {k: v for k, v in os.environ.items() if k != "SHARDPLAN_DEBUG"}
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full.get("PYTHONPATH", "")) if p)
    full.setdefault("COLUMNS", "100")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "planner.cli", *argv], capture_output=True, timeout=limit,
                           cwd=REPO, env=full, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome("hang", f"killed after {limit:g} s", seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    stderr = p.stderr.decode("utf-8", "backslashreplace")
    return _judge_cli(p.returncode, p.stdout.decode("utf-8", "backslashreplace"), stderr, seconds + 0.0,
                      limit + 1.0)


# ---------------------------------------------------------------------------------------------
# Extra rules of some commands
# ---------------------------------------------------------------------------------------------

def snapshot(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def check_output_file(path: Path, before: bytes | None, outcome: Outcome, kind: str) -> str | None:
    """The ``-o`` rule: a failed command leaves ``path`` as it was; a successful one leaves a whole
    file (``kind``: ``plan``, ``svg``, ``png`` or ``text``); no temporary file stays behind."""
    try:
        parent = path.parent
        leftovers = [p.name for p in parent.glob(f".{path.name}.*.tmp")] if parent.is_dir() else []
    except (OSError, ValueError):
        leftovers = []
    if leftovers:
        return f"temporary files left next to -o: {leftovers[:3]}"
    now = snapshot(path)
    if outcome.rc != 0:
        if now != before:
            return ("a failed command created -o" if before is None else "a failed command changed -o") + f" ({path})"
        return None
    if outcome.rc == 0:
        if now is None:
            return f"exit 0 but -o '{path}' is not a file"
        if kind == "plan":
            from vocab.plan import parse_plan

            try:
                parse_plan(now.decode("utf-8"))
            except (ShardplanError, UnicodeDecodeError) as e:
                return f"-o holds no valid plan: {str(e)[:200]}"
        elif kind == "svg" and b"</svg>" not in now:
            return "-o is not a whole SVG"
        elif kind == "png" and not (now.startswith(b"\x89PNG") and now.rstrip().endswith(b"\xaeB`\x82")):
            return "-o is not a whole PNG"
        elif kind == "text" and not now:
            return "-o is empty"
    return None


def jsonl_lines(data: bytes) -> int | None:
    """Lines of a JSON-lines file (None: not UTF-8): each ended by ``\\n`` (a ``\\r`` before it, or
    anywhere, is JSON whitespace), a final one ending the last line. Other characters Unicode
    counts as line breaks (``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028, U+2029) end no
    line: JSON allows U+2028 and U+2029 unescaped inside strings."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text:
        return 0
    parts = text.split("\n")
    return len(parts) - 1 if parts[-1] == "" else len(parts)


def check_batch(data: bytes, outcome: Outcome) -> str | None:
    """``estimate --batch``: one JSON object out per line in, in order, ``{"error": ...}`` for a bad
    line (an internal error reported for a line counts as a bug); refusing the whole file (exit 2)
    is for a file that is empty, blank or not UTF-8 only."""
    n = jsonl_lines(data)
    if outcome.rc == 2:
        if n is None or not data.decode("utf-8").strip():
            return None
        return f"a readable batch file of {n} line(s) refused as a whole: {outcome.detail}"
    if outcome.rc != 0:
        return None
    got = outcome.stdout.split("\n")
    if got and got[-1] == "":
        got.pop()
    if n is None:
        return None if len(got) >= 1 else "no output for a non-UTF-8 file"
    if len(got) != n:
        return f"{n} input line(s) but {len(got)} output line(s)"
    for i, line in enumerate(got, 1):
        try:
            obj = json.loads(line)
        except ValueError:
            return f"output line {i} is not JSON: {line[:120]!r}"
        if not isinstance(obj, dict):
            return f"output line {i} is not a JSON object"
        err = obj.get("error")
        if isinstance(err, str) and err.startswith("line ") and not err.startswith(f"line {i}:"):
            return f"output line {i} reports another line: {err[:80]!r}"
        if isinstance(err, str) and ("internal error" in err or "this is a bug" in err):
            return f"output line {i} reports a bug instead of a bad input: {err[:300]}"
    return None


# ---------------------------------------------------------------------------------------------
# Cases: one generated input with the call that runs it
# ---------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One fuzzed input: ``run(limit)`` runs it in-process; ``argv``/``env`` (CLI cases) can also run as
    a subprocess; ``checks`` are the extra rules its outcome must meet."""

    family: str
    target: str
    notes: list[str]
    run: Callable[[float | None], Outcome]
    argv: list[str] | None = None
    env: dict[str, str | None] | None = None
    payload: bytes | None = None
    checks: list[Callable[[Outcome], str | None]] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)

    def describe(self, limit: int = 1500) -> str:
        parts = [f"[{self.family}] {self.target}", "mutations: " + "; ".join(self.notes)]
        if self.argv is not None:
            parts.append("argv: " + " ".join(_quote(a) for a in self.argv))
        if self.env:
            parts.append("env: " + ", ".join(f"{k}={v}" for k, v in self.env.items()))
        if self.payload is not None:
            more = " ..." if len(self.payload) > limit else ""
            parts.append(f"input ({len(self.payload)} bytes): {self.payload[:limit]!r}{more}")
        return "\n  ".join(parts)

    def execute(self, limit: float | None = HANG_S, subprocess_mode: bool = False) -> Outcome:
        """Run and judge (the extra rules included); removes the case's files afterwards."""
        try:
            if subprocess_mode:
                assert self.argv is not None
                out = run_cli_subprocess(self.argv, limit or HANG_S, self.env)
            else:
                out = self.run(limit)
            if out.ok:
                for check in self.checks:
                    problem = check(out)
                    if problem:
                        out.kind, out.detail = "other", problem
                        break
            if out.kind == "exit70" and self.argv is not None and not subprocess_mode:
                out.where = locate_cli(self.argv, self.env, limit)
            return out
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the case's files."""
        for p in self.cleanup:
            with contextlib.suppress(OSError, ValueError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()

    @property
    def subprocess_ok(self) -> bool:
        return self.argv is not None and not any("\x00" in a for a in self.argv)


def _quote(arg: str) -> str:
    if arg and all(c.isalnum() or c in "-_./=:,+@%" for c in arg):
        return arg
    return repr(arg) if any(not c.isprintable() for c in arg) else "'" + arg.replace("'", "'\\''") + "'"


class FuzzEnv:
    """Where the generators write files, and the seeds they start from (plans are made once)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self._plans: list[tuple[str, dict[str, Any], Path]] | None = None
        self.profile = valid_profile()
        self.profile_path = self.root / "seed-profile.json"
        self.profile_path.write_text(json.dumps(self.profile))
        self.configs = hf_configs()
        self.accelerator = accelerator_seed()
        self.clusters = cluster_seeds()

    @property
    def plans(self) -> list[tuple[str, dict[str, Any], Path]]:
        if self._plans is None:
            self._plans = make_plans(self.root)
        return self._plans

    def name(self, suffix: str = "", stem: str = "f") -> Path:
        self._n += 1
        return self.root / f"{stem}{self._n}{suffix}"

    def file(self, data: bytes, suffix: str = ".json", stem: str = "f") -> Path:
        p = self.name(suffix, stem)
        p.write_bytes(data)
        return p


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
    mode = rnd.choice(("dict", "text", "file"))
    tree, data, notes = mutate_document(rnd, doc, focus=PLAN_FOCUS, text_p=0.0 if mode == "dict" else 0.35)
    notes = [f"seed plan {name}", *notes]
    if mode == "dict":
        return Case("plan-doc", "vocab.plan.parse_plan(dict)", notes, _in_process(parse_plan, tree), payload=data)
    if mode == "text":
        text = data.decode("utf-8", "surrogateescape")
        return Case("plan-doc", "vocab.plan.parse_plan(str)", notes, _in_process(parse_plan, text), payload=data)
    path = fz.file(data)
    return Case("plan-doc", "vocab.plan.load_plan(path)", notes, _in_process(load_plan, path), payload=data,
                cleanup=[path])


PROFILE_FOCUS = (("compute",), ("comm",), ("device",), ("model",))


def gen_profile_doc(rnd: Any, fz: FuzzEnv) -> Case:
    """``profiler.profile_schema.parse_profile`` (dict or text) and ``load_profile``."""
    from profiler.profile_schema import load_profile, parse_profile

    mode = rnd.choice(("dict", "text", "file"))
    tree, data, notes = mutate_document(rnd, fz.profile, focus=PROFILE_FOCUS, text_p=0.0 if mode == "dict" else 0.35)
    if mode == "dict":
        return Case("profile-doc", "parse_profile(dict)", notes, _in_process(parse_profile, tree), payload=data)
    if mode == "text":
        text = data.decode("utf-8", "surrogateescape")
        return Case("profile-doc", "parse_profile(str)", notes, _in_process(parse_profile, text), payload=data)
    path = fz.file(data)
    return Case("profile-doc", "load_profile(path)", notes, _in_process(load_profile, path), payload=data,
                cleanup=[path])


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

EXPORT_TARGETS = ("torchtitan", "megatron", "deepspeed", "nanotron", "python")
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
                  "--dp": "count", "--dp-shard": "count", "--dp-replicate": "count"}),
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


def gen_cli_output(rnd: Any, fz: FuzzEnv) -> Case:
    """-o onto a folder, under a regular file, into a missing folder, onto an existing file, with odd
    names; a failed command must leave the target as it was, a successful one a whole file."""
    cmd = rnd.choice(("plan", "export", "plot"))
    name, _, seed_path = rnd.choice(fz.plans)
    base = fz.name("", stem="outdir")
    base.mkdir()
    (base / "file.json").write_text("{}\n")
    (base / "sub").mkdir()
    suffix = {"plan": ".json", "export": ".toml", "plot": ".svg"}[cmd]
    kind = rnd.choice(("dir", "under-file", "missing-dir", "existing", "new", "odd-suffix", "newline", "long", "dot"))
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


# ---------------------------------------------------------------------------------------------
# Time limits and reports shared by the tests and the benchmark
# ---------------------------------------------------------------------------------------------

class HangBudget:
    """The time limit of each call of one family: :data:`HANG_S` until ``allowed`` calls ran over
    it, then ``after`` seconds (a family with a hang does not spend the run waiting on more of
    them; a call over ``after`` then counts as a hang too)."""

    def __init__(self, allowed: int = 3, after: float = 5.0, limit: float = HANG_S):
        self.allowed, self.after, self.full, self.hangs = allowed, after, limit, 0

    def limit(self) -> float:
        return self.full if self.hangs < self.allowed else self.after

    def record(self, outcome: Outcome) -> None:
        if outcome.kind == "hang":
            self.hangs += 1


def signature(case: Case, out: Outcome) -> tuple[str, str, str]:
    """What makes two failures the same bug: family, kind, and the place and exception type (or the
    message with names and numbers blanked)."""
    import re

    if out.kind == "exit70":
        m = re.search(r"internal error in '[^']*': (\w+)", out.detail)
        what = m.group(1) if m else ""
    elif out.kind == "exception":
        what = out.detail.removeprefix("main() raised ").split(":")[0]
    else:
        what = re.sub(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?", "_", out.detail)[:70]
    return case.family, out.kind, f"{out.where} {what}".strip()


def report(failures: list[tuple[Case, Outcome]], groups: int = 12, width: int = 700) -> str:
    """Failures grouped by :func:`signature`: count, outcome and the first input of each group."""
    by: dict[tuple[str, str, str], list[tuple[Case, Outcome]]] = {}
    for case, out in failures:
        by.setdefault(signature(case, out), []).append((case, out))
    lines = [f"{len(failures)} failing input(s), {len(by)} distinct:"]
    for (_, _kind, _), items in sorted(by.items(), key=lambda kv: -len(kv[1]))[:groups]:
        case, out = items[0]
        lines.append(f"- {len(items)}x {out.summary()[:300]}")
        lines.append("    " + case.describe(width).replace("\n", "\n    "))
    if len(by) > groups:
        lines.append(f"... and {len(by) - groups} more distinct failure(s)")
    return "\n".join(lines)
