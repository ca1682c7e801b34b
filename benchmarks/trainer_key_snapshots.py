"""Write the key snapshots of the installed trainer releases into ``vocab/targets/keys/``.

Run with a Python where the releases are importable (see ``docs/targets.md``, "Checking exports")::

    python benchmarks/trainer_key_snapshots.py [torchtitan megatron deepspeed nanotron]
    PYTHONPATH=.trainers/torchtitan-0.3.0 python benchmarks/trainer_key_snapshots.py torchtitan  # 0.3.x
    PYTHONPATH=.trainers/megatron-core-0.19.2 python benchmarks/trainer_key_snapshots.py megatron  # 0.19.2

Each file is named after the installed version (``torchtitan-0.2.2.json``, ``megatron_core-0.16.1.json``,
``deepspeed-0.19.8.json``, ``nanotron-0.4.json``) and holds the configuration keys the release's own
loader accepts, read from its dataclasses, pydantic models and constants. ``tests/test_export_keys.py``
checks every key an export emits against the snapshot of its target's pinned version.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
import typing
import warnings
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "vocab" / "targets" / "keys"

# Megatron-LM command-line flags (megatron/training/arguments.py, not in the megatron-core wheel) whose
# megatron-core field has another name, or that have no core field at all ("fields": []).
MEGATRON_LM_FLAGS: dict[str, dict[str, Any]] = {
    "--num-layers-per-virtual-pipeline-stage": {"fields": ["virtual_pipeline_model_parallel_size"],
                                                "note": "layers per virtual stage; the size is num_layers / pp / this"},
    "--decoder-first-pipeline-num-layers": {"fields": ["num_layers_in_first_pipeline_stage"]},
    "--decoder-last-pipeline-num-layers": {"fields": ["num_layers_in_last_pipeline_stage"]},
    "--swiglu": {"fields": ["gated_linear_unit", "activation_func"], "note": "gated_linear_unit=True, F.silu"},
    "--num-experts": {"fields": ["num_moe_experts"]},
    "--fp8-format": {"fields": ["fp8"]},
    "--grad-reduce-in-bf16": {"fields": ["grad_reduce_in_fp32"],
                              "note": "grad_reduce_in_fp32=False; with --bf16 and without it Megatron-LM sets it True"},
    "--disable-bias-linear": {"fields": ["add_bias_linear"], "note": "add_bias_linear=False"},
    "--norm-epsilon": {"fields": ["layernorm_epsilon"]},
    "--micro-batch-size": {"fields": [], "note": "no core field: Megatron-LM batch argument"},
    "--global-batch-size": {"fields": [], "note": "no core field: Megatron-LM batch argument"},
    "--seq-length": {"fields": [], "note": "no core field: Megatron-LM data argument"},
    "--max-position-embeddings": {"fields": [], "note": "no core field: GPTModel(max_sequence_length=)"},
    "--position-embedding-type": {"fields": [], "note": "no core field: GPTModel(position_embedding_type=)"},
    "--untie-embeddings-and-output-weights": {
        "fields": [], "note": "no core field: GPTModel(share_embeddings_and_output_weights=False)"},
    "--group-query-attention": {"fields": [], "note": "no core field: enables --num-query-groups"},
    "--vocab-size": {"fields": [], "note": "no core field: GPTModel(vocab_size=), padded by Megatron-LM"},
    "--use-mcore-models": {"fields": [], "note": "no core field: Megatron-LM model choice"},
    "--ckpt-format": {"fields": [], "note": "no core field: Megatron-LM checkpoint argument (fsdp_dtensor with "
                                           "--use-megatron-fsdp)"},
}


def _write(name: str, version: str, body: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}-{version}.json"
    path.write_text(json.dumps({"package": name, "version": version, **body}, indent=1, sort_keys=True) + "\n")
    return path


def _fields(cls: type) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(cls) if f.init)


def torchtitan() -> Path:
    from importlib.metadata import version

    from torchtitan.config import JobConfig

    job = JobConfig()
    sections = {f.name: _fields(type(getattr(job, f.name))) for f in dataclasses.fields(JobConfig)
                if dataclasses.is_dataclass(getattr(job, f.name))}
    return _write("torchtitan", version("torchtitan"), {"loader": "torchtitan.config.ConfigManager",
                                                        "sections": sections})


#: torchtitan 0.3's model modules whose registry functions the snapshot records (the families of
#: shardplan's presets; qwen3_5, kimi_k2_7 and muse_glimmer need packages the tests do not install)
TORCHTITAN_MODULES = ("llama3", "deepseek_v3", "qwen3", "gpt_oss")
#: the sections of a registry function's config whose values an import reads as its defaults
TORCHTITAN_READ_SECTIONS = ("parallelism", "training")


def _leaves(obj: Any, hints_of: Any, prefix: str = "") -> dict[str, str]:
    """Every settable leaf of a config dataclass instance, ``section.key`` -> its annotation's text."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        if not f.init or f.name == "model_spec":  # model_spec is tyro.conf.Suppress: no flag
            continue
        value = getattr(obj, f.name)
        path = prefix + f.name
        if _union_subcommands(hints.get(f.name)):
            continue  # a subcommand: its fields are recorded per variant
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, hints_of, path + "."))
        else:
            out[path] = hints_of(hints.get(f.name))
    return out


