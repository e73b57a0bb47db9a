"""Masked word-piece datasets (BERT, T5): sentence-level samples and n-gram masking.

The low-level dataset holds one sequence per sentence (``preprocess_data.py --split-sentences``)
grouped into documents. The sample mapping packs consecutive sentences of one document up to a
target length; each sample is then masked with whole-word n-grams, deterministically from
``random_seed`` and the sample's index.

Sample mapping (Megatron's ``build_mapping``), per epoch and document:

* documents with fewer than ``min_num_sent`` sentences are skipped, and so are documents of two or
  more sentences of which one is longer than ``LONG_SENTENCE_LEN`` tokens;
* a target length is drawn per sample: the maximum, or with probability about
  ``short_sequence_probability`` (one draw in ``round(1 / p)``) a uniform length in
  [2, maximum];
* sentences are added until the target is reached, provided more than one sentence remains in the
  document and the sample holds ``min_num_sent`` sentences; the end of a document always closes a
  sample;
* each sample is ``(first sentence, end sentence (exclusive), target length)``.

The target lengths come from MT19937 seeded with ``random_seed`` (numpy's ``RandomState(seed)``
is that generator with C++'s ``std::mt19937(seed)`` seeding; a test checks the standard's
10000th output). Megatron shuffles the mapping with ``std::mt19937_64(seed + 1)``; numpy has no
64-bit Mersenne twister, so here the mapping is permuted by ``RandomState(seed + 1)``: the same
samples as Megatron's in another order.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import (
    MegatronDataset,
    cache_paths,
    load_cache_array,
    save_cache,
)
from megatron.core.datasets.utils import Split, dist_rank, log_single_rank

logger = logging.getLogger(__name__)

LONG_SENTENCE_LEN = 512
"""A document with a sentence longer than this (and two or more sentences) is skipped."""

_MAX_EPOCHS = np.iinfo(np.int32).max - 1


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of a masked word-piece dataset (``sequence_length`` includes the special
    tokens)."""

    masking_probability: float = 0.15
    """Fraction of the tokens to mask (``--mask-prob``)."""

    short_sequence_probability: float = 0.10
    """Probability of a sample with a shorter random target length (``--short-seq-prob``)."""

    masking_max_ngram: int = 3
    """Longest masked n-gram, in whole words."""

    masking_do_full_word: bool = True
    """Mask whole words (a word piece starting with ``##`` joins the word before it)."""

    masking_do_permutation: bool = False
    """Shuffle masked n-grams (not used by BERT or T5; refused when set)."""

    masking_use_longer_ngrams: bool = False
    """Favour long n-grams (probabilities proportional to n instead of 1/n)."""

    masking_use_geometric_distribution: bool = False
    """Draw n from Geometric(0.2), capped at ``masking_max_ngram`` (SpanBERT, T5)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.masking_probability <= 1.0:
            raise ValueError(f"--mask-prob must be in [0, 1], got {self.masking_probability}")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(
                f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}"
            )
        if self.masking_max_ngram < 1:
            raise ValueError(f"masking_max_ngram must be >= 1, got {self.masking_max_ngram}")
        if self.masking_do_permutation:
            raise ValueError("masking_do_permutation is not implemented")


def _uint32_stream(seed: int, chunk: int = 4096):
    """The raw 32-bit outputs of MT19937 seeded like ``std::mt19937(seed)``."""
    state = np.random.RandomState(seed % 2**32)
    while True:
        for value in state.randint(0, 2**32, size=chunk, dtype=np.uint32):
            yield int(value)


def build_sample_mapping(
    document_indices: np.ndarray,
    sizes: np.ndarray,
    num_epochs: int,
    max_num_samples: int,
    max_seq_length: int,
    short_seq_prob: float,
    seed: int,
    min_num_sent: int,
) -> np.ndarray:
    """Unshuffled [N, 3] int64 (first sentence, end sentence, target length); see the module doc.

    ``document_indices`` are sentence offsets of documents (``len = documents + 1``), ``sizes``
    the sentence lengths. Whole epochs are mapped until ``max_num_samples`` is reached."""
    short_seq_ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    draws = _uint32_stream(seed)

    def target_length() -> int:
        if short_seq_ratio == 0:
            return max_seq_length
        r = next(draws)
        if r % short_seq_ratio == 0:
            return 2 + r % (max_seq_length - 1)
        return max_seq_length

    sizes = np.asarray(sizes)
    docs = np.asarray(document_indices, dtype=np.int64)
    samples: List[Tuple[int, int, int]] = []
    for _ in range(num_epochs):
        if len(samples) >= max_num_samples:
            break
        before = len(samples)
        for doc in range(len(docs) - 1):
            first, last = int(docs[doc]), int(docs[doc + 1])
            remaining = last - first
            if remaining < max(min_num_sent, 1):
                continue
            if remaining > 1 and int(sizes[first:last].max()) > LONG_SENTENCE_LEN:
                continue
            start, seq_len, num_sent = first, 0, 0
            target = target_length()
            for sent in range(first, last):
                seq_len += int(sizes[sent])
                num_sent += 1
                remaining -= 1
                if (
                    seq_len >= target and remaining > 1 and num_sent >= min_num_sent
                ) or remaining == 0:
                    samples.append((start, sent + 1, target))
                    start = sent + 1
                    target = target_length()
                    seq_len, num_sent = 0, 0
        if len(samples) == before:
            raise ValueError(
                f"no sample can be made from {len(docs) - 1} documents: each needs at least "
                f"{min_num_sent} sentences (split the text with --split-sentences) and no sentence "
                f"longer than {LONG_SENTENCE_LEN} tokens"
            )
    return np.array(samples, dtype=np.int64).reshape(-1, 3)


def shuffle_sample_mapping(mapping: np.ndarray, seed: int) -> np.ndarray:
    """The mapping's rows permuted by ``RandomState(seed + 1)``."""
    order = np.random.RandomState((seed + 1) % 2**32).permutation(mapping.shape[0])
    return np.ascontiguousarray(mapping[order])


