"""BERT's dataset: the sample mapping on hand-worked inputs, the generator it draws from, the
sample layout, and the masking statistics over many samples (bounds stated per test)."""

import os

import numpy as np
import pytest

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import _uint32_stream, build_sample_mapping
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceLowerCase
from tests.functional_tests.runner import REPO

VOCAB = str(REPO / "tests" / "data" / "bert-vocab.txt")


def test_target_lengths_come_from_the_standard_mt19937():
    # The C++ standard fixes the 10000th output of a default-constructed std::mt19937 (seed
    # 5489): 4123659995. Megatron's mapping draws its target lengths from that generator.
    stream = _uint32_stream(5489)
    values = [next(stream) for _ in range(10000)]
    assert values[-1] == 4123659995


def test_sample_mapping_on_hand_worked_documents():
    # Documents (sentence lengths): d0 [5, 4, 3, 2, 6]; d1 [1]; d2 [600, 2]; d3 []; d4 [6, 6];
    # d5 [9, 1].
    sizes = np.array([5, 4, 3, 2, 6, 1, 600, 2, 6, 6, 9, 1])
    docs = np.array([0, 5, 6, 8, 8, 10, 12])
    got = build_sample_mapping(docs, sizes, 1, 10**9, 8, 0.0, 1, min_num_sent=2)
    # d0: 5+4 reaches 8 with 3 sentences left -> (0, 2); 3+2+6 ends the document -> (2, 5).
    # d1 has one sentence (< 2), d2 holds a sentence > 512 tokens, d3 is empty: all skipped.
    # d4: 6 alone has one sentence left after it; 6+6 ends the document -> (8, 10).
    # d5: 9 reaches the target, but a sample never leaves one sentence behind -> (10, 12).
    assert got.tolist() == [[0, 2, 8], [2, 5, 8], [8, 10, 8], [10, 12, 8]]
    # Without the binary head one sentence suffices: d1 becomes a sample; d0's first sample
    # still needs 5+4 >= 8.
    got = build_sample_mapping(docs, sizes, 1, 10**9, 8, 0.0, 1, min_num_sent=1)
    assert got.tolist() == [[0, 2, 8], [2, 5, 8], [5, 6, 8], [8, 10, 8], [10, 12, 8]]
    # Whole epochs until the requested number is reached: 4 per epoch, 5 wanted -> 2 epochs.
    got = build_sample_mapping(docs, sizes, 100, 5, 8, 0.0, 1, min_num_sent=2)
    assert got.tolist() == [[0, 2, 8], [2, 5, 8], [8, 10, 8], [10, 12, 8]] * 2
    with pytest.raises(ValueError, match="no sample can be made from 2 documents.*at least 2"):
        build_sample_mapping(np.array([0, 1, 2]), np.array([3, 4]), 5, 10, 8, 0.0, 1, 2)


def test_short_targets_follow_short_seq_prob():
    # One document of 20000 one-token sentences: every target is drawn. With p = 0.1 a draw
    # r gives a short target 2 + r % (max - 1) when r % 10 == 0, so over ~N targets the short
    # fraction is 0.1 +- 3 sqrt(0.09 / N) and short targets are uniform on [2, max].
    sizes = np.ones(20000, dtype=np.int64)
    mapping = build_sample_mapping(np.array([0, 20000]), sizes, 1, 10**9, 50, 0.1, 7, 2)
    targets = mapping[:, 2]
    short = targets[targets < 50]
    n = len(targets)
    assert abs(len(short) / n - 0.1) < 3 * np.sqrt(0.09 / n)
    assert short.min() >= 2 and targets.max() == 50
    # Each sample ends at its target (one-token sentences) unless the document ends.
    lengths = mapping[:-1, 1] - mapping[:-1, 0]
    assert np.array_equal(lengths, np.maximum(targets[:-1], 2))


@pytest.fixture(scope="module")
def tokenizer():
    return BertWordPieceLowerCase(VOCAB)


def _dataset(bert_corpus, tokenizer, num_samples, **overrides):
    fields = dict(
        random_seed=1234,
        sequence_length=64,
        tokenizer=tokenizer,
        split="1,0,0",
        path_to_cache=None,
    )
    fields.update(overrides)
    config = BERTMaskedWordPieceDatasetConfig(**fields)
    low = IndexedDataset(bert_corpus)
    docs = np.arange(low.document_indices.shape[0] - 1, dtype=np.int32)
    return BERTMaskedWordPieceDataset(low, None, docs, num_samples, Split.train, config), low


