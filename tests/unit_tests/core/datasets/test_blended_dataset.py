"""BlendedDataset: greedy blending index against a reference, counts vs weights, caching, errors."""

import os
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.index_helpers import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from megatron.core.datasets.utils import Split


def reference_blend(weights, size):
    """Megatron's blending rule (its C++ build_blending_indices), written out independently:
    sample n goes to argmax_i weight_i * max(n, 1) - count_i (ties: lowest i)."""
    counts = [0] * len(weights)
    index, sample = [], []
    for n in range(size):
        errors = [w * max(n, 1) - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index), np.array(sample)


def reference_exhaustive(sizes):
    total = sum(sizes)
    weights = [s / total for s in sizes]
    counts = [0] * len(sizes)
    index, sample = [], []
    for n in range(total):
        live = [i for i in range(len(sizes)) if counts[i] < sizes[i]]
        errors = {i: weights[i] * max(n, 1) - counts[i] for i in live}
        best = min(i for i in live if errors[i] == max(errors.values()))
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index), np.array(sample)


@pytest.mark.parametrize(
    "weights",
    [
        [0.5, 0.5],
        [0.3, 0.7],
        [0.2, 0.3, 0.5],
        [1.0],
        [0.25, 0.25, 0.25, 0.25],
        list(np.random.default_rng(0).random(9)),
    ],
)
def test_blending_index_matches_reference(weights):
    weights = (np.array(weights) / np.sum(weights)).tolist()
    size = 3001
    index, sample = build_blending_indices(weights, size)
    ref_index, ref_sample = reference_blend(weights, size)
    assert index.dtype == np.int16 and sample.dtype == np.int64
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(sample, ref_sample)
    counts = np.bincount(index, minlength=len(weights))
    assert np.all(np.abs(counts - np.array(weights) * size) <= 1.0)
    for n in (1, 10, 100, 1000):  # every prefix stays within one sample of its share
        c = np.bincount(index[:n], minlength=len(weights))
        assert np.all(np.abs(c - np.array(weights) * n) <= 1.0)


def test_tie_goes_to_lowest_index():
    index, _ = build_blending_indices([0.5, 0.5], 6)
    assert index.tolist() == [0, 1, 0, 1, 0, 1]
    index, _ = build_blending_indices([0.25] * 4, 4)
    assert index.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("sizes", [[5, 0, 3, 100], [1, 1], [7], [13, 29, 2]])
def test_exhaustive_blending_matches_reference(sizes):
    index, sample = build_exhaustive_blending_indices(sizes)
    ref_index, ref_sample = reference_exhaustive(sizes)
    np.testing.assert_array_equal(index, ref_index)
    np.testing.assert_array_equal(sample, ref_sample)
    assert np.bincount(index, minlength=len(sizes)).tolist() == sizes


# --- BlendedDataset over small mock datasets ---------------------------------------------------


def mock_datasets(tmp_path, sizes, seq_len=16):
    tok = SimpleNamespace(eod=0, pad=None, vocab_size=500, unique_identifiers={"class": "T"})
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=seq_len, tokenizer=tok, path_to_cache=str(tmp_path / "cache")
    )
    low = MockGPTDataset.build_low_level_dataset(None, config)
    datasets = [
        MockGPTDataset(
            low, None, np.arange(100 * k, 100 * k + 50, dtype=np.int32), n, Split.train, config
        )
        for k, n in enumerate(sizes)
    ]
    return datasets, config


def test_blended_dataset_samples_and_cache(tmp_path):
    datasets, config = mock_datasets(tmp_path, [40, 90])
    blend = BlendedDataset(datasets, [0.3, 0.7], 120, config)
    assert len(blend) == 120 and blend.built_anew_on_cache_miss
    counts = np.bincount(blend.dataset_index)
    assert abs(counts[0] - 36) <= 1 and abs(counts[1] - 84) <= 1
    for n in (0, 1, 57, 119):
        sample = blend[n]
        d, s = int(blend.dataset_index[n]), int(blend.dataset_sample_index[n])
        assert sample["dataset_id"] == d
        assert np.array_equal(sample["tokens"].numpy(), datasets[d][s]["tokens"].numpy())
    files = [f for f in os.listdir(tmp_path / "cache") if "BlendedDataset" in f]
    assert sorted(f.split("-", 1)[1] for f in files) == sorted(
        "BlendedDataset-train-" + s
        for s in ["description.txt", "dataset_index.npy", "dataset_sample_index.npy"]
    )
    again = BlendedDataset(datasets, [3, 7], 120, config)  # the same normalized weights
    assert not again.built_anew_on_cache_miss
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    np.testing.assert_array_equal(again.dataset_sample_index, blend.dataset_sample_index)


def test_deterministic_and_exhaustive(tmp_path):
    datasets, config = mock_datasets(tmp_path, [15, 25])
    config.path_to_cache = None
    a = BlendedDataset(datasets, [0.4, 0.6], 30, config)
    b = BlendedDataset(datasets, [0.4, 0.6], 30, config)
    np.testing.assert_array_equal(a.dataset_index, b.dataset_index)
    full = BlendedDataset(datasets, [15, 25], None, config)
    assert len(full) == 40 and np.bincount(full.dataset_index).tolist() == [15, 25]


def test_oversampling_is_an_error(tmp_path):
    datasets, config = mock_datasets(tmp_path, [5, 200])
    with pytest.raises(ValueError, match="oversamples dataset 0"):
        BlendedDataset(datasets, [0.5, 0.5], 100, config)


def test_bad_weights(tmp_path):
    datasets, config = mock_datasets(tmp_path, [5, 5])
    with pytest.raises(ValueError, match="positive"):
        BlendedDataset(datasets, [0.0, 1.0], 5, config)
    with pytest.raises(ValueError, match="2 datasets but 3 weights"):
        BlendedDataset(datasets, [1, 1, 1], 5, config)


def test_compiled_loop_equals_python_loop():
    from megatron.core.datasets import index_helpers

    if index_helpers._load_c_blend() is None:
        pytest.skip("no C compiler: the Python loop is the only path")
    rng = np.random.default_rng(3)
    for k in (2, 3, 7):
        weights = rng.random(k)
        weights = (weights / weights.sum()).tolist()
        fast = build_blending_indices(weights, 20000, accelerate=True)
        slow = build_blending_indices(weights, 20000, accelerate=False)
        for x, y in zip(fast, slow):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
    sizes = [40, 0, 3, 901]
    for x, y in zip(
        build_exhaustive_blending_indices(sizes, accelerate=True), reference_exhaustive(sizes)
    ):
        np.testing.assert_array_equal(x, y)
