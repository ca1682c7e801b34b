"""The values of a price request (``shardplan estimate``'s flags, a batch line's keys): each key's type
and range, checked before anything is priced; a batch line's JSON can hold anything."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

from planner.request import PriceRequest
from vocab.errors import ShardplanError

#: the keys of a batch line: the fields of :class:`planner.request.PriceRequest`, in order
KEYS = tuple(f.name for f in fields(PriceRequest))
COUNTS = ("seq_len", "global_batch", "micro_batch", "tp", "pp", "cp", "ep", "etp", "dp", "dp_shard", "dp_replicate",
          "vpp", "offload_layers")
NAMES = ("recompute", "schedule", "precision", "attention_kernel", "cross_entropy", "grad_dtype", "adam_states",
         "moe_dispatch", "moe_overlap", "selective", "profile", "plan", "tp_mode", "cp_mode", "cp_rotate", "offload",
         "target", "calibration")
LIMITS = ("memory_limit", "memory_limit_gib")
POSITIVE = ("moe_capacity_factor",)
CLUSTER_COUNTS = ("nodes", "gpus", "gpus_per_node")


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: float) -> bool:
    """Whether ``v`` is a finite float (an integer too large for a float is not)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def check_values(a: dict[str, Any]) -> None:
    """The type and range of each value (a batch line's JSON can hold anything); None is "not given"."""
    for k, v in a.items():
        if v is None:
            continue
        if k in COUNTS and not (_is_int(v) and v >= 1):
            raise ShardplanError(f"{k} must be a positive integer, got {_show(v)}")
        if k == "zero" and not _is_int(v):
            raise ShardplanError(f"zero must be 0, 1, 2 or 3, got {_show(v)}")
        if k in NAMES and not isinstance(v, str):
            raise ShardplanError(f"{k} must be a string, got {_show(v)}")
        if k == "sequence_parallel" and not isinstance(v, bool):
            raise ShardplanError(f"sequence_parallel must be true or false, got {_show(v)}")
        if k in LIMITS + POSITIVE and not (isinstance(v, int | float) and not isinstance(v, bool) and _finite(v)
                                           and v > 0):
            raise ShardplanError(f"{k} must be a finite positive number{' of GiB' if k in LIMITS else ''}, "
                                 f"got {_show(v)}")
        if k == "stage_layers":
            stage_layers(v)
        if k in ("model", "cluster") and not isinstance(v, str | dict):
            raise ShardplanError(f"{k} must be a name or an object, got {_show(v)}")
    cluster = a.get("cluster")
    if isinstance(cluster, dict):
        for k in CLUSTER_COUNTS:
            if cluster.get(k) is not None and not (_is_int(cluster[k]) and cluster[k] >= 1):
                raise ShardplanError(f"cluster.{k} must be a positive integer, got {_show(cluster[k])}")


def stage_layers(v: str | list[Any]) -> list[int]:
    """Blocks per (virtual) stage from ``10,12,12`` or a list of whole numbers (raises ShardplanError)."""
    parts = v.split(",") if isinstance(v, str) else v
    if not isinstance(parts, list) or not parts:
        raise ShardplanError(f"stage_layers must be whole numbers, comma-separated or a list, got {_show(v)}")
    out = []
    for x in parts:
        if isinstance(x, str) and x.strip().isdigit():
            x = int(x.strip())
        if not (_is_int(x) and x >= 0):
            raise ShardplanError(f"stage_layers must be whole numbers, comma-separated or a list, got {_show(v)}")
        out.append(x)
    return out
