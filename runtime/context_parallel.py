"""Context parallelism: the sequence split over the ``cp`` ranks, attention across the split.

Causal load balancing (head-tail, the "zigzag" layout of Megatron-LM and torchtitan): the sequence
of ``S`` tokens is cut into ``2·cp`` chunks and rank ``r`` holds chunks ``r`` and ``2·cp-1-r``, so
every rank gets the same share of the causal mask's work. :func:`shard_sequence` cuts a batch
that way; :meth:`ContextShard.positions` gives the global positions of a rank's tokens (RoPE and
learned positions use them).

Attention (the plan's ``cp_mode``; for a ring, its ``cp_rotate``, ``allgather`` by default: the
cost model prices a ring as an all-gather of K/V):

* ``ring`` with ``alltoall`` rotation: the K/V chunks travel round the ring by point-to-point
  sends, ``cp-1`` steps; each step attends the local queries to the visiting chunk with the fused
  attention kernel (on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the
  log-sum-exp; elsewhere the same arithmetic written out), and the partial outputs are merged by
  their log-sum-exps. Backward sends K/V round again with their gradients, which arrive home after
  one more send. Under the zigzag layout step 0 is causal attention over the local chunks, a
  chunk from a lower rank is seen whole by every local query, a chunk from a higher rank only by
  the local tail chunk (Brandon et al., 2023, "Striped attention"; Liu et al., 2023, "Ring
  attention").
* ``ring`` with ``allgather`` rotation: K/V all-gathered over the ring (autograd: gradients
  reduce-scattered back) and the local queries attend to the whole sequence under the causal mask
  of their global positions (torchtitan's ``context_parallel_rotate_method = "allgather"``).
* ``ulysses``: an all-to-all turns (sequence/cp, all heads) into (whole sequence, heads/cp),
  causal attention runs on whole sequences, and a second all-to-all turns it back (Jacobs et al.,
  2023, "DeepSpeed Ulysses"); the local heads must divide by ``cp``.

The loss of each rank is the mean over its tokens (every rank holds as many), and gradients are
averaged over data parallelism and ``cp`` together (:meth:`runtime.mesh.RuntimeMesh.shard_group`),
which is the mean over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as fc

ROTATES = ("alltoall", "allgather")


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two of ``2·size`` sequence chunks rank ``rank`` holds (head-tail load balancing)."""
    return rank, 2 * size - 1 - rank


def zigzag_index(seq: int, rank: int, size: int, device: Any = None) -> torch.Tensor:
    """Positions (into a sequence of ``seq`` tokens) that rank ``rank`` of ``size`` holds, in order."""
    if seq % (2 * size):
        raise ValueError(f"context parallelism over {size} ranks cuts the sequence into {2 * size} chunks: "
                         f"seq_len {seq} is not divisible by {2 * size}")
    ch = seq // (2 * size)
    a, b = chunk_ids(rank, size)
    return torch.cat([torch.arange(a * ch, (a + 1) * ch, device=device), torch.arange(b * ch, (b + 1) * ch, device=device)])


