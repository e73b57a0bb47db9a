"""The data half of Megatron Core's quickstart (Megatron-LM's
examples/run_simple_mcore_train_loop.py, ``get_train_data_iterator``), its logic written here:
compile_helpers, a GPTDatasetConfig from the quickstart's keywords and tokenizer call,
BlendedMegatronDatasetBuilder over MockGPTDataset, and a shuffling DataLoader.

The properties asserted are megatron-core 0.16's MockGPTDataset semantics (read from its source):
each mock document ``d`` of length ``L`` is ``1, 2, ..., L-1`` (mod vocab_size) then EOD, the
samples are ``sequence_length + 1`` tokens cut across documents, ``tokens``/``labels`` are that
window without its last/first token, the attention mask is causal ``[1, s, s]`` bool (True =
masked) and the loss mask is all ones (no padding, eod_mask_loss off).
"""

import torch
from torch.utils.data import DataLoader

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase

_SEQUENCE_LENGTH = 64


def _quickstart_datasets():
    compile_helpers()
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=_SEQUENCE_LENGTH,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(
            metdata_path={"library": "null-text"}, vocab_size=_SEQUENCE_LENGTH
        ),
        mid_level_dataset_surplus=0.005,
    )
    return config, BlendedMegatronDatasetBuilder(
        MockGPTDataset, [1000, None, None], lambda: True, config
    ).build()


def test_quickstart_data_iterator_yields_megatron_core_batches():
    config, datasets = _quickstart_datasets()
    assert config.mock and config.split == "1,1,1"
    assert len(datasets) == 3 and all(isinstance(d, MockGPTDataset) for d in datasets)
    # At least the 1000 requested training samples; valid and test (None) get one epoch of their
    # third of the mock documents.
    assert len(datasets[0]) >= 1000 and len(datasets[1]) > 0 and len(datasets[2]) > 0
    tokenizer = config.tokenizer
    assert isinstance(tokenizer, MegatronTokenizer) and isinstance(tokenizer, MegatronTokenizerBase)
    vocab_size, eod = tokenizer.vocab_size, tokenizer.eod
    assert (vocab_size, eod) == (_SEQUENCE_LENGTH + 1, _SEQUENCE_LENGTH)

    torch.manual_seed(0)
    batch = next(iter(DataLoader(datasets[0], batch_size=8, shuffle=True)))
    assert set(batch) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}
    s = _SEQUENCE_LENGTH
    for key, dtype in (
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ):
        assert batch[key].shape == (8, s) and batch[key].dtype == dtype, key
    assert batch["attention_mask"].shape == (8, 1, s, s)
    assert batch["attention_mask"].dtype == torch.bool
    causal_masked = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    assert torch.equal(batch["attention_mask"], causal_masked.expand(8, 1, s, s))
    assert torch.equal(batch["position_ids"], torch.arange(s).expand(8, s))
    assert torch.equal(batch["loss_mask"], torch.ones(8, s))

    # labels are the tokens shifted by one
    tokens, labels = batch["tokens"], batch["labels"]
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    # Inside a document each id is followed by id + 1 (mod vocab_size); after an EOD a new
    # document starts at 1, or is EOD alone. The EOD id (64) is also a body id (vocab 65), so a
    # token equal to it may be followed by 0, 1 or EOD.
    next_in_document = labels == (tokens + 1) % vocab_size
    next_is_eod = labels == eod
    new_document = (tokens == eod) & (labels == 1)
    assert torch.all(next_in_document | next_is_eod | new_document)
    assert torch.all(tokens >= 0) and torch.all(tokens < vocab_size)
