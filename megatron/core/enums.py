"""Enums shared by the whole library (Megatron Core's ``megatron.core.enums``)."""

import enum


class ModelType(enum.Enum):
    """Kind of model a pretrain script builds: GPT and BERT are ``encoder_or_decoder``, T5 is
    ``encoder_and_decoder``."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
