"""What the runtime needs to know about a model: where the plan's units and operators live.

A plan names units (``embedding``, ``layers.<i>``, ``head``) and operators with the layer graph's
names (``layers.3.mlp.up``). An adapter maps those names onto module paths of a concrete model:

========================  ==========================  ==================================
graph name                reference ``Transformer``   HF Llama / HF GPT-2
========================  ==========================  ==================================
``embed``                 ``embed``                   ``model.embed_tokens`` / ``transformer.wte`` + ``wpe``
``layers.<i>``            ``layers.<i>``              ``model.layers.<i>`` / ``transformer.h.<i>``
``layers.<i>.attn_norm``  same                        ``input_layernorm`` / ``ln_1``
``layers.<i>.attn.qkv``   same                        ``self_attn.{q,k,v}_proj`` / ``attn.c_attn``
``layers.<i>.attn.core``  same (weightless module)    the whole attention module (``self_attn`` / ``attn``)
``layers.<i>.attn.out``   same                        ``self_attn.o_proj`` / ``attn.c_proj``
``layers.<i>.mlp_norm``   same                        ``post_attention_layernorm`` / ``ln_2``
``layers.<i>.mlp.up``     same                        ``mlp.{gate,up}_proj`` / ``mlp.c_fc``
``layers.<i>.mlp.act``    same                        ``mlp.act_fn`` / ``mlp.act``
``layers.<i>.mlp.down``   same                        ``mlp.down_proj`` / ``mlp.c_proj``
``final_norm``            same                        ``model.norm`` / ``transformer.ln_f``
``head``                  same                        ``lm_head``
``loss``                  none (computed outside)     none
========================  ==========================  ==================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from vocab.errors import ShardplanError

#: Units of a plan that are not blocks, and the graph operators each one holds.
UNIT_OPS = {"embedding": ("embed",), "head": ("final_norm", "head")}
#: Operators inside a block (graph names relative to ``layers.<i>``).
BLOCK_OPS = ("attn_norm", "attn.qkv", "attn.core", "attn.out", "mlp_norm", "mlp.up", "mlp.act", "mlp.down")
#: Operators of a mixture-of-experts block in the reference model, in place of the ``mlp`` ones.
MOE_OPS = ("moe.router", "moe.experts", "moe.shared.up", "moe.shared.down")


@dataclass
class ModelAdapter:
    """A model seen through the layer graph's names.

    Attributes:
        kind: ``reference``, ``hf-llama`` or ``hf-gpt2``.
        model: the module.
        num_layers / heads / kv_heads / hidden / ffn_hidden / vocab: shape facts validation needs.
        experts: routed experts per MoE block (0: a dense model).
        tied: whether the LM head shares the token embedding's weight.
        paths: graph operator name -> module paths (relative to ``model``) implementing it.
        block_prefix: module path of block 0 without the index (``layers.``, ``model.layers.``).
    """

    kind: str
    model: nn.Module
    num_layers: int
    heads: int
    kv_heads: int
    hidden: int
    ffn_hidden: int
    vocab: int
    tied: bool
    block_prefix: str
    top: dict[str, tuple[str, ...]]
    in_block: dict[str, tuple[str, ...]]
    forward_logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = field(repr=False, default=None)  # type: ignore[assignment]
    experts: int = 0

    # ---- names ---------------------------------------------------------------------------
    def block_path(self, i: int) -> str:
        return f"{self.block_prefix}{i}"

    def op_paths(self, name: str) -> tuple[str, ...]:
        """Module paths of graph operator ``name``; raises KeyError when the model has none."""
        if name in self.top:
            return self.top[name]
        if name.startswith("layers."):
            parts = name.split(".", 2)
            if len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) < self.num_layers:
                i = int(parts[1])
                if len(parts) == 2:
                    return (self.block_path(i),)
                if parts[2] in self.in_block:
                    return tuple(f"{self.block_path(i)}.{p}" for p in self.in_block[parts[2]])
        raise KeyError(name)

    def unit_ops(self, unit: str) -> tuple[str, ...]:
        """Graph operators of a unit (``embedding``, ``layers.<i>``, ``head``)."""
        if unit in UNIT_OPS:
            return UNIT_OPS[unit]
        return (unit,)

    def unit_paths(self, unit: str) -> list[str]:
        """Module paths that make up a unit or an operator, in forward order."""
        if unit in UNIT_OPS:
            out: list[str] = []
            for op in UNIT_OPS[unit]:
                out += [p for p in self.op_paths(op) if p]
            return out
        return list(self.op_paths(unit))

    def has(self, name: str) -> bool:
        """Whether ``name`` is a unit or operator of this model."""
        try:
            self.unit_paths(name)
        except KeyError:
            return False
        return True

    def units(self) -> list[str]:
        return ["embedding", *(f"layers.{i}" for i in range(self.num_layers)), "head"]

    def get(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None


def _reference(model: nn.Module) -> ModelAdapter:
    cfg = model.cfg
    in_block = {op: (op,) for op in (*BLOCK_OPS, *(MOE_OPS if cfg.is_moe else ()))}
    return ModelAdapter(
        kind="reference", model=model, num_layers=cfg.layers, heads=cfg.heads, kv_heads=cfg.kv_heads,
        hidden=cfg.hidden, ffn_hidden=cfg.ffn_hidden, vocab=cfg.vocab, tied=cfg.tied_embeddings,
        block_prefix="layers.", top={"embed": ("embed",), "final_norm": ("final_norm",), "head": ("head",), "loss": ()},
        in_block=in_block, forward_logits=lambda m, x: m(x), experts=cfg.experts,
    )


def _hf_logits(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x, use_cache=False).logits


def _hf_llama(model: nn.Module) -> ModelAdapter:
    c = model.config
    heads = c.num_attention_heads
    return ModelAdapter(
        kind="hf-llama", model=model, num_layers=c.num_hidden_layers, heads=heads,
        kv_heads=c.num_key_value_heads or heads, hidden=c.hidden_size, ffn_hidden=c.intermediate_size,
        vocab=c.vocab_size, tied=model.lm_head.weight is model.model.embed_tokens.weight,
        block_prefix="model.layers.",
        top={"embed": ("model.embed_tokens",), "final_norm": ("model.norm",), "head": ("lm_head",), "loss": ()},
        in_block={
            "attn_norm": ("input_layernorm",), "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "attn.core": ("self_attn",), "attn.out": ("self_attn.o_proj",), "mlp_norm": ("post_attention_layernorm",),
            "mlp.up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.act": ("mlp.act_fn",), "mlp.down": ("mlp.down_proj",),
        },
        forward_logits=_hf_logits,
    )


def _hf_gpt2(model: nn.Module) -> ModelAdapter:
    c = model.config
    h = c.n_embd
    return ModelAdapter(
        kind="hf-gpt2", model=model, num_layers=c.n_layer, heads=c.n_head, kv_heads=c.n_head, hidden=h,
        ffn_hidden=c.n_inner or 4 * h, vocab=c.vocab_size,
        tied=model.lm_head.weight is model.transformer.wte.weight, block_prefix="transformer.h.",
        top={"embed": ("transformer.wte", "transformer.wpe"), "final_norm": ("transformer.ln_f",), "head": ("lm_head",),
             "loss": ()},
        in_block={
            "attn_norm": ("ln_1",), "attn.qkv": ("attn.c_attn",), "attn.core": ("attn",), "attn.out": ("attn.c_proj",),
            "mlp_norm": ("ln_2",), "mlp.up": ("mlp.c_fc",), "mlp.act": ("mlp.act",), "mlp.down": ("mlp.c_proj",),
        },
        forward_logits=_hf_logits,
    )


#: Model classes the runtime knows, by class name (HF classes are matched by name: no import).
KNOWN_MODELS: dict[str, Callable[[nn.Module], ModelAdapter]] = {
    "Transformer": _reference,
    "LlamaForCausalLM": _hf_llama,
    "GPT2LMHeadModel": _hf_gpt2,
}


def adapt(model: nn.Module) -> ModelAdapter:
    """The adapter of ``model``; an unknown model class is a :class:`ShardplanError` naming it."""
    from runtime.model import Transformer

    if isinstance(model, Transformer):
        return _reference(model)
    name = type(model).__name__
    if name in KNOWN_MODELS and name != "Transformer":
        return KNOWN_MODELS[name](model)
    raise ShardplanError(
        f"the runtime has no plan mapping for model type '{type(model).__module__}.{name}'; "
        f"known: runtime.model.Transformer, transformers LlamaForCausalLM, GPT2LMHeadModel"
    )
