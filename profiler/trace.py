"""Trace any ``nn.Module`` into a :class:`LayerGraph` without real memory.

The model runs forward and backward once on fake tensors (:class:`FakeTensorMode`: shapes, dtypes
and devices but no storage), while a :class:`TorchDispatchMode` sees every aten op:

* forward ops go to the innermost module running (module hooks keep a stack); ops of a module that
  has children (attention math, residual adds, the loss) go to a node ``<path>.fn``;
* backward ops go to the module whose forward op created the autograd node being run (its sequence
  number, recorded in forward), so q/k/v sharing an input are not over-counted;
* FLOPs use :data:`torch.utils.flop_counter.flop_registry` (what ``FlopCounterMode`` counts) plus
  :data:`EXTRA_FLOP_FORMULAS` for ops torch 2.13 has no formula for (CPU SDPA, ``_grouped_mm``);
* saved-for-backward bytes come from :func:`torch.autograd.graph.saved_tensors_hooks`, each storage
  once, parameters and buffers excluded; ops outside every module (the caller's ``.sum()``) are not
  recorded.

Limits: data-dependent code (a per-expert MoE loop over ``nonzero``) cannot run on fake tensors;
Hugging Face MoE models trace with ``experts_implementation="grouped_mm"`` (bf16 only on fake
tensors). Per-leaf ``act_saved_bytes`` sums to the real step's total, byte for byte on the tested
models, but a storage saved by two modules counts for the first one only.

Floating-point inputs are made to require grad, so that every matmul's backward computes the
gradients of both operands (the 2x model-FLOPs convention; a pipeline stage needs its input's
gradient anyway).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from profiler.graph import LayerGraph, LayerNode
from vocab.errors import ShardplanError

aten = torch.ops.aten


def _cpu_sdpa_flop(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_bwd_flop(g: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return sdpa_backward_flop_count(g, q, k, v)


def _grouped_mm_flop(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``(S, K) @ (E, K, N)`` and ``(K, S) @ (S, N)`` (groups split S) and ``(E, M, K) @ (E, K, N)``:
    every row meets one group's matrix; ``(E, M, K) @ (K, S)`` (groups split S) likewise."""
    rows = math.prod(a[1:]) if len(a) == 3 and len(b) == 2 else math.prod(a)
    return 2 * rows * b[-1]


#: Shape formulas (``FlopCounterMode(custom_mapping=...)`` style) for ops torch 2.13 does not count:
#: SDPA on CPU tensors (real or fake) runs ``_scaled_dot_product_flash_attention_for_cpu``; MoE
#: experts run ``_grouped_mm`` (Hugging Face ``experts_implementation="grouped_mm"``).
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_bwd_flop,
    aten._grouped_mm: _grouped_mm_flop,
}
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry, **{k: shape_wrapper(f) for k, f in EXTRA_FLOP_FORMULAS.items()}
}
_SDPA_OPS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward", "flex_attention"}
_ATTN_OPS = _SDPA_OPS | {"bmm", "baddbmm"}
_LOSS_OPS = {"_log_softmax", "nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss"}
#: Leaf module kinds by words in the class name (``Conv1D`` is transformers' GPT-2 linear).
_LEAF_KINDS = (
    ("linear", ("Linear", "Conv1D")), ("router", ("Router",)), ("norm", ("Norm",)), ("dropout", ("Dropout",)),
    ("activation", ("GELU", "SiLU", "ReLU", "Tanh", "Sigmoid", "Swish", "Mish", "Activation", "Softplus")),
    ("other", ("Rotary",)),
)
_TP_BY_KIND = {"loss": "vocab", "norm": "replicated", "router": "replicated", "attention": "heads",
               "experts": "column"}
_COLUMN = {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "c_attn",
           "c_fc", "fc1", "w1", "w3", "query", "key", "value", "wq", "wk", "wv", "in_proj"}
_ROW = {"o_proj", "down_proj", "c_proj", "fc2", "w2", "wo", "out_proj", "dense"}


@dataclass
class _Acc:
    """What one node accumulates while the model runs (totals over the batch)."""

    key: str
    path: str
    module: nn.Module
    leaf: bool
    params: int = 0
    param_bytes: int = 0
    fwd: int = 0
    bwd: int = 0
    saved: int = 0
    out: int = 0
    mem: int = 0
    ops: set[str] = field(default_factory=set)
    dims: dict[str, int] = field(default_factory=dict)
    causal: bool = False
    first: int = 0
    order: int | None = None


