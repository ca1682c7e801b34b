"""Command-line arguments: one-line usage errors naming the valid form, ``--version``, Hugging Face
ids for ``--model`` (presets, the local cache, never the network) and ``inspect``'s default length."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tomllib
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

from planner.cli import INSPECT_SEQ_LEN, main, version
from profiler import models
from profiler.model_config import TransformerConfig
from profiler.models import (
    cached_hf_config,
    default_seq_len,
    hf_hub_cache,
    hf_ids,
    load_model,
    preset,
    presets,
    resolve_config,
)
from vocab.errors import ShardplanError, UnknownNameError

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
PLAN = ["plan", "-m", "llama3-8b", "-c", "8xh100"]
ESTIMATE = ["estimate", "-m", "llama3-8b", "-c", "8xh100", "--seq-len", "4096", "--global-batch", "8"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- usage errors: one line, exit code 2, the valid form named ----------------------------------

USAGE_ERRORS = [
    ([*PLAN, "--seq-len", "8k", "--global-batch", "8"],
     "--seq-len takes an integer number of tokens, e.g. 8192, got '8k' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--memory-limit", "80GB"],
     "--memory-limit takes a number of GiB, e.g. 80, got '80GB' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192"],
     "shardplan plan needs --global-batch (samples per step, e.g. 1024)"),
    ([*PLAN, "--global-batch", "8"],
     "shardplan plan needs --seq-len (tokens per sample, e.g. 8192)"),
    (["plan", "-c", "8xh100", "--seq-len", "8192", "--global-batch", "8"],
     "shardplan plan needs --model (preset name, config.json path or pkg.module:factory, e.g. llama3-8b)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "-o"],
     "-o needs a file path (see shardplan plan --help)"),
    (["profile", "model", "-m", "gpt2", "-o"],
     "-o needs a file path (see shardplan profile model --help)"),
    ([*PLAN, "--seq-len", "0", "--global-batch", "8"],
     "--seq-len takes an integer number of tokens, at least 1, e.g. 8192, got '0' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "4.5", "--global-batch", "8"],
     "--seq-len takes an integer number of tokens, e.g. 8192, got '4.5' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--memory-limit", "nan"],
     "--memory-limit takes a number of GiB, above 0, e.g. 80, got 'nan' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--memory-limit", "-3"],
     "--memory-limit takes a number of GiB, above 0, e.g. 80, got '-3' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--reserve", "200"],
     "--reserve takes a percentage, 0 to 90, e.g. 5, got '200' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--top-k", "x"],
     "--top-k takes an integer number of runners-up, e.g. 5, got 'x' (see shardplan plan --help)"),
    ([*PLAN, "--seq-len", "8192", "--global-batch", "8", "--bogus"],
     "shardplan plan has no option --bogus (see shardplan plan --help)"),
    ([*ESTIMATE, "--tp", "1.5"],
     "--tp takes an integer degree, e.g. 8, got '1.5' (see shardplan estimate --help)"),
    ([*ESTIMATE, "--time-limit", "1"],
     "shardplan estimate has no option --time-limit; did you mean --memory-limit? (see shardplan estimate --help)"),
    (["estimate", "-m", "llama3-8b", "-c", "8xh100", "--seq-len"],
     "--seq-len needs an integer number of tokens, e.g. 8192 (see shardplan estimate --help)"),
    (["profile", "comm", "--nproc", "1000"],
     "--nproc takes an integer number of processes, 1 to 256, e.g. 8, got '1000' (see shardplan profile comm --help)"),
    (["train", "--watchdog-s", "nan"],
     "--watchdog-s takes a number of seconds, e.g. 600, got 'nan' (see shardplan train --help)"),
    (["inspect", "-m", "llama3-8b", "--seq-len", "8k"],
     "--seq-len takes an integer number of tokens, e.g. 8192, got '8k' (see shardplan inspect --help)"),
    (["explain"],
     "shardplan explain needs PLAN (plan JSON written by 'shardplan plan')"),
    (["no-such-command"],
     "No such command 'no-such-command' (see shardplan --help)"),
]


@pytest.mark.parametrize(("argv", "line"), USAGE_ERRORS, ids=[" ".join(a[-3:]) for a, _ in USAGE_ERRORS])
def test_argument_mistakes_give_one_line_naming_the_valid_form(capsys: pytest.CaptureFixture[str],
                                                              argv: list[str], line: str) -> None:
    rc, out, err = _run(capsys, *argv)
    assert (rc, out, err) == (2, "", f"error: {line}\n")


def test_usage_errors_print_odd_values_literally(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, *PLAN, "--seq-len", "[red]1\n2\x1b", "--global-batch", "8")
    assert rc == 2 and err == ("error: --seq-len takes an integer number of tokens, e.g. 8192, got '[red]1\\n2\\x1b' "
                               "(see shardplan plan --help)\n")
    rc, _, err = _run(capsys, *PLAN, "--seq-len", "9" * 5000, "--global-batch", "8")
    assert rc == 2 and err.count("\n") == 1 and f"got '{'9' * 37}...'" in err


def test_the_usage_error_of_a_subprocess_has_no_traceback_or_box() -> None:
    p = subprocess.run([sys.executable, "-m", "planner.cli", *PLAN, "--seq-len", "8k", "--global-batch", "8"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "error: --seq-len takes an integer number of tokens, e.g. 8192, got '8k' (see shardplan plan --help)\n"


# ---- --version ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    rc, out, err = _run(capsys, flag)
    assert (rc, out, err) == (0, f"shardplan {installed_version('shardplan')}\n", "")


def test_version_falls_back_to_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert version() == tomllib.load(f)["project"]["version"]


def test_version_and_help_import_no_heavy_module() -> None:
    code = ("import sys, io, contextlib\nfrom planner.cli import main\n"
            "for argv in (['--version'], ['--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert main(argv) == 0\n"
            "print(sorted(m for m in ('torch', 'numpy', 'pandas', 'pydantic', 'yaml', 'networkx', 'matplotlib',"
            " 'highspy', 'ortools', 'profiler.models') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# ---- Hugging Face ids ----------------------------------------------------------------------------

@pytest.mark.parametrize(("hf_id", "name"), [
    ("meta-llama/Meta-Llama-3-70B", "llama3-70b"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "llama3-8b"),
    ("meta-llama/Llama-3.1-8B", "llama3.1-8b"),
    ("meta-llama/Llama-3.1-405B-Instruct", "llama3.1-405b"),
    ("meta-llama/Llama-2-7b-hf", "llama2-7b"),
    ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
    ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"),
    ("openai/gpt-oss-20b", "gpt-oss-20b"),
    ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("gpt2", "gpt2"),
    ("openai-community/gpt2-xl", "gpt2-xl"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ("moonshotai/Kimi-K2-Instruct", "kimi-k2"),
    ("google/gemma-2-9b", "gemma2-9b"),
    ("META-LLAMA/meta-llama-3-70b", "llama3-70b"),
    (" qwen/qwen3-235b-a22b ", "qwen3-235b-a22b"),
])
def test_hugging_face_ids_name_their_preset(hf_id: str, name: str) -> None:
    assert resolve_config(hf_id) is presets()[name]
    assert preset(hf_id).name == name


def test_every_listed_id_is_unique_and_names_its_own_preset() -> None:
    seen: dict[str, str] = {}
    for name, cfg in presets().items():
        for hf_id in cfg.hf_ids:
            assert hf_id.lower() not in seen, (hf_id, seen.get(hf_id.lower()), name)
            seen[hf_id.lower()] = name
            assert resolve_config(hf_id).name == name
    assert seen == hf_ids() and len(seen) >= 40


def test_hf_ids_stay_out_of_graphs_and_plans() -> None:
    cfg = presets()["llama3-8b"]
    assert cfg.hf_ids and "hf_ids" not in cfg.to_dict()
    g = load_model("meta-llama/Meta-Llama-3-8B", 2048)
    assert g.content_hash() == load_model("llama3-8b", 2048).content_hash() == "58b12ea628dc4250"
    assert "hf_ids" not in g.summary()["config"]
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_hf_ids_are_checked_and_an_id_two_presets_claim_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"name": "m", "layers": 1, "hidden": 64, "heads": 4, "vocab": 10}
    assert TransformerConfig(**base, hf_ids=["org/name"]).hf_ids == ("org/name",)
    for bad in (["org/na me"], ["a/b/c"], [""], "org/name", [3]):
        with pytest.raises(ShardplanError, match="hf_ids"):
            TransformerConfig(**base, hf_ids=bad)  # type: ignore[arg-type]
    twins = {"a": TransformerConfig(**{**base, "name": "a"}, hf_ids=("Org/X",)),
             "b": TransformerConfig(**{**base, "name": "b"}, hf_ids=("org/x",))}
    monkeypatch.setattr(models, "presets", lambda: twins)
    with pytest.raises(ShardplanError, match="model presets 'a' and 'b' both list the Hugging Face id 'org/x'"):
        hf_ids.__wrapped__()


# ---- the local Hugging Face cache ----------------------------------------------------------------

def _snapshot(cache: Path, repo: str, revision: str, config: Path | dict, blob: bool = False) -> Path:
    """A snapshot of ``repo`` in a fake cache, its config.json a copy (or, as Hugging Face keeps it,
    a link to a blob)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    text = config.read_text() if isinstance(config, Path) else json.dumps(config)
    if blob:
        (folder / "blobs").mkdir(exist_ok=True)
        (folder / "blobs" / f"b{revision}").write_text(text)
        (snap / "config.json").symlink_to(Path("..") / ".." / "blobs" / f"b{revision}")
    else:
        (snap / "config.json").write_text(text)
    return snap / "config.json"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("shardplan touched the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_an_unknown_id_reads_the_cached_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _snapshot(tmp_path, "acme/Tiny-Llama", "abc123", DATA / "llama3-8b-config.json", blob=True)
    cfg = resolve_config("acme/Tiny-Llama")
    assert cfg.name == "acme/Tiny-Llama" and (cfg.layers, cfg.hidden, cfg.vocab) == (32, 4096, 128256)
    assert resolve_config("ACME/tiny-llama").layers == 32  # the folder matched ignoring case
    rc, out, err = _run(capsys, "inspect", "-m", "acme/Tiny-Llama", "--json")
    assert rc == 0 and err == ""
    summary = json.loads(out)
    assert summary["model"] == "acme/Tiny-Llama" and summary["total_params"] == 8030261248
    assert summary["seq_len"] == INSPECT_SEQ_LEN


def test_the_snapshot_refs_main_names_wins_else_the_newest(tmp_path: Path) -> None:
    gpt2 = DATA / "gpt2-config.json"
    old = _snapshot(tmp_path, "org/m", "old", gpt2)
    new = _snapshot(tmp_path, "org/m", "new", gpt2)
    os.utime(old.parent, (1_000_000, 1_000_000))
    os.utime(new.parent, (2_000_000, 2_000_000))
    assert cached_hf_config("org/m", tmp_path) == new
    (tmp_path / "models--org--m" / "refs").mkdir()
    (tmp_path / "models--org--m" / "refs" / "main").write_text("old\n")
    assert cached_hf_config("org/m", tmp_path) == old
    (tmp_path / "models--org--m" / "refs" / "main").write_text("gone")  # a revision without a snapshot
    assert cached_hf_config("org/m", tmp_path) == new
    shutil.rmtree(tmp_path / "models--org--m" / "snapshots")
    assert cached_hf_config("org/m", tmp_path) is None
    assert cached_hf_config("org/none", tmp_path) is None
    assert cached_hf_config("org/none", tmp_path / "missing") is None


def test_where_the_cache_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_hub_cache() == tmp_path / "hub"
    _snapshot(tmp_path / "hf" / "hub", "org/from-home", "r1", DATA / "gpt2-config.json")
    monkeypatch.delenv("HF_HUB_CACHE")
    assert resolve_config("org/from-home").layers == 12


def test_an_id_nowhere_says_where_its_config_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    line = (f"model 'acme/no-such-model' is not a preset and not in the local Hugging Face cache {cache}: put its "
            f"config.json at {cache}/models--acme--no-such-model/snapshots/<revision>/config.json (HF_HUB_CACHE moves "
            "the cache), or pass --model path/to/config.json; shardplan never downloads")
    with pytest.raises(ShardplanError) as e:
        resolve_config("acme/no-such-model")
    assert str(e.value) == line
    rc, out, err = _run(capsys, "inspect", "-m", "acme/no-such-model")
    assert (rc, out, err) == (2, "", f"error: {line}\n")
    with pytest.raises(ShardplanError, match=r"is not a preset \(did you mean 'meta-llama/Meta-Llama-3-8B'\?\)"):
        resolve_config("meta-llama/Meta-Llama-3-8")
    with pytest.raises(UnknownNameError, match="unknown model 'lama3-8b'"):  # a bare name: a mistyped preset
        resolve_config("lama3-8b")


def test_an_existing_path_keeps_meaning_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "meta-llama").mkdir()
    shutil.copy(DATA / "gpt2-config.json", tmp_path / "meta-llama" / "Meta-Llama-3-8B")  # a file, named like an id
    assert resolve_config("meta-llama/Meta-Llama-3-8B").layers == 12
    (tmp_path / "acme" / "local").mkdir(parents=True)  # a folder holding a config.json
    shutil.copy(DATA / "gpt2-config.json", tmp_path / "acme" / "local" / "config.json")
    cfg = resolve_config("acme/local")
    assert cfg.layers == 12 and cfg.name == "local"


