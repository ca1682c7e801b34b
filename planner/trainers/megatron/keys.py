"""Megatron-LM's key names, in one place.

The exporter and the importer read configuration keys, flags and enum values only from here, so that
when the tool renames one, a single edit follows the rename. The release they are meant for is the
target's pinned version (``vocab/targets/<name>.yaml``). A value of ``None`` means the target has no
such key and the exporter leaves it out.
"""

from __future__ import annotations

from typing import Final

# ---- Megatron-LM: command-line flags ----------------------------------------------------------------
MEGATRON: Final[dict[str, str | None]] = {
    "num_layers": "--num-layers",
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vpp_layers": "--num-layers-per-virtual-pipeline-stage",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "account_embedding": "--account-for-embedding-in-pipeline-split",  # TransformerConfig fields as flags
    "account_loss": "--account-for-loss-in-pipeline-split",
    "layout": "--pipeline-model-parallel-layout",
    "cp": "--context-parallel-size",
    "cp_comm": "--cp-comm-type",
    "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size",  # default: tp; 1 with tp > 1 folds the expert ranks over tp (MoE parallel folding)
    "sp": "--sequence-parallel",
    "dist_opt": "--use-distributed-optimizer",
    "dist_opt_instances": "--num-distributed-optimizer-instances",  # ZeRO-1 / Megatron-FSDP sharded within dp_shard
    "megatron_fsdp": "--use-megatron-fsdp",  # DistributedDataParallelConfig.use_megatron_fsdp
    "fsdp_strategy": "--data-parallel-sharding-strategy",
    "ckpt_format": "--ckpt-format",  # Megatron-LM checkpoint argument: fsdp_dtensor with Megatron-FSDP
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "micro_batch": "--micro-batch-size",
    "global_batch": "--global-batch-size",
    "seq_len": "--seq-length",
    "bf16": "--bf16",
    "grad_bf16": "--grad-reduce-in-bf16",  # DistributedDataParallelConfig.grad_reduce_in_fp32=False
    # Megatron-FSDP's gradient dtype where the release has it (FSDP_OWN_GRAD_DTYPE): fp32 | bf16 | fp16 | auto
    "fsdp_main_grads": "--megatron-fsdp-main-grads-dtype",
    "fp8": "--fp8-format",
    "fp8_recipe": "--fp8-recipe",  # TransformerConfig.fp8_recipe as a flag (arguments.py:2290)
    "fp4": "--fp4-format",  # TransformerConfig.fp4 (arg_names, transformer_config.py:510-511): NVFP4, not priced
    "optimizer_offload": "--optimizer-cpu-offload",
    "optimizer_offload_fraction": "--optimizer-offload-fraction",
    # Adam's moments in bf16 and the master as 16-bit remainders (OptimizerConfig, store_param_remainders)
    "precision_aware": "--use-precision-aware-optimizer",
    "exp_avg_dtype": "--exp-avg-dtype",
    "exp_avg_sq_dtype": "--exp-avg-sq-dtype",
    "main_params_dtype": "--main-params-dtype",
    # activations of the first N layers in host memory (Megatron-LM arguments.py:1869-1870 sets cpu_offloading)
    "activation_offload_layers": "--cpu-offloading-num-layers",
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
    "rotary_base": "--rotary-base",  # Megatron-LM's default 10000
    "norm_eps": "--norm-epsilon",  # Megatron-LM's default 1e-5
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
#: what a launch needs beside the plan, written as placeholders that Megatron-LM's parser accepts and its
#: start-up refuses while they name no file (the tokenizer is loaded, the data path's index read): the
#: user sets them (and adds the optimizer, learning-rate and checkpoint flags of the run)
MEGATRON_PLACEHOLDERS: Final = (("--tokenizer-type", "HuggingFaceTokenizer"),
                                ("--tokenizer-model", "SET-ME/tokenizer-directory"),
                                ("--data-path", "SET-ME/dataset_text_document"))
MEGATRON_FP8_FORMAT: Final = "hybrid"
#: fp8 with one scale per tensor computed from the tensor itself (current scaling), the recipe NVIDIA's
#: performance recipes run (fp8_cs); its linear_proj keeps the attention output it shares with the core
#: (megatron-core 0.16.1 attention.py:364-379), as ``fp8_saved_inputs`` quantized prices. Megatron-LM's
#: default, delayed, also keeps an fp8 copy of that output, which an imported delayed run is not priced with.
MEGATRON_FP8_RECIPE: Final = "tensorwise"
#: MXFP8: --fp8-recipe mxfp8 (megatron-core 0.16.1 transformer_config.py:436, Fp8Recipe.mxfp8 in
#: megatron/core/enums.py:25) with E4M3 values throughout (--fp8-format e4m3, transformer_config.py:429-433)
MEGATRON_MXFP8: Final = {"format": "e4m3", "recipe": "mxfp8"}
#: the recipes of --fp8-recipe (transformer_config.py:436): all but mxfp8 are priced as fp8
MEGATRON_FP8_RECIPES: Final = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
#: Megatron-FSDP as ZeRO-3: parameters, gradients and optimizer states sharded (optim_grads_params;
#: distributed_data_parallel_config.py:79), with the checkpoint format Megatron-LM requires of it
#: (arguments.py:1146, megatron-core 0.19.2 wheel)
MEGATRON_FSDP: Final = {"strategy": "optim_grads_params", "ckpt_format": "fsdp_dtensor"}
#: the megatron-core releases whose Megatron-FSDP keeps its gradients in ``megatron_fsdp_main_grads_dtype``
#: (default: the parameters' dtype), not reading ``grad_reduce_in_fp32`` (0.19.2
#: distributed_data_parallel_config.py:192, fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2306-2315; 0.16.1
#: read grad_reduce_in_fp32): the export writes the flag, the import reads the dtype from it
FSDP_OWN_GRAD_DTYPE: Final = frozenset({"0.19.2"})
