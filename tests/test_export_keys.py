"""Every key an export emits is one its trainer's loader accepts at the pinned version.

The key snapshots in ``vocab/targets/keys/`` are generated from the installed releases by
``benchmarks/trainer_key_snapshots.py``; these tests always run. Where a trainer is importable, its own
loader reads the exported file too (skipped otherwise).
"""

from __future__ import annotations

import functools
import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from planner.api import plan as search
from planner.trainers import export
from planner.trainers.reading import unknown_keys
from tests.test_explain import make_plan
from tests.test_exports import flags as megatron_flags
from tests.trainer_loaders import trainer_loader, unknown_to_megatron_core
from vocab.plan import Plan, TargetRef
from vocab.targets import by_exporter, key_snapshot

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "vocab" / "targets" / "keys"
TARGETS = ("torchtitan", "torchtitan-0.3", "megatron", "megatron-0.19", "deepspeed", "nanotron")


def snapshot(target: str) -> dict[str, Any]:
    return key_snapshot(by_exporter(target))


@functools.cache
def plans(target: str) -> tuple[Plan, ...]:
    """Plans searched for ``target`` (small presets; a tight memory limit for pipelines and recompute),
    and hand-made ones for what a search does not pick."""
    out = [search("llama3-8b", "16xh100", 2048, 64, target=target),
           search("llama3-8b", "16xh100", 4096, 64, memory_limit_gib=18, target=target),
           search("gpt2", "16xh100", 1024, 64, target=target)]
    if "ep" in by_exporter(target).axes:
        out.append(search("mixtral-8x7b", "16xh100", 2048, 64, target=target))
    full = {"default": {"sharding": "zero1", "recompute": "full"}}
    out += [make_plan({"mesh": {"pp": 2, "dp_shard": 4, "tp": 2}, "micro_batch": 1, **full}),
            make_plan({"mesh": {"pp": 2, "dp_shard": 8}, "default": {"sharding": "zero1"},
                       "layers": [{"unit": f"layers.{i}", "sharding": "zero1", "recompute": "full"}
                                  for i in range(1, 32, 2)]}),
            make_plan({"mesh": {"dp_replicate": 2, "dp_shard": 8}, "default": {"sharding": "zero3"}})]
    return tuple(out)


def texts(target: str) -> list[str]:
    return [export(p, target).text for p in plans(target)]


def test_snapshots_name_the_pinned_versions() -> None:
    """Every pinned release has its key snapshot (``vocab.targets.key_snapshot`` refuses a missing one or
    one of another version); run benchmarks/trainer_key_snapshots.py with the release installed."""
    for target in TARGETS:
        t = by_exporter(target)
        assert snapshot(target)["version"] == t.version
        assert (SNAPSHOTS / f"{t.package.replace('-', '_')}-{t.version}.json").is_file()


def test_torchtitan_keys_are_in_the_snapshot() -> None:
    sections = snapshot("torchtitan")["sections"]
    for text in texts("torchtitan"):
        doc = tomllib.loads(text)
        assert unknown_keys(doc, {k: dict.fromkeys(v) for k, v in sections.items()}) == []
        assert "enable_sequence_parallel" not in doc["parallelism"]
        ac = doc["activation_checkpoint"]
        assert ac["mode"] in ("none", "selective", "full")
        opt = ac.get("selective_ac_option", "op")
        assert opt == "op" or (opt.isdigit() and int(opt) >= 1)


@pytest.mark.parametrize("target", ["megatron", "megatron-0.19"])
def test_megatron_flags_are_in_the_snapshot(target: str) -> None:
    for text in texts(target):
        f = megatron_flags(text)
        assert unknown_to_megatron_core(f, target) == []
        for need in ("--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--normalization",
                     "--position-embedding-type", "--overlap-grad-reduce"):
            assert need in f


