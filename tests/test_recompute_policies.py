"""Selective recomputation as each trainer runs it (:mod:`costmodel.recompute`): the bytes a policy
keeps are the bytes its checkpoint caches, counted in the cache itself on CPU, and the time and
memory follow from what is kept."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as ckpt

from costmodel.device import DeviceModel
from costmodel.recompute import gemm_widths, selective
from costmodel.units import unit_cost
from profiler.hardware import parse_cluster
from profiler.model_config import TransformerConfig
from profiler.models import load_model
from profiler.transformer import build_graph
from runtime import checkpointing
from runtime.model import Block
from vocab.strategy import LayerStrategy, Mesh, Strategy, Workload

B, S = 2, 32
LLAMA = TransformerConfig(name="llama-like", layers=1, hidden=64, heads=4, kv_heads=2, vocab=256, max_seq=S,
                          ffn_hidden=96, activation="swiglu", norm="rmsnorm", position="rope", bias=False)


@contextmanager
def cached_bytes() -> Iterator[list[int]]:
    """While open, every selective checkpoint's cache is recorded; the list holds, once closed, the
    bytes of the tensors the caches hold (what the policy kept from forward)."""
    caches: list[dict] = []
    mode = ckpt._CachingTorchDispatchMode
    original = mode.__init__

    def recording(self: Any, policy_fn: Any, storage: dict, *args: Any, **kwargs: Any) -> None:
        original(self, policy_fn, storage, *args, **kwargs)
        caches.append(storage)

    out: list[int] = []
    mode.__init__ = recording  # type: ignore[method-assign]
    try:
        yield out
    finally:
        mode.__init__ = original  # type: ignore[method-assign]
    for storage in caches:
        for outputs in storage.values():  # per op: its calls' outputs, or a mark that they are recomputed
            for entry in (outputs.values() if isinstance(outputs, dict) else outputs):
                for t in torch.utils._pytree.tree_leaves(entry):
                    val = getattr(t, "val", t)
                    if isinstance(val, torch.Tensor):
                        out.append(val.numel() * val.element_size())


def predicted_kept(cfg: TransformerConfig, policy: str) -> float:
    """The cost model's activations of one block under selective recomputation and ``policy``:
    its input and the outputs the policy keeps, per micro-batch of ``B``."""
    nodes = dict(build_graph(cfg, S).blocks())["layers.0"]
    s = Strategy(micro_batch=B, default=LayerStrategy(recompute="selective"))
    w = Workload(seq_len=S, global_batch=B, selective=policy)  # type: ignore[arg-type]
    return unit_cost("layers.0", nodes, DeviceModel(parse_cluster("1xcpu")), s, w).activations


def run_block(block: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> int:
    """Bytes one forward of ``block`` (wrapped by ``wrap``) keeps in bf16: its input and its cache;
    backward runs too, so that the recomputation is exercised."""
    block = wrap(block.to(torch.bfloat16))
    x = torch.randn(B, S, LLAMA.hidden, dtype=torch.bfloat16, requires_grad=True)
    with cached_bytes() as sizes:
        y = block(x)
    y.float().sum().backward()
    return sum(sizes) + x.numel() * x.element_size()


# ---- torchtitan's op-level policy, with its own code --------------------------------------------

def _bare_package(name: str) -> None:
    """Import package ``name`` without its ``__init__`` (torchtitan's model packages import the
    trainer's data loader and metrics stack, which the tests do not install)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None
    mod = types.ModuleType(name)
    mod.__path__ = list(spec.submodule_search_locations)
    mod.__spec__ = spec
    sys.modules[name] = mod


class TitanBlock(nn.Module):
    """A Llama 3 block as torchtitan 0.2.2 writes it (torchtitan/models/llama3/model/model.py):
    ``wq``, ``wk``, ``wv`` in that order, SDPA, ``wo``; ``w2(silu(w1(x)) * w3(x))``. The order of
    the GEMMs is what the op-level policy counts."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        h, a, kv, d, f = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden
        self.a, self.kv, self.d = a, kv, d
        self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
        self.wq, self.wk, self.wv = nn.Linear(h, a * d, bias=False), nn.Linear(h, kv * d, bias=False), \
            nn.Linear(h, kv * d, bias=False)
        self.wo = nn.Linear(a * d, h, bias=False)
        self.w1, self.w2, self.w3 = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False), \
            nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        n = self.attention_norm(x)
        q = self.wq(n).view(b, s, self.a, self.d).transpose(1, 2)
        k = self.wk(n).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.wv(n).view(b, s, self.kv, self.d).transpose(1, 2)
        rep = self.a // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = x + self.wo(o)
        m = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))


def titan_op_sac(block: nn.Module) -> nn.Module:
    """torchtitan's own ``_apply_op_sac`` with its own Llama 3 save list, the CPU flash-attention
    op added beside the CUDA ones it names."""
    pytest.importorskip("torchtitan")
    _bare_package("torchtitan.models.llama3")
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_op_sac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    save = set(_op_sac_save_list) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    return _apply_op_sac(block, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
                         op_sac_save_list=save)


def test_torchtitans_op_policy_keeps_what_the_cost_model_says() -> None:
    """torchtitan's policy, run: every second GEMM of the block kept (wq, wv, w1, w2), attention's
    output and log-sum-exp, the block's input; the cost model's ``op`` policy counts the same bytes."""
    torch.manual_seed(0)
    kept = run_block(TitanBlock(LLAMA), titan_op_sac)
    h, a, kv, d, f = LLAMA.hidden, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim, LLAMA.ffn_hidden
    by_hand = 2 * B * S * (h + a * d + kv * d + a * d + f + h) + 4 * B * a * S
    assert kept == by_hand
    assert predicted_kept(LLAMA, "op") == pytest.approx(kept, rel=1e-12)


def test_the_runtimes_policy_keeps_what_the_cost_model_says() -> None:
    """The runtime's selective checkpoint on its own block keeps every GEMM output and the block's
    input: the cost model's ``gemms`` policy."""
    torch.manual_seed(0)
    kept = run_block(Block(LLAMA, 0), lambda m: (checkpointing.wrap(m, "selective", "cpu"), m)[1])
    h, a, kv, d, f = LLAMA.hidden, LLAMA.heads, LLAMA.kv_heads, LLAMA.head_dim, LLAMA.ffn_hidden
    assert kept == 2 * B * S * (h + (a + 2 * kv) * d + h + 2 * f + h)
    assert predicted_kept(LLAMA, "gemms") == pytest.approx(kept, rel=1e-12)


# ---- the policies priced -------------------------------------------------------------------------

def test_fused_nodes_count_their_gemms_in_call_order() -> None:
    """Q/K/V and SwiGLU's gate and up are one node each in the graph and three and two GEMMs in
    torchtitan: the op policy keeps Q and V, recomputes K, the output projection and the up half."""
    nodes = dict(build_graph(LLAMA, S).blocks())["layers.0"]
    by_name = {n.name.rsplit(".", 2)[-2] + "." + n.name.rsplit(".", 1)[-1]: n for n in nodes}
    qkv = by_name["attn.qkv"]
    assert gemm_widths(qkv) == [64, 32, 32]
    kept = dict(zip((n.name for n in nodes), selective(nodes, "op"), strict=True))
    assert kept[qkv.name].recompute == pytest.approx(32 / 128)  # K
    assert kept["layers.0.attn.out"].recompute == 1.0 and kept["layers.0.attn.out"].out_bytes == 0
    assert kept["layers.0.mlp.up"].recompute == 0.5  # w3 (up) recomputed, w1 (gate) kept
    assert kept["layers.0.mlp.down"].recompute == 0.0
    assert kept["layers.0.attn.core"].recompute == 0.0
    assert all(k.recompute == 1.0 for n, k in zip(nodes, selective(nodes, "op"), strict=True)
               if n.kind in ("norm", "activation"))
    # with biases every linear runs aten.addmm, which torchtitan's list does not hold
    biased = dict(build_graph(replace(LLAMA, bias=True), S).blocks())["layers.0"]
    assert all(k.recompute == 1.0 and k.out_bytes == 0 for n, k in zip(biased, selective(biased, "op"), strict=True)
               if n.kind == "linear")
    assert [k.recompute for n, k in zip(biased, selective(biased, "gemms"), strict=True) if n.kind == "linear"] == [
        0.0] * 4


def test_policies_trade_memory_for_recomputation_on_llama3_8b() -> None:
    """Llama 3 8B at 8k tokens: the op policy keeps less than attention-core recomputation (the
    Llama 3.1 8B runs of torchtitan on 8 H100 fit only so, at 81 GiB of 96) and recomputes about
    a third of the block's GEMMs; the runtime's policy keeps more than op, recomputing no GEMM."""
    g = load_model("llama3-8b", 8192)
    nodes = dict(g.blocks())["layers.0"]
    dev = DeviceModel(parse_cluster("8xh100"))
    s = Strategy(mesh=Mesh(dp_shard=8), micro_batch=2, default=LayerStrategy(recompute="selective"))
    cost = {p: unit_cost("layers.0", nodes, dev, s, Workload(seq_len=8192, global_batch=16, selective=p))
            for p in ("attention", "op", "gemms")}
    assert cost["op"].activations < cost["gemms"].activations < cost["attention"].activations
    assert cost["op"].activations / cost["attention"].activations == pytest.approx(0.46, abs=0.02)
    gemm = sum(n.fwd_flops for n in nodes if n.kind == "linear")
    recomputed = sum(n.fwd_flops * k.recompute for n, k in zip(nodes, selective(nodes, "op"), strict=True)
                     if n.kind == "linear")
    assert recomputed / gemm == pytest.approx(0.37, abs=0.01)
    assert cost["op"].recompute > cost["gemms"].recompute > 0
    assert cost["attention"].recompute == pytest.approx(
        unit_cost("layers.0", nodes, dev, s, Workload(seq_len=8192, global_batch=16)).recompute)
