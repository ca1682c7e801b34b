"""Context-parallel attention (ring with point-to-point or all-gather rotation, Ulysses) equals
causal attention over the whole sequence, outputs and gradients, on gloo ranks; the head-tail
layout and its positions."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from runtime.context_parallel import ContextShard, shard_sequence, zigzag_index

MODES = [("ring", "alltoall"), ("ring", "allgather"), ("ulysses", "alltoall")]


def test_zigzag_layout() -> None:
    assert zigzag_index(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_index(16, 1, 4).tolist() == [2, 3, 12, 13]
    whole = torch.cat([zigzag_index(24, r, 3) for r in range(3)])
    assert sorted(whole.tolist()) == list(range(24))  # every token on exactly one rank
    x = torch.arange(16).reshape(1, 16)
    assert shard_sequence(x, 3, 4).tolist() == [[6, 7, 8, 9]]
    with pytest.raises(ValueError, match="not divisible by 4"):
        zigzag_index(6, 0, 2)
    cs = ContextShard(group=None, rank=1, size=2)  # type: ignore[arg-type]
    assert cs.positions(4).tolist() == [2, 3, 4, 5]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        b, h, s, d = 2, 4, 8 * world, 16
        q, k, v, g = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(4))
        results = {}
        for mode, rotate in MODES:
            cs = ContextShard(dist.group.WORLD, rank, world, mode, rotate)
            idx = zigzag_index(s, rank, world)
            ql, kl, vl = (t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v))
            o = cs.attention(ql, kl, vl)
            (o * g[:, :, idx]).sum().backward()
            results[f"{mode}-{rotate}"] = {"idx": idx, "out": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        torch.save(results, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_attention_equals_whole_sequence(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"{r}.pt") for r in range(world)]
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 8 * world, 16
    q, k, v, g = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    (ref * g).sum().backward()
    for mode, rotate in MODES:
        for r in ranks:
            got = r[f"{mode}-{rotate}"]
            idx = got["idx"]
            for name, want in (("out", ref.detach()), ("dq", qr.grad), ("dk", kr.grad), ("dv", vr.grad)):
                torch.testing.assert_close(got[name], want[:, :, idx], rtol=1e-9, atol=1e-10,
                                           msg=lambda m, n=name, md=mode, rt=rotate: f"{md}/{rt} {n}: {m}")
