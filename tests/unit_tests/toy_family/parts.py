"""The toy family's model builder, datasets, forward step and FLOPs (see the package)."""

from collections import Counter
from functools import partial

import torch

from megatron.core.device import compute_device
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import get_args, get_parallel_state, get_tokenizer
from megatron.training.configs import core_transformer_config_from_args
from megatron.training.model_families.losses import masked_token_loss

CALLS = Counter()


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    CALLS["model_provider"] += 1
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        pg_collection=get_parallel_state(),
    )


class SuccessorDataset(torch.utils.data.Dataset):
    """Sample i: ids start_i, start_i + 1, ... (modulo the text ids), labels one further."""

    def __init__(self, num_samples: int, seq_length: int, num_ids: int):
        self.num_samples, self.seq_length, self.num_ids = num_samples, seq_length, num_ids

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        ids = (index * 37 + torch.arange(self.seq_length + 1)) % self.num_ids  # host: data
        return {"tokens": ids[:-1], "labels": ids[1:]}


def train_valid_test_datasets_provider(train_val_test_num_samples):
    CALLS["datasets"] += 1
    CALLS["train samples"] += train_val_test_num_samples[0]
    args = get_args()
    num_ids = get_tokenizer().vocab_size - 1  # the NullTokenizer's text ids (eod is the last)
    return tuple(
        SuccessorDataset(n, args.seq_length, num_ids) if n else None
        for n in train_val_test_num_samples
    )


def forward_step(data_iterator, model):
    CALLS["forward_step"] += 1
    batch = next(data_iterator)
    tokens = batch["tokens"].to(compute_device())
    labels = batch["labels"].to(compute_device())
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float, device=tokens.device)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(masked_token_loss, loss_mask)


def num_floating_point_operations(args, batch_size: int) -> float:
    CALLS["flops"] += 1
    return 1000.0 * batch_size
