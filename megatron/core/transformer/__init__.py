"""Transformer building blocks. ``TransformerConfig`` is imported on first use, so that the
torch-free modules of this package (``enums``) can be imported without torch: the flag
definitions of megatron/training/flags name ``AttnBackend``."""

__all__ = ["TransformerConfig"]


def __getattr__(name):
    if name == "TransformerConfig":
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
