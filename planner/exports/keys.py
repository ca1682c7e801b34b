"""Every export target's key names, in one place.

The exporters read configuration keys, flags and enum values only from here, so that when a tool
renames one, a single edit follows the rename. The release they are meant for is the target's
pinned version (``vocab/targets/<name>.yaml``). A value of ``None`` means the target has no such key
and the exporter leaves it out.
"""

from __future__ import annotations

from typing import Final

# ---- torchtitan: job config TOML ------------------------------------------------------------------
TORCHTITAN: Final[dict[str, str | None]] = {
    "parallelism": "parallelism",  # [parallelism]
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "reshard": "fsdp_reshard_after_forward",  # "default" | "always" | "never"
    "tp": "tensor_parallel_degree",
    # torchtitan applies sequence parallelism whenever tp > 1 and has no switch for it.
    "sequence_parallel": None,
    "pp": "pipeline_parallel_degree",
    "schedule": "pipeline_parallel_schedule",
    "layers_per_stage": "pipeline_parallel_layers_per_stage",
    "first_less": "pipeline_parallel_first_stage_less_layers",  # the embedding's weight in layers
    "last_less": "pipeline_parallel_last_stage_less_layers",  # the norm and head's weight in layers
    "fqns_per_part": "module_fqns_per_model_part",  # exact stage boundaries (uneven splits too)
    "pp_microbatch": "pipeline_parallel_microbatch_size",
    "cp": "context_parallel_degree",
    "cp_rotate": "context_parallel_rotate_method",
    "ep": "expert_parallel_degree",
    "ep_backend": "expert_parallel_comm_backend",  # "standard" (all-to-all) | "deepep"
    "ac": "activation_checkpoint",  # [activation_checkpoint]
    "ac_mode": "mode",  # "none" | "selective" | "full"
    "ac_option": "selective_ac_option",  # "op" (selective op-level) or "N" (full AC every N-th layer)
    "training": "training",  # [training]
    "local_batch": "local_batch_size",
    "global_batch": "global_batch_size",
    "seq_len": "seq_len",
    "cpu_offload": "enable_cpu_offload",  # FSDP2 CPUOffloadPolicy: parameters, gradients, optimizer
    "mp_param": "mixed_precision_param",
    "model": "model",  # [model]
    "converters": "converters",  # ["float8"] turns on float8 training
}
TORCHTITAN_SCHEDULES: Final = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                               "zb": "InterleavedZeroBubble"}
TORCHTITAN_RESHARD: Final = {"zero3": "always", "zero3_keep": "never"}
TORCHTITAN_CP_ROTATE: Final = {"allgather": "allgather", "alltoall": "alltoall"}  # the plan's cp_rotate
TORCHTITAN_FLOAT8: Final = "float8"
TORCHTITAN_FQN: Final = {"embedding": ["tok_embeddings"], "block": "layers.{i}", "head": ["norm", "output"]}

# ---- Megatron-LM: command-line flags ----------------------------------------------------------------
MEGATRON: Final[dict[str, str | None]] = {
    "num_layers": "--num-layers",
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vpp_layers": "--num-layers-per-virtual-pipeline-stage",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "cp": "--context-parallel-size",
    "cp_comm": "--cp-comm-type",
    "ep": "--expert-model-parallel-size",
    "sp": "--sequence-parallel",
    "dist_opt": "--use-distributed-optimizer",
    "dist_opt_instances": "--num-distributed-optimizer-instances",  # ZeRO-1 sharded within dp_shard
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "micro_batch": "--micro-batch-size",
    "global_batch": "--global-batch-size",
    "seq_len": "--seq-length",
    "bf16": "--bf16",
    "fp8": "--fp8-format",
    "optimizer_offload": "--optimizer-cpu-offload",
    "optimizer_offload_fraction": "--optimizer-offload-fraction",
    "overlap_grad": "--overlap-grad-reduce",
    "overlap_param": "--overlap-param-gather",
    "tp_overlap": "--tp-comm-overlap",
    # the model's shape (megatron-core TransformerConfig, GPTModel arguments)
    "hidden": "--hidden-size",
    "ffn_hidden": "--ffn-hidden-size",
    "heads": "--num-attention-heads",
    "head_dim": "--kv-channels",
    "gqa": "--group-query-attention",
    "kv_heads": "--num-query-groups",
    "swiglu": "--swiglu",
    "norm": "--normalization",
    "position": "--position-embedding-type",
    "max_seq": "--max-position-embeddings",
    "untie": "--untie-embeddings-and-output-weights",
    "no_bias": "--disable-bias-linear",
    "qkv_bias": "--add-qkv-bias",
    "qk_norm": "--qk-layernorm",
    "attention_dropout": "--attention-dropout",
    "hidden_dropout": "--hidden-dropout",
    "experts": "--num-experts",
    "top_k": "--moe-router-topk",
    "moe_ffn_hidden": "--moe-ffn-hidden-size",
    "shared_expert_hidden": "--moe-shared-expert-intermediate-size",
    "moe_layer_freq": "--moe-layer-freq",
    "router_groups": "--moe-router-num-groups",
    "router_group_topk": "--moe-router-group-topk",
    "moe_dispatcher": "--moe-token-dispatcher-type",
    "moe_flex_backend": "--moe-flex-dispatcher-backend",
    "moe_grouped_gemm": "--moe-grouped-gemm",
    "moe_permute_fusion": "--moe-permute-fusion",
    "moe_overlap": "--overlap-moe-expert-parallel-comm",
    "moe_capacity": "--moe-expert-capacity-factor",
    "mla": "--multi-latent-attention",
    "q_lora_rank": "--q-lora-rank",
    "kv_lora_rank": "--kv-lora-rank",
    "qk_head_dim": "--qk-head-dim",
    "qk_rope_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim",
    "mtp_layers": "--mtp-num-layers",
}
MEGATRON_NORM: Final = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
MEGATRON_POSITION: Final = {"rope": "rope", "learned": "learned_absolute", "none": "none"}
#: (cp_mode, cp_rotate) -> --cp-comm-type (a Ulysses plan's rotate is unused: allgather)
MEGATRON_CP_COMM: Final = {("ring", "allgather"): "all_gather", ("ring", "alltoall"): "p2p", ("ulysses", "allgather"): "a2a"}
MEGATRON_FP8_FORMAT: Final = "hybrid"

