"""The trainers' own loaders, run on an export: torchtitan's ``ConfigManager`` (0.2.2 in process, 0.3.0 in a
child process), megatron-core's config dataclasses (0.16.1) and Megatron-LM's own parser and
``validate_args`` (the megatron-core 0.19.2 wheel's, in a child process), DeepSpeed's ``DeepSpeedConfig``
and nanotron's strict ``get_config_from_file``. ``tests/install_trainers.sh`` (the README's test command)
installs them: the pinned releases from ``tests/trainers.txt``, the newer ones beside them in
``.trainers/``. Where one is not installed its checks are skipped, and an installed release other than
the one its target pins fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from planner.trainers.exporting import Exported
from tests.benchmark_scripts import benchmark_script
from vocab.targets import by_exporter, key_snapshot

ROOT = Path(__file__).resolve().parents[1]
MODULE = {"torchtitan": "torchtitan.config.manager", "megatron": "megatron.core", "deepspeed": "deepspeed",
          "nanotron": "nanotron"}

Loader = Callable[[Exported, Path], None]


def trainer_loader(target: str, skip: bool = True) -> Loader | None:
    """The loader of ``target``'s trainer. Where the trainer is not installed the test is skipped (or,
    without ``skip``, None is returned); an installed release other than the pinned one fails."""
    if target == "python":
        return LOADERS[target]
    if target in SIDE_INSTALLS:
        return _side_loader(target, skip)
    t = by_exporter(target)
    try:
        installed = importlib.metadata.version(t.package)
    except importlib.metadata.PackageNotFoundError:
        if not skip:
            return None
        pytest.skip(f"{t.package} is not installed (pip install --no-deps -r tests/trainers.txt)")
    assert installed == t.version, f"{t.package} {installed} is installed, the {target} target pins {t.version}"
    if target != "nanotron":  # nanotron 0.4 cannot be imported as installed: an import cycle, see _nanotron
        importlib.import_module(MODULE[target])  # installed: an import error is a failure, not a skip
    return LOADERS[target]


#: releases installed beside the pinned ones (``tests/install_trainers.sh``: ``pip install --no-deps --target``),
#: loaded in a child process with their folder first on ``PYTHONPATH``
SIDE_INSTALLS = {"torchtitan-0.3": ROOT / ".trainers" / "torchtitan-0.3.0",
                 "megatron-0.19": ROOT / ".trainers" / "megatron-core-0.19.2"}
#: megatron-core 0.19.2 beside the pinned 0.16.1: its wheel ships Megatron-LM's ``megatron/training``
MEGATRON_LM = SIDE_INSTALLS["megatron-0.19"]


def _side_loader(target: str, skip: bool) -> Loader | None:
    t, folder = by_exporter(target), SIDE_INSTALLS[target]
    dist = t.package.replace("-", "_")  # a wheel's dist-info names the distribution with underscores
    found = sorted(folder.glob(f"{dist}-*.dist-info"))
    if not found:
        if not skip:
            return None
        pytest.skip(f"{t.package} {t.version} is not installed in {folder.relative_to(ROOT)} (the README's test command)")
    assert found[0].name == f"{dist}-{t.version}.dist-info", f"{found[0].name} in {folder}, {target} pins {t.version}"
    return LOADERS[target]


#: what the child process runs: torchtitan 0.3's own ConfigManager on the script's flags (those after
#: ``-m torchtitan.train``), as ``torchtitan/train.py`` parses them
TORCHTITAN_03_CHECK = r"""
import json, shlex, sys, warnings
warnings.filterwarnings("ignore")
from torchtitan.config.manager import ConfigManager
tokens = shlex.split(sys.stdin.read().replace("\\\n", " "), comments=True)
c = ConfigManager().parse_args(tokens[tokens.index("torchtitan.train") + 1:])
p, t = c.parallelism, c.training
print(json.dumps({"tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
                  "ep": p.expert_parallel_degree, "dp_shard": p.data_parallel_shard_degree,
                  "dp_replicate": p.data_parallel_replicate_degree, "sp": p.enable_sequence_parallel,
                  "local_batch": t.local_batch_size, "global_batch": t.global_batch_size, "seq_len": t.seq_len,
                  "ac": type(c.activation_checkpoint).__qualname__, "parts": p.module_fqns_per_model_part}))
