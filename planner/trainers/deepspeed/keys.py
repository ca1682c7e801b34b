"""DeepSpeed's key names, in one place.

The exporter and the importer read configuration keys, flags and enum values only from here, so that
when the tool renames one, a single edit follows the rename. The release they are meant for is the
target's pinned version (``vocab/targets/<name>.yaml``). A value of ``None`` means the target has no
such key and the exporter leaves it out.
"""

from __future__ import annotations

from typing import Final

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
    # with sequence_parallel_size, deepspeed.initialize builds the (data_parallel, sequence_parallel) mesh
    # of the whole world from the config (deepspeed/__init__.py:543-546); otherwise the model code's mpu
    "data_parallel_size": "data_parallel_size",
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