# ---- DeepSpeed: config JSON -----------------------------------------------------------------------
DEEPSPEED: Final[dict[str, str | None]] = {
    "train_batch": "train_batch_size",
    "micro_batch": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "bf16": "bf16",
    "enabled": "enabled",
    "zero": "zero_optimization",
    "stage": "stage",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
    "device": "device",
    "pin_memory": "pin_memory",
    "hpz": "zero_hpz_partition_size",  # ZeRO++ hierarchical (secondary) parameter partition
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "tensor_parallel": "tensor_parallel",  # AutoTP training (DeepSpeed >= 0.16.4)
    "autotp_size": "autotp_size",
    "sequence_parallel_size": "sequence_parallel_size",  # DeepSpeed-Ulysses
    "pipeline": "pipeline",  # read by PipelineEngine
    "pipe_stages": "stages",
    "pipe_partition": "partition",
    "pipe_ac_interval": "activation_checkpoint_interval",
    "ac": "activation_checkpointing",  # deepspeed.checkpointing.configure
    "ac_partition": "partition_activations",
    "ac_cpu": "cpu_checkpointing",
    "ac_contiguous": "contiguous_memory_optimization",
    "ac_number": "number_checkpoints",
}
DEEPSPEED_PARTITION: Final = "uniform"  # equal layer counts per stage
DEEPSPEED_ZERO_STAGE: Final = {"replicate": 0, "zero1": 1, "zero2": 2, "zero3": 3}

# ---- nanotron: YAML config --------------------------------------------------------------------------
NANOTRON: Final[dict[str, str | None]] = {
    "parallelism": "parallelism",
    "dp": "dp",  # nanotron's world is dp * tp * pp * expert_parallel_size
    "pp": "pp",
    "tp": "tp",
    "pp_engine": "pp_engine",
    "tp_mode": "tp_mode",
    "tp_async": "tp_linear_async_communication",
    "ep": "expert_parallel_size",
    "recompute": None,  # nanotron 0.4 has no recomputation key
    "tokens": "tokens",
    "micro_batch": "micro_batch_size",
    "grad_accum": "batch_accumulation_per_replica",
    "seq_len": "sequence_length",
    "optimizer": "optimizer",
    "zero_stage": "zero_stage",
}
NANOTRON_PP_ENGINES: Final = {"gpipe": "afab", "1f1b": "1f1b"}
NANOTRON_TP_MODES: Final = {True: "REDUCE_SCATTER", False: "ALL_REDUCE"}

# ---- python: the project's own runtime ------------------------------------------------------------
PYTHON: Final[dict[str, str | None]] = {
    "apply_module": "runtime.apply", "apply": "apply_plan",  # apply_plan(model, plan) -> model
    "optimizer": "build_optimizer",  # build_optimizer(model, cls, **kwargs), in apply_module
    "model_module": "runtime.model", "model": "Transformer", "config": "resolve_config",
    "train_module": "runtime.train", "step": "train_step",  # train_step(model, tokens, targets, n_mb)
    "batch": "local_batch",  # local_batch(model, batch) -> this rank's rows and tokens, in train_module
}
