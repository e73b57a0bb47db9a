"""Split/blend parsing, the config, and BlendedMegatronDatasetBuilder in every configuration."""

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    get_blend_from_list,
    parse_and_normalize_split,
)
from tests.unit_tests.dist_utils import run_distributed

TOK = SimpleNamespace(
    eod=0, pad=None, vocab_size=1000, unique_identifiers={"class": "TestTokenizer"}
)


def write_dataset(prefix, num_docs, seed):
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(2, 80))
        builder.add_document(np.append(rng.integers(1, 1000, n - 1), 0), [n])
    builder.finalize(prefix + ".idx")
    return prefix


# --- parsing -------------------------------------------------------------------------------------


def test_parse_split():
    assert parse_and_normalize_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_and_normalize_split("969, 30, 1") == [0.969, 0.03, 0.001]
    assert parse_and_normalize_split("99/1/0") == [0.99, 0.01, 0.0]
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    assert parse_and_normalize_split("0.5 0.5") == [0.5, 0.5, 0.0]
    for bad in ["0,0,0", "1,2,3,4", "90,-5,15"]:
        with pytest.raises(ValueError, match="--split"):
            parse_and_normalize_split(bad)


def test_split_matrix():
    assert convert_split_vector_to_split_matrix([0.5, 0.5, 0.0]) == [(0, 0.5), (0.5, 1.0), None]
    assert convert_split_vector_to_split_matrix([0.0, 0.25, 0.75]) == [None, (0, 0.25), (0.25, 1.0)]


def test_get_blend_from_list():
    assert get_blend_from_list(None) is None
    assert get_blend_from_list(["a"]) == (["a"], None)
    assert get_blend_from_list(["a", "b", "c"]) == (["a", "b", "c"], None)
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["1", "a", "x", "b"]) == (["1", "a", "x", "b"], None)


def test_config_rules():
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=TOK)
    assert config.mock and config.split_matrix == [(0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.0)]
    with pytest.raises(ValueError, match="--split"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, tokenizer=TOK, blend=(["a"], None))
    with pytest.raises(ValueError, match="incompatible"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=8,
            tokenizer=TOK,
            blend=(["a"], None),
            split="1",
            blend_per_split=[(["a"], None), None, None],
        )
    with pytest.raises(ValueError, match="2 prefixes but 1 weights"):
        GPTDatasetConfig(
            random_seed=1, sequence_length=8, tokenizer=TOK, blend=(["a", "b"], [1.0]), split="1"
        )
    per_split = GPTDatasetConfig(
        random_seed=1, sequence_length=8, tokenizer=TOK, blend_per_split=[(["a"], None), None, None]
    )
    assert not per_split.mock and per_split.split_matrix is None


# --- building ------------------------------------------------------------------------------------


def config_for(tmp_path, **kw):
    kw.setdefault("split", "80,15,5")
    return GPTDatasetConfig(
        random_seed=1234,
        sequence_length=16,
        tokenizer=TOK,
        path_to_cache=str(tmp_path / "cache"),
        **kw,
    )


def test_single_prefix_splits(tmp_path):
    prefix = write_dataset(str(tmp_path / "a"), 101, 0)
    config = config_for(tmp_path, blend=([prefix], None))
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [200, 20, 5], lambda: True, config
    ).build()
    assert all(isinstance(d, GPTDataset) for d in (train, valid, test))
    bounds = [0, round(0.8 * 101), round(0.95 * 101), 101]
    for d, lo, hi in zip((train, valid, test), bounds[:-1], bounds[1:]):
        np.testing.assert_array_equal(d.indices, np.arange(lo, hi))
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 5
    assert train.index_split == Split.train and test.index_split == Split.test
    # a zero-width split is None
    config = config_for(tmp_path, blend=([prefix], None), split="100,0,0")
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [10, 10, 10], lambda: True, config
    ).build()
    assert train is not None and valid is None and test is None


def test_weighted_blend_sizes(tmp_path):
    a = write_dataset(str(tmp_path / "a"), 300, 1)
    b = write_dataset(str(tmp_path / "b"), 300, 2)
    config = config_for(tmp_path, blend=([a, b], [1.0, 3.0]))
    sizes = [400, 40, 10]
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    for split, size, blend in zip(Split, sizes, datasets):
        assert isinstance(blend, BlendedDataset)
        targets = [math.ceil(size * w) for w in (0.25, 0.75)]
        assert len(blend) == sum(targets)
        for component, target in zip(blend.datasets, targets):
            assert component.num_samples == math.ceil(target * 1.005)
            assert component.index_split == split
        counts = np.bincount(blend.dataset_index, minlength=2)
        assert np.all(np.abs(counts - np.array([0.25, 0.75]) * len(blend)) <= 1)
    sample = datasets[0][3]
    assert set(sample) == {
        "dataset_id",
        "tokens",
        "labels",
        "attention_mask",
        "loss_mask",
        "position_ids",
    }


def test_unweighted_blend_uses_one_epoch_each(tmp_path):
    a = write_dataset(str(tmp_path / "a"), 50, 1)
    b = write_dataset(str(tmp_path / "b"), 150, 2)
    config = config_for(tmp_path, blend=([a, b], None))
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [10**6, 3, None], lambda: True, config
    ).build()
    lengths = [len(d) for d in train.datasets]
    assert all(d.num_samples is None for d in train.datasets)
    assert len(train) == sum(lengths)  # the target exceeds one epoch of everything
    assert np.bincount(train.dataset_index).tolist() == lengths
    assert len(valid) == 3