def _elem_size(p: torch.Tensor, dtype: torch.dtype | None) -> int:
    return (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())


def _arg(func: Any, args: Any, kwargs: dict[str, Any], name: str) -> Any:
    """The argument ``name`` of an aten op call, by its schema (None when absent)."""
    names = [a.name for a in func._schema.arguments]
    i = names.index(name) if name in names else len(args)
    return kwargs.get(name, args[i] if i < len(args) else None)


def _nbytes(obj: Any) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class _Recorder(TorchDispatchMode):
    """Module stack, per-node FLOPs / saved / output bytes, autograd-node owners."""

    def __init__(self, model: nn.Module, skip_storages: set[int], dtype: torch.dtype | None) -> None:
        super().__init__()
        self.root = model
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.leaf = {id(m): next(m.children(), None) is None for m in model.modules()}
        # Own parameters of each module as (id, numel, bytes per element), taken before the swap.
        self.own = {id(m): [(id(p), p.numel(), _elem_size(p, dtype)) for p in m.parameters(recurse=False)]
                    for m in model.modules()}
        self.ticks = itertools.count()
        self.stack: list[tuple[str, nn.Module]] = []
        self.accs: dict[str, _Acc] = {}
        self.owner: dict[int, str] = {}
        self.claimed: set[int] = set()
        self.skip = skip_storages
        self.seen: dict[int, Any] = {}

    # ---- nodes ---------------------------------------------------------------------------------
    def acc(self, path: str, module: nn.Module, leaf: bool) -> _Acc:
        key = (path or "root") if leaf else (f"{path}.fn" if path else "root.fn")
        if key not in self.accs:
            self.claim(self.accs.setdefault(key, _Acc(key, path, module, leaf, first=next(self.ticks))), module)
        return self.accs[key]

    def claim(self, a: _Acc, module: nn.Module) -> None:
        """Give ``a`` the parameters of ``module`` no node has yet (tied ones count once)."""
        own = [p for p in self.own[id(module)] if p[0] not in self.claimed]
        self.claimed.update(p[0] for p in own)
        a.params += sum(p[1] for p in own)
        a.param_bytes = a.param_bytes or (own[0][2] if own else 0)

    def mark(self, a: _Acc) -> None:
        """Place ``a`` in execution order where it first does work."""
        a.order = next(self.ticks) if a.order is None else a.order

    def current(self) -> _Acc | None:
        if not self.stack:
            return None
        path, mod = self.stack[-1]
        return self.acc(path, mod, self.leaf[id(mod)])

    # ---- module hooks --------------------------------------------------------------------------
    def pre_hook(self, mod: nn.Module, args: Any) -> None:
        self.stack.append((self.paths[id(mod)], mod))
        if self.leaf[id(mod)]:
            self.mark(self.current())

    def post_hook(self, mod: nn.Module, args: Any, output: Any) -> None:
        path, _ = self.stack.pop()
        if self.leaf[id(mod)]:
            self.acc(path, mod, True).out += _nbytes(output)

    # ---- saved tensors -------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        a, st = self.current(), t.untyped_storage()
        sid = st._cdata
        if a is not None and sid not in self.skip and sid not in self.seen:
            self.seen[sid] = st  # keep it alive so that the id stays unique
            a.saved += st.nbytes()
            self.mark(a)
        return t

    # ---- ops -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.prim.device.default:  # decompose what FlopCounterMode decomposes
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        out = func(*args, **kwargs)
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        node = torch._C._current_autograd_node()
        if node is not None:  # backward
            if flops:
                key = self.owner.get(node._sequence_nr())
                a = self.accs[key] if key else self.acc("", self.root, False)
                a.bwd += flops
            return out
        a = self.current()
        if a is None:
            return out
        self.owner.setdefault(torch._C._autograd._get_sequence_nr() - 1, a.key)
        name = func._overloadpacket.__name__
        a.fwd += flops
        if flops or name in _LOSS_OPS:
            a.ops.add(name)
            self.mark(a)
        if name in _SDPA_OPS and not a.dims:
            q, k = args[0], args[1]
            a.dims = {"heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[-1], "seq": q.shape[2]}
            a.causal = bool(_arg(func, args, kwargs, "is_causal"))
        if name == "_log_softmax":
            a.dims = {"vocab": int(out.shape[-1])}
        if not func.is_view:
            a.mem += _nbytes((args, kwargs)) + _nbytes(out)
        if not a.leaf:
            a.out = _nbytes(out)
        return out


# ---- turning accumulators into nodes ------------------------------------------------------------

def _kind(a: _Acc) -> str:
    cls = type(a.module).__name__
    if a.leaf and (isinstance(a.module, nn.Embedding) or (cls.endswith("Embedding") and a.params)):
        return "embedding"
    for kind, words in _LEAF_KINDS if a.leaf else ():
        if any(w in cls for w in words):
            return kind
    if a.ops & _LOSS_OPS:
        return "loss"
    if "_grouped_mm" in a.ops:
        return "experts"
    if a.ops & _ATTN_OPS:
        return "attention"
    return "linear" if a.leaf and a.ops & {"mm", "addmm"} and a.params else "other"


def _tp(kind: str, a: _Acc, vocab: int) -> str:
    """Megatron TP role guessed from the kind and the usual module names."""
    last = a.path.rsplit(".", 1)[-1]
    if kind == "embedding":
        return "vocab" if a.dims.get("vocab") == vocab else "replicated"
    if kind == "linear":
        return ("column" if last in _COLUMN else "row" if last in _ROW
                else "vocab" if last in ("lm_head", "head", "output") else "none")
    return _TP_BY_KIND.get(kind, "none")


def _linear_dims(m: nn.Module) -> dict[str, int]:
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return {}
    d_out, d_in = w.shape[::-1] if hasattr(m, "nf") else w.shape  # transformers' Conv1D keeps (in, out)
    return {"in": int(d_in), "out": int(d_out)}


def _block_ids(model: nn.Module, paths: list[str]) -> dict[str, tuple[int, str] | None]:
    """Block index (numbered across all layer lists in order) and block type for each module path."""
    lists = {p for p, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    numbering: dict[tuple[str, str], int] = {}
    out: dict[str, tuple[int, str] | None] = {}
    for path in paths:
        parts = path.split(".") if path else []
        out[path] = None
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            if part.isdigit() and parent in lists:
                idx = numbering.setdefault((parent, part), len(numbering))
                out[path] = (idx, "encoder" if "encoder" in parent else "decoder")
                break
    return out


def _to_node(a: _Acc, batch: int, block: tuple[int, str] | None, btype: str, dflt_pb: int, vocab: int) -> LayerNode:
    kind = _kind(a)
    if kind == "embedding" and isinstance(a.module, nn.Embedding):
        a.dims = {"vocab": a.module.num_embeddings, "hidden": a.module.embedding_dim}
    tp = _tp(kind, a, vocab)
    dims = _linear_dims(a.module) if kind == "linear" else dict(a.dims)
    return LayerNode(
        name=a.key, kind=kind, block=block[0] if block else None, block_type=btype,
        params=a.params, param_bytes=a.param_bytes or dflt_pb,
        fwd_flops=a.fwd / batch, bwd_flops=a.bwd / batch, act_saved_bytes=a.saved / batch,
        act_tp_sharded=tp in ("row", "heads") or kind in ("activation", "loss", "experts"),
        out_bytes=a.out / batch, mem_bytes=a.mem / batch, causal=a.causal, tp=tp, dims=dims,
    )


def _nodes(model: nn.Module, rec: _Recorder, batch: int) -> list[LayerNode]:
    accs = [a for a in rec.accs.values() if a.params or a.fwd or a.bwd or a.saved]
    accs.sort(key=lambda a: a.order if a.order is not None else a.first)
    blocks = _block_ids(model, [a.path for a in accs])
    pb = next((p[2] for ps in rec.own.values() for p in ps), 2)
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=0)
    seen_block = False
    nodes = []
    for a in accs:
        b = blocks[a.path]
        seen_block = seen_block or b is not None
        btype = b[1] if b else ("head" if seen_block else "embedding")
        nodes.append(_to_node(a, batch, b, btype, pb, vocab))
    return nodes


# ---- running the model on fake tensors ----------------------------------------------------------

def _fake_like(t: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake tensor of ``t``'s shape (on CPU for meta tensors); values never matter here."""
    if isinstance(t, FakeTensor):
        return t
    dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
    with mode:
        f = torch.empty_strided(t.shape, t.stride(), dtype=dt, device="cpu" if t.is_meta else t.device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(f, requires_grad=t.requires_grad)
    return f.requires_grad_(t.requires_grad) if f.is_floating_point() else f


def _scalar(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    vals = list(out.values()) if isinstance(out, Mapping) else out
    for t in tree_flatten(vals)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            return t.sum()
    raise ShardplanError("traced model returned no floating-point tensor that requires grad")


def _batch_of(inputs: tuple | dict) -> int:
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def _unpacked_hf_sequences() -> contextlib.AbstractContextManager[Any]:
    """HF cannot read fake position ids, so it assumes packed sequences and builds a 4-D mask (more
    saved bytes, no GQA in SDPA); the tracer's samples are single sequences, as HF finds on real ones."""
    mu = sys.modules.get("transformers.masking_utils")
    if not hasattr(mu, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(mu, "find_packed_sequence_indices", lambda position_ids: None)


def trace_module(
    model: nn.Module, example_inputs: tuple | dict, *, model_id: str, seq_len: int, backward: bool = True,
    dtype: torch.dtype | None = None, input_grad: bool = True,
) -> LayerGraph:
    """The layer graph of ``model`` run on ``example_inputs`` (a tuple of args or a dict of kwargs).

    Real, meta and fake models all work; the model is not changed (its parameters are swapped for
    fake ones with :func:`torch.func.functional_call`). ``dtype`` recasts floating parameters and
    inputs; per-sample figures divide by the batch size of the inputs.
    """
    named, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    fake = next((t for t in [*named.values(), *buffers.values()] if isinstance(t, FakeTensor)), None)
    mode = fake.fake_mode if fake is not None else FakeTensorMode(allow_non_fake_inputs=True)
    state = {**{k: _fake_like(v, mode, dtype) for k, v in named.items()},
             **{k: _fake_like(v, mode, None) for k, v in buffers.items()}}
    args, kwargs = (((), dict(example_inputs)) if isinstance(example_inputs, dict)
                    else (tuple(example_inputs), {}))

    def fake_input(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        f = _fake_like(t.detach(), mode, dtype)
        return f.requires_grad_() if input_grad and backward and f.is_floating_point() else f

    args, kwargs = tree_map(fake_input, (args, kwargs))
    skip = {t.untyped_storage()._cdata for t in state.values()}
    rec = _Recorder(model, skip, dtype)
    handles = [h for m in model.modules() for h in (
        m.register_forward_pre_hook(rec.pre_hook), m.register_forward_hook(rec.post_hook, always_call=True))]
    try:
        with _unpacked_hf_sequences(), mode, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), rec:
            with torch.set_grad_enabled(backward):
                out = torch.func.functional_call(model, state, args, kwargs, strict=False)
            if backward:
                _scalar(out).backward()
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ShardplanError(
            f"{model_id}: the model runs data-dependent code ({e}) that fake tensors cannot trace; for "
            "Hugging Face MoE models pass experts_implementation='grouped_mm' in the config"
        ) from None
    finally:
        for h in handles:
            h.remove()
    _claim_unused(model, rec)
    nodes = _nodes(model, rec, _batch_of((args, kwargs)))
    idle = [n.name for n in nodes if n.params and not n.fwd_flops and n.kind not in ("embedding", "norm")]
    if idle:
        warnings.warn(f"{model_id}: {len(idle)} layers hold parameters but ran no counted FLOPs ({idle[:3]}...): "
                      "data-dependent code (MoE routing) or an op without a FLOP formula", stacklevel=2)
    return LayerGraph(model_id=model_id, seq_len=seq_len, nodes=nodes, source="traced",
                      config={"class": type(model).__name__, "no_flop_layers": idle})


def _claim_unused(model: nn.Module, rec: _Recorder) -> None:
    """Give parameters of modules that never ran (``nn.MultiheadAttention.out_proj``) to the nearest
    ancestor's ``.fn`` node, or to a node of their own."""
    for path, mod in model.named_modules():
        if all(p[0] in rec.claimed for p in rec.own[id(mod)]):
            continue
        parts = path.split(".") if path else []
        keys = [(".".join(parts[:i]) or "root") + ".fn" for i in range(len(parts) - 1, -1, -1)]
        key = next((k for k in keys if k in rec.accs), None)
        rec.claim(rec.accs[key], mod) if key else rec.acc(path, mod, rec.leaf[id(mod)])


# ---- building models from names -----------------------------------------------------------------
