"""The runtime at real size: a model built on the meta device and initialised shard by shard (each
rank drawing only its shards' values, the same numbers whatever the plan), a token file read
through a memory map, and checkpoints written with torch.distributed.checkpoint that the same plan
resumes bit for bit and another plan of the same model resumes like one process."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from profiler.model_config import TransformerConfig
from runtime import weights
from runtime.apply import apply_plan
from runtime.data import file_batch, open_tokens, synthetic_batch
from runtime.dcp import flat_boxes
from runtime.init import seeded, seeded_values
from runtime.launch import Job, free_port, launch
from runtime.memory import TensorPeak
from runtime.model import INIT_STD, TINY_HF, build, spec_for, spec_for_weights
from runtime.origins import Origin
from runtime.train import TrainSettings
from tests.runtime_checks import assert_parity
from vocab.errors import ShardplanError
from vocab.strategy import LayerStrategy as L
from vocab.strategy import Mesh, Strategy

TOKENS = Path(__file__).parent / "data" / "tokens" / "architecture-bytes.npy"  # docs/architecture.md's bytes


# ---- origins and seeded values -------------------------------------------------------------------
def test_an_origin_composes_the_cuts_of_a_parameter() -> None:
    o = Origin.whole("w", (8, 6))
    part = o.split(0, 3, 1).chunk(1, 2, 1).select(0, torch.tensor([0, 2]))  # rows 3..5 of 8, then columns 3..5
    assert [i.tolist() for i in part.index] == [[3, 5], [3, 4, 5]]
    assert part.boxes() == [((0, 0), (3, 3), (1, 3)), ((1, 0), (5, 3), (1, 3))]
    assert Origin.whole("w", (4,)).chunk(0, 8, 5).local_shape == (0,)  # FSDP2's empty chunks


def test_flat_ranges_become_row_major_boxes() -> None:
    shape = (3, 4, 5)
    for lo, hi in [(0, 60), (7, 53), (20, 40), (3, 4), (19, 21)]:
        boxes = flat_boxes(shape, lo, hi)
        covered = torch.zeros(shape, dtype=torch.int64)
        for off, size in boxes:
            covered[tuple(slice(a, a + n) for a, n in zip(off, size, strict=True))] += 1
        assert covered.view(-1).tolist() == [int(lo <= i < hi) for i in range(60)], (lo, hi)


def test_a_shard_draws_the_values_the_whole_parameter_has_there() -> None:
    """Whatever the cut (rows of a ring shard, interleaved OSDP rows, TP columns), a part's values are
    the whole parameter's at those indices, drawn without drawing the rest of the rows."""
    whole = Origin.whole("layers.0.mlp.up.weight", (300, 40))
    full = seeded(whole, 7, INIT_STD, 4)
    assert full.std().item() == pytest.approx(INIT_STD, rel=0.05)
    for part in (whole.split(0, 3, 2), whole.select(0, torch.tensor([5, 150, 299])), whole.chunk(1, 4, 3)):
        got = seeded(part, 7, INIT_STD, 4)
        want = full[part.index[0]][:, part.index[1]]
        assert torch.equal(got, want)
    assert not torch.equal(seeded(whole, 8, INIT_STD, 4), full)  # another seed, other values
    out = seeded(Origin.whole("layers.0.attn.out.weight", (64, 64)), 7, INIT_STD, 4)
    assert out.std().item() == pytest.approx(INIT_STD / 8 ** 0.5, rel=0.1)  # residual outputs: std / sqrt(2 layers)
    assert torch.equal(seeded(Origin.whole("layers.0.attn_norm.weight", (5,)), 7, INIT_STD, 4), torch.ones(5))


def test_a_seeded_model_is_the_same_built_whole_or_on_meta() -> None:
    spec = spec_for("tiny-llama", init="seeded")
    a, _ = build(spec, seed=3)
    meta, _ = build(spec, seed=3, meta=True)
    assert all(p.is_meta for p in meta.parameters())
    assert all(torch.equal(a.get_parameter(n), seeded(Origin.whole(n, tuple(p.shape)), 3, INIT_STD, 4))
               for n, p in a.named_parameters())


# ---- Hugging Face weights ------------------------------------------------------------------------------
def _hf_checkpoint(kind: str, path: Path) -> Any:
    """A tiny Hugging Face model of ``kind`` saved as safetensors in ``path``; the model."""
    import transformers

    torch.manual_seed(0)
    conf = dict(TINY_HF[kind])
    hf = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf)) if kind == "hf-llama"
          else transformers.GPT2LMHeadModel(transformers.GPT2Config(**conf)))
    hf.save_pretrained(path, safe_serialization=True)
    return hf.eval()


