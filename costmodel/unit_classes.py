"""Units of a layer graph and their classes: units that price alike (every block of one shape,
the embedding, the head) share one class, so the pricer prices each class once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from profiler.graph import LayerGraph, LayerNode


def unit_class_key(name: str, nodes: list[LayerNode]) -> tuple:
    """Equal for units that price alike: everything of their operators but the block index in the
    names (blocks are one kind, the embedding and the head each their own)."""
    return (name if not name.startswith("layers.") else "layers",) + tuple(
        (n.name.split(".", 2)[-1] if n.block is not None else n.name, n.kind, n.params, n.fwd_flops,
         n.bwd_flops, n.act_saved_bytes, n.act_selective_bytes, n.act_tp_sharded, n.out_bytes,
         n.mem_bytes, n.causal, n.tp, tuple(sorted(n.dims.items()))) for n in nodes)


def _cached(graph: LayerGraph, name: str, build: Callable[[], Any]) -> Any:
    """``build()`` once per graph (kept on the graph while its nodes stay the same)."""
    cached = graph.__dict__.get(name)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    value = build()
    graph.__dict__[name] = (len(graph.nodes), value)
    return value


def class_keys(graph: LayerGraph) -> list[tuple]:
    """The :func:`unit_class_key` of every unit in order."""
    return _cached(graph, "_class_keys", lambda: [unit_class_key(name, nodes) for name, nodes in graph.blocks()])


_CLASS_IDS: dict[tuple, int] = {}


def class_id(key: tuple) -> int:
    """A small integer for a :func:`unit_class_key`, the same in every graph (cheap to hash)."""
    return _CLASS_IDS.setdefault(key, len(_CLASS_IDS))


def class_ids(graph: LayerGraph) -> list[int]:
    """The :func:`class_id` of every unit in order."""
    return _cached(graph, "_class_ids", lambda: [class_id(k) for k in class_keys(graph)])


def unit_names(graph: LayerGraph) -> list[str]:
    """The graph's unit names in order."""
    return _cached(graph, "_unit_names", lambda: [n for n, _ in graph.blocks()])


def unit_classes(graph: LayerGraph) -> tuple[list[tuple[str, list[LayerNode]]], list[int]]:
    """Distinct units (first of each class) and the class index of every unit in order."""
    return _cached(graph, "_unit_classes", lambda: _classes(graph))


def _classes(graph: LayerGraph) -> tuple[list[tuple[str, list[LayerNode]]], list[int]]:
    reps: list[tuple[str, list[LayerNode]]] = []
    keys: dict[tuple, int] = {}
    index = []
    for (name, nodes), key in zip(graph.blocks(), class_keys(graph), strict=True):
        if key not in keys:
            keys[key] = len(reps)
            reps.append((name, nodes))
        index.append(keys[key])
    return reps, index


def block_classes(graph: LayerGraph) -> list[int]:
    """The class (:func:`unit_classes`) of every transformer block, in order."""
    return list(_cached(graph, "_block_classes", lambda: [
        k for k, n in zip(unit_classes(graph)[1], unit_names(graph), strict=True) if n.startswith("layers.")]))
