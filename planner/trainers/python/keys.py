"""The names the python export's script imports from the project's runtime, in one place.

The exporter reads them only from here, so that when the runtime renames one, a single edit follows
the rename.
"""

from __future__ import annotations

from typing import Final

# ---- python: the project's own runtime ------------------------------------------------------------
PYTHON: Final[dict[str, str | None]] = {
    "apply_module": "runtime.apply", "apply": "apply_plan",  # apply_plan(model, plan) -> model
    "optimizer": "build_optimizer",  # build_optimizer(model, cls, **kwargs), in apply_module
    "model_module": "runtime.model", "model": "Transformer", "config": "resolve_config",
    "train_module": "runtime.train", "step": "train_step",  # train_step(model, tokens, targets, n_mb)
    "batch": "local_batch",  # local_batch(model, batch) -> this rank's rows and tokens, in train_module
}
