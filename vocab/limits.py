"""The supported ranges of a plan's sizes: read by the plan vocabulary and by the model reader,
which does not need the vocabulary's classes."""

#: the largest supported degree of any axis, and of the whole mesh (GPUs)
MAX_GPUS = 1 << 20
#: the longest supported sequence (tokens per sample)
MAX_SEQ_LEN = 10_000_000
#: the largest supported global batch (samples per step) and micro-batch
MAX_GLOBAL_BATCH = 1 << 24
