"""Least stage time of pipeline ranks holding blocks of one class, many ranks and counts at once.

A rank holding ``n`` blocks (and the embedding or the head on the first and last rank) lets each
block recompute or not; with one block class the plan is how many blocks take each option, so for
every ``n`` the number ``nf`` that recomputes fully is enumerated and the rest split between the
two other options in closed form (the faster first, as many as fit). With only two options, the
faster one the heavier, the fewest full recomputations that fit are a closed form too
(:func:`_two`). Every (rank, embedding option, head option) is a row of one array computation;
a rank's table is its best row per ``n`` (the first of equals, as the options are listed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from solvers.stage_tables import PipelineProblem

INF = float("inf")


def single_class_tables(pp: PipelineProblem, rows: list[tuple[int, bool, bool, int]], ns: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """Per row ``(rank, holds the embedding, holds the head, boundaries it sends)`` and per block
    count in ``ns``: the least stage time (inf where nothing fits), the embedding and head options
    (-1: none), how many blocks recompute fully (``nf``) and how many take the fastest option
    (``na``; the rest take the third). Arrays of shape ``(len(rows), len(ns))``."""
    k = pp.kinds[0]
    opts = pp.costs[k]
    f, rest = pp.option_order()
    fo = opts[f]
    a = opts[rest[0]] if rest else None
    owner, es, hs, fly, pend, fixed0, r_eh, base_t = [], [], [], [], [], [], [], []
    for i, (r, emb, head, bounds) in enumerate(rows):
        fl, pe = pp.held(r)
        fx = pp.fixed({k: 1}, emb, head)
        e_opts = list(enumerate(pp.costs[pp.emb])) if emb and pp.emb is not None else [(-1, None)]
        h_opts = list(enumerate(pp.costs[pp.head])) if head and pp.head is not None else [(-1, None)]
        for e, ue in e_opts:
            for h, uh in h_opts:
                owner.append(i)
                es.append(e)
                hs.append(h)
                fly.append(fl)
                pend.append(pe)
                # what does not depend on n: states beyond the blocks', the largest gathered unit,
                # the ends' held bytes, the receive buffers
                fixed0.append(fx.states - opts[0].states + fx.gathered + pp.ends_held(ue, uh, fl, pe) + pp.recv(r))
                r_eh.append(max(ue.recompute_peak if ue else 0.0, uh.recompute_peak if uh else 0.0))
                base_t.append((ue.time if ue else 0.0) + (uh.time if uh else 0.0) + bounds * pp.p2p)
    col = lambda xs: np.array(xs, dtype=float)[:, None]  # noqa: E731
    fl_a, pe_a, fixed_a, reh_a, bt_a = col(fly), col(pend), col(fixed0), col(r_eh), col(base_t)
    cap = pp.budget - pp.bucket
    mf = fo.held(fl_a, pe_a)
    ma = a.held(fl_a, pe_a) if a else np.zeros_like(mf)
    # no row fits more blocks than its memory holds at the leanest option of each block
    lean = opts[0].states + (np.minimum(mf, np.minimum(ma, opts[rest[min(1, len(rest) - 1)]].held(fl_a, pe_a))) if rest else mf)
    most = np.max(np.where(lean > 0, np.floor((cap - fixed_a - reh_a) / np.where(lean > 0, lean, 1.0)), np.inf))
    ns_all = np.asarray(ns)
    keep = ns_all <= most
    if not keep.any():
        return _empty(len(rows), len(ns_all))
    n = ns_all[keep].astype(float)[None, :]
    two = (len(rest) == 1 and a.time <= fo.time) & (ma > mf) if a else np.zeros_like(mf, dtype=bool)
    time, nf, na = _general(pp, n, cap, fixed_a, reh_a, bt_a, fl_a, pe_a)
    if two.any():
        rows2 = two[:, 0]
        t2, nf2 = _two(n, cap - fixed_a[rows2] - n * opts[0].states, reh_a[rows2], bt_a[rows2], ma[rows2], mf[rows2],
                       a.time, fo.time, fo.recompute_peak)  # type: ignore[union-attr]
        time[rows2], nf[rows2], na[rows2] = t2, nf2, n - nf2
    time[:, n[0] == 0] = INF  # every stage holds at least one block
    owner_a = np.array(owner)
    starts = np.flatnonzero(np.r_[True, owner_a[1:] != owner_a[:-1]])
    ends = np.r_[starts[1:], len(owner_a)]
    best = np.stack([lo + np.argmin(time[lo:hi], axis=0) for lo, hi in zip(starts, ends, strict=True)])
    cols = np.arange(n.shape[1])[None, :]
    out = _empty(len(rows), len(ns_all))
    out["time"][:, keep], out["e"][:, keep], out["h"][:, keep] = time[best, cols], np.array(es)[best], np.array(hs)[best]
    out["nf"][:, keep], out["na"][:, keep] = nf[best, cols], na[best, cols]
    for i, (_, emb, head, _) in enumerate(rows):
        out["time"][i, ~pp.host_fits(emb, head, int(ns_all.max()))[ns_all]] = INF
    return out


def _empty(rows: int, counts: int) -> dict[str, np.ndarray]:
    """Tables where nothing fits."""
    return {"time": np.full((rows, counts), INF), "e": np.full((rows, counts), -1), "h": np.full((rows, counts), -1),
            "nf": np.zeros((rows, counts), dtype=int), "na": np.zeros((rows, counts))}


def _general(pp: PipelineProblem, n: np.ndarray, cap: float, fixed: np.ndarray, r_eh: np.ndarray,
             base_t: np.ndarray, fly: np.ndarray, pend: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, nf, na) per row and count: every ``nf`` tried, the remaining blocks filled with the
    fastest option ``a`` as far as memory allows, the rest with ``b``."""
    opts = pp.costs[pp.kinds[0]]
    f, rest = pp.option_order()
    fo = opts[f]
    nf = np.arange(int(n.max()) + 1, dtype=float)[None, None, :]  # (1, 1, NF)
    n3, fixed3, fly3, pend3 = n[:, :, None], fixed[:, :, None], fly[:, :, None], pend[:, :, None]
    mf = fo.held(fly3, pend3)
    remat = np.where(nf > 0, np.maximum(r_eh, fo.recompute_peak)[:, :, None], r_eh[:, :, None])
    room = cap - fixed3 - n3 * opts[0].states - remat - nf * mf
    left = n3 - nf
    valid = nf <= n3
    if not rest:
        ok = valid & (left == 0) & (room >= 0)
        na = np.zeros_like(room)
        t = np.where(ok, base_t[:, :, None] + nf * fo.time, INF)
    else:
        a, b = opts[rest[0]], opts[rest[1] if len(rest) > 1 else rest[0]]
        ma, mb = a.held(fly3, pend3), b.held(fly3, pend3)
        lean = mb < ma  # b the leaner: as many a as fit
        span = np.where(lean, ma - mb, 1.0)
        na = np.where(lean, np.clip(np.floor((room - left * mb) / span), 0, left), left)
        ok = valid & np.where(lean, room - left * mb >= 0, room - left * ma >= 0)
        t = np.where(ok, base_t[:, :, None] + nf * fo.time + na * a.time + (left - na) * b.time, INF)
    j = np.argmin(t, axis=2)
    take = lambda x: np.take_along_axis(np.broadcast_to(x, t.shape), j[:, :, None], axis=2)[:, :, 0]  # noqa: E731
    return take(t), j.astype(float), take(na)


def _two(n: np.ndarray, room: np.ndarray, r_eh: np.ndarray, base_t: np.ndarray, ma: np.ndarray, mf: np.ndarray,
         ta: float, tf: float, rf: float) -> tuple[np.ndarray, np.ndarray]:
    """Faster option ``a`` (``ma`` bytes held a block) and leaner ``f``: per count, the fewest
    ``f`` blocks that fit in ``room`` (the memory left beside the blocks' held bytes and the
    transients). (time, nf)."""
    room0 = room - r_eh  # no block recomputes fully
    room1 = room - np.maximum(r_eh, rf)
    need = np.maximum(1.0, np.ceil((n * ma - room1) / (ma - mf)))
    need = np.where(need * mf + (n - need) * ma <= room1, need, need + 1)
    nf = np.where(n * ma <= room0, 0.0, need)
    ok = (nf <= n) & (nf * mf + (n - nf) * ma <= np.where(nf > 0, room1, room0))
    return np.where(ok, base_t + nf * tf + (n - nf) * ta, INF), nf
