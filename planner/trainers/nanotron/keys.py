"""Nanotron's key names, in one place.

The exporter and the importer read configuration keys, flags and enum values only from here, so that
when the tool renames one, a single edit follows the rename. The release they are meant for is the
target's pinned version (``vocab/targets/<name>.yaml``). A value of ``None`` means the target has no
such key and the exporter leaves it out.
"""

from __future__ import annotations

from typing import Final

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
    "model": "model",  # ModelArgs: model_config, init_method, dtype
    "model_config": "model_config",
    "init_method": "init_method",
    "dtype": "dtype",
    "tokenizer": "tokenizer",  # TokenizerArgs
    "tokenizer_path": "tokenizer_name_or_path",  # a placeholder in an export
}
#: nanotron 0.4's LlamaConfig (config/models_config.py:19-42) field for each of the model's facts
NANOTRON_LLAMA: Final[dict[str, str]] = {
    "hidden": "hidden_size", "ffn_hidden": "intermediate_size", "heads": "num_attention_heads",
    "layers": "num_hidden_layers", "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
    "max_seq": "max_position_embeddings", "norm_eps": "rms_norm_eps", "tied_embeddings": "tie_word_embeddings",
}
#: the precision -> ModelArgs.dtype
NANOTRON_DTYPES: Final = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16", "mxfp8": "bfloat16"}
NANOTRON_PP_ENGINES: Final = {"gpipe": "afab", "1f1b": "1f1b"}
NANOTRON_TP_MODES: Final = {True: "REDUCE_SCATTER", False: "ALL_REDUCE"}
#: the tokenizer a launch needs, written as a placeholder nanotron's config loader accepts and its start-up
#: refuses while it names nothing (the tokenizer is loaded from it)
NANOTRON_TOKENIZER_PLACEHOLDER: Final = "SET-ME/tokenizer"
