"""T5's datasets (Megatron's ``train_valid_test_datasets_provider``)."""

from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.training import get_args
from megatron.training.model_families.masked_lm import masked_lm_datasets


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """T5 datasets from sentence-level --data-path / per-split paths."""
    args = get_args()
    return masked_lm_datasets(
        args,
        train_val_test_num_samples,
        "t5",
        T5MaskedWordPieceDataset,
        T5MaskedWordPieceDatasetConfig,
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
    )
