"""torchtitan 0.3's flag names, in one place (``vocab/targets/keys/torchtitan-0.3.0.json`` holds every
flag the release accepts; these are the ones shardplan writes and prices).

A job is ``--module M --config F`` (a function of ``torchtitan/models/M/config_registry.py`` that
returns the whole ``Trainer.Config``) with ``--section.key value`` overrides (tyro): booleans are bare
``--section.key`` / ``--section.no_key``, a list of lists is one token per inner list, comma-joined,
and the activation-checkpointing policy is a subcommand token after every flag
(``activation_checkpoint:full``; torchtitan/config/manager.py:34-92, :233-244).
"""

from __future__ import annotations

from typing import Final

#: shardplan's key -> torchtitan 0.3's flag path
FLAGS: Final[dict[str, str]] = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "reshard": "parallelism.fsdp_reshard_after_forward",
    "tp": "parallelism.tensor_parallel_degree",
    "sequence_parallel": "parallelism.enable_sequence_parallel",
    "pp": "parallelism.pipeline_parallel_degree",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "first_less": "parallelism.pipeline_parallel_first_stage_less_layers",
    "last_less": "parallelism.pipeline_parallel_last_stage_less_layers",
    "fqns_per_part": "parallelism.module_fqns_per_model_part",
    "pp_microbatch": "parallelism.pipeline_parallel_microbatch_size",
    "cp": "parallelism.context_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "local_batch": "training.local_batch_size",
    "global_batch": "training.global_batch_size",
    "seq_len": "training.seq_len",
    "cpu_offload": "training.enable_cpu_offload",
    "mp_param": "training.mixed_precision_param",
    "no_cuda_graphs": "training.disable_cuda_graphs",
    "dataset_path": "dataloader.dataset_path",
    "hf_assets": "hf_assets_path",
}
MODULE_FLAG: Final = "--module"
CONFIG_FLAG: Final = "--config"
AC: Final = "activation_checkpoint"  # the subcommand's field: activation_checkpoint:<policy>
AC_POLICIES: Final = {"none": "none", "selective": "selective", "full": "full"}  # shardplan's -> torchtitan's
#: the entry point the launch runs (torchtitan/train.py)
ENTRY: Final = "torchtitan.train"
#: the module names stage lists hold: the embedding, block i, and the last stage's norm and head
#: (torchtitan/distributed/pipeline_parallel.py:366-476 names the head lm_head)
FQN: Final = {"embedding": ["tok_embeddings"], "block": "layers.{i}", "head": ["norm", "lm_head"]}
#: shardplan's preset -> (module, registry function) of torchtitan 0.3.0 that builds that model in bf16;
#: llama3_405b is not one: it turns on float8 converters, compile and async TP
#: (torchtitan/models/llama3/config_registry.py), which a flag cannot turn off
REGISTRY: Final[dict[str, tuple[str, str]]] = {
    "llama3.1-8b": ("llama3", "llama3_8b"), "llama3-8b": ("llama3", "llama3_8b"),
    "llama3.1-70b": ("llama3", "llama3_70b"), "llama3-70b": ("llama3", "llama3_70b"),
    "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b"),
    "gpt-oss-20b": ("gpt_oss", "gpt_oss_20b"), "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b"),
}
#: the registry functions' token dispatchers the import prices (AllToAllTokenDispatcher: all-to-all)
DISPATCHERS: Final = {"AllToAll": "alltoall"}
#: what a launch needs beside the plan: placeholders torchtitan refuses once it builds the tokenizer and
#: the dataloader (torchtitan/components/tokenizer.py:169-181, hf_datasets/text_datasets.py:57-70)
PLACEHOLDERS: Final = (("hf_assets", "SET-ME/hf-assets"), ("dataset_path", "SET-ME/dataset"))
