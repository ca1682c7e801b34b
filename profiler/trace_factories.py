"""Build a model from a ``pkg.module:factory`` spec or a Hugging Face config, and trace it.

Models are built on the meta device (no weights, no download) and handed to
:func:`profiler.trace.trace_module`, which runs them on fake tensors.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from profiler.graph import LayerGraph
from profiler.trace import trace_module
from vocab.errors import ShardplanError

_MOE_KEYS = {"num_local_experts", "num_experts", "n_routed_experts"}


def _load_factory(spec: str) -> Callable[..., Any]:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ShardplanError(f"model factory '{spec}' must look like 'package.module:factory'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ShardplanError(f"model factory '{spec}': cannot import '{mod_name}': {e}") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ShardplanError(f"model factory '{spec}': '{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ShardplanError(f"model factory '{spec}': '{attr}' is not callable")
    return obj


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def hf_inputs(model: nn.Module, batch: int, seq_len: int) -> dict[str, Any]:
    """``input_ids`` (and ``labels``, ``use_cache=False`` when the model takes them) for an HF model."""
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs: dict[str, Any] = {"input_ids": ids}
    if _accepts(model.forward, "labels"):
        inputs["labels"] = ids
    if _accepts(model.forward, "use_cache"):
        inputs["use_cache"] = False
    return inputs


def _example_inputs(model: nn.Module, spec: str, batch: int, seq_len: int) -> tuple | dict:
    if callable(getattr(model, "example_inputs", None)):
        with torch.device("meta"):
            ex = model.example_inputs(batch, seq_len)
        return ex if isinstance(ex, (tuple, dict)) else (ex,)
    if isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        with torch.device("meta"):
            return hf_inputs(model, batch, seq_len)
    raise ShardplanError(
        f"model factory '{spec}': {type(model).__name__} is not a Hugging Face model; give it a method "
        "'example_inputs(batch, seq_len)' returning a tuple of args or a dict of kwargs"
    )


def trace_factory(spec: str, seq_len: int, *, dtype: torch.dtype | None = torch.bfloat16) -> LayerGraph:
    """Trace the module returned by ``package.module:factory`` (built on the meta device)."""
    factory = _load_factory(spec)
    kwargs = {"seq_len": seq_len} if _accepts(factory, "seq_len") else {}
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as e:  # the user's code: say which factory and that it ran on meta
        raise ShardplanError(f"model factory '{spec}' failed on the meta device: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ShardplanError(f"model factory '{spec}' returned {type(model).__name__}, not a torch.nn.Module")
    model.train()
    inputs = _example_inputs(model, spec, 1, seq_len)
    return trace_module(model, inputs, model_id=spec, seq_len=seq_len, dtype=dtype)


def trace_hf_config(
    config_dict: dict[str, Any], seq_len: int, model_id: str, *, dtype: torch.dtype | None = torch.bfloat16,
) -> LayerGraph:
    """Trace the causal LM a Hugging Face ``config.json`` describes (built on meta, no download)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ShardplanError("tracing a Hugging Face config needs transformers: pip install transformers") from None
    d = {k: v for k, v in config_dict.items() if k != "model_type"}
    mtype = config_dict.get("model_type")
    if not mtype:
        raise ShardplanError(f"config '{model_id}' has no 'model_type'")
    # MoE experts: grouped_mm has static shapes; the default per-expert loop depends on the routing,
    # which fake tensors cannot know (it would run no expert at all).
    tries = [{"experts_implementation": "grouped_mm"}, {}] if _MOE_KEYS & set(d) else [{}]
    for i, extra in enumerate(tries):
        try:
            cfg = AutoConfig.for_model(mtype, **{**extra, **d})
            cfg.use_cache = False
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            break
        except (ValueError, KeyError, TypeError) as e:
            if i == len(tries) - 1:
                raise ShardplanError(f"config '{model_id}': transformers cannot build it: {e}") from None
    model.train()
    with torch.device("meta"):
        inputs = hf_inputs(model, 1, seq_len)
    graph = trace_module(model, inputs, model_id=model_id, seq_len=seq_len, dtype=dtype)
    graph.config.update({"model_type": mtype})
    return graph
