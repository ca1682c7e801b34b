"""Token routing for the reference model's mixture-of-experts blocks, and expert parallelism.

A MoE block (:class:`profiler.reference_model.MoE`) routes each token to ``top_k`` of ``E`` experts
(:func:`~profiler.reference_model.route`). The experts' weights are two stacked tensors (``up``
(E, h, n·f) and ``down`` (E, f, h)); the tokens routed to them are sorted by expert and multiplied
expert by expert (:func:`~profiler.reference_model.grouped_mm`).

Expert parallelism (``ep > 1``): expert rank ``j`` of an EP group holds experts
``[j·E/ep, (j+1)·E/ep)``. The EP group is ``ep`` consecutive ranks of the ``dp_shard × cp`` ranks
(each holding other tokens), as the cost model lays it out; the tokens sorted by expert go to the
ranks holding their experts in one all-to-all (the counts first, then the tokens), are multiplied
there, and come back in a second one (:func:`dispatch_compute_combine`). Gradients go back the
same way (the all-to-alls are differentiable). Each expert's gradient then holds the contributions
of the ``ep`` ranks of its EP group, each the gradient of its own mean loss: :func:`scale_grad`
divides it by ``ep`` in backward, so that averaging over the expert's replicas (the ranks with the
same EP rank in the other EP groups, ``dp_replicate × dp_shard × cp / ep`` of them) gives the
gradient of the mean loss over every data-parallel rank, as for dense weights.

Balancing is auxiliary-loss-free (Wang et al., 2024; DeepSeek-V3): a per-expert bias, added to
the routing scores only to choose the experts, moves by ``BIAS_RATE`` after each optimizer step
towards the mean load, counted over every token of the step on every rank (:func:`rebalance`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as fc

#: bias update speed γ of auxiliary-loss-free balancing (DeepSeek-V3 uses 0.001)
BIAS_RATE = 1e-3


@dataclass
class ExpertShard:
    """This rank's place in its expert-parallel group."""

    group: dist.ProcessGroup
    rank: int
    size: int


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.factor, None


def scale_grad(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t`` in forward; its gradient times ``factor`` in backward."""
    return _ScaleGrad.apply(t, factor)


def dispatch_compute_combine(xs: torch.Tensor, counts: torch.Tensor, ep: ExpertShard,
                             compute: Any) -> torch.Tensor:
    """Rows ``xs`` sorted by (global) expert, ``counts`` (E,) of each: sent to the ranks holding
    their experts, ``compute(rows, local_counts)`` there (rows sorted by local expert), sent back."""
    local = counts.numel() // ep.size
    per_rank = counts.view(ep.size, local)  # rows for rank j's experts
    recv = torch.empty_like(per_rank)
    dist.all_to_all_single(recv, per_rank.contiguous(), group=ep.group)  # recv[s, e]: from s, for my e
    send_sizes, recv_sizes = per_rank.sum(1).tolist(), recv.sum(1).tolist()
    got = fc.wait_tensor(fc.all_to_all_single_autograd(xs.contiguous(), recv_sizes, send_sizes, ep.group))
    expert_of = torch.repeat_interleave(torch.arange(local, device=xs.device).repeat(ep.size), recv.reshape(-1))
    order = torch.argsort(expert_of, stable=True)  # source-major → expert-major
    ys = compute(got[order], recv.sum(0).tolist())
    back = torch.empty_like(ys).index_copy(0, order, ys)  # expert-major → source-major
    return fc.wait_tensor(fc.all_to_all_single_autograd(back, send_sizes, recv_sizes, ep.group))


def rebalance(modules: list[Any], groups: list[dist.ProcessGroup | None]) -> None:
    """After an optimizer step: every MoE block's load of the step summed over ``groups`` (the
    ranks holding other tokens), its bias moved by :data:`BIAS_RATE` towards the mean load."""
    for m in modules:
        load = m.load
        for g in groups:
            if g is not None:
                dist.all_reduce(load, group=g)
        m.balance_bias.add_(BIAS_RATE * torch.sign(load.mean() - load))
        load.zero_()