@pytest.mark.parametrize("kind", ["hf-llama", "hf-gpt2"])
def test_safetensors_weights_make_the_reference_model_compute_what_the_checkpoint_does(kind: str, tmp_path: Path) -> None:
    """Fused Q/K/V per KV group, SwiGLU's interleaved gate and up, GPT-2's transposed Conv1D."""
    hf = _hf_checkpoint(kind, tmp_path)
    model, vocab = build(spec_for_weights(str(tmp_path)))
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-6)
    part = Origin.whole("layers.1.attn.qkv.weight", tuple(model.layers["1"].attn.qkv.weight.shape)).split(0, 4, 3)
    assert torch.equal(weights.values(tmp_path)(part), model.layers["1"].attn.qkv.weight[part.index[0]])


# ---- the token file --------------------------------------------------------------------------------
def test_a_token_file_is_read_window_by_window() -> None:
    ids = np.load(TOKENS)
    x, y = file_batch(str(TOKENS), 2, 4, 16, 256)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    for i in range(4):  # window i of step 2 starts at (2*4 + i) * 16
        at = (2 * 4 + i) * 16
        assert x[i].tolist() == ids[at : at + 16].tolist() and y[i].tolist() == ids[at + 1 : at + 17].tolist()
    step = len(ids) // 16  # past the end: the windows wrap round the file
    at = (step * 16) % (len(ids) - 16)
    assert file_batch(str(TOKENS), step, 1, 16, 256)[0][0].tolist() == ids[at : at + 16].tolist()


def test_a_token_file_outside_the_vocabulary_or_too_short_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ShardplanError, match="holds token id 239, outside the model's vocabulary of 200$"):
        open_tokens(str(TOKENS), 200, 16)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(10, dtype=np.uint16))
    with pytest.raises(ShardplanError, match="holds 10 tokens, fewer than one sequence of 17$"):
        open_tokens(str(short), 256, 16)
    bad = tmp_path / "floats.npy"
    np.save(bad, np.zeros(100, dtype=np.float32))
    with pytest.raises(ShardplanError, match="is not a flat array of integer token ids"):
        open_tokens(str(bad), 256, 16)


def test_without_a_file_the_tokens_are_seeded() -> None:
    a, b = synthetic_batch(3, 1, 4, 8, 256), synthetic_batch(3, 1, 4, 8, 256)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], synthetic_batch(4, 1, 4, 8, 256)[0])


# ---- no rank holds the whole model ----------------------------------------------------------------------
SMALL = TransformerConfig(name="small-llama", layers=8, hidden=256, heads=4, kv_heads=2, vocab=2048, max_seq=64,
                          ffn_hidden=512, activation="swiglu", norm="rmsnorm", position="rope", bias=False,
                          tied_embeddings=False, source="test: a model bigger than its largest parameter by far")


def _peak_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model, _ = build(spec_for(SMALL, init="seeded"), meta=True)
        with TensorPeak(tensors=[]) as peak:  # every tensor made while the plan is applied and the shards drawn
            model = apply_plan(model, Strategy(mesh=Mesh(dp_shard=world), default=L(sharding="zero3")),
                               init=seeded_values(0, INIT_STD, SMALL.layers))
        held = sum(p.to_local().numel() * 4 for p in model.parameters())
        torch.save({"peak": peak.peak, "held": held}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_model_built_on_meta_is_never_whole_on_a_rank() -> None:
    world = 4
    whole = sum(p.numel() * 4 for p in build(spec_for(SMALL, init="seeded"), meta=True)[0].parameters())
    largest = 4 * SMALL.vocab * SMALL.hidden
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_peak_worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world,
                           start_method="spawn")
        got = [torch.load(Path(tmp) / f"{r}.pt") for r in range(world)]
    for r in got:
        assert r["held"] <= whole // world + 4 * SMALL.hidden  # its FSDP2 shards (a row of rounding)
        assert r["peak"] <= r["held"] + 2 * largest < whole / 2  # and at most the largest drawn parameter beside them


# ---- checkpoints -------------------------------------------------------------------------------------
def _job(model: str, s: Strategy, steps: int, precision: str, **kw: Any) -> Job:
    settings = TrainSettings(steps=steps, global_batch=8, seq_len=32, seed=0, precision=precision,
                             data=str(TOKENS), **kw)
    return Job(model=spec_for(model, init="seeded"), plan_json=s.model_dump_json(), settings=settings.to_dict(),
               name=f"{model}/{steps}", reference=True)


