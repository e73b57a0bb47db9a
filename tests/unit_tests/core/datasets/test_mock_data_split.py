"""Mock data is split as Megatron Core splits it: with neither a blend nor per-split blends the
split becomes "1,1,1" (an even split of the synthetic documents), whatever --split says.

The expected document ranges are computed here from Megatron's rule for a split string
(normalized weights -> book-ends -> ``int(round(book-end * number of documents))``), not read
from our code."""

import sys

import numpy as np

from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.tokenizer import build_tokenizer
from tests.harness import REPO
from tests.harness.argv import megatron_argv

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


def test_mock_train_split_is_the_even_split(single_process_env, fresh_globals):
    argv = megatron_argv(
        num_layers=2,
        seq_length=64,
        max_position_embeddings=64,
        train_iters=2,
        vocab_size=500,
        split="99,1,0",
    )
    args = validate_args(parse_args(argv=argv))
    global_vars.set_args(args)
    global_vars.set_tokenizer(build_tokenizer(args))
    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider([16, 8, 8])

    documents = len(MockGPTLowLevelDataset(global_vars.get_tokenizer()).sequence_lengths)
    expected = _document_ranges([1, 1, 1], documents)
    for dataset, (begin, end) in zip((train, valid, test), expected):
        np.testing.assert_array_equal(dataset.indices, np.arange(begin, end))
    assert expected[0][1] - expected[0][0] == 33333  # a third of Megatron's 100000 documents
