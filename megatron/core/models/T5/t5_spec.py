"""Layer specs of T5 (Megatron Core's ``t5_spec``): an encoder layer under a padding mask and a
decoder layer with causal self-attention and cross-attention over the encoder output."""

from megatron.core.transformer.attention import CrossAttention, SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
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
