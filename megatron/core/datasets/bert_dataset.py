"""BERT's pretraining samples: ``[CLS] A [SEP] B [SEP]`` with a sentence-order label and masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    create_masked_lm_predictions,
)


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of BERT's dataset."""

    classification_head: bool = True
    """Split each sample into A and B and emit the sentence-order label (``--bert-no-binary-head``
    turns it off); samples then hold at least two sentences."""


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """One sample per row of the sample mapping (see masked_dataset.py), built with
    ``RandomState((random_seed + idx) % 2**32)``:

    * with the binary head, the sentences are cut at a random pivot into A and B, swapped with
      probability 0.5 (``is_random`` = 1: the sentence-order-prediction label);
    * while A + B exceed the target length, the longer one loses a token at its front or back
      (chosen at random);
    * ``[CLS] A [SEP] B [SEP]`` with token types 0 (up to the first [SEP]) and 1;
    * whole-word n-gram masking (n <= 3): 80 % [MASK], 10 % a random vocabulary id, 10 % kept.

    Keys (Megatron's): ``text``, ``types``, ``labels`` (the original token at masked positions,
    -1 elsewhere), ``is_random``, ``padding_mask`` (1 = token), ``loss_mask`` (1 at masked
    positions), ``truncated``; all padded to ``sequence_length``: text with the pad id, types with
    0 (a valid token-type row whatever the pad id; pad positions are masked keys anyway).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tokenizer = self.config.tokenizer
        self._special = (tokenizer.cls, tokenizer.sep)
        self._token_ids = self._token_lookup()

    def _get_token_padding(self) -> int:
        return 3  # [CLS], [SEP], [SEP]

    def _min_num_sentences(self) -> int:
        return 2 if self.config.classification_head else 1

    def _token_mask(self, rng: np.random.RandomState) -> Optional[int]:
        if rng.random_sample() < 0.8:
            return self.config.tokenizer.mask
        if rng.random_sample() >= 0.5:
            return self._token_ids[rng.randint(0, len(self._token_ids))]
        return None

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        sentences, target = self._sentences(idx)
        cfg = self.config
        tokenizer = cfg.tokenizer
        rng = np.random.RandomState(seed=(cfg.random_seed + int(idx)) % 2**32)
        if target > cfg.sequence_length:
            raise ValueError(f"sample {idx}: target length {target} > {cfg.sequence_length}")

        pivot = len(sentences)
        is_random = False
        if cfg.classification_head:
            if len(sentences) < 2:
                raise ValueError(f"sample {idx} has {len(sentences)} sentence(s); needs 2")
            pivot = int(rng.randint(low=1, high=len(sentences)))
            is_random = bool(rng.random_sample() < 0.5)
        split_a: List[int] = [int(t) for s in sentences[:pivot] for t in s]
        split_b: List[int] = [int(t) for s in sentences[pivot:] for t in s]
        if is_random:
            split_a, split_b = split_b, split_a

        truncated = len(split_a) + len(split_b) > target
        while len(split_a) + len(split_b) > target:
            longer = split_a if len(split_a) >= len(split_b) else split_b
            if rng.random_sample() < 0.5:
                del longer[0]
            else:
                del longer[-1]

        tokens = [tokenizer.cls, *split_a, tokenizer.sep]
        types = [0] * len(tokens)
        if split_b:
            tokens += [*split_b, tokenizer.sep]
            types += [1] * (len(split_b) + 1)

        predictions = create_masked_lm_predictions(
            tokens,
            target,
            rng,
            cfg,
            self._special,
            self._is_word_start,
            self._token_mask,
        )
        length = cfg.sequence_length
        labels = np.full(length, -1, dtype=np.int64)
        labels[predictions.positions] = predictions.labels
        loss_mask = np.zeros(length, dtype=np.int64)
        loss_mask[predictions.positions] = 1
        padding_mask = np.zeros(length, dtype=np.int64)
        padding_mask[: len(tokens)] = 1
        return {
            "text": self._pad(predictions.tokens, length, tokenizer.pad),
            "types": self._pad(types, length, 0),
            "labels": labels,
            "is_random": int(is_random),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }
