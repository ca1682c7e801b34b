"""The local Hugging Face cache, read and never filled (shardplan does not touch the network):
where it is, and the ``config.json`` of a model id in it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from profiler.model_config import HF_ID


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (``XDG_CACHE_HOME`` in place of ``~/.cache`` where set)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    try:
        base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    except RuntimeError:  # no home directory to expand
        base = Path(".cache")
    return base / "huggingface" / "hub"


def is_hf_id(spec: str) -> bool:
    """Whether ``spec`` has the shape of a Hugging Face model id (``org/name`` or ``name``)."""
    return len(spec) <= 200 and re.fullmatch(HF_ID, spec) is not None


def repo_folder(repo_id: str) -> str:
    """The cache's folder of ``repo_id`` (``org/name`` -> ``models--org--name``)."""
    return "models--" + repo_id.replace("/", "--")


def cached_hf_config(repo_id: str, cache_dir: Path | None = None) -> Path | None:
    """The ``config.json`` of ``repo_id`` in the local Hugging Face cache
    (``models--org--name/snapshots/<revision>/config.json``): the revision ``refs/main`` names, else
    the newest snapshot holding one; None where the cache has none. The folder is matched ignoring
    case where no folder has the exact name."""
    root = hf_hub_cache() if cache_dir is None else cache_dir
    want = repo_folder(repo_id)
    try:
        folder = root / want
        if not folder.is_dir():
            folder = next((p for p in sorted(root.iterdir()) if p.name.lower() == want.lower() and p.is_dir()),
                          None)
            if folder is None:
                return None
        snapshots = folder / "snapshots"
        ref = folder / "refs" / "main"
        if ref.is_file():
            with open(ref, encoding="utf-8", errors="replace") as f:
                revision = f.read(256).strip()
            if re.fullmatch(r"[\w.-]+", revision):
                config = snapshots / revision / "config.json"
                if config.is_file():
                    return config
        found = [d for d in snapshots.iterdir() if (d / "config.json").is_file()]
        if not found:
            return None
        return max(found, key=lambda d: (d.stat().st_mtime, d.name)) / "config.json"
    except (OSError, ValueError):  # no cache, an unreadable one, a name no file system takes
        return None
