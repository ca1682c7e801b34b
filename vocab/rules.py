"""Whether a strategy suits a model and a workload: one list of rules (:data:`RULES`), one message each.

Every validator judges a strategy with this list: the cost model's
(``costmodel.estimate.check``), the runtime's (``runtime.validate``, ``runtime.apply.check_plan``)
and the search spaces', whose generators yield only degrees the rules' predicates accept
(``solvers.space``). A validator says what it knows (:class:`Subject`: the model's shape, the
workload, the ranks that run it) and what it adds to the plain rules: ``strict_tp`` (Megatron
tensor parallelism divides the KV heads and the FFN width: no KV-head replication), ``tp_experts``
(tensor parallelism beside mixture-of-experts blocks), ``pipelining`` (at least ``pp``
micro-batches, which ``torch.distributed.pipelining`` needs) and ``sp_tokens`` (sequence
parallelism splits each context-parallel rank's tokens evenly over ``tp``, as the runtime cuts them;
the cost model prices fractions of tokens, and the search spaces offer them) and ``bare_end_stages``
(the first and last virtual stage may hold only the embedding or the loss, as Megatron's pipeline
layout lets them: the cost model prices such stages; the runtime builds none) and ``folding``
(expert-tensor parallelism other than ``tp``, MoE parallel folding: the cost model prices it; the
runtime splits experts over ``tp`` only). A fact it does not know (a size of
0, blocks, a workload or ranks of None) breaks no rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from vocab.errors import ShardplanError
from vocab.strategy import Strategy, expert_ranks_problem, sequence_chunks

#: the names of whole units (a strategy entry naming anything else names an operator path)
UNIT_NAME = r"\*|embedding|head|layers\.\d+"


@dataclass(frozen=True)
class ModelShape:
    """What the rules read of a model: a size of 0 is none or not known (``experts``: a dense
    model), ``blocks`` None not known."""

    name: str = "the model"
    heads: int = 0
    kv_heads: int = 0
    ffn_hidden: int = 0
    experts: int = 0
    blocks: int | None = None
    has_unit: Callable[[str], bool] | None = field(default=None, compare=False)  # None: the units are not known
    units_hint: str = ""  # what units the model has, for a message


@dataclass(frozen=True)
class Subject:
    """What the rules judge: a strategy for a model, with what the validator knows of the workload
    and of the ranks that run it, and the rules it adds (module docstring)."""

    strategy: Strategy
    model: ModelShape = ModelShape()
    seq_len: int | None = None
    global_batch: int | None = None
    world: int | None = None  # ranks that run it
    world_is: str = "the cluster's {} GPUs"  # those ranks in a message
    strict_tp: bool = False
    tp_experts: bool = True
    pipelining: bool = False
    sp_tokens: bool = False
    bare_end_stages: bool = False  # the first and last virtual stage may hold the embedding or the loss alone
    folding: bool = True  # expert-tensor parallelism other than tp (MoE parallel folding) runs


# ---- predicates: what the rules and the search spaces' generators test ---------------------------
def divides(d: int, n: int) -> bool:
    """Whether ``d`` divides ``n`` (always where ``n`` is 0: none, or not known)."""
    return n % d == 0


def kv_heads_fit(tp: int, kv_heads: int, strict: bool = False) -> bool:
    """Whether ``tp`` ranks can split ``kv_heads`` KV heads: one divides the other (replicated KV
    heads where ``tp`` exceeds them), or with ``strict`` ``tp`` divides them."""
    return divides(tp, kv_heads) or (not strict and tp % kv_heads == 0)


def ulysses_problem(tp: int, cp: int, heads: int, kv_heads: int = 0) -> str | None:
    """Why Ulysses cannot split the query heads or the KV heads of a tensor-parallel rank over ``cp``
    ranks (a KV head that ``tp`` replicates counts once per rank), or None. Transformer Engine's
    all-to-all context parallelism (``cp_comm_type="a2a"``) asserts both divisible by the CP size;
    DeepSpeed's Ulysses scatters the head dimension of Q, K and V alike. Splitting fewer KV heads would
    replicate them across the CP group, which nothing here prices. Where ``tp`` does not divide the
    heads, rule ``tp_heads`` refuses the strategy; ``kv_heads`` 0: not known."""
    if not divides(tp, heads):
        return None
    if not divides(cp, heads // tp):
        return f"Ulysses splits the {heads // tp} heads of a tp rank over cp={cp}: not divisible"
    kv_rank = (kv_heads // tp if divides(tp, kv_heads) else 1) if kv_heads else 0
    if kv_rank == 0 or divides(cp, kv_rank):
        return None
    return (f"Ulysses splits the {kv_rank} KV head{'s' if kv_rank != 1 else ''} of a tp rank over cp={cp}: "
            "not divisible (KV heads replicated across context-parallel ranks are not run)")


def ulysses_fits(tp: int, cp: int, heads: int, kv_heads: int = 0) -> bool:
    """Whether Ulysses can split a tensor-parallel rank's heads over ``cp`` ranks (:func:`ulysses_problem`)."""
    return ulysses_problem(tp, cp, heads, kv_heads) is None


def stages_fit(stages: int, blocks: int, bare_ends: int = 0) -> bool:
    """Whether a model of ``blocks`` transformer blocks has a block for each of ``stages`` virtual stages,
    but ``bare_ends`` (0 to 2) end stages that may hold only the embedding or the loss."""
    return stages <= max(blocks, 1) + bare_ends


def pipeline_fed(pp: int, n_mb: int) -> bool:
    """Whether a pipeline of ``pp`` ranks gets a micro-batch per rank (``torch.distributed.pipelining``
    refuses fewer)."""
    return pp == 1 or n_mb >= pp


# ---- the rules ----------------------------------------------------------------------------------
def _world(x: Subject) -> str | None:
    m = x.strategy.mesh
    if x.world is None or m.world_size == x.world:
        return None
    return (f"world size: mesh pp*dp_replicate*dp_shard*cp*tp = {m.pp}*{m.dp_replicate}*{m.dp_shard}*{m.cp}*{m.tp} "
            f"= {m.world_size} ranks does not match {x.world_is.format(x.world)}")


def _tp_heads(x: Subject) -> str | None:
    tp, heads = x.strategy.mesh.tp, x.model.heads
    return None if divides(tp, heads) else f"tp={tp} does not divide the {heads} attention heads"


def _strict(x: Subject) -> bool:
    """Whether Megatron tensor parallelism splits the KV heads and the FFN width (TSP splits neither)."""
    return x.strict_tp and x.strategy.tp_mode != "tsp"


def _tp_kv_heads(x: Subject) -> str | None:
    tp, kv = x.strategy.mesh.tp, x.model.kv_heads
    if kv_heads_fit(tp, kv, _strict(x)):
        return None
    if _strict(x):
        return f"tp={tp} does not divide the {kv} KV heads"
    return f"tp={tp} and the {kv} KV heads: one must divide the other"


def _tp_ffn(x: Subject) -> str | None:
    tp, ffn = x.strategy.mesh.tp, x.model.ffn_hidden
    return None if not _strict(x) or divides(tp, ffn) else f"tp={tp} does not divide the FFN width {ffn}"


def _tp_experts(x: Subject) -> str | None:
    tp = x.strategy.mesh.tp
    if x.tp_experts or tp == 1 or not x.model.experts:
        return None
    return f"tp={tp} with mixture-of-experts blocks: the runtime does not split experts over tensor-parallel ranks"


def _ep_model(x: Subject) -> str | None:
    ep = x.strategy.mesh.ep
    if ep == 1 or x.model.experts:
        return None
    return f"expert parallelism (ep={ep}) needs a mixture-of-experts model; {x.model.name} has no experts"


def _ep_experts(x: Subject) -> str | None:
    ep, experts = x.strategy.mesh.ep, x.model.experts
    return None if divides(ep, experts) else f"ep={ep} does not divide the {experts} experts"


