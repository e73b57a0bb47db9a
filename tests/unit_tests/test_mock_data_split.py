"""Mock data is split as Megatron Core splits it: with neither a blend nor per-split blends the
split becomes "1,1,1" (an even split of the synthetic documents), whatever --split says.

The expected document ranges are computed here from Megatron's rule for a split string
(normalized weights -> book-ends -> ``int(round(book-end * number of documents))``), not read
from our code."""

import sys

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.tokenizer import build_tokenizer
from tests.functional_tests.runner import REPO

sys.path.insert(0, str(REPO))
import pretrain_gpt  # noqa: E402


def _document_ranges(weights, documents):
    total = sum(weights)
    bounds, acc = [0.0], 0.0
    for w in weights:
        acc += w / total
        bounds.append(acc)
    return [
        (int(round(lo * documents)), int(round(hi * documents)))
        for lo, hi in zip(bounds, bounds[1:])
    ]


@pytest.fixture
def mock_run_globals(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    yield
    global_vars.reset_globals()


def test_mock_train_split_is_the_even_split(mock_run_globals):
    argv = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "500", "--split", "99,1,0",
    ]  # fmt: skip
    args = validate_args(parse_args(argv=argv))
    global_vars.set_args(args)
    global_vars.set_tokenizer(build_tokenizer(args))
    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider([16, 8, 8])

    documents = len(MockGPTLowLevelDataset(global_vars.get_tokenizer()).sequence_lengths)
    expected = _document_ranges([1, 1, 1], documents)
    for dataset, (begin, end) in zip((train, valid, test), expected):
        np.testing.assert_array_equal(dataset.indices, np.arange(begin, end))
    assert expected[0][1] - expected[0][0] == 33333  # a third of Megatron's 100000 documents
