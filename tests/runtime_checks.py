"""What the runtime's parity tests check of a trained job (a result of :func:`runtime.launch.launch`):
losses like one process, and per-rank state bytes as the cost model predicts them."""

from __future__ import annotations

from typing import Any

import pytest

from costmodel.estimate import estimate
from profiler.hardware import parse_cluster
from profiler.transformer import build_graph
from runtime.model import TINY_MODELS
from runtime.train import TrainSettings
from vocab.strategy import Strategy, Workload


def assert_parity(res: dict[str, Any], context: Any = None) -> None:
    """Losses equal those of the same model trained in one process at the same precision (computed
    by rank 0) within the job's tolerance, :func:`runtime.train.parity_tolerance`: 1e-6 in fp32."""
    got = [s["loss"] for s in res["steps"]]
    ref = res["reference_losses"][res["steps"][0]["step"]:]  # a resumed run: the same steps from scratch
    what = (res["name"], context) if context is not None else res["name"]
    assert got == pytest.approx(ref, rel=res["parity_rtol"], abs=0), what


def state_bytes(res: dict[str, Any]) -> list[tuple[int, int, int]]:
    """Every rank's (parameter, gradient, optimizer) bytes after the last step, rank order."""
    return [(r["param_bytes"], r["grad_bytes"], r["optim_bytes"]) for r in res["steps"][-1]["ranks"]]


def predicted_state_bytes(model: str, s: Strategy, world: int, settings: TrainSettings) -> list[tuple[int, int, int]]:
    """Per-rank (parameter, gradient, optimizer) bytes the cost model predicts for the plan at the
    settings' precision, rank order: under bf16 with this runtime's rules (fp32 gradients, the
    FSDP2 parameter shard is the fp32 master)."""
    g = build_graph(TINY_MODELS[model], settings.seq_len)
    w = Workload(seq_len=settings.seq_len, global_batch=settings.global_batch, precision=settings.precision,
                 grad_dtype=settings.grad_dtype, zero3_master="parameter")
    r = estimate(g, parse_cluster(f"{world}xcpu"), s, w)
    return [(st.param_bytes, st.grad_bytes, st.optim_bytes) for st in r.stages for _ in range(world // s.mesh.pp)]
