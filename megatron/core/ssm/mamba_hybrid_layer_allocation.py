"""The layer pattern of a hybrid model (``--hybrid-override-pattern`` / ``--hybrid-layer-pattern``):
one symbol per layer, ``M`` Mamba, ``*`` self-attention, ``-`` MLP, ``E`` mixture of experts;
``|`` marks a pipeline-stage boundary (Megatron's newer pattern syntax)."""

from typing import List

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from .mamba_layer import MambaLayer

MAMBA, ATTENTION, MLP_SYMBOL, MOE, STAGE = "M", "*", "-", "E", "|"
SYMBOLS = (MAMBA, ATTENTION, MLP_SYMBOL, MOE)


def layer_symbols(pattern: str) -> List[str]:
    """The layers' symbols of ``pattern`` (stage boundaries dropped); ValueError naming a
    symbol that is none of M * - E |."""
    symbols = []
    for char in pattern:
        if char == STAGE:
            continue
        if char not in SYMBOLS:
            raise ValueError(
                f"--hybrid-override-pattern {pattern!r}: unknown layer symbol {char!r} "
                "(M mamba, * attention, - MLP, E MoE, | pipeline stage boundary)"
            )
        symbols.append(char)
    return symbols


def stage_layer_counts(pattern: str) -> List[int]:
    """Layers per pipeline stage of a pattern with ``|`` boundaries."""
    return [len(layer_symbols(part)) for part in pattern.split(STAGE)]


def layer_spec(symbol: str) -> ModuleSpec:
    """The module of one layer symbol, with Megatron's module names (an attention layer has no
    MLP and an MLP layer no attention, as in Megatron's hybrid stack)."""
    if symbol == MAMBA:
        return ModuleSpec(module=MambaLayer)
    if symbol == ATTENTION:
        submodules = TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal}
            ),
        )
    else:
        submodules = TransformerLayerSubmodules(
            pre_mlp_layernorm=build_norm, mlp=MoELayer if symbol == MOE else MLP
        )
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def hybrid_block_spec(pattern: str) -> TransformerBlockSubmodules:
    """One spec per layer of the pattern, and the final norm."""
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(s) for s in layer_symbols(pattern)], layer_norm=build_norm
    )
