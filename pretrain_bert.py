"""Pretrain BERT (masked LM + sentence order): ``torchrun --nproc-per-node N pretrain_bert.py``.

Data: sentence-level ``.bin/.idx`` files (``tools/preprocess_data.py --split-sentences``) and a
WordPiece tokenizer (``--tokenizer-type BertWordPieceLowerCase --vocab-file ...``)."""

from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_and_blend_per_split
from megatron.core.device import compute_device
from megatron.core.enums import ModelType
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.transformer.spec_utils import import_spec
from megatron.training import get_args, get_parallel_state, get_timers, get_tokenizer, print_rank_0
from megatron.training.configs import core_transformer_config_from_args
from megatron.training.model_families import get_model_family
from megatron.training.rerun import check_loss
from megatron.training.training import pretrain


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """BERT, or with pipeline parallelism this rank's stage (and virtual stage) of it."""
    args = get_args()
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    spec = import_spec(args.spec) if args.spec is not None else get_bert_layer_local_spec()
    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        add_binary_head=args.bert_binary_head,
        transformer_layer_spec=spec,
        vp_stage=vp_stage,
        pg_collection=get_parallel_state(),
    )


def get_batch(data_iterator):
    """(tokens, types, sentence order, loss mask, labels, padding mask) of the next micro-batch.

    Labels are -1 where nothing is masked (Megatron's convention); they are set to 0 there so
    that every label is a vocabulary row; the loss mask removes those positions."""
    batch = next(data_iterator)
    device = compute_device()
    tokens = batch["text"].long().to(device)
    types = batch["types"].long().to(device)
    sentence_order = batch["is_random"].long().to(device)
    loss_mask = batch["loss_mask"].float().to(device)
    labels = batch["labels"].long().to(device).clamp(min=0)
    padding_mask = batch["padding_mask"].long().to(device)
    return tokens, types, sentence_order, loss_mask, labels, padding_mask


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """Masked-LM loss averaged over the masked tokens of the micro-batch, plus the
    sentence-order cross entropy with the binary head; reported as 'lm loss' and 'sop loss'.

    A micro-batch without a masked token (possible with very short samples) contributes 0
    instead of Megatron's 0/0."""
    args = get_args()
    lm_losses, sop_logits = output_tensor
    loss_mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(lm_losses.float().reshape(-1) * loss_mask) / loss_mask.sum().clamp(min=1)
    loss = lm_loss
    reported = {"lm loss": lm_loss.clone().detach()}
    if sop_logits is not None:
        sop_loss = F.cross_entropy(
            sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
        )
        loss = lm_loss + sop_loss
        reported["sop loss"] = sop_loss.clone().detach()
    check_loss(loss, args, iteration=args.iteration + 1)
    return loss, reported


def forward_step(data_iterator, model):
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """BERT datasets from sentence-level --data-path / per-split paths."""
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
            "pretrain_bert.py needs sentence-level data (--data-path PREFIX from "
            "tools/preprocess_data.py --split-sentences); --mock-data is not supported for BERT"
        )
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
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
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )
    print_rank_0("> building train, validation, and test datasets for BERT ...")
    datasets = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0("> finished creating BERT datasets ...")
    return datasets


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_family=get_model_family("bert"),
    )
