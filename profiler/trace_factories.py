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
from profiler.model_config import MAX_EXPERTS, MAX_FFN, MAX_POSITIONS, MAX_VOCAB, shown
from profiler.trace import trace_module
from vocab.errors import ShardplanError

_MOE_KEYS = {"num_local_experts", "num_experts", "n_routed_experts"}

#: the deepest Hugging Face config traced (blocks): tracing costs 0.1-0.2 s a block on a CPU, and
#: every published model has at most 126; the known key sets (llama, qwen, ...) are built
#: analytically up to ``profiler.model_config.MAX_LAYERS``
MAX_TRACED_LAYERS = 128
_WIDTH_KEYS = {"n_embd", "d_model", "d_ff", "d_kv", "n_inner", "n_head", "ffn_dim"}
_POSITION_KEYS = {"n_positions", "n_ctx", "seq_length", "max_seq_len", "max_sequence_length"}


def _bound(key: str) -> tuple[int, str] | None:
    """The largest value a size-like config key may hold, and what it counts (None: not a size)."""
    if key == "n_layer" or key.endswith("layers"):
        return MAX_TRACED_LAYERS, "blocks (deeper configs take minutes to trace)"
    if "vocab" in key:
        return MAX_VOCAB, "tokens"
    if "position" in key or key in _POSITION_KEYS:
        return MAX_POSITIONS, "positions"
    if key.endswith(("_size", "_dim", "heads")) or key in _WIDTH_KEYS:
        return MAX_FFN, "wide"
    if "expert" in key:
        return MAX_EXPERTS, "experts"
    return None


def check_traced_sizes(config: dict[str, Any], model_id: str) -> None:
    """Refuse a config (and the configs nested in it) whose integer sizes are beyond the supported
    range, before ``transformers`` builds it: layer counts, widths, vocabularies, positions, experts."""
    stack = [config]
    while stack:
        d = stack.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                stack.append(v)
            elif isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool):
                bound = _bound(k)
                if bound is not None and v > bound[0]:
                    raise ShardplanError(f"config '{model_id}': {k} {shown(v)} is over the supported {bound[0]:,} "
                                         f"{bound[1]}")


def _user_error(what: str, e: Exception, limit: int = 300) -> ShardplanError:
    """``e``, raised by the user's code, by ``transformers`` or while tracing, as one line naming
    ``what`` (its message's lines joined, cut to ``limit`` characters)."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return ShardplanError(f"{what}: {text}" if isinstance(e, ShardplanError) else f"{what}: {type(e).__name__}: {text}")


def _load_factory(spec: str) -> Callable[..., Any]:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ShardplanError(f"model factory '{spec}' must look like 'package.module:factory'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module: ImportError, or anything its top level raises
        raise _user_error(f"model factory '{spec}': cannot import '{mod_name}'", e) from None
    obj: Any = mod
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ShardplanError(f"model factory '{spec}': '{mod_name}' has no attribute '{attr}'") from None
        except Exception as e:
            raise _user_error(f"model factory '{spec}': reading '{attr}' failed", e) from None
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
        raise _user_error(f"model factory '{spec}' failed on the meta device", e) from None
    if not isinstance(model, nn.Module):
        raise ShardplanError(f"model factory '{spec}' returned {type(model).__name__}, not a torch.nn.Module")
    try:
        model.train()
        inputs = _example_inputs(model, spec, 1, seq_len)
    except ShardplanError:
        raise
    except Exception as e:
        raise _user_error(f"model factory '{spec}': example_inputs failed", e) from None
    try:
        return trace_module(model, inputs, model_id=spec, seq_len=seq_len, dtype=dtype)
    except Exception as e:  # the user's forward or backward, run on fake tensors
        raise _user_error(f"model factory '{spec}': tracing failed", e) from None


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
    if not isinstance(mtype, str):
        raise ShardplanError(f"config '{model_id}': model_type must be a string, got {type(mtype).__name__}")
    check_traced_sizes(config_dict, model_id)
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
        except Exception as e:  # transformers' own checks of the config, or what they miss
            if i == len(tries) - 1:
                raise _user_error(f"config '{model_id}': transformers cannot build it", e) from None
    try:
        model.train()
        with torch.device("meta"):
            inputs = hf_inputs(model, 1, seq_len)
        graph = trace_module(model, inputs, model_id=model_id, seq_len=seq_len, dtype=dtype)
    except Exception as e:
        raise _user_error(f"config '{model_id}': tracing failed", e) from None
    graph.config.update({"model_type": mtype})
    return graph
