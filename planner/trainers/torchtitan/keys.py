"""Torchtitan's key names, in one place.

The exporter and the importer read configuration keys, flags and enum values only from here, so that
when the tool renames one, a single edit follows the rename. The release they are meant for is the
target's pinned version (``vocab/targets/<name>.yaml``). A value of ``None`` means the target has no
such key and the exporter leaves it out.
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
    "etp": "expert_tensor_parallel_degree",  # tp, or 1 (the default: ep ranks folded over tp) where ep > 1
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
    "dataset_path": "dataset_path",  # the data the run reads (a placeholder in an export)
    "hf_assets": "hf_assets_path",  # [model]: the tokenizer and config files (a placeholder in an export)
    "model": "model",  # [model]
    "model_name": "name",  # the model family (torchtitan's default: "llama3")
    "flavor": "flavor",  # its size within the family (torchtitan's default: "debugmodel")
    "converters": "converters",  # ["quantize.linear.float8"] turns on float8 training
    "quantize": "quantize",  # [quantize.grouped_mm.float8] / [quantize.grouped_mm.mx]: the experts' converters
    "grouped_mm": "grouped_mm",
    "grouped_fqns": "fqns",  # the modules whose 3-D expert weights they convert (a substring of the FQN)
}
TORCHTITAN_MODEL_DEFAULT: Final = "llama3"  # [model] name when the file leaves it out
#: torchtitan 0.2.2's model flavors that are a preset of shardplan, by ([model] name, flavor); an import
#: refuses a file whose flavor is not the model it prices. torchtitan's ``llama3`` flavors are Llama 3.1
#: (rope scaling); their layers are the Llama 3 presets' too. Sources, in the pinned release:
#: torchtitan/models/llama3/__init__.py ``llama3_args``, deepseek_v3/__init__.py ``deepseekv3_args``,
#: qwen3/__init__.py ``qwen3_args``, gpt_oss/__init__.py ``gptoss_configs``. A flavor not listed here
#: (``debugmodel``, llama4, the smaller qwen3 and deepseek_v3 ones, a family of one's own) is not checked.
TORCHTITAN_FLAVORS: Final[dict[tuple[str, str], str]] = {
    ("llama3", "8B"): "llama3.1-8b", ("llama3", "8B_flex"): "llama3.1-8b", ("llama3", "8B_varlen"): "llama3.1-8b",
    ("llama3", "70B"): "llama3.1-70b", ("llama3", "405B"): "llama3.1-405b",
    ("deepseek_v3", "671B"): "deepseek-v3", ("qwen3", "235B-A22B"): "qwen3-235b-a22b",
    ("gpt_oss", "20b"): "gpt-oss-20b", ("gpt_oss", "120b"): "gpt-oss-120b",
}
TORCHTITAN_SCHEDULES: Final = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                               "zb": "InterleavedZeroBubble"}
TORCHTITAN_RESHARD: Final = {"zero3": "always", "zero3_keep": "never"}
TORCHTITAN_CP_ROTATE: Final = {"allgather": "allgather", "alltoall": "alltoall"}  # the plan's cp_rotate
#: float8 Linear layers: the converter torchtitan 0.2.2 registers (components/quantization/float8.py:238;
#: model_converter.py:61-63 looks every name of model.converters up in that registry)
TORCHTITAN_FLOAT8: Final = "quantize.linear.float8"
#: MXFP8 Linear layers: the converter torchtitan 0.2.2 registers (components/quantization/mx.py:171), its
#: [quantize.linear.mx] defaults (recipe mxfp8_cublas, the output layer left out: job_config.py:767-790)
TORCHTITAN_MX: Final = "quantize.linear.mx"
#: the experts' grouped-GEMM converters by precision: (the [quantize.grouped_mm] table, the converter name)
#: (float8.py:176-239, mx.py:99-172; job_config.py:756-808), and the module they convert: GroupedExperts
#: is ``moe.experts`` in every torchtitan MoE model (models/moe/moe.py:426)
TORCHTITAN_GROUPED: Final = {"fp8": ("float8", "quantize.grouped_mm.float8"), "mxfp8": ("mx", "quantize.grouped_mm.mx")}
TORCHTITAN_EXPERTS_FQN: Final = "experts"
#: every converter name torchtitan 0.2.2 registers (float8.py:238-239, mx.py:171-172); the grouped-GEMM
#: ones convert MoE experts beside their Linear converter
TORCHTITAN_CONVERTERS: Final = (TORCHTITAN_FLOAT8, "quantize.grouped_mm.float8", TORCHTITAN_MX, "quantize.grouped_mm.mx")
TORCHTITAN_FQN: Final = {"embedding": ["tok_embeddings"], "block": "layers.{i}", "head": ["norm", "output"]}
#: what a launch needs beside the plan, written as placeholders that torchtitan's config loader accepts
#: and its start-up refuses while they name nothing (the dataset is loaded from the path, the tokenizer
#: from the assets): (section key, key, value)
TORCHTITAN_PLACEHOLDERS: Final = (("training", "dataset_path", "SET-ME/dataset"),
                                  ("model", "hf_assets", "SET-ME/hf-assets"))