def test_megatron_exports_parse_with_megatron_lms_parser() -> None:
    """Every export is accepted by the definitions of Megatron-LM's own parser (recorded from its
    arguments.py: benchmarks/megatron_lm_parser.py), types and choices included."""
    from planner.trainers.megatron.parser import check_flags, recorded

    assert recorded()["version"] == "0.19.2" and len(recorded()["actions"]) > 700
    for i, text in enumerate(texts("megatron")):
        doc: dict[str, list[str]] = {}
        for tok in shlex.split(text, comments=True):
            if tok.startswith("--"):
                flag = tok
                doc[flag] = []
            else:
                doc[flag].append(tok)
        check_flags(doc, f"export {i}")


def test_megatron_model_shape_flags() -> None:
    f = megatron_flags(export(plans("megatron")[0], "megatron").text)
    assert (f["--hidden-size"], f["--ffn-hidden-size"], f["--num-attention-heads"]) == ("4096", "14336", "32")
    assert f["--group-query-attention"] is True and f["--num-query-groups"] == "8" and f["--swiglu"] is True
    assert (f["--normalization"], f["--position-embedding-type"]) == ("RMSNorm", "rope")
    assert f["--untie-embeddings-and-output-weights"] is True and f["--disable-bias-linear"] is True
    moe = megatron_flags(export(search("mixtral-8x7b", "16xh100", 2048, 64, target="megatron"), "megatron").text)
    assert (moe["--num-experts"], moe["--moe-router-topk"], moe["--moe-ffn-hidden-size"]) == ("8", "2", "14336")
    gpt2 = megatron_flags(export(search("gpt2", "16xh100", 1024, 64, target="megatron"), "megatron").text)
    assert "--swiglu" not in gpt2 and "--untie-embeddings-and-output-weights" not in gpt2
    assert gpt2["--normalization"] == "LayerNorm" and gpt2["--position-embedding-type"] == "learned_absolute"


@pytest.mark.parametrize("dispatch,overlap,pp,vpp,flex,overlapped", [
    ("alltoall", "1f1b", 1, 1, False, True), ("dedup", "1f1b", 2, 2, True, True),
    ("alltoall", "1f1b", 2, 1, False, False), ("alltoall", "none", 1, 1, False, False)])
