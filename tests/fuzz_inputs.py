"""Valid seed documents of the input fuzz suite (plans, profiles, Hugging Face configs, clusters,
accelerator files, batch lines, cluster specs) and the mutations made of them: keys dropped or
added, values swapped for other types, non-finite, negative, zero or huge numbers, deep nesting,
truncation, random or non-UTF-8 bytes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"


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