def shard_sequence(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` (batch, seq, ...)."""
    return x[:, zigzag_index(x.shape[1], rank, size, x.device)].contiguous()


@dataclass
class ContextShard:
    """This rank's place in the context-parallel group and how attention crosses it."""

    group: dist.ProcessGroup
    rank: int
    size: int
    mode: str = "ring"  # or "ulysses"
    rotate: str = "allgather"  # ring only: "allgather" or "alltoall" (point to point)
    gathered: int = 0  # elements of K/V the all-gather rotation received (whole sequences)

    def positions(self, local_len: int, device: Any = None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens."""
        return zigzag_index(local_len * self.size, self.rank, self.size, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the local queries over the whole sequence; (batch, heads, tokens, dim)
        each, the K/V heads dividing the query heads (grouped-query attention: each K/V head serves
        the consecutive query heads of its group)."""
        if self.rotate == "allgather" and self.mode == "ring":  # K/V move as they are, then repeat
            return _ring_allgather(q, k, v, self)
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        if self.mode == "ulysses":
            return _ulysses(q, k, v, self)
        return _RingAttention.apply(q, k, v, self)


# ---- one block: (out, lse) and its gradients --------------------------------------------------

def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to ``k``/``v`` and the log-sum-exp of each query's scores."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(_upper(s), float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    return (torch.exp(s.float() - lse[..., None]).to(v.dtype) @ v), lse


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the merged output and log-sum-exp of its queries."""
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
        return dq, dk, dv
    scale = q.shape[-1] ** -0.5
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_upper(s), float("-inf"))
    p = torch.exp(s.float() - lse[..., None]).to(q.dtype)
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def _upper(s: torch.Tensor) -> torch.Tensor:
    n, m = s.shape[-2], s.shape[-1]
    return torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1 + m - n)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries, merged by their log-sum-exps."""
    new = torch.logaddexp(lse, l_)
    merged = out * torch.exp(lse - new)[..., None].to(out.dtype) + o * torch.exp(l_ - new)[..., None].to(o.dtype)
    return merged, new


# ---- ring, point-to-point rotation ----------------------------------------------------------------

def _rotate(t: torch.Tensor, cs: ContextShard) -> torch.Tensor:
    """Send ``t`` to the next rank of the ring and return what the previous one sent."""
    nxt = dist.get_global_rank(cs.group, (cs.rank + 1) % cs.size)
    prv = dist.get_global_rank(cs.group, (cs.rank - 1) % cs.size)
    buf = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, cs.group), dist.P2POp(dist.irecv, buf, prv, cs.group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return buf


def _step_queries(step: int, cs: ContextShard, n: int) -> tuple[slice, slice, bool]:
    """At ring step ``step`` (the visiting K/V come from rank ``rank - step``): the local queries
    that see them, the part of the visiting K/V they see, and whether the block is causal."""
    if step == 0:
        return slice(0, n), slice(0, n), True
    src = (cs.rank - step) % cs.size
    if src < cs.rank:  # a lower rank's head chunk precedes both local chunks; its tail follows both
        return slice(0, n), slice(0, n // 2), False
    return slice(n // 2, n), slice(0, n), False  # a higher rank's chunks precede the local tail only


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cs: ContextShard) -> torch.Tensor:
        n = q.shape[-2]
        kv = torch.stack([k, v])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32 if q.dtype != torch.float64 else q.dtype,
                         device=q.device)
        for step in range(cs.size):
            rows, cols, causal = _step_queries(step, cs, n)
            o, l_ = _block(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], causal)
            out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], o, l_.to(lse.dtype))
            if step + 1 < cs.size:
                kv = _rotate(kv, cs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cs = cs
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cs: ContextShard = ctx.cs
        n = q.shape[-2]
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # gradients of the visiting K/V, travelling with them
        for step in range(cs.size):
            rows, cols, causal = _step_queries(step, cs, n)
            a, b, c = _block_backward(dout[..., rows, :], q[..., rows, :].contiguous(),
                                      kv[0][..., cols, :].contiguous(), kv[1][..., cols, :].contiguous(),
                                      out[..., rows, :].contiguous(), lse[..., rows].contiguous(), causal)
            dq[..., rows, :] += a
            dkv[0][..., cols, :] += b
            dkv[1][..., cols, :] += c
            if step + 1 < cs.size:
                kv = _rotate(kv, cs)
            dkv = _rotate(dkv, cs)  # after the last step: home
        return dq, dkv[0], dkv[1], None


# ---- ring, all-gather rotation ----------------------------------------------------------------------

def _ring_allgather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cs: ContextShard) -> torch.Tensor:
    n = q.shape[-2]
    k_all = fc.all_gather_single_autograd(k.contiguous(), gather_dim=2, group=cs.group)
    v_all = fc.all_gather_single_autograd(v.contiguous(), gather_dim=2, group=cs.group)
    k_all, v_all = fc.wait_tensor(k_all), fc.wait_tensor(v_all)
    cs.gathered += k_all.numel() + v_all.numel()
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k_all, v_all = k_all.repeat_interleave(g, dim=1), v_all.repeat_interleave(g, dim=1)
    kpos = torch.cat([zigzag_index(n * cs.size, r, cs.size, q.device) for r in range(cs.size)])
    mask = cs.positions(n, q.device)[:, None] >= kpos[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


# ---- Ulysses ---------------------------------------------------------------------------------------

def _heads_to_sequence(x: torch.Tensor, cs: ContextShard) -> torch.Tensor:
    """(b, h, n, d) with this rank's tokens → (b, h/cp, n·cp, d) with every rank's, in rank order."""
    b, h, n, d = x.shape
    if h % cs.size:
        raise ValueError(f"Ulysses splits the {h} local heads over cp={cs.size} ranks: not divisible")
    parts = x.reshape(b, cs.size, h // cs.size, n, d).transpose(0, 1).contiguous()  # (cp, b, h/cp, n, d)
    got = fc.wait_tensor(fc.all_to_all_single_autograd(parts.flatten(0, 1), None, None, cs.group))
    return got.reshape(cs.size, b, h // cs.size, n, d).permute(1, 2, 0, 3, 4).reshape(b, h // cs.size, cs.size * n, d)


def _sequence_to_heads(x: torch.Tensor, cs: ContextShard) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    b, hl, total, d = x.shape
    n = total // cs.size
    parts = x.reshape(b, hl, cs.size, n, d).permute(2, 0, 1, 3, 4).contiguous()  # (cp, b, h/cp, n, d)
    got = fc.wait_tensor(fc.all_to_all_single_autograd(parts.flatten(0, 1), None, None, cs.group))
    return got.reshape(cs.size, b, hl, n, d).transpose(0, 1).reshape(b, cs.size * hl, n, d)


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cs: ContextShard) -> torch.Tensor:
    n = q.shape[-2]
    order = torch.cat([zigzag_index(n * cs.size, r, cs.size, q.device) for r in range(cs.size)])
    natural = torch.argsort(order)  # rank-order tokens → sequence order
    qs, ks, vs = (_heads_to_sequence(t, cs)[..., natural, :] for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    return _sequence_to_heads(o[..., order, :], cs)
