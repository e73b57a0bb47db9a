"""Decoder block specs with an experimental attention variant (Megatron Core's
``experimental_attention_variant_module_specs``): gated delta net layers
(``--experimental-attention-variant gated_delta_net``) mixed with softmax-attention layers by
``--linear-attention-freq``.

The attention pattern and the MLP pattern are independent, as in Megatron: each layer takes
gated delta net or self-attention from the linear-attention pattern, and an MoE or a dense MLP
from ``--moe-layer-freq``. The layers are the local spec's (separate ``input_layernorm``; the
gated delta net's modules are ``self_attention.{in_proj, conv1d, dt_bias, A_log, out_norm,
out_proj}``).
"""

from typing import List, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.config_rules import (
    LINEAR_ATTENTION_VARIANTS,
    linear_attention_pattern,
)
from megatron.core.transformer.moe.moe_config import is_moe_layer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def is_linear_attention_variant(experimental_attention_variant: Optional[str]) -> bool:
    """Whether the variant is a linear attention (its layers follow --linear-attention-freq)."""
    return experimental_attention_variant in LINEAR_ATTENTION_VARIANTS


def get_linear_attention_pattern(config) -> List[int]:
    """Per layer: 1 for linear attention, 0 for softmax attention."""
    if not is_linear_attention_variant(config.experimental_attention_variant):
        return [0] * config.num_layers
    return linear_attention_pattern(config.linear_attention_freq, config.num_layers)


def get_gated_delta_net_module_spec(config=None) -> ModuleSpec:
    """The gated delta net in a layer's self-attention slot."""
    del config
    return ModuleSpec(module=GatedDeltaNet)


def get_transformer_block_with_experimental_attention_variant_spec(
    config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> TransformerBlockSubmodules:
    """One spec per layer of the whole model and the final norm (the TransformerBlock takes its
    pipeline stage's layers from the list, so ``vp_stage``/``pp_rank`` are unused)."""
    del vp_stage, pp_rank
    pattern = get_linear_attention_pattern(config)
    specs = []
    for i in range(config.num_layers):
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if is_moe_layer(config, i) else None,
            qk_layernorm=config.qk_layernorm and not pattern[i],
        )
        if pattern[i]:
            spec.submodules.self_attention = get_gated_delta_net_module_spec(config)
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=build_norm)