"""


def _torchtitan_03(e: Exported, where: Path) -> None:
    """torchtitan 0.3.0's ``ConfigManager`` parses the script's flags in a child process (the release beside
    the pinned 0.2.2); a script whose model has no registry function names placeholders, which are
    replaced by ``llama3 llama3_debugmodel`` so that the flags, the plan, are what is checked. The parsed
    degrees must be the export's."""
    import os
    import subprocess
    import sys

    text = e.text.replace("SET-ME-module", "llama3").replace("SET-ME-config", "llama3_debugmodel")
    env = {**os.environ, "PYTHONPATH": str(SIDE_INSTALLS["torchtitan-0.3"])}
    run = subprocess.run([sys.executable, "-c", TORCHTITAN_03_CHECK], input=text, capture_output=True, text=True,
                         env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    m = e.strategy.mesh
    assert (got["tp"], got["pp"], got["cp"], got["ep"]) == (m.tp, m.pp, m.cp, m.ep), got
    assert got["dp_shard"] * got["dp_replicate"] == m.dp_shard * m.dp_replicate, got
    assert got["sp"] == (m.tp == 1 or bool(e.strategy.sequence_parallel)), got


#: what the child process runs: Megatron-LM's own ``add_megatron_arguments`` parser and ``validate_args`` (the
#: checks across flags) on an export's flags, as ``pretrain_gpt.py``'s ``initialize_megatron`` runs them on one
#: rank of the job's world; ``typing.override`` (Python 3.12) is shimmed, and the GPU generation that
#: ``validate_args`` asks the CUDA driver for (``get_device_arch_version``, ``torch.cuda.get_device_capability``)
#: is the cluster's
MEGATRON_LM_CHECK = r"""
import argparse, json, os, sys, typing, warnings
warnings.filterwarnings("ignore")
if not hasattr(typing, "override"):
    typing.override = lambda f: f
import torch
import megatron.training.arguments as lm
out = []
for req in json.loads(sys.stdin.read()):
    lm.get_device_arch_version = lambda: req["arch"]
    torch.cuda.get_device_capability = lambda *a, **k: (req["arch"], 0)
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(req["env"])
    parser = argparse.ArgumentParser(allow_abbrev=False)
    lm.add_megatron_arguments(parser)
    args = parser.parse_args(req["argv"])
    args.rank, args.world_size = 0, req["world"]
    lm.validate_args(args, {})
    out.append({"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                "cp": args.context_parallel_size, "ep": args.expert_model_parallel_size,
                "dp": args.data_parallel_size, "fp32_grads": bool(args.accumulate_allreduce_grads_in_fp32)})
print(json.dumps(out))
"""
#: accelerators of the Blackwell generation (compute capability 10): validate_args lifts its pre-Blackwell checks
BLACKWELL = ("b200", "gb200", "b300", "gb300")


def megatron_lm_validates(exports: list[Exported]) -> list[dict[str, Any]] | None:
    """Megatron-LM 0.19.2's ``parse_args`` + ``validate_args`` on Megatron exports, in one child process (None
    where megatron-core 0.19.2 is not installed beside), each as one rank of its job's world would run them:
    WORLD_SIZE and RANK set, CUDA_DEVICE_MAX_CONNECTIONS 1 as Megatron-LM's launch scripts set it unless the
    export runs Megatron-FSDP (its note says to leave it unset). Each parsed mesh must be the export's."""
    import os
    import shlex
    import subprocess
    import sys

    from planner.trainers.reading import read_inputs

    if not (MEGATRON_LM / "megatron" / "training").is_dir():
        return None
    reqs = []
    for e in exports:
        argv = shlex.split(e.text, comments=True)
        accelerator = str(read_inputs(e.text, "the export")["cluster"]["accelerator"]).lower()
        env = {"WORLD_SIZE": str(e.strategy.mesh.world_size), "RANK": "0", "LOCAL_RANK": "0"}
        if "--use-megatron-fsdp" not in argv:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        reqs.append({"argv": argv, "world": e.strategy.mesh.world_size, "env": env,
                     "arch": 10 if accelerator.startswith(BLACKWELL) else 9})
    run = subprocess.run([sys.executable, "-c", MEGATRON_LM_CHECK], input=json.dumps(reqs), capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(MEGATRON_LM)}, timeout=600, check=False,
                         cwd=str(ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for e, g in zip(exports, got, strict=True):
        m = e.strategy.mesh
        assert (g["tp"], g["pp"], g["cp"], g["ep"]) == (m.tp, m.pp, m.cp, m.ep), (g, m)
    return got


def _megatron_019(e: Exported, where: Path) -> None:
    """The megatron-0.19 target's loader: Megatron-LM 0.19.2's own ``parse_args`` + ``validate_args``
    (:func:`megatron_lm_validates`; building its TransformerConfig needs Transformer Engine)."""
    assert megatron_lm_validates([e]) is not None


def _torchtitan(e: Exported, where: Path) -> None:
    from torchtitan.config.manager import ConfigManager

    where.mkdir(parents=True, exist_ok=True)
    path = where / "job.toml"
    path.write_text(e.text)
    ConfigManager().parse_args(["--job.config_file", str(path)])


def unknown_to_megatron_core(flags: Any, target: str = "megatron") -> list[str]:
    """The flags that are neither a field of megatron-core's configs at the pinned version (``--a-b`` is
    ``a_b``), nor a Megatron-LM flag its key snapshot names, nor a launch placeholder (Megatron-LM's own,
    which its recorded parser checks: ``tests/test_export_keys.py``)."""
    from planner.trainers.megatron.keys import MEGATRON_PLACEHOLDERS

    snap = key_snapshot(by_exporter(target))
    fields = {x for names in snap["classes"].values() for x in names}
    known = {*snap["lm_flags"], *(flag for flag, _ in MEGATRON_PLACEHOLDERS)}
    return [x for x in flags if x not in known and x[2:].replace("-", "_") not in fields]


def _flags(text: str) -> dict[str, str | bool]:
    from tests.test_exports import flags

    return flags(text)


def _megatron(e: Exported, where: Path) -> None:
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    snap = key_snapshot(by_exporter("megatron"))
    tc_fields = set(snap["classes"]["TransformerConfig"])
    ddp_fields = set(snap["classes"]["DistributedDataParallelConfig"])
    f = _flags(e.text)

    def val(v: str | bool) -> Any:
        if v is True:
            return True
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    kw = {k[2:].replace("-", "_"): val(v) for k, v in f.items() if k not in snap["lm_flags"]}
    tc = {k: v for k, v in kw.items() if k in tc_fields}
    if "--swiglu" in f:
        tc.update(gated_linear_unit=True, activation_func=F.silu)
    if "--num-experts" in f:
        tc["num_moe_experts"] = int(f["--num-experts"])  # type: ignore[arg-type]
    if "--disable-bias-linear" in f:
        tc["add_bias_linear"] = False
    pp = tc.get("pipeline_model_parallel_size", 1)
    if "--num-layers-per-virtual-pipeline-stage" in f:
        counted = tc["num_layers"] + sum(1 for k in ("--account-for-embedding-in-pipeline-split",
                                                   "--account-for-loss-in-pipeline-split") if k in f)
        tc["virtual_pipeline_model_parallel_size"] = counted // pp // int(  # Megatron-LM arguments.py:924-941
            f["--num-layers-per-virtual-pipeline-stage"])  # type: ignore[arg-type]
    if "--decoder-first-pipeline-num-layers" in f:
        tc["num_layers_in_first_pipeline_stage"] = int(f["--decoder-first-pipeline-num-layers"])  # type: ignore[arg-type]
    if "--decoder-last-pipeline-num-layers" in f:
        tc["num_layers_in_last_pipeline_stage"] = int(f["--decoder-last-pipeline-num-layers"])  # type: ignore[arg-type]
    if pp > 1:
        tc["pipeline_dtype"] = torch.bfloat16
    tc.pop("fp8", None)
    # Transformer Engine's fused permutation (TE >= 2.1) is not installed here; the flag is checked
    # against the key snapshot with every other (test_export_keys)
    tc.pop("moe_permute_fusion", None)
    TransformerConfig(**tc)
    DistributedDataParallelConfig(**{k: v for k, v in kw.items() if k in ddp_fields})


def _deepspeed(e: Exported, where: Path) -> None:
    import deepspeed.runtime.config as dsc

    m = e.strategy.mesh
    world = m.dp_replicate * m.dp_shard
    with mock.patch.object(dsc.dist, "get_rank", return_value=0), \
            mock.patch.object(dsc.dist, "get_world_size", return_value=world * m.cp):
        dsc.DeepSpeedConfig(json.loads(e.text))


#: the rest of a nanotron config around an export's parallelism, tokens and optimizer blocks
NANOTRON_BASE = """
general: {project: shardplan, run: check, seed: 42}
model:
  init_method: {std: 0.025}
  dtype: bfloat16
  model_config: {is_llama_config: true, hidden_size: 256, intermediate_size: 688, num_attention_heads: 8,
                 num_hidden_layers: 4, num_key_value_heads: 2, vocab_size: 32000}
tokenizer: {tokenizer_name_or_path: gpt2}
tokens: {train_steps: 10}
optimizer:
  weight_decay: 0.01
  clip_grad: 1.0
  accumulate_grad_in_fp32: true
  adam_eps: 1.0e-08
  adam_beta1: 0.9
  adam_beta2: 0.95
  torch_adam_is_fused: true
  learning_rate_scheduler: {learning_rate: 0.0003, lr_warmup_steps: 2, lr_warmup_style: linear,
                            lr_decay_style: cosine, min_decay_lr: 1.0e-05}
"""


def _nanotron_config() -> Any:
    return benchmark_script("trainer_key_snapshots")._nanotron_config()


def _nanotron(e: Exported, where: Path) -> None:
    """nanotron 0.4's strict ``get_config_from_file`` on the export inside a minimal config. ``nanotron.config``
    is imported with ``nanotron.logging`` stubbed around the release's import cycle
    (``benchmarks/trainer_key_snapshots.py`` ``_nanotron_config`` says what is stubbed, why, and what this
    proves: the file parses into nanotron's own ``Config``; not that nanotron's trainer runs it)."""
    cfg = _nanotron_config()
    doc = yaml.safe_load(NANOTRON_BASE)
    for k, v in yaml.safe_load(e.text).items():
        doc[k] = {**doc.get(k, {}), **v}
    where.mkdir(parents=True, exist_ok=True)
    path = where / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg.get_config_from_file(str(path))


def _shardplan(e: Exported, where: Path) -> None:
    """The project's own script: it compiles, and the plan it embeds parses (what it does first)."""
    from planner.trainers.python.read import parse

    compile(e.text, "plan.py", "exec")
    assert parse(e.text, "the script").strategy == e.strategy


LOADERS: dict[str, Loader] = {"torchtitan": _torchtitan, "torchtitan-0.3": _torchtitan_03,
                              "megatron-0.19": _megatron_019, "megatron": _megatron, "deepspeed": _deepspeed,
                              "nanotron": _nanotron, "python": _shardplan}
