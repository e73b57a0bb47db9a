"""Layer specs of T5 (Megatron Core's ``t5_spec``): an encoder layer under a padding mask and a
decoder layer with causal self-attention and cross-attention over the encoder output.

The ``*_block_spec(num_layers)`` functions are megatron-core's names for a whole stack; the
Transformer Engine ones give the local layers (there is no Transformer Engine here)."""

from megatron.core.transformer.attention import CrossAttention, SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def get_t5_encoder_layer_local_spec() -> ModuleSpec:
    """norm, self-attention under the encoder's padding mask, norm, MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.padding}
            ),
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )


def get_t5_decoder_layer_local_spec() -> ModuleSpec:
    """norm, causal self-attention, norm, cross-attention, norm, MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}
            ),
            pre_cross_attn_layernorm=build_norm,
            cross_attention=ModuleSpec(
                module=CrossAttention, params={"attn_mask_type": AttnMaskType.padding}
            ),
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` encoder layers and the final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[get_t5_encoder_layer_local_spec()] * num_layers, layer_norm=build_norm
    )


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """``num_layers`` decoder layers and the final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[get_t5_decoder_layer_local_spec()] * num_layers, layer_norm=build_norm
    )


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int):
    """The local encoder stack."""
    return get_t5_encoder_with_local_block_spec(num_layers)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int):
    """The local decoder stack."""
    return get_t5_decoder_with_local_block_spec(num_layers)
