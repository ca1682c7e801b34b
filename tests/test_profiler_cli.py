"""``shardplan profile``: bad input exits 2 with a message and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import planner.commands  # noqa: F401  (registers the subcommands)
from planner.cli import app
from profiler.profile_schema import load_profile

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("sub", ["compute", "model"])
def test_missing_cuda_device_exits_2_and_writes_nothing(sub: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    extra = ["--model", "gpt2"] if sub == "model" else []
    r = run("profile", sub, "--device", "cuda", *extra, "-o", str(out))
    assert r.exit_code == 2
    assert "device 'cuda' is not available" in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_merge_into_a_truncated_profile_exits_2_and_leaves_it(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    out.write_text('{"schema_version": "1.0", "kind": "shardplan-profile", "device": {"ki')
    r = run("profile", "compute", "--device", "cpu", "--quick", "--merge", "-o", str(out))
    assert r.exit_code == 2 and "truncated" in r.output
    assert out.read_text().endswith('"ki')


@pytest.mark.parametrize("args, message", [
    (["--sizes", "1X"], "--sizes"),
    (["--backend", "nccl"] if not torch.cuda.is_available() else ["--backend", "mpi"], "cannot start"
     if not torch.cuda.is_available() else "not gloo or nccl"),
    (["--nproc", "1"], "at least 2"),
])
def test_comm_bad_input_exits_2(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    r = run("profile", "comm", *args, "-o", str(out))
    assert r.exit_code == 2 and message in r.output and not out.exists()


def test_model_refuses_what_does_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = run("profile", "model", "--model", "llama3.1-405b", "--layers", "8", "-o", str(out))
    assert r.exit_code == 2 and "GiB is free" in r.output and not out.exists()


def test_model_on_a_tiny_config_writes_a_profile(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4, "vocab_size": 100,
                               "n_positions": 64}))
    out = tmp_path / "m.json"
    r = run("profile", "model", "--model", str(cfg), "--layers", "1", "--seq-len", "16", "--repeats", "2",
            "-o", str(out), "--json")
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.device.kind == "cpu" and prof.compute is None
    assert [m.layer for m in prof.model][:3] == ["layers.0.attn_norm", "layers.0.attn.qkv", "layers.0.attn.core"]
    assert prof.model[-1].layer == "layers.0" and prof.model[-1].kind == "block"
    # a second run merges: the rows are replaced, not duplicated
    r = run("profile", "model", "--model", str(cfg), "--layers", "1", "--seq-len", "16", "--repeats", "2",
            "-o", str(out), "--merge", "--json")
    assert r.exit_code == 0, r.output
    assert len(load_profile(out).model) == len(prof.model)


def test_a_profile_of_the_wrong_device_kind_is_refused(tmp_path: Path) -> None:
    from profiler.profile_schema import DeviceInfo, Profile

    gpu = tmp_path / "gpu.json"
    Profile(device=DeviceInfo(kind="gpu", name="NVIDIA H200", torch_version="2.13.0", cuda_version="12.8",
                              threads=16, hostname="g", created="2026-01-01T00:00:00+00:00")).save(gpu)
    out = tmp_path / "m.json"
    r = run("profile", "model", "--model", "gpt2", "--profile", str(gpu), "-o", str(out))
    assert r.exit_code == 2 and "measured on a gpu" in r.output and not out.exists()
    r = run("profile", "comm", "--sizes", "1K", "--merge", "-o", str(gpu))
    assert r.exit_code == 2 and "measured on a gpu" in r.output
    assert load_profile(gpu).device.kind == "gpu"  # left as it was
