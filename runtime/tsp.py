"""TSP: tensor and sequence parallelism folded onto one axis (``tp_mode = tsp``).

Each of the ``D`` ranks of the ``tp`` axis holds ``1/D`` of every weight and ``1/D`` of the tokens
(head-tail chunks, as context parallelism cuts them: :func:`runtime.context_parallel.shard_sequence`
over the sequence group, ``cp × tp`` ranks). No activation is ever all-reduced: the weights move
instead (Lamy-Poirier et al., 2025, "Folding tensor and sequence parallelism for memory-efficient
transformer training & inference").

* **Weight rings.** Every operator with weights loops over the ``D`` weight shards: the shard it
  computes with is sent on to the next rank while the next one arrives from the previous rank, so a
  rank holds two shards of the operator in flight (its own parameter aside). Each step's exchange
  is one batch of asynchronous point-to-point sends and receives, posted *before* the step's
  compute and waited on just before the next step uses the shard it brings (the paper's overlap).
  The shards travel in the parameters' dtype: bf16 under mixed precision (:mod:`runtime.precision`).
  Projections whose output feeds attention or the MLP activation (Q/K/V, MLP up, the LM head, the
  embeddings) hold *rows*: each step computes one block of output features. The output and
  MLP-down projections hold *columns* (input features): each step multiplies its block of the
  input and accumulates the partial sum locally. Norm weights hold a block of the hidden features
  each.
* **Backward** streams the shards round the ring once more, the other way, and with each shard
  its gradient accumulator, which every rank adds its tokens' contribution to (in fp32) until it
  arrives home: ``D-1`` hops for each, the traffic of an all-gather and a reduce-scatter. A rank
  holds two weight shards and two gradient accumulators in flight. The next shard's exchange is
  posted before a step's compute, the accumulator's once the step has added to it (it overlaps the
  input gradient's compute); the first shard arrives while the input gradient of the rank's own
  shard is computed.
* **Recomputation.** A unit that recomputes (``full``, and ``selective``, whose saved GEMM outputs
  do not spare the norms' and tables' shards) runs its forward rings again inside backward: three
  passes of the weights per micro-batch, as the cost model prices them.
* **Attention** all-gathers K and V along the sequence over the sequence group
  (:class:`runtime.context_parallel.ContextShard`, ``allgather`` rotation): each rank attends
  every head of its tokens.

Each rank's loss is the mean over its tokens, and backward computes the gradient of their sum over
the ``D`` ranks, so a shard's gradient is divided by ``D`` when it arrives home (data and context
parallelism then average it as usual). :class:`RingStats` counts what the rings send (per pass)
and hold, and can trace the order of posts, computes and waits;
``tests/test_runtime_tsp.py`` checks it against the cost model's formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime import origins
from runtime.splitting import SplitEmbedding, SplitLinear, SplitTiedHead

#: P2P tags: weight shards and gradient accumulators travel in one batch to the same peer
_W_TAG, _G_TAG = 1, 2


@dataclass
class RingStats:
    """What the weight rings of one rank sent (bytes: ``sent_w`` weight shards, ``sent_g`` gradient
    accumulators; ``by_pass``: the weight shards' bytes of each pass, ``forward``, ``recompute`` — a
    forward run again inside backward — and ``backward``) and held in flight: the most bytes at once
    (``peak``), and of them the weight shards' and the accumulators' (``peak_w``, ``peak_g``). With
    ``trace`` on, ``events`` lists ``(what, step)`` in order: ``post_w`` / ``post_g`` (an exchange of
    weight shards / of gradient accumulators posted), ``compute`` (a step's compute launched),
    ``wait`` (the step's exchanges waited on)."""

    sent_w: int = 0
    sent_g: int = 0
    live_w: int = 0
    live_g: int = 0
    peak: int = 0
    peak_w: int = 0
    peak_g: int = 0
    by_pass: dict[str, int] = field(default_factory=dict)
    trace: bool = False
    events: list[tuple[str, int]] = field(default_factory=list)

    def hold(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if grad:
            self.live_g += n
        else:
            self.live_w += n
        if self.live_w + self.live_g > self.peak:
            self.peak, self.peak_w, self.peak_g = self.live_w + self.live_g, self.live_w, self.live_g
        return t

    def drop(self, t: torch.Tensor, grad: bool = False) -> None:
        n = t.numel() * t.element_size()
        if grad:
            self.live_g -= n
        else:
            self.live_w -= n

    def note(self, what: str, step: int) -> None:
        if self.trace:
            self.events.append((what, step))

    def reset(self) -> None:
        self.sent_w = self.sent_g = self.peak = self.peak_w = self.peak_g = 0
        self.by_pass = {}
        self.events = []


@dataclass
class TspGroup:
    """This rank's place on the ``tp`` axis and what its rings have done."""

    group: dist.ProcessGroup
    rank: int
    size: int
    stats: RingStats = field(default_factory=RingStats)

    def peer(self, step: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + step) % self.size)


def shard_sizes(n: int, d: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(n), d)``: the first ``n % d`` blocks one longer."""
    return [n // d + (1 if j < n % d else 0) for j in range(d)]


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


# ---- kernels: what one step does with one rank's shard ------------------------------------------

class _Kernel:
    """One operator's use of a weight shard. ``shapes(j)``: the shapes of rank ``j``'s tensors."""

    has_dx = True

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], j: int, y: torch.Tensor) -> None:
        raise NotImplementedError

    def grad_w(self, dy: torch.Tensor, x: torch.Tensor, j: int, gs: list[torch.Tensor]) -> None:
        """Add this rank's contribution to the gradients ``gs`` (fp32) of rank ``j``'s shard."""
        raise NotImplementedError

    def grad_x(self, dy: torch.Tensor, ws: list[torch.Tensor], j: int, dx: torch.Tensor) -> None:
        raise NotImplementedError


class _Rows(_Kernel):
    """A Linear cut by output features: step ``j`` computes output block ``j``."""

    def __init__(self, n_out: int, n_in: int, bias: bool, d: int) -> None:
        self.sizes, self.n_in, self.bias, self.n_out = shard_sizes(n_out, d), n_in, bias, n_out
        self.offs = _offsets(self.sizes)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return [(self.sizes[j], self.n_in)] + ([(self.sizes[j],)] if self.bias else [])

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], self.n_out, dtype=dtype)

    def _cols(self, j: int) -> slice:
        return slice(self.offs[j], self.offs[j] + self.sizes[j])

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], j: int, y: torch.Tensor) -> None:
        y[..., self._cols(j)] = F.linear(x, ws[0], ws[1] if self.bias else None)

    def grad_w(self, dy: torch.Tensor, x: torch.Tensor, j: int, gs: list[torch.Tensor]) -> None:
        g = dy[..., self._cols(j)].reshape(-1, self.sizes[j]).float()
        gs[0].addmm_(g.t(), x.reshape(-1, self.n_in).float())
        if self.bias:
            gs[1] += g.sum(0)

    def grad_x(self, dy: torch.Tensor, ws: list[torch.Tensor], j: int, dx: torch.Tensor) -> None:
        dx += dy[..., self._cols(j)] @ ws[0]


class _Cols(_Kernel):
    """A Linear cut by input features: step ``j`` multiplies input block ``j`` and accumulates;
    the bias is cut by output features and added block by block."""

    def __init__(self, n_out: int, n_in: int, bias: bool, d: int) -> None:
        self.sizes, self.bsizes, self.n_out, self.bias = shard_sizes(n_in, d), shard_sizes(n_out, d), n_out, bias
        self.offs, self.boffs = _offsets(self.sizes), _offsets(self.bsizes)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return [(self.n_out, self.sizes[j])] + ([(self.bsizes[j],)] if self.bias else [])

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.n_out, dtype=dtype)

    def _in(self, j: int) -> slice:
        return slice(self.offs[j], self.offs[j] + self.sizes[j])

    def _bias(self, j: int) -> slice:
        return slice(self.boffs[j], self.boffs[j] + self.bsizes[j])

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], j: int, y: torch.Tensor) -> None:
        y += F.linear(x[..., self._in(j)], ws[0])
        if self.bias:
            y[..., self._bias(j)] += ws[1]

    def grad_w(self, dy: torch.Tensor, x: torch.Tensor, j: int, gs: list[torch.Tensor]) -> None:
        g = dy.reshape(-1, self.n_out).float()
        gs[0].addmm_(g.t(), x[..., self._in(j)].reshape(-1, self.sizes[j]).float())
        if self.bias:
            gs[1] += g[:, self._bias(j)].sum(0)

    def grad_x(self, dy: torch.Tensor, ws: list[torch.Tensor], j: int, dx: torch.Tensor) -> None:
        dx[..., self._in(j)] += dy @ ws[0]


class _Table(_Kernel):
    """An embedding table cut by rows (vocabulary or positions): step ``j`` looks up the indices
    that fall in rank ``j``'s rows."""

    has_dx = False

    def __init__(self, n: int, dim: int, d: int) -> None:
        self.sizes, self.dim = shard_sizes(n, d), dim
        self.offs = _offsets(self.sizes)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return [(self.sizes[j], self.dim)]

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(*x.shape, self.dim, dtype=dtype, device=x.device)

    def _hits(self, x: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = self.offs[j]
        hit = (x >= lo) & (x < lo + self.sizes[j])
        return hit, x[hit] - lo

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], j: int, y: torch.Tensor) -> None:
        hit, idx = self._hits(x, j)
        y[hit] = ws[0][idx]

    def grad_w(self, dy: torch.Tensor, x: torch.Tensor, j: int, gs: list[torch.Tensor]) -> None:
        hit, idx = self._hits(x, j)
        gs[0].index_add_(0, idx, dy[hit].float())


class _Scale(_Kernel):
    """A norm's affine part cut by hidden features: step ``j`` scales (and shifts) feature block ``j``."""

    def __init__(self, n: int, bias: bool, d: int) -> None:
        self.sizes, self.bias, self.n = shard_sizes(n, d), bias, n
        self.offs = _offsets(self.sizes)

    def shapes(self, j: int) -> list[tuple[int, ...]]:
        return [(self.sizes[j],)] * (2 if self.bias else 1)

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_like(x, dtype=dtype)

    def _f(self, j: int) -> slice:
        return slice(self.offs[j], self.offs[j] + self.sizes[j])

    def forward(self, x: torch.Tensor, ws: list[torch.Tensor], j: int, y: torch.Tensor) -> None:
        f = self._f(j)
        y[..., f] = x[..., f] * ws[0] + (ws[1] if self.bias else 0)

    def grad_w(self, dy: torch.Tensor, x: torch.Tensor, j: int, gs: list[torch.Tensor]) -> None:
        f = self._f(j)
        g = dy[..., f].reshape(-1, self.sizes[j]).float()
        gs[0] += (g * x[..., f].reshape(-1, self.sizes[j]).float()).sum(0)
        if self.bias:
            gs[1] += g.sum(0)

    def grad_x(self, dy: torch.Tensor, ws: list[torch.Tensor], j: int, dx: torch.Tensor) -> None:
        f = self._f(j)
        dx[..., f] = dy[..., f] * ws[0]


# ---- the rings -----------------------------------------------------------------------------------

def _pack(ts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(dtype or t.dtype) for t in ts])


