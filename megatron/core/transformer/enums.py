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
