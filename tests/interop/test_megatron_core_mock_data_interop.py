"""The quickstart's mock data (Megatron-LM's examples/run_simple_mcore_train_loop.py: a null
tokenizer of 64 ids, GPTDatasetConfig(random_seed=0, sequence_length=64, ...), MockGPTDataset
through BlendedMegatronDatasetBuilder with sizes [1000, None, None]) equals megatron-core
0.16.1's, sample for sample: every key, dtype and value of the first 100 samples of each split.

megatron-core 0.16.1 names the null library ``"null"`` (Megatron-LM's HEAD ``"null-text"``);
both name the same tokenizer here. Split lengths differ on purpose (ours: the requested 1000 train
samples and one epoch of documents for valid/test; 0.16.1: the whole one-epoch sample index) and
are not compared.

Run by ``make interop`` (needs $MCORE_PYTHON), not by ``make test``.
"""

import os
import subprocess

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers import MegatronTokenizer

MCORE_PYTHON = os.environ.get("MCORE_PYTHON")
SAMPLES = 100

_BUILD = f"""
import sys, torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers import MegatronTokenizer
config = GPTDatasetConfig(
    random_seed=0, sequence_length=64, reset_position_ids=False, reset_attention_mask=False,
    eod_mask_loss=False, mid_level_dataset_surplus=0.005,
    tokenizer=MegatronTokenizer.from_pretrained(metadata_path={{"library": "null"}}, vocab_size=64),
)
builder = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config)
datasets = builder.build()
torch.save([[d[i] for i in range({SAMPLES})] for d in datasets], sys.argv[1])
"""


def test_quickstart_mock_samples_equal_megatron_core(tmp_path):
    out = tmp_path / "mcore.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # ours is `megatron` too
    done = subprocess.run(
        [MCORE_PYTHON, "-c", _BUILD, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    theirs = torch.load(out, weights_only=False)

    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=64,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(
            metdata_path={"library": "null-text"}, vocab_size=64
        ),
        mid_level_dataset_surplus=0.005,
    )
    ours = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [1000, None, None], lambda: True, config
    ).build()
    for split, (dataset, expected) in enumerate(zip(ours, theirs)):
        for i, sample in enumerate(expected):
            got = dataset[i]
            assert set(got) == set(sample), (split, i)
            for key, value in sample.items():
                assert got[key].dtype == value.dtype, (split, i, key)
                assert torch.equal(got[key], value), (split, i, key)