@dataclass
class MaskedPredictions:
    """The result of :func:`create_masked_lm_predictions`."""

    tokens: List[int]
    """The tokens with masked positions replaced."""
    positions: List[int]
    """Masked positions, ascending."""
    labels: List[int]
    """The original token at each masked position."""
    spans: List[List[int]]
    """The masked n-grams (their positions), in position order."""
    spans_in_draw_order: List[List[int]]
    """The same n-grams in the order they were chosen (the first one's length is the drawn n
    unless the budget or the end of the sample shortened it)."""


def create_masked_lm_predictions(
    token_ids: List[int],
    target_sequence_length: int,
    rng: np.random.RandomState,
    config: MaskedWordPieceDatasetConfig,
    special_ids: Tuple[int, ...],
    is_word_start,
    token_mask,
) -> MaskedPredictions:
    """Whole-word n-gram masking (Megatron's ``_create_masked_lm_predictions``).

    Candidates are the words of ``token_ids`` (``special_ids`` excluded; with
    ``masking_do_full_word`` a piece for which ``is_word_start(id)`` is False joins the previous
    word). About ``masking_probability`` of the tokens are masked:
    ``min(p * target_length, max(1, round(p * len(tokens))))``. Candidate n-grams are visited in a
    random order; n is drawn with probability proportional to 1/n (or n, or geometric), shortened
    until the n-gram fits the budget, and skipped when it overlaps a masked token. Each masked
    token becomes ``token_mask(rng)`` (None: keep it)."""
    candidates: List[List[int]] = []
    for i, token in enumerate(token_ids):
        if token in special_ids:
            continue
        if config.masking_do_full_word and candidates and not is_word_start(token):
            candidates[-1].append(i)
        else:
            candidates.append([i])
    p = config.masking_probability
    n_maskings = min(p * target_sequence_length, max(1, int(round(len(token_ids) * p))))
    ngram_sizes = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
    nprobs = 1.0 / ngram_sizes
    nprobs = nprobs / nprobs.sum(keepdims=True)
    if config.masking_use_longer_ngrams:
        nprobs = nprobs[::-1]
    # Candidate c's n-gram is the words c .. c + n - 1 (fewer at the end of the sample). The
    # visiting order is a shuffle of the candidates (the same draws as shuffling their n-gram
    # lists, which Megatron does).
    order = list(range(len(candidates)))
    rng.shuffle(order)
    max_ngram = config.masking_max_ngram

    masked = list(token_ids)
    positions: List[int] = []
    labels: List[int] = []
    spans: List[List[int]] = []
    taken = set()
    for c in order:
        if len(positions) >= n_maskings:
            break
        if config.masking_use_geometric_distribution:
            n = min(int(rng.geometric(0.2)), max_ngram)
        else:
            n = int(rng.choice(ngram_sizes, p=nprobs))
        while True:
            indices = [i for word in candidates[c : c + n] for i in word]
            n -= 1
            if n_maskings >= len(positions) + len(indices):
                break
            if n == 0:
                indices = None
                break
        if indices is None or any(i in taken for i in indices):
            continue
        for i in indices:
            taken.add(i)
            replacement = token_mask(rng)
            masked[i] = token_ids[i] if replacement is None else replacement
            positions.append(i)
            labels.append(token_ids[i])
        spans.append(indices)
    order = np.argsort(positions, kind="stable")
    return MaskedPredictions(
        tokens=masked,
        positions=[positions[k] for k in order],
        labels=[labels[k] for k in order],
        spans=sorted(spans, key=lambda span: span[0]),
        spans_in_draw_order=spans,
    )