def _unpack(buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        out.append(buf[at : at + math.prod(s)].view(s))
        at += math.prod(s)
    return out


def _numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _post(tg: TspGroup, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
          step: int, what: str) -> list[Any]:
    """Post ``(tensor, peer step, tag)`` sends and receives in one batch, without waiting; their
    requests (:func:`_wait` them just before the received tensors are used). ``what``: the pass
    the weight shards' bytes count in."""
    ops = [dist.P2POp(dist.isend, t, tg.peer(s), tg.group, tag=tag) for t, s, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, tg.peer(s), tg.group, tag=tag) for t, s, tag in recvs]
    if not ops:
        return []
    st = tg.stats
    for t, _, tag in sends:
        n = t.numel() * t.element_size()
        if tag == _W_TAG:
            st.sent_w += n
            st.by_pass[what] = st.by_pass.get(what, 0) + n
        else:
            st.sent_g += n
    st.note("post_w" if any(tag == _W_TAG for _, _, tag in sends) else "post_g", step)
    return list(dist.batch_isend_irecv(ops))


def _wait(tg: TspGroup, reqs: list[Any], step: int) -> None:
    if reqs:
        for req in reqs:
            req.wait()
        tg.stats.note("wait", step)


def _forward_pass() -> str:
    """``recompute`` when a forward runs inside backward (activation checkpointing), else ``forward``."""
    return "forward" if torch._C._current_graph_task_id() == -1 else "recompute"


