"""What a unit's selective recomputation keeps from forward and recomputes in backward, by the
policy its trainer runs (:attr:`vocab.strategy.Workload.selective`).

Each policy is a rule over the unit's operators in call order; every operator gets the fraction of
its forward that backward recomputes and the bytes of its outputs kept until then:

* ``attention`` (Korthikanti et al., arXiv 2205.05198, section 4.2; Megatron-LM's ``core_attn``):
  the attention core is recomputed and drops what it saved (the scores of non-flash attention);
  everything else is kept as without recomputation.
* ``op`` (torchtitan's ``selective_ac_option = "op"``, ``_apply_op_sac``): a checkpoint over the
  block whose policy keeps the outputs of ``aten.mm`` except every second one of the block, of
  scaled-dot-product attention (its output and log-sum-exp) and of reduce-scatters; grouped GEMMs
  (routed experts), the router's GEMM (``per_op_sac_force_recompute_mm_shapes_by_fqns``, by default
  ``moe.router.gate``: recomputed and not counted), norms, activations and all-gathers are
  recomputed. A node that fuses several GEMMs (``dims["gemms"]``,
  Q/K/V or SwiGLU's gate and up) counts as that many calls; a linear layer with a bias runs
  ``aten.addmm``, which the list does not hold (recomputed, not counted). An fp8 linear (torchao's
  ``Float8Linear``) calls ``aten.mm`` on float8 tensors, which the policy sees, counts and keeps
  (its bf16 output) before the tensor subclass runs ``_scaled_mm``: fp8 keeps what bf16 keeps.
* ``gemms`` (this project's runtime, :mod:`runtime.checkpointing`): the same checkpoint keeping the
  output of every weight GEMM and collective; attention, norms and activations are recomputed.

Under ``op`` and ``gemms`` the unit keeps its input (the checkpoint's) and those outputs, nothing
else, and its backward re-creates its whole saved set for the time it runs (as under ``full``).
"""

from __future__ import annotations

from dataclasses import dataclass

from profiler.graph import LayerNode

#: policies that checkpoint the whole unit and keep chosen operator outputs
OP_POLICIES = ("op", "gemms")


@dataclass(frozen=True)
class Kept:
    """One operator under a policy: the share of its forward recomputed, and the bytes per sample
    of its outputs kept (2-byte activations, as the graph counts them)."""

    recompute: float
    out_bytes: float


def gemm_widths(n: LayerNode) -> list[int]:
    """The output widths of the GEMMs a linear node runs, in call order: ``dims["gemms"]`` of them,
    the first ``dims["first"]`` wide when given (Q before K and V), the others sharing the rest."""
    calls, out = int(n.dims.get("gemms", 1)), int(n.dims.get("out", 0))
    first = int(n.dims.get("first", out // calls))
    rest = [(out - first) // (calls - 1)] * (calls - 1) if calls > 1 else []
    return [first, *rest]


def expert_outputs(n: LayerNode) -> float:
    """Bytes per sample of the routed experts' GEMM outputs: every routed copy's up (and gate)
    projection and its down projection."""
    f, h, k, mats = (int(n.dims.get(x, d)) for x, d in (("out", 0), ("in", 0), ("top_k", 1), ("matrices", 2)))
    per_token = n.out_bytes / max(h, 1)  # the graph's bytes of one hidden vector, times tokens
    return per_token * k * ((mats - 1) * f + h)


def has_bias(n: LayerNode) -> bool:
    """Whether a linear node's parameters hold a bias (``out`` more than its weight's; a QK-norm's
    two head-wide weights do not divide by ``out``)."""
    out = int(n.dims.get("out", 0))
    extra = n.params - int(n.dims.get("in", 0)) * out
    return out > 0 and extra > 0 and extra % out == 0


def lse_bytes(n: LayerNode) -> float:
    """Bytes per sample of the fp32 log-sum-exp a flash attention node returns beside its output
    (one per head and query)."""
    return 4.0 * n.dims.get("heads", 0) * n.dims.get("seq", 0)


def selective(nodes: list[LayerNode], policy: str) -> list[Kept]:
    """Every operator of a unit under ``policy`` (see the module's docstring)."""
    if policy == "attention":
        return [Kept(1.0 if n.kind == "attention" else 0.0, 0.0) for n in nodes]
    if policy not in OP_POLICIES:
        raise ValueError(f"selective policy '{policy}' is not one of attention, {', '.join(OP_POLICIES)}")
    out: list[Kept] = []
    count = 0  # mm calls so far in the unit (op)
    for n in nodes:
        if n.kind in ("linear", "router") and policy == "gemms":
            out.append(Kept(0.0, n.out_bytes))
        elif n.kind == "linear" and not has_bias(n):
            widths = gemm_widths(n)
            per_col = n.out_bytes / max(sum(widths), 1)
            saved = 0
            for wd in widths:
                count += 1
                saved += wd if count % 2 else 0
            out.append(Kept(1.0 - saved / sum(widths), per_col * saved))
        elif n.kind == "attention":
            out.append(Kept(0.0, n.out_bytes + lse_bytes(n)) if policy == "op" else Kept(1.0, 0.0))
        elif n.kind == "experts" and policy == "gemms":
            out.append(Kept(0.0, expert_outputs(n)))
        else:  # norms, activations, dropout, the loss; under op biased linears, the router, the experts
            out.append(Kept(1.0, 0.0))
    return out


__all__ = ["OP_POLICIES", "Kept", "expert_outputs", "gemm_widths", "has_bias", "lse_bytes", "selective"]