class MaskedWordPieceDataset(MegatronDataset):
    """Samples of whole sentences of one document (see the module doc); subclasses build the
    tokens of a sample in ``__getitem__`` and say how many special tokens it adds
    (``_get_token_padding``) and how many sentences a sample needs (``_min_num_sentences``).

    ``indexed_indices`` are the document ids of this split; ``num_samples`` None means one epoch.
    The mapping is cached as ``<md5>-<class>-<split>-{description.txt,sample_index.npy}``."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )
        self.sample_index = self._build_sample_index()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(
        dataset_path: str, config: MaskedWordPieceDatasetConfig
    ) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "masking_probability",
            "short_sequence_probability",
            "masking_max_ngram",
            "masking_do_full_word",
            "masking_do_permutation",
            "masking_use_longer_ngrams",
            "masking_use_geometric_distribution",
        ]

    def _get_token_padding(self) -> int:
        raise NotImplementedError

    def _min_num_sentences(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _sentences(self, idx: int) -> Tuple[List[np.ndarray], int]:
        if not 0 <= int(idx) < len(self):
            raise IndexError(
                f"sample {idx} out of range for a {self.index_split.name} split of "
                f"{len(self)} samples"
            )
        first, end, target = (int(v) for v in self.sample_index[idx])
        return [self.dataset.get(i) for i in range(first, end)], target

    def _cache_directory(self) -> Optional[str]:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    def _build_sample_index(self) -> np.ndarray:
        name = f"{type(self).__name__} {self.index_split.name}"
        directory = self._cache_directory()
        paths = None
        if directory:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
            paths = cache_paths(directory, base, ["description.txt", "sample_index.npy"])
            if all(os.path.isfile(p) for p in paths.values()):
                log_single_rank(logger, logging.INFO, f"Load the {name} indices from {directory}")
                index = load_cache_array(paths["sample_index.npy"])
                if index.ndim != 2 or index.shape[1] != 3:
                    raise ValueError(
                        f"{paths['sample_index.npy']}: index cache has shape {index.shape}, "
                        "expected [N, 3]; delete it to rebuild"
                    )
                return index
        self.built_anew_on_cache_miss = True
        started = time.time()
        if self.num_samples is None:
            num_epochs, max_samples = 1, np.iinfo(np.int64).max - 1
        else:
            num_epochs, max_samples = _MAX_EPOCHS, self.num_samples
        if len(self.indices) == 0:
            raise ValueError(f"the {name} split of {self.dataset_path} holds no document")
        documents = self.dataset.document_indices[self.indices[0] : self.indices[-1] + 2]
        mapping = build_sample_mapping(
            documents,
            self.dataset.sequence_lengths,
            num_epochs,
            max_samples,
            self.config.sequence_length - self._get_token_padding(),
            self.config.short_sequence_probability,
            self.config.random_seed,
            self._min_num_sentences(),
        )
        index = shuffle_sample_mapping(mapping, self.config.random_seed)
        log_single_rank(
            logger,
            logging.INFO,
            f"> built the {name} sample index in {time.time() - started:.2f} s: "
            f"{index.shape[0]} samples",
        )
        rank = dist_rank()
        if paths is not None and (rank is None or rank == 0):
            try:
                save_cache(paths, self.unique_description, {"sample_index.npy": index})
            except OSError as err:
                logger.warning(
                    f"cannot write the {name} index cache to {directory} ({err}); pass a "
                    "writable --data-cache-path to reuse indices between runs"
                )
        return index

    def _token_lookup(self) -> List[int]:
        tokenizer = self.config.tokenizer
        return sorted(int(i) for i in tokenizer.inv_vocab.keys())

    def _is_word_start(self, token: int) -> bool:
        piece = self.config.tokenizer.inv_vocab.get(int(token), "")
        return not piece.startswith("##")

    @staticmethod
    def _pad(values: List[int], length: int, pad: int) -> np.ndarray:
        array = np.full(length, pad, dtype=np.int64)
        array[: len(values)] = values
        return array
