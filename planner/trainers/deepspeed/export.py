"""DeepSpeed: the config JSON (batch sizes, precision, ZeRO stage, offload, ZeRO++ hpZ, AutoTP, Ulysses,
the ``pipeline`` section of the pipeline engine and the ``activation_checkpointing`` section).

The model code still builds the ``deepspeed.pipe.PipelineModule`` and the MoE layers (``deepspeed.moe``)
and wraps the checkpointed modules; the notes say what to set there. ``activation_checkpointing`` keeps
the activations whole on the GPU (no partitioning, no CPU copy), as the price assumes.
"""

from __future__ import annotations

import json
from typing import Any

from planner.compare import label_units
from planner.trainers.deepspeed.keys import DEEPSPEED, DEEPSPEED_PARTITION, DEEPSPEED_ZERO_STAGE
from planner.trainers.exporting import Nearest
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
    if m["cp"] > 1 and (m["tp"] > 1 or m["pp"] > 1):
        n.notes.append(f"Ulysses beside tensor or pipeline parallelism: pass deepspeed.initialize an mpu whose "
                       f"sequence-parallel groups hold {m['cp']} ranks (its config mesh covers data x sequence "
                       "parallelism only)")
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
        if m.tp == m.pp == 1:  # the (dp, sp) mesh deepspeed.initialize builds covers the world
            cfg[K["data_parallel_size"]] = m.dp
    rec = [s.for_unit(u).recompute for u in n.units]
    if m.pp > 1:
        every_block = bool(n.blocks) and all(s.for_unit(u).recompute == "full" for u in n.blocks)
        cfg[K["pipeline"]] = {K["pipe_stages"]: m.pp, K["pipe_partition"]: DEEPSPEED_PARTITION,
                              K["pipe_ac_interval"]: 1 if every_block else 0}
    if any(r != "none" for r in rec):
        cfg[K["ac"]] = {K["ac_partition"]: False, K["ac_cpu"]: False, K["ac_contiguous"]: False,
                        K["ac_number"]: sum(r != "none" for r in rec)}
    return json.dumps({k: v for k, v in cfg.items() if k is not None}, indent=2) + "\n"
