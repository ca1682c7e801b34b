"""A plan from a stranger never becomes code: every string field of a plan, mutated with newlines,
quotes, shell, TOML and YAML syntax, exports either refused (exit 2, one line) or to a file whose
parsed content has the clean plan's shape — the same Python statements, Megatron flags, TOML tables
and keys, YAML and JSON keys, and header comment lines — with only string values differing."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from planner.cli import main
from planner.reprice import plan_from_strategy
from profiler.graph import graph_to_dict
from profiler.models import load_model
from vocab.plan import PlanError, parse_plan

MARKER = "shardplan-injected-marker"
PAYLOADS = (
    "\nimport os; os.system('touch " + MARKER + "')\n#",
    "\r" + MARKER,
    "\x0c\n" + MARKER,
    '"""; import os  # ' + MARKER,
    "'" + MARKER + "'",
    '"' + MARKER + '"',
    "$(touch " + MARKER + ")",
    "`touch " + MARKER + "`",
    "; touch " + MARKER + ";",
    "\u2028" + MARKER,
    "\x85" + MARKER,
    '\n[job]\ndump_folder = "/tmp/' + MARKER + '"',
    '[job] dump_folder = "/tmp/' + MARKER + '"',
    "\ncheckpoints_path: /tmp/" + MARKER,
    "checkpoints_path: /tmp/" + MARKER,
    " --save /tmp/" + MARKER,
    "# " + MARKER,
    "\\" + MARKER,
    "\x1b]0;" + MARKER + "\x07",
)
TARGETS = ("torchtitan", "torchtitan-0.3", "megatron", "deepspeed", "nanotron", "python")


@pytest.fixture(scope="module")
def clean() -> dict[str, Any]:
    """A plan with a recorded layer graph (so its graph's config and node names are fields too), a
    profile named for the record, solver options, notes and a runner-up."""
    p = plan_from_strategy("gpt2", "4xcpu", {"mesh": {"tp": 2, "dp_shard": 2}, "sequence_parallel": True}, 128, 8)
    doc = json.loads(p.to_json())
    graph = graph_to_dict(load_model("gpt2", 128))
    graph.pop("model_id", None)
    doc["inputs"].update(model="my-gpt2", model_graph=graph, profile="profiles/cpu.json")
    doc["solver"].update(options={"objective": "step time", "limits": ["memory"]}, space="hybrid grid")
    doc["predicted"]["notes"] = ["a note"]
    doc["alternatives"] = [{"strategy": doc["strategy"], "predicted": doc["predicted"]}]
    doc["strategy"]["layers"] = [{"unit": "layers.0", "sharding": "replicate", "recompute": "full",
                                  "offload": "none", "split": 1}]
    parse_plan(doc)
    return doc


