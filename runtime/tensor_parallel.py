"""Tensor and sequence parallelism (Megatron style) through DTensor ``parallelize_module``.

Plans exist for the reference model, Hugging Face ``LlamaForCausalLM`` and ``GPT2LMHeadModel``:

* token embedding: ``RowwiseParallel`` (vocabulary-parallel table), output replicated;
* Q/K/V and MLP up (gate/up): ``ColwiseParallel``; attention out and MLP down: ``RowwiseParallel``;
* LM head: ``ColwiseParallel`` keeping the logits vocabulary-sharded (a DTensor, ``Shard(-1)``),
  as torchtitan's loss parallelism and Megatron's vocab-parallel cross-entropy do: the loss and its
  backward run under ``loss_parallel`` (:func:`loss_context`), so no rank holds the full logits
  (tied heads reuse the vocabulary-parallel embedding weight: only their layouts are prepared);
* with ``sequence_parallel``: norms become ``SequenceParallel`` (activations sharded on the
  sequence dim), attention/MLP inputs are all-gathered by ``PrepareModuleInput`` and the
  row-parallel outputs are reduce-scattered (``output_layouts=Shard(1)``).

OSDP-split operators (:mod:`runtime.splitting`) take their style slice by slice (a split head gathers
its input once and returns vocabulary-sharded logits), and torchao's float8 Linear layers take its
float8 Colwise/Rowwise styles (:func:`runtime.fp8.tp_style`).

GPT-2's ``Conv1D`` layers are converted to ``nn.Linear`` first (same function, transposed weight),
and its fused ``c_attn`` output is permuted so that each rank's column shard holds its own heads'
``[q, k, v]``; ``attn.split_size`` becomes the local width. Any module of an unexpected type at a
place the plan shards raises a :class:`~vocab.errors.ShardplanError` naming it.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from runtime import fp8
from runtime.adapters import ModelAdapter
from runtime.splitting import SplitEmbedding, SplitLinear, SplitTiedHead
from vocab.errors import ShardplanError

NORM_TYPES = ("LayerNorm", "RMSNorm", "LlamaRMSNorm")


def _expect(root: nn.Module, path: str, style: ParallelStyle) -> None:
    try:
        mod = root.get_submodule(path)
    except AttributeError:
        raise ShardplanError(f"tensor parallel plan: the model has no module '{path}'") from None
    kind = type(mod).__name__
    if isinstance(style, ColwiseParallel | RowwiseParallel) and not isinstance(mod, nn.Linear | nn.Embedding):
        raise ShardplanError(
            f"tensor parallel plan: '{path}' is a {type(mod).__module__}.{kind}; "
            f"{type(style).__name__} needs nn.Linear or nn.Embedding"
        )
    if isinstance(style, SequenceParallel) and kind not in NORM_TYPES:
        raise ShardplanError(f"tensor parallel plan: '{path}' is a {type(mod).__module__}.{kind}, "
                             f"not a norm ({', '.join(NORM_TYPES)}) that SequenceParallel supports")


def _block_styles(p: str, names: dict[str, Any], sp: bool, kwarg_attn: bool) -> dict[str, ParallelStyle]:
    """Styles of one block; ``names`` maps roles to sub-paths of the block ``p``."""
    out_layout = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        attn_gather = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True) if kwarg_attn else gather
        plan[f"{p}.{names['attn_norm']}"] = SequenceParallel()
        plan[f"{p}.{names['attn']}"] = attn_gather
        plan[f"{p}.{names['mlp_norm']}"] = SequenceParallel()
        plan[f"{p}.{names['mlp']}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                         use_local_output=True)
    for c in names["colwise"]:
        plan[f"{p}.{c}"] = ColwiseParallel()
    for r in names["rowwise"]:
        plan[f"{p}.{r}"] = RowwiseParallel(output_layouts=out_layout)
    return plan


def _head_styles(head: str, tied: bool, sp: bool) -> dict[str, ParallelStyle]:
    """An untied head is column (vocabulary) parallel; a tied one is prepared after re-tying."""
    if tied:
        return {}
    return {head: ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                  use_local_output=False)}


def _prepare_tied_head(root: nn.Module, head: str, emb: str, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Re-tie the head to the distributed embedding weight (slice by slice when split); set its
    input/output layouts."""
    hm, em = root.get_submodule(head), root.get_submodule(emb)
    if isinstance(hm, SplitTiedHead):
        for part, table in zip(hm.parts, em.slices, strict=True):
            part.weight = table.weight
    else:
        hm.weight = em.weight
    in_layout = Shard(1) if sp else Replicate()
    parallelize_module(hm, tp_mesh, PrepareModuleInput(input_layouts=(in_layout,), desired_input_layouts=(Replicate(),),
                                                       use_local_output=False))
    parallelize_module(hm, tp_mesh, PrepareModuleOutput(output_layouts=(Shard(-1),), desired_output_layouts=(Shard(-1),),
                                                        use_local_output=False))


