"""DeepSpeed: the config JSON (batch sizes, precision, ZeRO stage, offload, ZeRO++ hpZ, AutoTP, Ulysses).

Pipeline stages (``deepspeed.pipe.PipelineModule``), MoE expert parallelism (``deepspeed.moe``) and
activation checkpointing live in the model code, not in this file; the notes say what to set there.
"""

from __future__ import annotations

import json
from typing import Any

from planner.compare import label_units
from planner.exports.base import Nearest
from planner.exports.keys import DEEPSPEED, DEEPSPEED_ZERO_STAGE
from vocab.strategy import Strategy

SUFFIX = ".json"


def adjust(n: Nearest) -> None:
    if not n.units:
        return
    m = n.mesh
    if m["pp"] > 1:
        n.notes.append(f"build the model as deepspeed.pipe.PipelineModule(layers, num_stages={m['pp']}, "
                       "partition_method='uniform')")
    if m["ep"] > 1:
        n.notes.append(f"MoE layers: deepspeed.moe.layer.MoE(..., ep_size={m['ep']})")
    runs = {}
    for u in n.units:
        runs.setdefault(n.choice[u]["recompute"], []).append(u)
    ckpt = [f"{v} on {label_units(us)}" for v, us in runs.items() if v != "none"]
    if ckpt:
        n.notes.append("activation checkpointing is applied in the model code (deepspeed.checkpointing."
                       f"checkpoint or torch.utils.checkpoint): {'; '.join(ckpt)}")


def render(n: Nearest, s: Strategy, cost: str) -> str:
    K, m, w = DEEPSPEED, s.mesh, n.workload_model()
    shard = n.values("sharding")[0] if n.units else s.default.sharding
    offload = n.values("offload")[0] if n.units else s.default.offload
    zero: dict[str, Any] = {K["stage"]: DEEPSPEED_ZERO_STAGE[shard], K["overlap_comm"]: True,
                            K["contiguous_gradients"]: True}
    cpu = {K["device"]: "cpu", K["pin_memory"]: True}
    if offload in ("optimizer", "params"):
        zero[K["offload_optimizer"]] = dict(cpu)
    if offload == "params":
        zero[K["offload_param"]] = dict(cpu)
    if shard == "zero3" and n.extra.get("hsdp_shard"):
        zero[K["hpz"]] = n.extra["hsdp_shard"]
    cfg: dict[str, Any] = {
        K["train_batch"]: w.global_batch, K["micro_batch"]: s.micro_batch,
        K["grad_accum"]: s.num_microbatches(w.global_batch), K["bf16"]: {K["enabled"]: True}, K["zero"]: zero,
    }
    if m.tp > 1:
        cfg[K["tensor_parallel"]] = {K["autotp_size"]: m.tp}
    if m.cp > 1:
        cfg[K["sequence_parallel_size"]] = m.cp
    return json.dumps({k: v for k, v in cfg.items() if k is not None}, indent=2) + "\n"
