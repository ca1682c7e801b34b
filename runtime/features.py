"""What of a model config the reference model (:mod:`runtime.model`) cannot build; no torch, so that
exports can say it without loading the runtime."""

from __future__ import annotations

from profiler.model_config import TransformerConfig


def unsupported_features(cfg: TransformerConfig) -> list[str]:
    """What of ``cfg`` the reference model cannot build (empty when it can)."""
    out = []
    if cfg.arch != "decoder":
        out.append(f"arch '{cfg.arch}' (only decoders)")
    if cfg.qk_norm:
        out.append("qk_norm")
    if cfg.type_vocab:
        out.append("token-type embeddings")
    if cfg.is_mla:
        out.append("multi-head latent attention")
    if cfg.sliding_window:
        out.append("sliding-window attention")
    if cfg.mtp_layers:
        out.append("multi-token prediction")
    if cfg.sandwich_norm:
        out.append("norms after the attention and the MLP")
    return out