def _union_subcommands(tp: Any) -> dict[str, Any]:
    """A tyro subcommand union's variants by subcommand name (``activation_checkpoint``), else {}."""
    out = {}
    for arm in typing.get_args(tp):
        if typing.get_origin(arm) is typing.Annotated:
            base, *meta = typing.get_args(arm)
            name = next((getattr(m, "name", None) for m in meta if getattr(m, "name", None)), None)
            if name:
                out[name] = base
    return out


def _type_text(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _registry_entry(cfg: Any) -> dict[str, Any]:
    """What an import needs of one registry function: its model and shape, the defaults of
    :data:`TORCHTITAN_READ_SECTIONS`, its activation-checkpointing subcommand, converters, dispatcher."""
    spec = cfg.model_spec
    model = getattr(spec, "model", None)
    layers = list(getattr(model, "layers", []) or [])
    values = {f"{sec}.{k}": v for sec in TORCHTITAN_READ_SECTIONS for k, v in
              dataclasses.asdict(getattr(cfg, sec)).items() if isinstance(v, int | float | str | bool | type(None))
              or (isinstance(v, list) and all(isinstance(x, list | str) for x in v))}
    ac = cfg.activation_checkpoint
    ac_name = "none" if ac is None else {"SelectiveAC": "selective", "FullAC": "full"}.get(
        type(ac).__qualname__.split(".")[0], type(ac).__qualname__)
    text = repr(spec)
    converters = sorted(set(re.findall(r"(\w+Converter)\.Config", text)))
    backend = sorted(set(re.findall(r"(\w+)TokenDispatcher\.Config", text)))
    return {"name": getattr(spec, "name", None), "flavor": getattr(spec, "flavor", None), "layers": len(layers),
            "hidden": getattr(model, "dim", None), "vocab": getattr(model, "vocab_size", None),
            "defaults": values, "activation_checkpoint": ac_name, "converters": converters,
            "token_dispatchers": backend}


def torchtitan_registry() -> Path:
    """torchtitan 0.3's flags (the leaves of ``Trainer.Config``), its subcommands, and each registry function
    of :data:`TORCHTITAN_MODULES` that can be called here (a hardware check refuses some on a CPU)."""
    import importlib
    import inspect as _inspect
    from importlib.metadata import version

    from torchtitan.trainer import Trainer

    base = Trainer.Config()
    hints = typing.get_type_hints(Trainer.Config, include_extras=True)
    subcommands = {name: sorted(_union_subcommands(tp)) for name, tp in hints.items() if _union_subcommands(tp)}
    leaves = _leaves(base, _type_text)
    for name, variants in ((n, _union_subcommands(hints[n])) for n in subcommands):
        for arm in variants.values():
            if dataclasses.is_dataclass(arm):
                leaves.update({f"{name}.{k}": v for k, v in _leaves(arm(), _type_text).items()})
    registry: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}
    for module in TORCHTITAN_MODULES:
        mod = importlib.import_module(f"torchtitan.models.{module}.config_registry")
        for fn_name, fn in sorted(vars(mod).items()):
            if not (_inspect.isfunction(fn) and fn.__module__ == mod.__name__ and not fn_name.startswith("_")
                    and not _inspect.signature(fn).parameters):  # a registry function takes no argument
                continue
            try:
                cfg = fn()
            except Exception as e:  # noqa: BLE001 - the release's own refusal, recorded
                refused[f"{module}.{fn_name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                continue
            leaves.update(_leaves(cfg, _type_text))
            registry.setdefault(module, {})[fn_name] = _registry_entry(cfg)
    base_entry = _registry_entry(base)
    return _write("torchtitan", version("torchtitan"), {
        "loader": "torchtitan.config.manager.ConfigManager (--module/--config + tyro flags)",
        "flags": dict(sorted(leaves.items())), "subcommands": subcommands, "registry": registry,
        "base": {k: base_entry[k] for k in ("defaults", "activation_checkpoint")},
        "refused_on_cpu": refused})


def megatron() -> Path:
    from importlib.metadata import version

    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    classes = {c.__name__: _fields(c) for c in (TransformerConfig, MLATransformerConfig, ModelParallelConfig,
                                               DistributedDataParallelConfig, OptimizerConfig)}
    known = {f for names in classes.values() for f in names}
    for flag, entry in MEGATRON_LM_FLAGS.items():
        missing = [f for f in entry["fields"] if f not in known]
        if missing:
            raise SystemExit(f"{flag}: fields {missing} are not in megatron-core {version('megatron-core')}")
    return _write("megatron_core", version("megatron-core"), {"classes": classes, "lm_flags": MEGATRON_LM_FLAGS,
                                                 "flag_rule": "--a-b is field a_b unless lm_flags names it"})


def _pydantic_keys(model: Any) -> list[str]:
    keys = set()
    for name, f in model.model_fields.items():
        keys.add(name)
        if f.alias:
            keys.add(f.alias)
    return sorted(keys)


def _constants(module: Any, prefix: str = "") -> set[str]:
    return {v for k, v in vars(module).items() if k.isupper() and k.startswith(prefix) and isinstance(v, str)
            and not k.endswith("_DEFAULT") and re.fullmatch(r"[a-z][a-z0-9_]*", v)}


def deepspeed() -> Path:
    import deepspeed as ds
    import deepspeed.runtime.activation_checkpointing.config as act
    import deepspeed.runtime.config as dsc
    import deepspeed.runtime.constants as const
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    src = inspect.getsource(dsc)
    literal = set(re.findall(r"""(?:param_dict|ds_config|config)\.get\(\s*["'](\w+)["']""", src))
    literal |= set(re.findall(r"""["'](\w+)["']\s+in\s+(?:param_dict|ds_config|config)\b""", src))
    literal |= set(re.findall(r"""["'](\w+)["']\s+in\s+ds_config\b""",
                              inspect.getsource(sys.modules[TPTrainingConfig.__module__])))
    # deepspeed.initialize reads the sequence-parallel mesh's keys off the raw config (``__init__.py``)
    literal |= set(re.findall(r"""["'](\w+)["']\s+in\s+config\b""", inspect.getsource(ds)))
    sections = {
        "zero_optimization": _pydantic_keys(DeepSpeedZeroConfig),
        "zero_optimization.offload_optimizer": _pydantic_keys(DeepSpeedZeroOffloadOptimizerConfig),
        "zero_optimization.offload_param": _pydantic_keys(DeepSpeedZeroOffloadParamConfig),
        "bf16": _pydantic_keys(DeepSpeedBF16Config),
        "tensor_parallel": _pydantic_keys(TPTrainingConfig),
        "activation_checkpointing": sorted(_constants(act, "ACT_CHKPT_") - {act.ACT_CHKPT}),
        "pipeline": sorted(dsc.get_pipeline_config({})),
    }
    top = sorted((_constants(const) | literal | set(sections)) - {"pipeline"} | {"pipeline"})
    strict = ["zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
              "bf16", "tensor_parallel"]
    return _write("deepspeed", ds.__version__, {
        "loader": "deepspeed.runtime.config.DeepSpeedConfig", "top_level": top, "sections": sections,
        "strict_sections": strict,
        "note": "unknown top-level, activation_checkpointing and pipeline keys are ignored by the loader; "
                "the pydantic sections in strict_sections forbid extra keys"})


def _nanotron_config() -> Any:
    """``nanotron.config`` of nanotron 0.4, imported around the release's import cycle.

    As installed (``pip install --no-deps nanotron==0.4``), ``import nanotron.config`` fails, and so does
    every other way in (``nanotron.logging``, ``nanotron.trainer``, ``nanotron.parallel.pipeline_parallel``,
    any ``nanotron.config.*`` module: no import order helps, no extra installs a fix): the package's
    module-level imports close a cycle, ``nanotron/config/config.py:13`` -> ``config/lighteval_config.py:5``
    -> ``config/parallelism_config.py:4`` -> ``config/utils_config.py:8`` ->
    ``parallel/pipeline_parallel/__init__.py:1`` -> ``parallel/pipeline_parallel/engine.py:6`` ->
    ``nanotron/logging.py:38`` (``from nanotron.config.config import LoggingArgs``), with
    ``config.config`` still half-initialised: ``ImportError: cannot import name 'LoggingArgs' from
    partially initialized module 'nanotron.config.config'``.

    What is stubbed: ``nanotron.logging`` alone, for the duration of ``import nanotron.config``, by a
    module whose every attribute (``get_logger``, ``log_rank``, ``warn_once``, ``human_format``, ...) is a
    function returning the standard ``logging.getLogger("nanotron")``; then the stub is dropped and the
    real ``nanotron.logging`` imported. The modules imported meanwhile keep what they took from the stub
    (``config.config``'s ``logger``, ``log_rank`` in ``pipeline_parallel/engine.py``, ``optim/zero.py``,
    ``models/base.py``, ``parallel/tied_parameters.py``): their log calls log nothing, or log to a plain
    logger. Every class and function of ``nanotron.config`` is the release's own.

    So the check proves that nanotron 0.4's own ``get_config_from_file`` (dacite ``from_dict`` with
    ``strict=True``: unknown keys and wrong types refused; the enum and dtype hooks; the dataclasses'
    ``__post_init__`` checks) accepts the file, and the key snapshot is the release's ``Config`` field
    tree. It does not prove that nanotron runs the file: ``nanotron.trainer`` is not imported (beyond the
    cycle it needs ``flash_attn``, not installed), no model is built, no process group started, and the
    logging the stubbed modules would do is not exercised."""
    import logging
    import types

    stub = types.ModuleType("nanotron.logging")

    def _getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: logging.getLogger("nanotron")

    stub.__getattr__ = _getattr  # type: ignore[method-assign]
    sys.modules["nanotron.logging"] = stub
    try:
        import nanotron.config as cfg
    finally:
        del sys.modules["nanotron.logging"]
    import nanotron.logging  # noqa: F401
    return cfg


def _tree(tp: Any, seen: tuple[type, ...] = ()) -> Any:
    """The dataclass field tree of a type: {field: subtree}, None for a leaf; a Union/Optional of
    dataclasses merges their fields."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        subs = [_tree(a, seen) for a in args]
        merged: dict[str, Any] = {}
        for s in subs:
            if isinstance(s, dict):
                merged.update(s)
        return merged or None
    if dataclasses.is_dataclass(tp) and tp not in seen:
        hints = typing.get_type_hints(tp)
        return {f.name: _tree(hints.get(f.name), (*seen, tp)) for f in dataclasses.fields(tp) if f.init}
    return None


def nanotron() -> Path:
    cfg = _nanotron_config()
    import nanotron

    return _write("nanotron", nanotron.__version__, {"loader": "nanotron.config.get_config_from_file (dacite strict)",
                                                     "tree": _tree(cfg.Config)})


SNAPSHOTS = {"torchtitan": lambda: torchtitan_registry() if _torchtitan_is_registry() else torchtitan(), "megatron": megatron, "deepspeed": deepspeed, "nanotron": nanotron}


def _torchtitan_is_registry() -> bool:
    """Whether the torchtitan on the path is a 0.3-style release (config registries, no JobConfig)."""
    import importlib.util

    return importlib.util.find_spec("torchtitan.config.job_config") is None


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    for name in argv or list(SNAPSHOTS):
        print(SNAPSHOTS[name]().relative_to(OUT.parents[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