def string_paths(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every string leaf's path; of a list, the first element's only (the rest are alike)."""
    if isinstance(doc, str):
        yield path
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from string_paths(v, (*path, k))
    elif isinstance(doc, list) and doc:
        yield from string_paths(doc[0], (*path, 0))


def mutated(doc: dict[str, Any], path: tuple[Any, ...], payload: str) -> dict[str, Any]:
    out = json.loads(json.dumps(doc))
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = node[path[-1]] + payload
    return out


def shape(x: Any) -> Any:
    """A parsed document with every string replaced by one placeholder: what a string cannot change."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [shape(v) for v in x]
    return "<str>" if isinstance(x, str) else x


class _Strings(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant("<str>") if isinstance(node.value, str) else node


def parsed(target: str, text: str) -> Any:
    """The export as its reader sees it, strings blanked; plus its comment lines (each one line)."""
    comments = [ln for ln in text.splitlines() if ln.startswith("#")]
    if target == "torchtitan":
        content: Any = shape(tomllib.loads(text))
    elif target == "nanotron":
        content = shape(yaml.safe_load(text))
    elif target == "deepspeed":
        content = shape(json.loads(text))
    elif target == "megatron":
        content = [t if t.startswith("--") else "<value>" for t in shlex.split(text, comments=True)]
    elif target == "torchtitan-0.3":
        content = [t if t.startswith("--") else "<value>" for t in _script_words(text)]
    else:
        content = ast.dump(_Strings().visit(ast.parse(text)))
    return content, len(comments)


def export_cli(doc: dict[str, Any], target: str, tmp: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, Path]:
    plan, out = tmp / "plan.json", tmp / f"out.{target}"
    plan.write_text(json.dumps(doc))
    out.unlink(missing_ok=True)
    rc = main(["export", str(plan), "--to", target, "--nearest", "-o", str(out)])
    return rc, capsys.readouterr().err, out


def assert_refused(rc: int, err: str, out: Path, path: tuple[Any, ...]) -> None:
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and not out.exists(), (path, err)
    assert not any(c in err for c in "\x1b\r\x0c\x85\u2028\x07"), (path, err)


def test_every_string_field_with_every_payload_is_refused_or_quoted(
        clean: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reference = {}
    for t in TARGETS:
        rc, err, out = export_cli(clean, t, tmp_path, capsys)
        assert rc == 0, err
        reference[t] = parsed(t, out.read_text())
    paths = list(string_paths(clean))
    assert len(paths) > 40  # inputs, strategy, predicted, solver, alternatives, the graph's config and nodes
    written: dict[str, list[Path]] = {t: [] for t in TARGETS}
    refused = 0
    for i, path in enumerate(paths):
        for j, payload in enumerate(PAYLOADS):
            doc = mutated(clean, path, payload)
            try:
                parse_plan(doc)
            except PlanError:
                refused += 1
                t = TARGETS[(i + j) % len(TARGETS)]  # a refused document is refused by every target alike
                rc, err, out = export_cli(doc, t, tmp_path, capsys)
                assert_refused(rc, err, out, path)
                continue
            for t in TARGETS:
                rc, err, out = export_cli(doc, t, tmp_path, capsys)
                if rc != 0:  # what the document holds is read when exporting (a recorded graph's config)
                    assert_refused(rc, err, out, path)
                    refused += 1
                    continue
                assert parsed(t, out.read_text()) == reference[t], (path, payload, t)
                kept = tmp_path / f"{len(written[t])}.{t}"
                out.rename(kept)
                written[t].append(kept)
    assert refused and all(written.values())
    _megatron_words_in_bash(written["megatron"], reference["megatron"][0], tmp_path)
    _script_words_in_sh(written["torchtitan-0.3"], reference["torchtitan-0.3"][0], tmp_path)
    _python_scripts_run(written["python"], tmp_path)


def _megatron_words_in_bash(files: list[Path], flags: list[str], tmp: Path) -> None:
    """The documented launch (``eval "PLAN_ARGS=($(cat plan.args))"``) gives bash the words shlex
    reads, and runs nothing."""
    script = 'for f in "$@"; do eval "PLAN_ARGS=($(cat "$f"))"; printf "%s\\0" "${PLAN_ARGS[@]}"; printf "\\1"; done'
    res = subprocess.run(["bash", "-c", script, "bash", *map(str, files)], cwd=tmp, capture_output=True, check=True)
    per_file = res.stdout.split(b"\x01")[:-1]
    assert len(per_file) == len(files)
    for f, words in zip(files, per_file, strict=True):
        got = [w.decode() for w in words.split(b"\0")[:-1]]
        assert got == shlex.split(f.read_text(), comments=True)
        assert [t if t.startswith("--") else "<value>" for t in got] == flags
    assert not (tmp / MARKER).exists()


def _script_words(text: str) -> list[str]:
    """The words of a torchtitan 0.3 launch script as the shell splits them (comments dropped, lines joined;
    ``"$@"``, the launch's own torchrun flags, none; from the command ``exec`` runs)."""
    words = [w for w in shlex.split(text.replace("\\\n", " "), comments=True) if w != "$@"]
    return words[1:] if words[:1] == ["exec"] else words


def _script_words_in_sh(files: list[Path], words: list[str], tmp: Path) -> None:
    """Each torchtitan 0.3 script, its ``exec torchrun`` replaced by ``printf``, run by ``sh``: the shell
    reads the words shlex reads, and runs nothing else."""
    for f in files:
        text = f.read_text()
        assert text.count("exec torchrun ") == 1
        probe = tmp / "probe.sh"
        probe.write_text(text.replace("exec torchrun ", "printf '%s\\0' torchrun "))
        res = subprocess.run(["sh", str(probe)], cwd=tmp, capture_output=True, check=True)
        got = [w.decode() for w in res.stdout.split(b"\0")[:-1]]
        assert got == _script_words(text)
        assert [t if t.startswith("--") else "<value>" for t in got] == words
    assert not (tmp / MARKER).exists()


STUB_RUNNER = r'''
import sys, types
sys.modules["torch"] = types.ModuleType("torch")
dist = types.ModuleType("torch.distributed")
sys.modules["torch.distributed"] = dist
sys.modules["torch"].distributed = dist
from vocab.plan import parse_plan
for name in ("runtime.apply", "runtime.model", "runtime.train"):
    mod = types.ModuleType(name)
    mod.__getattr__ = lambda attr: (lambda *a, **k: None)
    sys.modules[name] = mod
for path in sys.argv[1:]:
    scope = {"__name__": "exported"}
    exec(compile(open(path).read(), path, "exec"), scope)
    assert scope["PLAN"] == parse_plan(scope["PLAN_DOCUMENT"])
print("ran", len(sys.argv) - 1)
'''


def _python_scripts_run(files: list[Path], tmp: Path) -> None:
    """Each script's top level (imports stubbed, the plan parsed) runs and does nothing else."""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", STUB_RUNNER, *map(str, files)], cwd=tmp, capture_output=True,
                         text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"ran {len(files)}"
    assert not (tmp / MARKER).exists()


@pytest.mark.parametrize("key, value", [("kv_lora_rank", "1 --save /tmp/x"), ("heads", "4; touch x"),
                                        ("activation", "gelu\n--save /tmp/x")])
def test_graph_config_values_never_become_flags(clean: dict[str, Any], key: str, value: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(json.dumps(clean))
    doc["inputs"]["model_graph"]["config"][key] = value
    rc, err, out = export_cli(doc, "megatron", tmp_path, capsys)
    if rc == 2:
        assert err.count("\n") == 1 and not out.exists()
        return
    words = shlex.split(out.read_text(), comments=True)
    assert "--save" not in words and words.count("--num-attention-heads") <= 1


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_exporters_quote_what_validation_would_refuse(clean: dict[str, Any], payload: str) -> None:
    """The exporters hold on their own: a plan built in code, never validated, with the payload in
    its model and accelerator names, exports to the clean plan's shape (comments stay comments)."""
    from planner.trainers import export

    plan = parse_plan(clean)
    inputs = plan.inputs.model_copy(update={
        "model": plan.inputs.model + payload,
        "cluster": plan.inputs.cluster.model_copy(update={"accelerator": "cpu" + payload})})
    dirty = plan.model_copy(update={"inputs": inputs})
    for t in TARGETS:
        assert parsed(t, export(dirty, t).text) == parsed(t, export(plan, t).text), t