def _forward_ring(tg: TspGroup, k: _Kernel, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Step ``t`` computes with rank ``r - t``'s shard while the next one (rank ``r - t - 1``'s)
    arrives from rank ``r - 1`` and the current one goes on to rank ``r + 1``: the exchange is posted
    before the compute and waited on just before the next step uses what it brought."""
    d, r, st = tg.size, tg.rank, tg.stats
    what = _forward_pass()
    y = k.out(x, params[0].dtype)
    cur = st.hold(_pack(params))
    for t in range(d):
        src = (r - t) % d
        reqs, nxt = [], None
        if t + 1 < d:
            nxt = st.hold(cur.new_empty(_numel(k.shapes((src - 1) % d))))
            reqs = _post(tg, [(cur, 1, _W_TAG)], [(nxt, -1, _W_TAG)], t, what)
        st.note("compute", t)
        k.forward(x, _unpack(cur, k.shapes(src)), src, y)
        _wait(tg, reqs, t)
        st.drop(cur)
        cur = nxt  # type: ignore[assignment]
    return y


def _backward_ring(tg: TspGroup, k: _Kernel, x: torch.Tensor, params: list[torch.Tensor], dy: torch.Tensor,
                   dx: torch.Tensor | None) -> list[torch.Tensor]:
    """Step ``t`` computes with rank ``r + 1 + t``'s shard (the rank's own at the last step), received
    from rank ``r + 1`` with that shard's gradient accumulator; both go on to rank ``r - 1``. The next
    shard's exchange is posted before the step's compute, the accumulator's as soon as the step has
    added to it (before the input gradient's compute), and both are waited on just before the next
    step uses them; the first shard arrives while the input gradient of the rank's own shard is
    computed. Returns this rank's gradients, averaged over the ``D`` ranks."""
    d, r, st = tg.size, tg.rank, tg.stats
    cur: torch.Tensor | None = None
    reqs: list[Any] = []
    if d > 1:  # the first shard to use is rank r+1's
        own = st.hold(_pack(params))
        cur = st.hold(own.new_empty(_numel(k.shapes((r + 1) % d))))
        reqs = _post(tg, [(own, -1, _W_TAG)], [(cur, 1, _W_TAG)], -1, "backward")
    if dx is not None:
        st.note("compute", -1)
        k.grad_x(dy, params, r, dx)
    _wait(tg, reqs, -1)
    if d > 1:
        st.drop(own)
    acc = st.hold(torch.zeros(_numel(k.shapes((r + 1) % d)), dtype=torch.float32, device=dy.device), grad=True)
    for t in range(d):
        j = (r + 1 + t) % d
        ws = params if t == d - 1 else _unpack(cur, k.shapes(j))  # type: ignore[arg-type]
        nxt = nacc = None
        wreqs = greqs = []
        if t <= d - 3:  # rank r-1 uses this shard next step (at its last step it uses its own)
            nxt = st.hold(cur.new_empty(_numel(k.shapes((j + 1) % d))))  # type: ignore[union-attr]
            wreqs = _post(tg, [(cur, -1, _W_TAG)], [(nxt, 1, _W_TAG)], t, "backward")
        st.note("compute", t)
        k.grad_w(dy, x, j, _unpack(acc, k.shapes(j)))
        if t <= d - 2:
            nacc = st.hold(acc.new_empty(_numel(k.shapes((j + 1) % d))), grad=True)
            greqs = _post(tg, [(acc, -1, _G_TAG)], [(nacc, 1, _G_TAG)], t, "backward")
        if dx is not None and t < d - 1:
            k.grad_x(dy, ws, j, dx)
        _wait(tg, wreqs + greqs, t)
        if t < d - 1:
            st.drop(cur)  # type: ignore[arg-type]
            cur = nxt
            st.drop(acc, grad=True)
            acc = nacc  # type: ignore[assignment]
    st.drop(acc, grad=True)
    grads = _unpack(acc.div_(d), k.shapes(r))
    return [g.to(p.dtype) for g, p in zip(grads, params, strict=True)]


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: _Kernel, tg: TspGroup, *params: torch.Tensor) -> torch.Tensor:
        y = _forward_ring(tg, k, x, list(params))
        ctx.save_for_backward(x, *params)
        ctx.k, ctx.tg = k, tg
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, *params = ctx.saved_tensors
        k, tg = ctx.k, ctx.tg
        dy = dy.contiguous()
        dx = torch.zeros_like(x) if k.has_dx and ctx.needs_input_grad[0] else None
        grads = _backward_ring(tg, k, x, params, dy, dx)
        return (dx, None, None, *grads)