def test_blend_per_split(tmp_path):
    a = write_dataset(str(tmp_path / "a"), 60, 1)
    b = write_dataset(str(tmp_path / "b"), 60, 2)
    c = write_dataset(str(tmp_path / "c"), 60, 3)
    config = GPTDatasetConfig(
        random_seed=1,
        sequence_length=16,
        tokenizer=TOK,
        path_to_cache=str(tmp_path / "cache"),
        blend_per_split=[([a, b], [0.5, 0.5]), ([c], None), None],
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [100, 10, 10], lambda: True, config
    ).build()
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert isinstance(valid, GPTDataset) and valid.dataset_path == c and len(valid.indices) == 60
    assert test is None


def test_mock_build():
    config = GPTDatasetConfig(random_seed=1, sequence_length=32, tokenizer=TOK)
    train, valid, test = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [50, 5, 2], lambda: True, config
    ).build()
    assert (len(train), len(valid), len(test)) == (50, 5, 2)
    assert train[0]["tokens"].shape == (32,)


def test_missing_prefix_is_named(tmp_path):
    a = write_dataset(str(tmp_path / "a"), 10, 1)
    missing = str(tmp_path / "nope_text_document")
    config = config_for(tmp_path, blend=([a, missing], [0.5, 0.5]))
    with pytest.raises(FileNotFoundError, match="nope_text_document"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 1, 1], lambda: True, config).build()


def test_weights_without_size_is_an_error(tmp_path):
    config = config_for(tmp_path, blend=(["a", "b"], [0.5, 0.5]))
    with pytest.raises(ValueError, match="no target size"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, None, 1], lambda: True, config)


def test_second_build_loads_the_cache(tmp_path):
    a = write_dataset(str(tmp_path / "a"), 80, 1)
    b = write_dataset(str(tmp_path / "b"), 80, 2)
    config = config_for(tmp_path, blend=([a, b], [0.4, 0.6]))
    first = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 5], lambda: True, config).build()
    second = BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, 5], lambda: True, config).build()
    for x, y in zip(first, second):
        assert x.built_anew_on_cache_miss and not y.built_anew_on_cache_miss
        assert all(not d.built_anew_on_cache_miss for d in y.datasets)
        np.testing.assert_array_equal(x.dataset_index, y.dataset_index)
        for dx, dy in zip(x.datasets, y.datasets):
            np.testing.assert_array_equal(dx.sample_index, dy.sample_index)
            np.testing.assert_array_equal(dx.shuffle_index, dy.shuffle_index)
    assert not [f for f in os.listdir(tmp_path / "cache") if ".tmp" in f]


# --- distributed: rank 0 writes the cache, rank 1 reads it; a failure on rank 0 reaches rank 1 ---


def _distributed_body(rank, world_size, tmp):
    prefix = os.path.join(tmp, "a")
    config = GPTDatasetConfig(
        random_seed=7, sequence_length=16, tokenizer=TOK, blend=([prefix], None), split="90,10,0"
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [50, 5, 0], lambda: True, config
    ).build()
    assert train.built_anew_on_cache_miss == (rank == 0)
    expected = np.load(os.path.join(tmp, "expected_sample_index.npy"))
    np.testing.assert_array_equal(train.sample_index, expected)

    # only rank 0 sees a corrupt file: rank 1 must fail too, not wait forever
    bad = os.path.join(tmp, "bad")
    if rank == 0:
        with open(bad + ".idx", "r+b") as f:
            f.write(b"XXXX")
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=16,
        tokenizer=TOK,
        blend=([bad, prefix], [0.5, 0.5]),
        split="1",
    )
    # Rank 0 names the damaged file; the others learn that rank 0 failed.
    with pytest.raises(Exception, match="bad.idx" if rank == 0 else "rank 0 failed"):
        BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config).build()


def test_distributed_cache_and_failure(tmp_path):
    prefix = write_dataset(str(tmp_path / "a"), 60, 1)
    write_dataset(str(tmp_path / "bad"), 60, 2)
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=16,
        tokenizer=TOK,
        blend=([prefix], None),
        split="90,10,0",
        path_to_cache=str(tmp_path / "elsewhere"),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [50, 5, 0], lambda: True, config
    ).build()
    np.save(tmp_path / "expected_sample_index.npy", np.asarray(train.sample_index))
    run_distributed(_distributed_body, 2, str(tmp_path))


def test_blend_from_flags_and_files(tmp_path):
    from megatron.core.datasets.utils import get_blend_and_blend_per_split

    assert get_blend_and_blend_per_split(data_path=["0.3", "a", "0.7", "b"]) == (
        (["a", "b"], [0.3, 0.7]),
        None,
    )
    args_file = tmp_path / "data_args.txt"
    args_file.write_text("0.3 a\n0.7 b\n")
    assert get_blend_and_blend_per_split(data_args_path=str(args_file)) == (
        (["a", "b"], [0.3, 0.7]),
        None,
    )
    assert get_blend_and_blend_per_split(train_data_path=["t"], test_data_path=["x", "y"]) == (
        None,
        [(["t"], None), None, (["x", "y"], None)],
    )
    per_split = tmp_path / "per_split.json"
    per_split.write_text('{"train": "1 t1 2 t2", "valid": ["v"], "test": null}')
    assert get_blend_and_blend_per_split(per_split_data_args_path=str(per_split)) == (
        None,
        [(["t1", "t2"], [1.0, 2.0]), (["v"], None), None],
    )
    assert get_blend_and_blend_per_split() == (None, None)
    per_split.write_text("{not json")
    with pytest.raises(ValueError, match="per_split.json:1"):
        get_blend_and_blend_per_split(per_split_data_args_path=str(per_split))
    with pytest.raises(ValueError, match="incompatible"):
        get_blend_and_blend_per_split(data_path=["a"], train_data_path=["b"])
