"""BERT's FLOPs, parameters and activations. BERT is the GPT layer stack without the causal
mask, plus the masked-LM and sentence-order heads.

FLOPs are GPT's (same layers, tied output layer) plus the heads: the LM-head transform
(h x h per token), and with the binary head the pooler (h x h) and the binary classifier (h x 2)
per sample; each at 2 FLOPs per multiply-add, times 3 for forward and backward. Parameters are
GPT's plus the token-type embedding (first stage) and the heads (last stage). Activations are
GPT's: the layers are the same and the heads' are small next to the logits."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from megatron.training.flops import num_floating_point_operations as _gpt_flops
from megatron.training.theoretical_memory import (
    ParameterCount,
    activation_components,
)
from megatron.training.theoretical_memory import (
    count_parameters as _gpt_parameters,
)


def num_floating_point_operations(args, batch_size: int) -> float:
    h, s = args.hidden_size, args.seq_length
    heads = 6.0 * batch_size * s * h * h
    if args.bert_binary_head:
        heads += 6.0 * batch_size * (h * h + 2 * h)
    return _gpt_flops(args, batch_size) + heads


@dataclass
class BertParameterCount(ParameterCount):
    """GPT's count plus BERT's extra tables and heads."""

    first_stage_extra: int = 0
    """Token-type embedding (2 x h with the binary head)."""
    last_stage_extra: int = 0
    """LM-head transform (dense + norm), output-layer bias, pooler and binary head."""
    last_stage_extra_split: int = 0
    """The part of ``last_stage_extra`` split over tensor-parallel ranks (the output bias)."""

    @property
    def total(self) -> int:
        return super().total + self.first_stage_extra + self.last_stage_extra

    def on_rank(self, tp: int, pp: int, pp_rank: int, layers: int) -> int:
        count = super().on_rank(tp, pp, pp_rank, layers)
        if pp_rank == 0:
            count += self.first_stage_extra
        if pp_rank == pp - 1:
            split = self.last_stage_extra_split
            count += self.last_stage_extra - split + split // tp
        return count


def count_parameters(args, padded_vocab_size) -> BertParameterCount:
    gpt = _gpt_parameters(args, padded_vocab_size)
    h = args.hidden_size
    norm = h if args.normalization == "RMSNorm" else 2 * h
    vocab = padded_vocab_size or 0
    last = h * h + h + norm + vocab
    first = 0
    if args.bert_binary_head:
        first = 2 * h
        last += h * h + h + 2 * h + 2
    return BertParameterCount(
        **vars(gpt), first_stage_extra=first, last_stage_extra=last, last_stage_extra_split=vocab
    )


# Its attention takes a mask tensor (the padding mask), so SDPA runs and keeps no scores.
bert_activation_components = partial(activation_components, explicit_mask=True)
