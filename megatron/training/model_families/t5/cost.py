"""T5's FLOPs, parameters and activations. T5 is an encoder and a decoder (with
cross-attention) sharing one embedding and the LM head.

FLOPs (2 per multiply-add, 3x the forward for forward and backward), with B samples, encoder and
decoder lengths s_e and s_d, L_e and L_d layers: the encoder's layers are GPT's formula at s_e
without logits; the decoder's layers are GPT's at s_d plus, per layer, the cross-attention
(query and output projections over s_d, key/value projections over s_e, scores and context
s_d x s_e); the logits are computed over s_d. Parameters are GPT's for the embedding and the
encoder stack plus the decoder stack (its layers hold a cross-attention block and a norm more),
the decoder's final norm and the output bias. Activations are GPT's estimate for the encoder."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from megatron.training.theoretical_memory import (
    ParameterCount,
    activation_components,
)
from megatron.training.theoretical_memory import (
    count_parameters as _gpt_parameters,
)


def _decoder_layers(args) -> int:
    return args.decoder_num_layers or args.num_layers


def _layer_flops_per_token(args, s: int) -> float:
    """Forward+backward FLOPs of one self-attention + MLP layer per token at length ``s``."""
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    d = args.kv_channels or h // heads
    query_ratio = d * heads / h
    gated = 1.5 if args.swiglu else 1.0
    return (
        12.0
        * h
        * h
        * ((1 + groups / heads + s / h) * query_ratio + gated * args.ffn_hidden_size / h)
    )


def num_floating_point_operations(args, batch_size: int) -> float:
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    d = args.kv_channels or h // heads
    s_e, s_d = args.encoder_seq_length, args.decoder_seq_length
    encoder = args.encoder_num_layers * s_e * _layer_flops_per_token(args, s_e)
    decoder = _decoder_layers(args) * s_d * _layer_flops_per_token(args, s_d)
    q, kv = d * heads, d * groups
    cross = 6.0 * _decoder_layers(args) * (2 * s_d * h * q + 2 * s_e * h * kv + 2 * s_d * s_e * q)
    logits = 6.0 * s_d * h * args.padded_vocab_size
    return batch_size * (encoder + decoder + cross + logits)


@dataclass
class T5ParameterCount(ParameterCount):
    """GPT's count (embedding, encoder layers, encoder final norm) plus the decoder."""

    extra: int = 0
    """Decoder layers, decoder final norm and output bias."""
    extra_split: int = 0
    """The part of ``extra`` split over tensor-parallel ranks."""

    @property
    def total(self) -> int:
        return super().total + self.extra

    def on_rank(self, tp: int, pp: int, pp_rank: int, layers: int) -> int:
        return (
            super().on_rank(tp, pp, pp_rank, layers)
            + self.extra
            - self.extra_split
            + self.extra_split // tp
        )


def count_parameters(args, padded_vocab_size) -> T5ParameterCount:
    gpt = _gpt_parameters(args, padded_vocab_size)
    h = args.hidden_size
    norm = h if args.normalization == "RMSNorm" else 2 * h
    q = args.num_attention_heads * args.kv_channels
    kv = args.num_query_groups * args.kv_channels
    bias = bool(args.add_bias_linear)
    in_bias = bias or bool(args.add_qkv_bias)
    cross_split = h * q + h * 2 * kv + q * h + ((q + 2 * kv) if in_bias else 0)
    cross = norm + cross_split + (h if bias else 0)
    layer_split = gpt.per_layer - gpt.per_layer_replicated
    decoder_layers = _decoder_layers(args)
    vocab = padded_vocab_size or 0
    extra = decoder_layers * (gpt.per_layer + cross) + norm + vocab
    extra_split = decoder_layers * (layer_split + cross_split) + vocab
    return T5ParameterCount(**vars(gpt), extra=extra, extra_split=extra_split)


# The encoder's attention takes a mask tensor (padding): SDPA runs, no scores are kept.
t5_activation_components = partial(activation_components, explicit_mask=True)
