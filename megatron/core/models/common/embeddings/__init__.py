"""Embeddings of language models (``from megatron.core.models.common.embeddings import ...``)."""

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding"]
