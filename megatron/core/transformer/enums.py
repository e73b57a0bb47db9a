"""Enums of the transformer (Megatron Core names and values)."""

import enum


class AttnType(enum.Enum):
    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnBackend(enum.Enum):
    """Attention kernel (``--attention-backend``): flash/fused take torch's
    scaled_dot_product_attention, unfused/local the unfused path where it applies, auto picks."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