# ---- inspect's default length ----------------------------------------------------------------------

@pytest.mark.parametrize(("model", "seq_len"), [("llama3-8b", 4096), ("llama3.1-405b", 4096), ("gpt2", 1024),
                                                ("bert-large", 512), ("meta-llama/Meta-Llama-3-70B", 4096)])
def test_inspect_defaults_to_4096_tokens_capped_at_the_models_max(capsys: pytest.CaptureFixture[str], model: str,
                                                                   seq_len: int) -> None:
    rc, out, _ = _run(capsys, "inspect", "-m", model, "--json")
    assert rc == 0 and json.loads(out)["seq_len"] == seq_len
    rc, out, _ = _run(capsys, "inspect", "-m", model)
    assert rc == 0 and f"at seq_len {seq_len} (default" in " ".join(out.split())


def test_inspect_takes_a_given_length(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "inspect", "-m", "llama3-8b", "--seq-len", "128", "--json")
    assert rc == 0 and json.loads(out)["seq_len"] == 128
    rc, out, _ = _run(capsys, "inspect", "-m", "llama3-8b", "--seq-len", "8192")
    assert rc == 0 and "at seq_len 8192: " in " ".join(out.split())


def test_default_seq_len() -> None:
    assert default_seq_len("llama3-8b") == 4096 and default_seq_len("gpt2", 512) == 512
    assert default_seq_len(str(DATA / "gpt2-config.json")) == 1024
    assert default_seq_len("tests.fixtures_models:tiny") is None  # a traced factory: the tracer's default
    assert default_seq_len({"model_type": "t5", "n_positions": 512, "d_model": 8}) == 512
    assert default_seq_len({"model_type": "t5", "d_model": 8}) is None