RESHARD = [  # (model, precision, plan that saves, plan that resumes too; 4 ranks)
    ("tiny-gpt", "bf16", Strategy(mesh=Mesh(pp=2, dp_shard=2), default=L(sharding="zero1"), micro_batch=1),
     Strategy(mesh=Mesh(dp_shard=2, tp=2), tp_mode="tsp", default=L(sharding="zero2"), micro_batch=4,
              layers=[L(unit="embedding", split=2), L(unit="layers.1.mlp.up", sharding="zero3", split=2)])),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,precision,first,second", RESHARD, ids=["pp-zero1-bf16-to-tsp-split"])
def test_a_checkpoint_resumes_on_the_same_plan_and_on_another(model: str, precision: str, first: Strategy,
                                                               second: Strategy, tmp_path: Path) -> None:
    """The masters of ZeRO-1 slices in bf16, a pipeline's two copies of a tied table, written as
    boxes of the unsplit model; read back on the same plan, and on TSP ring shards and OSDP slices."""
    ck = str(tmp_path / "ck")
    hf = _hf_checkpoint("hf-llama", tmp_path / "hf")  # and a checkpoint's weights, read shard by shard
    settings = TrainSettings(steps=1, global_batch=8, seq_len=32, seed=0, data=str(TOKENS))
    loaded = Job(model=spec_for_weights(str(tmp_path / "hf")), settings=settings.to_dict(), reference=True, name="hf",
                 plan_json=Strategy(mesh=Mesh(dp_shard=2, tp=2), sequence_parallel=True, micro_batch=4,
                                    default=L(sharding="zero3")).model_dump_json())
    whole, saved, from_hf = launch([_job(model, first, 3, precision), _job(model, first, 2, precision, save=ck), loaded], 4)
    x, y = file_batch(str(TOKENS), 0, 8, 32, 256)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert from_hf["steps"][0]["loss"] == pytest.approx(want, rel=1e-6)
    assert_parity(from_hf)
    assert sorted(os.listdir(ck))[0] == ".metadata"
    assert [s["loss"] for s in saved["steps"]] == [s["loss"] for s in whole["steps"][:2]]
    again, other = launch([_job(model, first, 1, precision, resume=ck), _job(model, second, 1, precision, resume=ck)], 4)
    assert [(s["step"], s["loss"]) for s in again["steps"]] == [(2, whole["steps"][2]["loss"])]  # bit for bit
    assert other["steps"][0]["step"] == 2 and other["reference_losses"] == whole["reference_losses"]
    assert_parity(other)
    assert_parity(whole)


# ---- the python export -----------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _script(tmp_path: Path, model: str, cluster: str, strategy: dict[str, Any], seq: int, batch: int) -> Path:
    from planner.reprice import plan_from_strategy
    from planner.trainers import export, refusal

    e = export(plan_from_strategy(model, cluster, strategy, seq, batch), "python")
    assert refusal(e) is None
    path = tmp_path / "train.py"
    path.write_text(e.text)
    return path


def _python(script: Path, *args: str, world: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run([sys.executable, str(script), *args], env=env, cwd=script.parent, capture_output=True,
                          text=True, timeout=300)


def test_a_70b_plans_python_export_builds_the_model_on_meta_without_allocating_it(tmp_path: Path) -> None:
    from profiler.models import resolve_config
    from profiler.transformer import build_graph

    script = _script(tmp_path, "llama3-70b", "1024xh100", {"mesh": {"dp_shard": 128, "tp": 8}, "tp_mode": "tsp"},
                     8192, 1024)
    res = _python(script, "--dry-run")
    assert res.returncode == 0, res.stderr[-2000:]
    n = build_graph(resolve_config("llama3-70b"), 1).total_params
    assert res.stdout.strip() == f"llama3-70b: {n:,} parameters built on the meta device (all on meta: True)"
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < 4 * 2**30  # not 280 GB of fp32


def test_the_python_export_refuses_a_model_the_runtime_cannot_build() -> None:
    from planner.reprice import plan_from_strategy
    from planner.trainers import export, refusal

    e = export(plan_from_strategy("deepseek-v3", "256xh100", {"mesh": {"dp_shard": 256, "ep": 8}}, 4096, 256), "python")
    why = refusal(e)
    assert why is not None and "multi-head latent attention" in why and "\n" not in why


@pytest.mark.slow
def test_the_python_export_trains_on_a_token_file_saves_and_resumes(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny_gpt2.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
                               "n_positions": 64}))
    script = _script(tmp_path, str(cfg), "1xcpu", {"micro_batch": 2}, 32, 4)
    ck = tmp_path / "ck"
    first = _python(script, "2", "--data", str(TOKENS), "--save", str(ck))
    assert first.returncode == 0, first.stderr[-2000:]
    assert (ck / ".metadata").is_file()
    both = _python(script, "3", "--data", str(TOKENS))
    resumed = _python(script, "1", "--data", str(TOKENS), "--resume", str(ck))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    last = [line for line in both.stdout.splitlines() if "step 2:" in line]
    assert resumed.stdout.strip().splitlines() == last and len(last) == 1  # the third step, as without a break
