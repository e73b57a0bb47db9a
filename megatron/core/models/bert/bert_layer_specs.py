"""Layer specs of BERT (Megatron Core's ``bert_layer_specs``): the GPT layer with a padding mask
instead of the causal one, so every token attends to every real token of its sample.

``bert_layer_local_spec`` and ``get_bert_layer_with_transformer_engine_spec()`` are
megatron-core's names; the latter gives the local layer (there is no Transformer Engine here).
"""

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


def get_bert_layer_local_spec() -> ModuleSpec:
    """An encoder layer: norm, self-attention under a padding mask, norm, MLP."""
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


bert_layer_local_spec = get_bert_layer_local_spec()


def get_bert_layer_with_transformer_engine_spec() -> ModuleSpec:
    """The local encoder layer (same parameters and names as megatron-core's local spec)."""
    return get_bert_layer_local_spec()