def _split_head_styles(root: nn.Module, head: str, sp: bool) -> dict[str, ParallelStyle]:
    """An OSDP-split head (its own weights): its input gathered once, each slice (or part of a
    tied copy) column parallel, the logits a vocabulary-sharded DTensor."""
    hm = root.get_submodule(head)
    gather = PrepareModuleInput(input_layouts=(Shard(1) if sp else Replicate(),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    if isinstance(hm, SplitTiedHead):  # a later pipeline stage's copy: DTensor logits summed over the parts
        plan: dict[str, ParallelStyle] = {head: gather}
        for j in range(len(hm.parts)):
            plan[f"{head}.parts.{j}"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return plan
    plan = {f"{head}.slices.{j}": ColwiseParallel() for j in range(len(hm.slices))}
    plan[head] = gather  # applied after the slices: one style per call (see _apply)
    return {**plan, f"{head}#out": PrepareModuleOutput(output_layouts=(Shard(-1),), desired_output_layouts=(Shard(-1),),
                                                        use_local_output=False)}


def _expand_splits(root: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan with each Colwise/Rowwise style on an OSDP-split operator applied to its slices
    (sliced so that each tp rank's slices hold its unsplit shard: :mod:`runtime.splitting`)."""
    out: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        mod = root.get_submodule(path.split("#")[0])
        if isinstance(mod, SplitLinear | SplitEmbedding) and isinstance(style, ColwiseParallel | RowwiseParallel):
            out.update({f"{path}.slices.{j}": style for j in range(len(mod.slices))})
        else:
            out[path] = style
    return out


def _apply(root: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    plan = _expand_splits(root, plan)
    for path, style in plan.items():
        if "#" not in path:
            _expect(root, path, style)
    for path, style in plan.items():  # one at a time: several styles may hit one module
        mod = root.get_submodule(path.split("#")[0])
        parallelize_module(mod, tp_mesh, fp8.tp_style(style, mod))


# ---- the reference model -------------------------------------------------------------------

def parallelize_reference(stage: nn.Module, tp_mesh: DeviceMesh, sp: bool, tied_model: bool = False) -> None:
    """TP(+SP) on a reference ``Transformer`` (or a pipeline stage of one); OSDP-split operators
    are parallelized slice by slice."""
    plan: dict[str, ParallelStyle] = {}
    tied = tied_model and stage.head is not None and stage.embed is not None
    if stage.embed is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            plan["embed"] = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    names = {"attn_norm": "attn_norm", "attn": "attn", "mlp_norm": "mlp_norm", "mlp": "mlp",
             "colwise": ("attn.qkv", "mlp.up"), "rowwise": ("attn.out", "mlp.down")}
    for i in stage.layers:
        plan.update(_block_styles(f"layers.{i}", names, sp, kwarg_attn=False))
    if stage.final_norm is not None and sp:
        plan["final_norm"] = SequenceParallel()
    if stage.head is not None:
        split = isinstance(stage.head, SplitLinear | SplitTiedHead) and not tied
        plan.update(_split_head_styles(stage, "head", sp) if split else _head_styles("head", tied, sp))
    _apply(stage, tp_mesh, plan)
    if tied:
        _prepare_tied_head(stage, "head", "embed.tok", tp_mesh, sp)


# ---- Hugging Face --------------------------------------------------------------------------

def parallelize_hf_llama(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    names = {"attn_norm": "input_layernorm", "attn": "self_attn", "mlp_norm": "post_attention_layernorm",
             "mlp": "mlp", "colwise": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                       "mlp.gate_proj", "mlp.up_proj"),
             "rowwise": ("self_attn.o_proj", "mlp.down_proj")}
    n = model.config.num_hidden_layers
    for i in range(n):
        plan.update(_block_styles(f"model.layers.{i}", names, sp, kwarg_attn=True))
    if sp:
        plan["model.norm"] = SequenceParallel()
    plan.update(_head_styles("lm_head", tied, sp))
    _apply(model, tp_mesh, plan)
    if sp:  # the model computes masks and RoPE on the full sequence, then the first block shards it
        _shard_sequence_before(model.model.layers[0], tp_mesh)
    if tied:
        _prepare_tied_head(model, "lm_head", "model.embed_tokens", tp_mesh, sp)


def _shard_sequence_before(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Turn the replicated hidden state entering ``block`` (first positional arg) into its sequence shard."""

    def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = DTensor.from_local(args[0], tp_mesh, (Replicate(),), run_check=False)
        return (x.redistribute(tp_mesh, (Shard(1),)).to_local(), *args[1:])

    block.register_forward_pre_hook(hook)


def _conv1d_to_linear(parent: nn.Module, name: str, perm: torch.Tensor | None = None) -> None:
    conv = getattr(parent, name)
    if type(conv).__name__ != "Conv1D":
        raise ShardplanError(f"tensor parallel plan for GPT-2: '{name}' is a {type(conv).__name__}, expected Conv1D")
    nx, nf = conv.weight.shape
    lin = nn.Linear(nx, nf, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        w, b = conv.weight.t(), conv.bias
        if perm is not None:
            w, b = w[perm], b[perm]
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    setattr(parent, name, lin)


def _qkv_permutation(h: int, tp: int) -> torch.Tensor:
    """Rows of the fused [q; k; v] output reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] per rank."""
    w = h // tp
    idx = [torch.arange(part * h + r * w, part * h + (r + 1) * w) for r in range(tp) for part in range(3)]
    return torch.cat(idx)


def parallelize_hf_gpt2(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    tp = tp_mesh.size()
    c = model.config
    if getattr(c, "add_cross_attention", False):
        raise ShardplanError("tensor parallel plan for GPT-2: cross-attention blocks are not supported")
    for blk in model.transformer.h:
        _conv1d_to_linear(blk.attn, "c_attn", _qkv_permutation(c.n_embd, tp))
        _conv1d_to_linear(blk.attn, "c_proj")
        _conv1d_to_linear(blk.mlp, "c_fc")
        _conv1d_to_linear(blk.mlp, "c_proj")
        blk.attn.split_size = c.n_embd // tp
    tied = model.lm_head.weight is model.transformer.wte.weight
    plan: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    names = {"attn_norm": "ln_1", "attn": "attn", "mlp_norm": "ln_2", "mlp": "mlp",
             "colwise": ("attn.c_attn", "mlp.c_fc"), "rowwise": ("attn.c_proj", "mlp.c_proj")}
    for i in range(c.n_layer):
        plan.update(_block_styles(f"transformer.h.{i}", names, sp, kwarg_attn=False))
    if sp:
        plan["transformer.ln_f"] = SequenceParallel()
    plan.update(_head_styles("lm_head", tied, sp))
    _apply(model, tp_mesh, plan)
    if sp:
        _shard_sequence_before(model.transformer.h[0], tp_mesh)
    if tied:
        _prepare_tied_head(model, "lm_head", "transformer.wte", tp_mesh, sp)


def _grad_to_param_layout(p: torch.Tensor) -> None:
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def keep_grad_layouts(stage: nn.Module) -> None:
    """Give each TP parameter's gradient the parameter's placements once accumulated.

    DTensor's embedding backward returns a *replicated* gradient for a vocabulary-sharded
    table; left so, every rank would hold (and step) the whole gradient.
    """
    for p in stage.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_to_param_layout)


def parallelize(ad: ModelAdapter, stage: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Apply TP (and SP when ``sp``) to ``stage`` (the model, or its pipeline stage)."""
    if ad.kind == "reference":
        parallelize_reference(stage, tp_mesh, sp, ad.tied)
    elif ad.kind == "hf-llama":
        parallelize_hf_llama(stage, tp_mesh, sp)
    elif ad.kind == "hf-gpt2":
        parallelize_hf_gpt2(stage, tp_mesh, sp)
    else:  # pragma: no cover - adapt() rejects other kinds first
        raise ShardplanError(f"no tensor parallel plan for model kind '{ad.kind}'")
    keep_grad_layouts(stage)


def loss_context(tp: int) -> Any:
    """Where the loss and its backward run: ``loss_parallel`` over vocabulary-sharded logits when
    the plan has tensor parallelism (the cross-entropy reduces across the TP ranks), else nothing."""
    if tp <= 1:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as an ordinary tensor (a DTensor loss is replicated: its full value)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