def _ep_ranks(x: Subject) -> str | None:
    return expert_ranks_problem(x.strategy.mesh)


def _etp(x: Subject) -> str | None:
    s = x.strategy
    m = s.mesh
    if not m.etp or m.etp == m.tp and x.model.experts:
        return None
    if not x.model.experts:
        return f"expert-tensor parallelism (etp={m.etp}) needs a mixture-of-experts model; {x.model.name} has no experts"
    if not x.folding:
        return f"etp={m.etp} beside tp={m.tp} (MoE parallel folding): the runtime splits experts over tp only"
    if m.tp > 1 and (s.tp_mode == "tsp" or not s.sequence_parallel):
        return (f"etp={m.etp} beside tp={m.tp} needs Megatron tensor parallelism with sequence parallelism: each "
                "tensor-parallel rank dispatches its own tokens to the experts")
    return None


def _stages(x: Subject) -> str | None:
    s, blocks = x.strategy, x.model.blocks
    if blocks is None or stages_fit(s.num_stages, blocks, 2 if x.bare_end_stages else 0):
        return None
    return f"pp*vpp = {s.mesh.pp}*{s.vpp} = {s.num_stages} stages for only {blocks} layers"


def _stage_layers(x: Subject) -> str | None:
    s, blocks = x.strategy, x.model.blocks
    if blocks is None or s.stage_layers is None or sum(s.stage_layers) == blocks:
        return None
    return f"stage_layers {s.stage_layers} sum to {sum(s.stage_layers)}, the model has {blocks} layers"


def _cp_sequence(x: Subject) -> str | None:
    cp, seq = x.strategy.mesh.cp, x.seq_len
    n = sequence_chunks(cp)
    if seq is None or divides(n, seq):
        return None
    return (f"context parallelism cuts each sequence into 2*cp = {n} chunks (head-tail load balancing): "
            f"seq_len {seq} is not divisible by it")


def _tsp_sequence(x: Subject) -> str | None:
    s, seq = x.strategy, x.seq_len
    if seq is None or s.tp_mode != "tsp" or s.mesh.tp == 1 or divides(s.sequence_chunks, seq):
        return None
    return (f"TSP cuts each sequence into 2*cp*tp = {s.sequence_chunks} chunks (head-tail load balancing): "
            f"seq_len {seq} is not divisible by it")


def _sp_sequence(x: Subject) -> str | None:
    s, seq = x.strategy, x.seq_len
    m = s.mesh
    if seq is None or not x.sp_tokens or not s.sequence_parallel or divides(m.tp * m.cp, seq):
        return None
    return f"sequence parallelism splits each rank's {seq // m.cp} tokens over tp={m.tp}: not divisible"


def _tsp_alone(x: Subject) -> str | None:
    s = x.strategy
    if s.tp_mode == "tsp" and s.sequence_parallel:
        return "tp_mode 'tsp' already shards the sequence; drop sequence_parallel"
    return None


def _ulysses(x: Subject) -> str | None:
    s, m = x.strategy, x.strategy.mesh
    if s.cp_mode != "ulysses" or m.cp == 1:
        return None
    return ulysses_problem(m.tp, m.cp, x.model.heads, x.model.kv_heads)


def batch_problem(global_batch: int | None, dp: int, micro_batch: int) -> str | None:
    """Why a global batch cannot be cut into ``dp`` data-parallel shares of whole micro-batches
    (None: it can, or no batch is given)."""
    if global_batch is None or divides(dp * micro_batch, global_batch):
        return None
    return (f"global batch {global_batch} is not divisible by dp*micro_batch = {dp}*{micro_batch} = "
            f"{dp * micro_batch}")


def _batch(x: Subject) -> str | None:
    return batch_problem(x.global_batch, x.strategy.mesh.dp, x.strategy.micro_batch)


def _interleaved(x: Subject) -> str | None:
    s, gb = x.strategy, x.global_batch
    if gb is None or s.schedule != "interleaved" or divides(s.mesh.pp, n := s.num_microbatches(gb)):
        return None
    return f"interleaved schedule: {n} micro-batch{'es' if n != 1 else ''} must be a multiple of pp={s.mesh.pp}"


