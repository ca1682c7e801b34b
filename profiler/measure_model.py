"""Run a few real layers of a model and measure each layer-graph node: time and saved bytes.

:func:`build_stack` turns a :class:`~profiler.model_config.TransformerConfig` cut to ``layers``
blocks into the reference blocks that the runtime trains (:mod:`profiler.reference_model`), whose
submodule names are the layer-graph node names of :mod:`profiler.transformer` (``layers.0.attn_norm``,
``layers.0.attn.qkv``, ``layers.0.attn.core``, ``layers.0.attn.out``, ``layers.0.mlp_norm``,
``layers.0.mlp.up/act/down``, dropouts, MoE router and experts). :func:`measure_layers` times each
node's forward (pre/post forward hooks) and backward (full backward pre/post hooks) with the
profiler's clock, and attributes every tensor autograd saves for backward to the node that saved it (``saved_tensors_hooks``; parameters
excluded, a storage counted once, at the last node that saves it). RoPE runs inside the attention
core; the MoE routing (scores, top-k, sorting the tokens by expert) and residual adds are not graph
nodes: their time shows only in the whole-block rows (``layers.<i>``).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from profiler.graph import LayerGraph
from profiler.hardware import Accelerator, accelerator
from profiler.measure_compute import DTYPES, Clock, guess_accelerator
from profiler.model_config import TransformerConfig
from profiler.profile_schema import LayerMeasurement
from profiler.reference_model import INIT_STD, MEASURED, Block, init_weights
from profiler.transformer import build_graph
from vocab.errors import ShardplanError


class Stack(nn.Module):
    """``layers`` reference blocks (:mod:`profiler.reference_model`) as the profiler runs them:
    hidden states in, hidden states out, dropout and eager attention as the config says."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, i, MEASURED) for i in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return x


def cut_config(cfg: TransformerConfig, layers: int) -> TransformerConfig:
    if layers < 1:
        raise ShardplanError(f"--layers must be at least 1, got {layers}")
    if cfg.arch == "vit":
        raise ShardplanError(f"model '{cfg.name}': ViT blocks are not measured yet (decoder and encoder stacks are)")
    return replace(cfg, layers=min(layers, cfg.layers), dense_layers=min(cfg.dense_layers, layers))


def build_stack(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype) -> Stack:
    """The blocks of ``cfg`` on ``device`` in ``dtype``, with the reference model's initial weights
    (drawn from torch's generator)."""
    with torch.device(device):
        stack = Stack(cfg)
        init_weights(stack, INIT_STD, cfg.layers)
        return stack.to(dtype)


def check_fits(graph: LayerGraph, micro_batch: int, dtype: str, device: torch.device, fraction: float = 0.6) -> float:
    """Bytes the slice needs (weights, gradients, activations, transients); refuse if too much."""
    es = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    params = sum(n.params for n in graph.nodes if n.block is not None)
    acts = sum(n.act_saved_bytes for n in graph.nodes if n.block is not None) * micro_batch * es / 2
    biggest = max((n.out_bytes for n in graph.nodes if n.block is not None), default=0) * micro_batch * es / 2
    need = 2.0 * params * es + 1.5 * acts + 4 * biggest
    if device.type == "cuda":
        avail = float(torch.cuda.mem_get_info(device)[0])
    else:
        import psutil

        avail = float(psutil.virtual_memory().available)
    if need > fraction * avail:
        raise ShardplanError(
            f"model '{graph.model_id}': {graph.num_blocks} layer(s) at micro-batch {micro_batch} and seq_len "
            f"{graph.seq_len} need about {need / 2**30:.1f} GiB on {device} (weights, gradients, activations) "
            f"but {avail / 2**30:.1f} GiB is free; use fewer --layers, a shorter --seq-len or a smaller model")
    return need


def checked_graph(cfg: TransformerConfig, layers: int, micro_batch: int, seq_len: int, repeats: int, dtype: str,
                  device: torch.device) -> LayerGraph:
    """The layer graph a measurement of ``layers`` blocks of ``cfg`` runs (:func:`layers_graph`), refused
    before it starts: sizes that are not positive, or a slice that does not fit."""
    if micro_batch < 1 or seq_len < 1 or repeats < 1:
        raise ShardplanError("--micro-batch, --seq-len and --repeats must be positive")
    graph = layers_graph(cfg, layers, seq_len)
    check_fits(graph, micro_batch, dtype, device)
    return graph


# ---- measuring -------------------------------------------------------------------------------------

