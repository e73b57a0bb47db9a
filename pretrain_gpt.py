"""Pretrain a GPT (or Llama-style) decoder:
``torchrun --nproc-per-node N pretrain_gpt.py <flags>``."""

from functools import partial

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_and_blend_per_split
from megatron.core.device import compute_device
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.spec_utils import import_spec
from megatron.training import get_args, get_parallel_state, get_timers, get_tokenizer, print_rank_0
from megatron.training.configs import core_transformer_config_from_args
from megatron.training.flag_errors import UserInputError
from megatron.training.model_families import get_model_family
from megatron.training.rerun import check_loss
from megatron.training.training import pretrain


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """Build the GPT model, or with pipeline parallelism the chunk of pipeline stage (and virtual
    stage ``vp_stage``) of this rank, from the flags: local PyTorch layers, or the spec named by
    ``--spec``."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    if args.spec is not None:
        transformer_layer_spec = import_spec(args.spec)
    elif config.num_moe_experts:
        transformer_layer_spec = get_gpt_decoder_block_spec(config)
    else:
        transformer_layer_spec = get_gpt_layer_local_spec()
    return GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
        pg_collection=get_parallel_state(),
    )


def _check_token_ids(batch, args) -> None:
    """Data tokenized with a larger vocabulary than this run's would index past the embedding
    (one process) or be masked away in silence (tensor parallel): refuse it by name."""
    vocab_size = get_tokenizer().vocab_size
    for key in ("tokens", "labels"):
        largest = int(batch[key].max()) if batch[key].numel() else 0
        if largest >= vocab_size:
            names = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
            paths = [p for name in names for p in (getattr(args, name, None) or [])]
            raise UserInputError(
                f"token id {largest} in the data ({' '.join(paths) or 'mock data'}) is outside "
                "the vocabulary of "
                f"--tokenizer-type {args.tokenizer_type} (ids 0..{vocab_size - 1}); the data was "
                "tokenized with another vocabulary (re-run tools/preprocess_data.py with this "
                "run's tokenizer)"
            )


def get_batch(data_iterator):
    """The next micro-batch on this rank's device, cut to this rank's context-parallel chunks.

    Every tensor-parallel rank reads the same data-parallel batch from its own loader, so no
    broadcast over TP is needed. The causal mask is implicit unless documents must not attend
    to each other (--reset-attention-mask), which keeps the fast SDPA path."""
    args = get_args()
    batch = next(data_iterator)
    _check_token_ids(batch, args)
    device = compute_device()
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    attention_mask = None
    if args.reset_attention_mask and "attention_mask" in batch:
        attention_mask = batch["attention_mask"].to(device, non_blocking=True)
    state = get_parallel_state()
    if state.get_context_parallel_world_size() > 1:
        cut = get_batch_on_this_cp_rank(
            {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": loss_mask,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            state.get_context_parallel_world_size(),
            state.get_context_parallel_rank(),
        )
        return (
            cut["tokens"],
            cut["labels"],
            cut["loss_mask"],
            cut["attention_mask"],
            cut["position_ids"],
        )
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses, token count, and the [sum, count] pair reported as 'lm
    loss'."""
    args = get_args()
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    local_tokens = loss_mask.sum().clone().detach().to(torch.int)
    num_tokens = local_tokens
    state = get_parallel_state()
    if state.get_context_parallel_world_size() > 1 and not args.calculate_per_token_loss:
        # Each CP rank holds part of every sequence: divide by the tokens of the whole sequence
        # (the schedule multiplies by CP size and DDP averages over DP x CP).
        num_tokens = local_tokens.clone()
        torch.distributed.all_reduce(num_tokens, group=state.get_context_parallel_group())
    check_loss(loss, args, iteration=args.iteration + 1)
    reported = torch.cat([loss.clone().detach().view(1), local_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": reported}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """GPT datasets from --data-path / per-split paths, or mock data."""
    args = get_args()
    tokenizer = get_tokenizer()
    blend, per_split = get_blend_and_blend_per_split(
        args.data_path,
        args.data_args_path,
        args.per_split_data_args_path,
        args.train_data_path,
        args.valid_data_path,
        args.test_data_path,
    )
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        mock=args.mock_data or (blend is None and per_split is None),
    )
    dataset_type = MockGPTDataset if config.mock else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_family=get_model_family("gpt"),
    )