def _pipeline_fed(x: Subject) -> str | None:
    s, gb = x.strategy, x.global_batch
    m = s.mesh
    if gb is None or not x.pipelining or pipeline_fed(m.pp, n := s.num_microbatches(gb)):
        return None
    return (f"a pipeline of {m.pp} stages needs at least {m.pp} micro-batches per step "
            f"(torch.distributed.pipelining refuses fewer): global batch {gb} / data-parallel "
            f"{m.dp} / micro-batch {s.micro_batch} gives {n}")


def _zb_selective(x: Subject) -> str | None:
    s = x.strategy
    if not x.pipelining or s.schedule != "zb" or s.mesh.pp == 1:
        return None
    if all(ls.recompute != "selective" for ls in [s.default, *s.layers]):
        return None
    return ("the zero-bubble schedule (zb) with selective recomputation: torch.distributed.pipelining's split "
            "backward (input, then weight gradients) recomputes a selectively checkpointed region with inputs "
            "that no longer match its saved outputs; use full recomputation or another schedule")


def _units(x: Subject) -> str | None:
    has = x.model.has_unit
    unknown = [ls.unit for ls in x.strategy.layers if has is not None and not has(ls.unit)]
    if not unknown:
        return None
    hint = f" ({x.model.units_hint})" if x.model.units_hint else ""
    return f"layer strategies name units the model does not have: {unknown[:5]}{hint}"


def _activation_offload(x: Subject) -> str | None:
    s = x.strategy
    if s.mesh.pp > 1 and any(ls.offload == "activations" for ls in [s.default, *s.layers]):
        return ("offload 'activations' is priced without pipeline parallelism only (pp=1): the host would hold "
                "every micro-batch in flight")
    ops = [ls.unit for ls in s.layers if ls.offload == "activations" and not re.fullmatch(UNIT_NAME, ls.unit)]
    if not ops:
        return None
    return (f"offload 'activations' moves a unit's saved activations, not an operator's: {ops[:3]} name operators; "
            "give it to the unit ('layers.<i>', 'embedding', 'head' or '*')")


@dataclass(frozen=True)
class Rule:
    """One rule: its name and what it says of a subject that breaks it (None: kept)."""

    name: str
    broken: Callable[[Subject], str | None]


#: every rule, in the order a validator that stops at the first reports them
RULES: tuple[Rule, ...] = (
    Rule("world_size", _world),
    Rule("tp_heads", _tp_heads),
    Rule("tp_kv_heads", _tp_kv_heads),
    Rule("tp_ffn", _tp_ffn),
    Rule("tp_experts", _tp_experts),
    Rule("ep_model", _ep_model),
    Rule("ep_experts", _ep_experts),
    Rule("ep_ranks", _ep_ranks),
    Rule("etp", _etp),
    Rule("stages", _stages),
    Rule("stage_layers", _stage_layers),
    Rule("cp_sequence", _cp_sequence),
    Rule("ulysses_heads", _ulysses),
    Rule("tsp_sequence", _tsp_sequence),
    Rule("tsp_alone", _tsp_alone),
    Rule("sp_sequence", _sp_sequence),
    Rule("batch", _batch),
    Rule("interleaved_microbatches", _interleaved),
    Rule("pipeline_microbatches", _pipeline_fed),
    Rule("zb_selective", _zb_selective),
    Rule("units", _units),
    Rule("activation_offload", _activation_offload),
)


def problems(x: Subject) -> list[str]:
    """The message of every rule ``x`` breaks, in :data:`RULES` order."""
    return [msg for rule in RULES if (msg := rule.broken(x)) is not None]


def require(x: Subject) -> None:
    """Raise :class:`ShardplanError` with the message of the first rule ``x`` breaks."""
    for rule in RULES:
        if (msg := rule.broken(x)) is not None:
            raise ShardplanError(msg)