def test_sample_layout_and_determinism(bert_corpus, tokenizer):
    ds, low = _dataset(bert_corpus, tokenizer, 300)
    again, _ = _dataset(bert_corpus, tokenizer, 300)
    other_seed, _ = _dataset(bert_corpus, tokenizer, 300, random_seed=99)
    swapped = 0
    for idx in range(200):
        sample = ds[idx]
        assert all(np.array_equal(sample[k], v) for k, v in again[idx].items())
        first, end, target = (int(v) for v in ds.sample_index[idx])
        n = int(sample["padding_mask"].sum())
        assert sample["padding_mask"][:n].all() and not sample["padding_mask"][n:].any()
        assert (sample["text"][n:] == tokenizer.pad).all()
        # Restore the masked tokens: [CLS] A [SEP] B [SEP], A and B the document's sentences
        # (swapped when is_random) trimmed at their ends to fit the target length.
        text = sample["text"].copy()
        masked = sample["loss_mask"] == 1
        text[masked] = sample["labels"][masked]
        assert (sample["labels"][~masked] == -1).all()
        tokens = text[:n].tolist()
        seps = [i for i, t in enumerate(tokens) if t == tokenizer.sep]
        assert tokens[0] == tokenizer.cls and len(seps) == 2 and seps[1] == n - 1
        types = sample["types"][:n].tolist()
        assert types == [0] * (seps[0] + 1) + [1] * (n - seps[0] - 1)
        a, b = tokens[1 : seps[0]], tokens[seps[0] + 1 : n - 1]
        assert len(a) + len(b) <= target and bool(sample["truncated"]) == (
            len(a) + len(b) < sum(len(low[i]) for i in range(first, end))
        )
        if sample["is_random"]:
            a, b = b, a
            swapped += 1
        whole = [int(t) for i in range(first, end) for t in low[i]]
        joined = " ".join(map(str, whole))
        assert " ".join(map(str, a)) in joined and " ".join(map(str, b)) in joined
        assert joined.index(" ".join(map(str, a))) <= joined.rindex(" ".join(map(str, b)))
        # Special tokens are never masked.
        assert not masked[0] and not masked[seps].any()
    # Sentence-order swaps: Binomial(200, 0.5), mean 100, sd ~7.1: within 4 sd.
    assert abs(swapped - 100) < 4 * 7.1
    assert any(not np.array_equal(ds[i]["text"], other_seed[i]["text"]) for i in range(5)), (
        "the seed must change the samples"
    )


def test_masking_statistics(bert_corpus, tokenizer):
    """Over 2000 samples (~19k masked tokens): the masked share of the tokens is within 1 % (abs.)
    of 15 %, and the [MASK] / random / kept split within 1 % of 80 / 10 / 10. The binomial sd of
    each share at this count is <= 0.3 %, so the bound is > 3 sd."""
    ds, _ = _dataset(bert_corpus, tokenizer, 2000)
    masked = tokens = to_mask = kept = 0
    for idx in range(2000):
        sample = ds[idx]
        where = sample["loss_mask"] == 1
        masked += int(where.sum())
        tokens += int(sample["padding_mask"].sum())
        to_mask += int((sample["text"][where] == tokenizer.mask).sum())
        kept += int((sample["text"][where] == sample["labels"][where]).sum())
    assert masked > 15000
    assert abs(masked / tokens - 0.15) < 0.01, masked / tokens
    assert abs(to_mask / masked - 0.8) < 0.01
    # A random replacement equal to the original (1 in ~8000) counts as kept: negligible.
    assert abs(kept / masked - 0.1) < 0.01
    assert abs((masked - to_mask - kept) / masked - 0.1) < 0.01


def test_index_is_cached_and_reloaded(bert_corpus, tokenizer, tmp_path):
    ds, _ = _dataset(bert_corpus, tokenizer, 50, path_to_cache=str(tmp_path))
    assert ds.built_anew_on_cache_miss
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].endswith(
        "-BERTMaskedWordPieceDataset-train-description.txt"
    )
    again, _ = _dataset(bert_corpus, tokenizer, 50, path_to_cache=str(tmp_path))
    assert not again.built_anew_on_cache_miss
    assert np.array_equal(ds.sample_index, again.sample_index)
    other, _ = _dataset(
        bert_corpus, tokenizer, 50, path_to_cache=str(tmp_path), masking_probability=0.2
    )
    assert other.built_anew_on_cache_miss  # the masking settings are part of the cache name


def test_without_binary_head_one_segment_and_single_sentence_samples(bert_corpus, tokenizer):
    ds, low = _dataset(bert_corpus, tokenizer, 300, classification_head=False)
    single = 0
    for idx in range(100):
        sample = ds[idx]
        first, end, _ = (int(v) for v in ds.sample_index[idx])
        single += end - first == 1
        n = int(sample["padding_mask"].sum())
        text = sample["text"][:n]
        assert text[0] == tokenizer.cls and text[-1] == tokenizer.sep
        assert (text[1:-1] != tokenizer.sep).all()  # [CLS] A [SEP]: no B segment
        assert not sample["types"].any() and sample["is_random"] == 0
    assert single > 0  # one sentence suffices without the sentence-order task


def test_blended_bert_datasets(bert_corpus, tokenizer):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=3,
        sequence_length=64,
        tokenizer=tokenizer,
        blend=([bert_corpus, bert_corpus], [0.25, 0.75]),
        split="80,10,10",
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, [200, 20, 10], lambda: True, config
    ).build()
    # Megatron blends sum(ceil(size * weight)) samples: ceil(2.5) + ceil(7.5) = 11 for test.
    assert (len(train), len(valid), len(test)) == (200, 20, 11)
    ids = [int(train[i]["dataset_id"]) for i in range(200)]
    assert ids.count(0) == 50 and ids.count(1) == 150  # the blend's greedy 1:3 schedule
    assert {"text", "labels", "loss_mask", "is_random"} <= set(train[0])
