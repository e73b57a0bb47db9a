"""Pretrain T5 (span corruption): ``torchrun --nproc-per-node N pretrain_t5.py <flags>``.

Data: sentence-level ``.bin/.idx`` files (``tools/preprocess_data.py --split-sentences``), a
WordPiece tokenizer with sentinels (``--vocab-extra-ids 100``), ``--encoder-seq-length`` (or
``--seq-length``) and ``--decoder-seq-length``. Tensor, sequence and data parallelism; pipeline
parallelism is refused as Megatron Core's T5 refuses it."""

import dataclasses
from functools import partial

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.utils import get_blend_and_blend_per_split
from megatron.core.device import compute_device
from megatron.core.enums import ModelType
from megatron.core.models.T5 import T5Model
from megatron.training import get_args, get_parallel_state, get_timers, get_tokenizer, print_rank_0
from megatron.training.configs import core_transformer_config_from_args
from megatron.training.model_families import get_model_family
from megatron.training.training import pretrain
from pretrain_gpt import loss_func


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """T5 with ``--encoder-num-layers`` (or ``--num-layers``) encoder layers and
    ``--decoder-num-layers`` (default: as many) decoder layers."""
    args = get_args()
    if args.pipeline_model_parallel_size > 1:
        raise ValueError("Pipeline parallelism is not supported for T5.")
    if args.spec is not None:
        raise ValueError("--spec is not supported by pretrain_t5.py (T5 has two layer specs)")
    print_rank_0("building T5 model ...")
    config = core_transformer_config_from_args(args)
    encoder_config = dataclasses.replace(config, num_layers=args.encoder_num_layers)
    if args.decoder_num_layers is not None:
        config = dataclasses.replace(config, num_layers=args.decoder_num_layers)
    return T5Model(
        config=config,
        encoder_config=encoder_config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        pg_collection=get_parallel_state(),
    )


def get_batch(data_iterator):
    """(encoder ids, decoder ids, loss mask, labels, encoder mask, decoder mask). Labels are -1
    after the decoder's end (Megatron's convention); they become 0 there, where the loss mask
    is 0, so that every label is a vocabulary row."""
    batch = next(data_iterator)
    device = compute_device()
    return (
        batch["text_enc"].long().to(device),
        batch["text_dec"].long().to(device),
        batch["loss_mask"].float().to(device),
        batch["labels"].long().to(device).clamp(min=0),
        batch["enc_mask"].long().to(device),
        batch["dec_mask"].long().to(device),
    )


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, lm_labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """T5 datasets from sentence-level --data-path / per-split paths."""
    args = get_args()
    blend, per_split = get_blend_and_blend_per_split(
        args.data_path,
        args.data_args_path,
        args.per_split_data_args_path,
        args.train_data_path,
        args.valid_data_path,
        args.test_data_path,
    )
    if args.mock_data or (blend is None and per_split is None):
        raise ValueError(
            "pretrain_t5.py needs sentence-level data (--data-path PREFIX from "
            "tools/preprocess_data.py --split-sentences); --mock-data is not supported for T5"
        )
    config = T5MaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=10,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True,
    )
    print_rank_0("> building train, validation, and test datasets for T5 ...")
    datasets = BlendedMegatronDatasetBuilder(
        T5MaskedWordPieceDataset, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0("> finished creating T5 datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_and_decoder,
        forward_step,
        model_family=get_model_family("t5"),
    )