class _Recorder:
    """Forward/backward marks per named module and saved bytes per node."""

    def __init__(self, modules: dict[str, nn.Module], clock: Clock, params: set[int]):
        self.clock, self.params = clock, params
        self.marks: dict[str, dict[str, Any]] = {}
        self.stack: list[str] = []
        self.saved: dict[int, tuple[str, int]] = {}  # storage pointer -> (node, bytes)
        self.recording = False
        self.allocated: dict[str, int] = {}  # CUDA: bytes a forward left allocated
        self._mem0: dict[str, int] = {}
        self.handles = []
        for name, mod in modules.items():
            self.handles += [
                mod.register_forward_pre_hook(self._pre(name)),
                mod.register_forward_hook(self._post(name)),
                mod.register_full_backward_pre_hook(self._bpre(name)),
                mod.register_full_backward_hook(self._bpost(name)),
            ]

    def _pre(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            self.stack.append(name)
            if self.recording and self.clock.cuda:
                self._mem0[name] = torch.cuda.memory_allocated(self.clock.device)
            self.marks.setdefault(name, {})["f0"] = self.clock.mark()
        return hook

    def _post(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            self.marks[name]["f1"] = self.clock.mark()
            self.stack.pop()
            if self.recording and self.clock.cuda:
                self.allocated[name] = torch.cuda.memory_allocated(self.clock.device) - self._mem0[name]
        return hook

    def _bpre(self, name: str) -> Any:
        def hook(mod: nn.Module, grad_out: Any) -> None:
            self.marks[name]["b0"] = self.clock.mark()
        return hook

    def _bpost(self, name: str) -> Any:
        def hook(mod: nn.Module, grad_in: Any, grad_out: Any) -> None:
            self.marks[name]["b1"] = self.clock.mark()
        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.stack and not isinstance(t, nn.Parameter):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.params and st.nbytes():
                self.saved[ptr] = (self.stack[-1], st.nbytes())
        return t

    def times(self) -> dict[str, tuple[float, float]]:
        self.clock.sync()
        out = {}
        for name, m in self.marks.items():
            fw = self.clock.elapsed(m["f0"], m["f1"]) if "f1" in m else 0.0
            bw = self.clock.elapsed(m["b0"], m["b1"]) if "b1" in m else 0.0
            out[name] = (fw, bw)
        self.marks = {}
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def accelerator_for(device: torch.device, name: str | None = None) -> Accelerator:
    """The accelerator that predictions for ``device`` assume: ``name``, else ``cpu`` on a CPU, else
    the GPU's own (an H100 SXM when it is not recognised)."""
    return accelerator(name or ("cpu" if device.type == "cpu" else _guess_gpu(device) or "h100-sxm"))


def _guess_gpu(device: torch.device) -> str | None:
    props = torch.cuda.get_device_properties(device)
    return guess_accelerator(props.name, props.total_memory / 1e9)


def layers_graph(cfg: TransformerConfig, layers: int, seq_len: int) -> LayerGraph:
    """The layer graph of the ``layers`` blocks of ``cfg`` that :func:`measure_layers` runs."""
    return build_graph(cut_config(cfg, layers), seq_len)


def measure_layers(
    cfg: TransformerConfig, device: torch.device, *, layers: int = 2, micro_batch: int = 1,
    seq_len: int = 128, dtype: str = "bf16", warmup: int = 2, repeats: int = 5, model_name: str | None = None,
) -> list[LayerMeasurement]:
    """Per-node and per-block measurements of ``layers`` blocks of ``cfg``, with the layer graph's
    saved bytes beside them (``costmodel.compute.with_predicted_times`` adds predicted times)."""
    graph = checked_graph(cfg, layers, micro_batch, seq_len, repeats, dtype, device)
    cut = cut_config(cfg, layers)
    blocks = [n for n in graph.nodes if n.block is not None]
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    stack = build_stack(cut, device, dt).train()
    mods = dict(stack.named_modules())
    names = [n.name for n in blocks if n.name in mods] + [f"layers.{i}" for i in range(cut.layers)]
    params = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    clock = Clock(device)
    rec = _Recorder({n: mods[n] for n in names}, clock, params)
    shape = (micro_batch, graph.seq_len, cut.hidden)

    def step(record_saved: bool) -> dict[str, tuple[float, float]]:
        for p in stack.parameters():
            p.grad = None
        x = torch.randn(shape, device=device, dtype=dt, requires_grad=True)
        if record_saved:
            rec.recording = True
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                y = stack(x)
            rec.recording = False
        else:
            y = stack(x)
        y.backward(torch.ones_like(y))
        return rec.times()

    try:
        step(record_saved=True)
        for _ in range(max(0, warmup - 1)):
            step(False)
        runs = [step(False) for _ in range(repeats)]
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError) or "allocate" in str(e):
            raise ShardplanError(f"out of memory on {device} running {layers} layer(s) of '{cfg.name}'") from None
        raise
    finally:
        rec.close()
    saved: dict[str, float] = {}
    for node, nbytes in rec.saved.values():
        saved[node] = saved.get(node, 0.0) + nbytes
    kinds = {n.name: n.kind for n in blocks}
    rows = []
    for name in names:
        if name in kinds:
            kind, sv = kinds[name], saved.get(name, 0.0)
        else:  # a whole block: its nodes plus what only the block saw (residual adds, ...)
            kind = "block"
            sv = sum(v for k, v in saved.items() if k == name or k.startswith(name + "."))
        rows.append(LayerMeasurement(
            model=model_name or cfg.name, layer=name, micro_batch=micro_batch, seq_len=graph.seq_len,
            fwd_s=statistics.median(r.get(name, (0.0, 0.0))[0] for r in runs),
            bwd_s=statistics.median(r.get(name, (0.0, 0.0))[1] for r in runs),
            saved_bytes=sv, kind=kind, dtype=dtype, allocated_bytes=rec.allocated.get(name)))
    return with_saved_predictions(rows, graph)


def with_saved_predictions(rows: list[LayerMeasurement], graph: LayerGraph) -> list[LayerMeasurement]:
    """``rows`` with the layer graph's saved bytes for the same nodes (a block: the sum of its nodes),
    counted as 16-bit activations and scaled to the rows' dtype."""
    out = []
    for r in rows:
        scale = r.micro_batch * torch.tensor([], dtype=DTYPES[r.dtype or "bf16"]).element_size() / 2
        saved = sum(n.act_saved_bytes for n in graph.members(r.layer)) * scale
        out.append(r.model_copy(update={"predicted_saved_bytes": saved}))
    return out
