"""BERT's datasets (Megatron's ``train_valid_test_datasets_provider``)."""

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.training import get_args
from megatron.training.model_families.masked_lm import masked_lm_datasets


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """BERT datasets from sentence-level --data-path / per-split paths."""
    args = get_args()
    return masked_lm_datasets(
        args,
        train_val_test_num_samples,
        "bert",
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
        sequence_length=args.seq_length,
        masking_max_ngram=3,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )
