from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]