def test_megatron_moe_flags_are_what_the_price_assumes(dispatch: str, overlap: str, pp: int, vpp: int, flex: bool,
                                                       overlapped: bool) -> None:
    """Expert parallelism runs the all-to-all dispatcher the price assumes (or DeepEP's flex one for
    dedup), with grouped GEMMs and fused permutations, and overlaps the all-to-alls where Megatron
    can (no pipeline, or virtual stages): Megatron's default allgather dispatcher is never left."""
    mesh = {"pp": pp, "dp_shard": 16 // pp, "ep": 8}
    s = {"mesh": mesh, "micro_batch": 1, "default": {"sharding": "zero1"},
         **({"schedule": "interleaved", "vpp": vpp} if vpp > 1 else {})}
    p = make_plan(s, cluster="16xh100", seq_len=2048, global_batch=32, model="mixtral-8x7b",
                  target=TargetRef(name="megatron", version="0.16.1"), cross_entropy="fused", recv_buffers="none",
                  kernels="fused", moe_dispatch=dispatch, moe_overlap=overlap)
    f = megatron_flags(export(p, "megatron").text)
    assert f["--moe-token-dispatcher-type"] == ("flex" if flex else "alltoall")
    assert f.get("--moe-flex-dispatcher-backend") == ("deepep" if flex else None)
    assert f["--moe-grouped-gemm"] is True and f["--moe-permute-fusion"] is True
    assert f.get("--overlap-moe-expert-parallel-comm", False) is overlapped
    fields = {x for names in snapshot("megatron")["classes"].values() for x in names}
    assert {k[2:].replace("-", "_") for k in f if k.startswith("--moe") or k.startswith("--overlap-moe")} <= fields


def test_deepspeed_keys_are_in_the_snapshot() -> None:
    snap = snapshot("deepspeed")
    sec = snap["sections"]
    seen = set()
    for text in texts("deepspeed"):
        cfg = json.loads(text)
        assert [k for k in cfg if k not in snap["top_level"]] == []
        z = cfg["zero_optimization"]
        assert [k for k in z if k not in sec["zero_optimization"]] == []
        for sub in ("offload_optimizer", "offload_param"):
            assert [k for k in z.get(sub, {}) if k not in sec[f"zero_optimization.{sub}"]] == []
        for name in ("bf16", "tensor_parallel", "activation_checkpointing", "pipeline"):
            assert [k for k in cfg.get(name, {}) if k not in sec[name]] == []
        seen |= set(cfg)
    assert {"pipeline", "activation_checkpointing"} <= seen


def test_nanotron_keys_are_in_the_snapshot() -> None:
    tree = snapshot("nanotron")["tree"]
    for text in texts("nanotron"):
        doc = yaml.safe_load(text)
        assert unknown_keys(doc, tree) == [] and "recompute_layer" not in doc["parallelism"]
        assert doc["parallelism"]["pp_engine"] in ("afab", "1f1b")
        assert doc["parallelism"]["tp_mode"] in ("ALL_REDUCE", "REDUCE_SCATTER")


# ---- the trainers' own loaders (installed from tests/trainers.txt) --------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_trainer_loaders_accept_the_exports(target: str, tmp_path: Path) -> None:
    loader = trainer_loader(target)
    assert loader is not None
    for i, p in enumerate(plans(target)):
        loader(export(p, target), tmp_path / str(i))


def test_megatron_drops_the_overlap_a_full_recompute_forbids_and_prices_it() -> None:
    """One block recomputed fully: Megatron refuses the all-to-all overlap for the whole model, so the
    export leaves the flag out, says why, and prices the plan without the overlap (slower)."""
    s = {"mesh": {"dp_shard": 16, "ep": 8}, "micro_batch": 1, "default": {"sharding": "zero1"},
         "layers": [{"unit": "layers.0", "sharding": "zero1", "recompute": "full"}]}
    p = make_plan(s, cluster="16xh100", seq_len=2048, global_batch=32, model="mixtral-8x7b",
                  target=TargetRef(name="megatron", version="0.16.1"), cross_entropy="fused", recv_buffers="none",
                  kernels="fused", moe_overlap="1f1b")
    e = export(p, "megatron")
    assert "--overlap-moe-expert-parallel-comm" not in megatron_flags(e.text)
    assert any(x.what == "MoE all-to-all overlap" and x.behaviour for x in e.losses)
    assert e.repriced is not None and e.repriced.variant["step_time_s"] > e.repriced.original["step_time_s"]


def test_a_capacity_factor_goes_to_megatron_and_comes_back_and_is_lost_elsewhere(tmp_path: Path) -> None:
    """Megatron-LM writes --moe-expert-capacity-factor and reads it back; torchtitan runs dropless
    only, so its export loses the factor and is priced without it; a search for it refuses one."""
    from planner.trainers import import_plan
    from vocab.errors import ShardplanError

    s = {"mesh": {"dp_shard": 16, "ep": 8}, "micro_batch": 1, "default": {"sharding": "zero1"}}
    p = make_plan(s, cluster="16xh100", seq_len=2048, global_batch=32, model="mixtral-8x7b",
                  target=TargetRef(name="megatron", version="0.16.1"), cross_entropy="fused", recv_buffers="none",
                  kernels="fused", moe_capacity_factor=1.25)
    e = export(p, "megatron")
    assert megatron_flags(e.text)["--moe-expert-capacity-factor"] == "1.25"
    path = tmp_path / "cf.args"
    path.write_text(e.text)
    assert import_plan(path).inputs.workload.moe_capacity_factor == 1.25
    t = export(p, "torchtitan")
    assert any(x.what == "capacity factor" for x in t.losses)
    assert not [k for sec in tomllib.loads(t.text).values() for k in sec if "capacity" in k]
    with pytest.raises(ShardplanError, match="runs dropless MoE only"):
        search("mixtral-8x7b", "16xh100", 2048, 32, target="torchtitan", moe_capacity_factor=1.25)
