"""Layer specs of GPT models (Megatron Core's ``gpt_layer_specs``).

The local spec is this code base's plain PyTorch layer; its module names are Megatron Core's,
so checkpoints keep their names: ``input_layernorm``, ``self_attention.{linear_qkv,
q_layernorm, k_layernorm, core_attention, linear_proj}``, ``pre_mlp_layernorm``,
``mlp.{linear_fc1, linear_fc2}``.
"""

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_config import is_moe_layer
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def get_gpt_layer_local_spec(moe: bool = False) -> ModuleSpec:
    """A decoder layer: norm, causal self-attention, norm, MLP (``moe``: a mixture of experts).
    The norm type (LayerNorm or RMSNorm), QK-norm, biases, activation and grouped-query
    attention follow the config."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}
            ),
            pre_mlp_layernorm=build_norm,
            mlp=MoELayer if moe else MLP,
        ),
    )


def get_gpt_decoder_block_spec(config) -> TransformerBlockSubmodules:
    """One spec per layer of the model and the final norm: where layers differ (an MoE layer
    every few layers, ``--moe-layer-freq``) they differ here."""
    return TransformerBlockSubmodules(
        layer_specs=[
            get_gpt_layer_local_spec(moe=is_moe_layer(config, i)) for i in range(config.num_layers)
        ],
        layer_norm=build_norm,
    )
