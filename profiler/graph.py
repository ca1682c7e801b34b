"""The layer graph: a model as operators in execution order, with what each costs.

Every quantity is for **one sample** (one sequence of ``seq_len`` tokens) and for the whole,
unsharded operator; the cost model divides by the parallel degrees of a plan. FLOPs follow the
model-FLOPs convention of Megatron-LM and PaLM (every matmul counted, attention counted in full
even when causal; ``causal`` on the node lets the cost model halve the *time* of causal attention).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vocab.errors import ShardplanError

if TYPE_CHECKING:
    import networkx as nx


#: Operator kinds the cost model knows how to price.
OP_KINDS = (
    "embedding",  # token (and position) embedding lookup
    "norm",  # LayerNorm / RMSNorm
    "linear",  # a GEMM with weights; ``tp`` says how Megatron TP splits it
    "attention",  # the attention core: QK^T, softmax, AV (no weights)
    "activation",  # elementwise activation (GELU, SiLU*gate)
    "dropout",  # dropout after a projection (saves a 1-byte mask)
    "router",  # MoE gate: a small GEMM plus top-k
    "experts",  # MoE expert MLPs (weights of all experts, top-k of them run per token)
    "loss",  # softmax cross-entropy over the vocabulary
    "other",  # anything traced that is none of the above
)

#: How Megatron tensor parallelism splits an operator's weights and output.
TP_ROLES = ("column", "row", "replicated", "vocab", "heads", "none")


@dataclass(frozen=True)
class LayerNode:
    """One operator of the model.

    Attributes:
        name: dotted module path, unique in the graph (``layers.3.mlp.up``).
        kind: one of :data:`OP_KINDS`.
        block: index of the repeated block it belongs to, ``None`` outside the stack.
        block_type: ``embedding``, ``decoder``, ``encoder`` or ``head``; blocks of one type with
            equal shapes are identical and solvers may share decisions across them.
        params: number of parameters (all experts included for ``experts``).
        param_bytes: bytes of one parameter in the compute dtype (2 for bf16).
        fwd_flops: forward FLOPs per sample.
        bwd_flops: backward FLOPs per sample (gradients of inputs and of weights).
        act_saved_bytes: bytes kept from forward for backward, per sample.
        act_tp_sharded: whether Megatron TP alone already shards ``act_saved_bytes`` (attention
            heads, FFN columns); otherwise only sequence parallelism shards them.
        act_selective_bytes: part of ``act_saved_bytes`` that selective recomputation drops
            (the attention scores of non-flash attention).
        out_bytes: bytes of the output activation per sample.
        mem_bytes: bytes moved through memory per sample in forward (for bandwidth-bound ops).
        causal: attention only: whether it is causal.
        tp: how TP splits the weights (:data:`TP_ROLES`).
        dims: shape facts the cost model needs (``in``, ``out``, ``heads``, ``kv_heads``,
            ``head_dim``, ``experts``, ``top_k``, ``vocab``, ``hidden``).
    """

    name: str
    kind: str
    block: int | None
    block_type: str
    params: int = 0
    param_bytes: int = 2
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    act_saved_bytes: float = 0.0
    act_tp_sharded: bool = False
    act_selective_bytes: float = 0.0
    out_bytes: float = 0.0
    mem_bytes: float = 0.0
    causal: bool = False
    tp: str = "none"
    dims: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"layer {self.name}: kind '{self.kind}' is not one of {OP_KINDS}")
        if self.tp not in TP_ROLES:
            raise ValueError(f"layer {self.name}: tp role '{self.tp}' is not one of {TP_ROLES}")
        if self.params < 0 or self.fwd_flops < 0 or self.act_saved_bytes < 0:
            raise ValueError(f"layer {self.name}: negative size")

    def to_dict(self) -> dict[str, Any]:
        """The fields in order, ``dims`` as a plain dict (what :func:`dataclasses.asdict` gives,
        without its deep copy of the scalars: graphs of thousands of blocks hash in a second)."""
        d = {name: getattr(self, name) for name in _NODE_FIELDS}
        d["dims"] = dict(self.dims)
        return d


_NODE_FIELDS = tuple(f.name for f in fields(LayerNode))


@dataclass
class LayerGraph:
    """Operators of a model in execution order, over a networkx DiGraph (edges = data flow).

    Attributes:
        model_id: the name the model was asked by (preset, file or factory).
        seq_len: tokens per sample the per-sample figures are for.
        nodes: operators in execution order.
        config: the architecture facts (hidden size, heads, ...), when known.
    """

    model_id: str
    seq_len: int
    nodes: list[LayerNode]
    config: dict[str, Any] = field(default_factory=dict)
    source: str = "analytic"

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"layer graph of {self.model_id}: duplicate layer names {dup[:5]}")
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}")

    # ---- networkx view -------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph whose nodes carry the :class:`LayerNode` fields, edges in execution order."""
        import networkx as nx  # only for this view: 80 ms of every command's start-up otherwise

        g = nx.DiGraph(model_id=self.model_id, seq_len=self.seq_len)
        prev = None
        for n in self.nodes:
            g.add_node(n.name, **n.to_dict())
            if prev is not None:
                g.add_edge(prev, n.name)
            prev = n.name
        return g

    # ---- totals --------------------------------------------------------------------------
    @property
    def total_params(self) -> int:
        return sum(n.params for n in self.nodes)

    @property
    def fwd_flops(self) -> float:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def train_flops(self) -> float:
        """Forward plus backward FLOPs per sample, without recomputation."""
        return sum(n.fwd_flops + n.bwd_flops for n in self.nodes)

    @property
    def act_saved_bytes(self) -> float:
        return sum(n.act_saved_bytes for n in self.nodes)

    @property
    def has_experts(self) -> bool:
        """Whether the model has mixture-of-experts layers (an ``experts`` node)."""
        return any(n.kind == "experts" for n in self.nodes)

    @property
    def num_blocks(self) -> int:
        return len({n.block for n in self.nodes if n.block is not None})

    def blocks(self) -> Iterator[tuple[str, list[LayerNode]]]:
        """Units a pipeline stage or a per-layer strategy applies to, in order.

        ``embedding`` (everything before the first block), ``layers.<i>`` for each block,
        ``head`` (everything after the last block).
        """
        units: dict[str, list[LayerNode]] = {}
        seen_block = False
        for n in self.nodes:
            if n.block is not None:
                seen_block = True
                key = f"layers.{n.block}"
            else:
                key = "head" if seen_block else "embedding"
            units.setdefault(key, []).append(n)
        yield from units.items()

    def members(self, name: str) -> list[LayerNode]:
        """The nodes ``name`` covers: the node of that name, or every node of block ``layers.<i>``."""
        for n in self.nodes:
            if n.name == name:
                return [n]
        return [n for n in self.nodes if n.block is not None and f"layers.{n.block}" == name]

    def content_hash(self) -> str:
        """A stable hash of the graph's contents (names, kinds, sizes, seq_len)."""
        payload = json.dumps(
            {"seq_len": self.seq_len, "nodes": [n.to_dict() for n in self.nodes]},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "seq_len": self.seq_len,
            "source": self.source,
            "total_params": self.total_params,
            "num_blocks": self.num_blocks,
            "fwd_flops_per_token": self.fwd_flops / self.seq_len,
            "train_flops_per_token": self.train_flops / self.seq_len,
            "act_saved_bytes_per_token": self.act_saved_bytes / self.seq_len,
            "content_hash": self.content_hash(),
            "config": self.config,
        }


