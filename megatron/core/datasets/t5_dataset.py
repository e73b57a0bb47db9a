"""T5's span-corruption samples: spans of whole words replaced by sentinels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    create_masked_lm_predictions,
)


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of T5's dataset; ``sequence_length`` is the encoder's."""

    sequence_length_encoder: Optional[int] = field(init=False, default=None)
    """The encoder's length (an alias of ``sequence_length``)."""

    sequence_length_decoder: Optional[int] = None
    """The decoder's length (``--decoder-seq-length``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        if self.sequence_length_decoder is None or self.sequence_length_decoder < 2:
            raise ValueError(
                f"T5 needs --decoder-seq-length >= 2, got {self.sequence_length_decoder}"
            )
        if not list(getattr(self.tokenizer, "additional_special_tokens_ids", None) or []):
            raise ValueError(
                "T5's span corruption needs sentinel tokens: give --vocab-extra-ids (e.g. 100) "
                "or a tokenizer with <extra_id_N> tokens"
            )


def span_corruption(
    tokens: List[int], spans: List[List[int]], sentinels: List[int], bos: int, eos: int
) -> Tuple[List[int], List[int], List[int]]:
    """(encoder input, decoder input, labels) of ``tokens`` whose ``spans`` (position lists in
    position order) are masked: span k becomes ``sentinels[k]`` in the encoder input; the decoder
    input is ``bos`` then each span's sentinel and tokens; the labels are each span's sentinel and
    tokens, then ``eos``."""
    encoder_input, decoder_input, labels = [], [bos], []
    start = 0
    for sentinel, span in zip(sentinels, spans):
        original = [tokens[i] for i in span]
        encoder_input += tokens[start : span[0]] + [sentinel]
        decoder_input += [sentinel] + original
        labels += [sentinel] + original
        start = span[-1] + 1
    encoder_input += tokens[start:]
    labels.append(eos)
    return encoder_input, decoder_input, labels


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """One sample per row of the sample mapping (see masked_dataset.py), built with
    ``RandomState((random_seed + idx) % 2**32)``:

    * the sentences are joined and cut to the target length (encoder length - 2);
    * whole-word spans are chosen with lengths min(Geometric(0.2), 10) words, ~``mask_prob`` of
      the tokens in all;
    * span k (in position order) is replaced in the encoder input by sentinel k
      (``additional_special_tokens_ids[k]``); the decoder input is ``[BOS]`` then, per span,
      its sentinel and its tokens; the labels are, per span, its sentinel and its tokens, then
      ``[EOS]`` (the decoder input shifted by one).

    Keys (Megatron's): ``text_enc``, ``text_dec`` (padded with the pad id), ``labels`` (-1 after
    the end), ``loss_mask`` (1 over the decoder's tokens), ``enc_mask`` / ``dec_mask`` (1 =
    token), ``truncated``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tokenizer = self.config.tokenizer
        self._special = (tokenizer.cls, tokenizer.sep)

    @staticmethod
    def _key_config_attributes():
        return MaskedWordPieceDataset._key_config_attributes() + ["sequence_length_decoder"]

    def _get_token_padding(self) -> int:
        return 2  # room for one [BOS] and one [EOS], as Megatron counts them

    def _min_num_sentences(self) -> int:
        return 1

    def _token_mask(self, rng: np.random.RandomState) -> int:
        return self.config.tokenizer.mask  # always replaced (the span becomes a sentinel)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        sentences, target = self._sentences(idx)
        cfg = self.config
        tokenizer = cfg.tokenizer
        rng = np.random.RandomState(seed=(cfg.random_seed + int(idx)) % 2**32)
        tokens = [int(t) for s in sentences for t in s]
        truncated = len(tokens) > target
        tokens = tokens[:target]
        predictions = create_masked_lm_predictions(
            tokens, target, rng, cfg, self._special, self._is_word_start, self._token_mask
        )
        sentinels = list(tokenizer.additional_special_tokens_ids)
        if len(predictions.spans) > len(sentinels):
            raise ValueError(
                f"sample {idx} has {len(predictions.spans)} masked spans but the tokenizer has "
                f"{len(sentinels)} sentinels (--vocab-extra-ids)"
            )
        encoder_input, decoder_input, decoder_output = span_corruption(
            tokens, predictions.spans, sentinels, tokenizer.bos, tokenizer.eos
        )

        enc_len, dec_len = cfg.sequence_length_encoder, cfg.sequence_length_decoder
        if len(decoder_input) > dec_len:
            raise ValueError(
                f"sample {idx}: the decoder needs {len(decoder_input)} tokens but "
                f"--decoder-seq-length is {dec_len}; raise it (or lower --mask-prob)"
            )
        labels = np.full(dec_len, -1, dtype=np.int64)
        labels[: len(decoder_output)] = decoder_output
        loss_mask = np.zeros(dec_len, dtype=np.int64)
        loss_mask[: len(decoder_input)] = 1
        enc_mask = np.zeros(enc_len, dtype=np.int64)
        enc_mask[: len(encoder_input)] = 1
        dec_mask = np.zeros(dec_len, dtype=np.int64)
        dec_mask[: len(decoder_input)] = 1
        return {
            "text_enc": self._pad(encoder_input, enc_len, tokenizer.pad),
            "text_dec": self._pad(decoder_input, dec_len, tokenizer.pad),
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }
