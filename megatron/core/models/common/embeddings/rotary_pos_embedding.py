"""Megatron's import path for RoPE; the implementation lives in megatron.core.transformer."""

from megatron.core.transformer.rotary_pos_embedding import (  # noqa: F401
    RotaryEmbedding,
    apply_rotary_pos_emb,
    llama3_scale_inv_freq,
)