# ---- modules: the reference model's operators with their weights on the ring -------------------

def _shard(t: torch.Tensor, dim: int, tg: TspGroup) -> nn.Parameter:
    part = nn.Parameter(torch.tensor_split(t.detach(), tg.size, dim=dim)[tg.rank].clone())
    origins.inherit_split(part, t, dim, tg.size, tg.rank)
    return part


class TspLinear(nn.Module):
    """A Linear whose weight is cut by rows (``rows``) or columns (``cols``) over the tp ranks."""

    def __init__(self, lin: nn.Linear, cut: str, tg: TspGroup, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        n_out, n_in = lin.out_features, lin.in_features
        bias = lin.bias is not None
        self.in_features, self.out_features = n_in, n_out
        self.k: _Kernel = _Rows(n_out, n_in, bias, tg.size) if cut == "rows" else _Cols(n_out, n_in, bias, tg.size)
        self.tg = tg
        self.weight = weight if weight is not None else _shard(lin.weight, 0 if cut == "rows" else 1, tg)
        self.bias = _shard(lin.bias, 0, tg) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ps = [self.weight] + ([self.bias] if self.bias is not None else [])
        return _Ring.apply(x, self.k, self.tg, *ps)


class TspEmbedding(nn.Module):
    """An embedding table cut by rows over the tp ranks."""

    def __init__(self, emb: nn.Embedding, tg: TspGroup) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.k = _Table(emb.num_embeddings, emb.embedding_dim, tg.size)
        self.tg = tg
        self.weight = _shard(emb.weight, 0, tg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return _Ring.apply(idx, self.k, self.tg, self.weight)


class TspNorm(nn.Module):
    """LayerNorm or RMSNorm whose affine weight (and bias) is cut by features over the tp ranks."""

    def __init__(self, norm: nn.Module, tg: TspGroup) -> None:
        super().__init__()
        self.layer = isinstance(norm, nn.LayerNorm)
        self.shape = tuple(norm.normalized_shape)
        self.eps = norm.eps
        bias = self.layer and norm.bias is not None
        self.k = _Scale(self.shape[-1], bias, tg.size)
        self.tg = tg
        self.weight = _shard(norm.weight, 0, tg)
        self.bias = _shard(norm.bias, 0, tg) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xh = F.layer_norm(x, self.shape, eps=self.eps) if self.layer else F.rms_norm(x, self.shape, eps=self.eps)
        ps = [self.weight] + ([self.bias] if self.bias is not None else [])
        return _Ring.apply(xh, self.k, self.tg, *ps)


#: how TSP cuts each weighted operator of a reference block: rows feed attention or the activation,
#: columns take the heads' or the activation's features and accumulate
BLOCK_CUTS = {"attn.qkv": "rows", "attn.out": "cols", "mlp.up": "rows", "mlp.down": "cols"}


def _linear(mod: nn.Module, cut: str, tg: TspGroup, weight: nn.Parameter | None = None) -> nn.Module:
    """``mod`` on the ring; an OSDP-split Linear keeps its slices, each on a ring of its own."""
    if isinstance(mod, SplitLinear):
        for j, s in enumerate(mod.slices):
            mod.slices[j] = TspLinear(s, cut, tg)
        return mod
    return TspLinear(mod, cut, tg, weight)


def _table(mod: nn.Module, tg: TspGroup) -> nn.Module:
    if isinstance(mod, SplitEmbedding):
        for j, s in enumerate(mod.slices):
            mod.slices[j] = TspEmbedding(s, tg)
        return mod
    return TspEmbedding(mod, tg)


def apply_tsp(stage: nn.Module, tg: TspGroup, tied_model: bool = False) -> None:
    """Put every weight of a reference ``Transformer`` (or a pipeline stage of one) on the tp ring;
    the head of a tied model shares the table's shards (slice by slice when split)."""
    tied = tied_model and stage.head is not None and stage.embed is not None
    if stage.embed is not None:
        stage.embed.tok = _table(stage.embed.tok, tg)
        if stage.embed.pos is not None:
            stage.embed.pos = _table(stage.embed.pos, tg)
    for block in stage.layers.values():
        for norm in ("attn_norm", "mlp_norm"):
            setattr(block, norm, TspNorm(getattr(block, norm), tg))
        for op, cut in BLOCK_CUTS.items():
            parent, _, name = op.rpartition(".")
            owner = block.get_submodule(parent)
            setattr(owner, name, _linear(getattr(owner, name), cut, tg))
    if stage.final_norm is not None:
        stage.final_norm = TspNorm(stage.final_norm, tg)
    if isinstance(stage.head, SplitTiedHead):
        for j, part in enumerate(stage.head.parts):
            stage.head.parts[j] = TspLinear(part, "rows", tg, weight=stage.embed.tok.slices[j].weight if tied else None)
    elif stage.head is not None:
        stage.head = _linear(stage.head, "rows", tg, weight=stage.embed.tok.weight if tied else None)