# ---- plain-data form (a plan records the graph of a model it cannot load by name) ----------------

def _node_defaults() -> dict[str, Any]:
    from dataclasses import MISSING, fields

    out: dict[str, Any] = {}
    for f in fields(LayerNode):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def _is_default(value: Any, default: Any) -> bool:
    """Same type and value: an ``int`` 0 is not the default ``0.0`` (the content hash tells them apart)."""
    return type(value) is type(default) and value == default


def _shape_key(d: dict[str, Any]) -> str:
    """A node's fields but its name and block, with their types (two nodes of one key are alike)."""
    return json.dumps({k: [type(v).__name__, v] for k, v in d.items() if k not in ("name", "block")},
                      sort_keys=True, default=repr)


def graph_to_dict(graph: LayerGraph) -> dict[str, Any]:
    """The graph as plain JSON data: ``model_id``, ``seq_len``, ``source``, ``config`` and ``nodes``.

    A node is written without the fields that hold their default (same type and value); a node
    alike an earlier one in all but its name and block (the same layer of another block) as
    ``{"name", "block", "like": <index of that node>}``. :func:`graph_from_dict` reads it back
    with the same :meth:`LayerGraph.content_hash`."""
    defaults = _node_defaults()
    first: dict[str, int] = {}
    nodes: list[dict[str, Any]] = []
    for i, n in enumerate(graph.nodes):
        d = n.to_dict()
        j = first.setdefault(_shape_key(d), i)
        if j < i:
            nodes.append({"name": n.name, "block": n.block, "like": j})
        else:
            nodes.append({k: v for k, v in d.items() if k not in defaults or not _is_default(v, defaults[k])})
    return {"model_id": graph.model_id, "seq_len": graph.seq_len, "source": graph.source,
            "config": dict(graph.config), "nodes": nodes}


#: the config a traced graph records: the module's class and the layers that ran no counted FLOPs
TRACED_CONFIG = {"class", "no_flop_layers"}


def checked_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded graph's ``config`` as its writer made it: a transformer's fields (each type, range
    and choice checked by :class:`profiler.model_config.TransformerConfig`), a traced module's class
    name (an identifier) and idle layers (names), or nothing; else ``ValueError``."""
    from profiler.model_config import TransformerConfig

    config = dict(config)
    if not config:
        return config
    if set(config) <= TRACED_CONFIG:
        cls, idle = config.get("class", ""), config.get("no_flop_layers", [])
        if not (isinstance(cls, str) and cls.isidentifier() and isinstance(idle, list)
                and all(isinstance(x, str) for x in idle)):
            raise ValueError("layer graph: a traced config holds a class name and a list of layer names")
        return config
    try:
        TransformerConfig.from_dict(config)
    except ShardplanError as e:
        raise ValueError(f"layer graph: config: {e}") from None
    return config


def graph_from_dict(data: Mapping[str, Any]) -> LayerGraph:
    """The graph :func:`graph_to_dict` wrote; a missing or malformed field raises ``ValueError``."""
    try:
        nodes: list[LayerNode] = []
        for i, raw in enumerate(data["nodes"]):
            d = dict(raw)
            like = d.pop("like", None)
            if like is not None:
                if type(like) is not int or not 0 <= like < i:
                    raise ValueError(f"layer graph: node {i}: 'like' must be the index of an earlier node")
                d = {**nodes[like].to_dict(), "block": None, **d}
            nodes.append(LayerNode(**d))
        return LayerGraph(model_id=str(data["model_id"]), seq_len=data["seq_len"], nodes=nodes,
                          config=checked_config(data.get("config") or {}), source=str(data.get("source", "analytic")))
    except KeyError as e:
        raise ValueError(f"layer graph: missing field {e.args[0]!r}") from None
    except TypeError as e:
        raise ValueError(f"layer graph: {e}") from None
