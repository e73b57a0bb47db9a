"""The datasets of the masked word-piece families (sentence-level data with n-gram masking)."""

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_and_blend_per_split
from megatron.training import get_tokenizer, print_rank_0


def masked_lm_datasets(
    args, train_val_test_num_samples, family: str, dataset_type, config_type, **own
):
    """(train, valid, test) of ``dataset_type`` from sentence-level --data-path / per-split
    paths, with the masking flags every masked-LM family reads and the config fields of its own
    (``own``: sequence lengths, n-gram sizes...). ``family`` names the script and the log lines
    (``bert``: pretrain_bert.py, "BERT")."""
    label = family.upper()
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
            f"pretrain_{family}.py needs sentence-level data (--data-path PREFIX from "
            "tools/preprocess_data.py --split-sentences); --mock-data is not supported for "
            f"{label}"
        )
    config = config_type(
        random_seed=args.seed,
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
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        **own,
    )
    print_rank_0(f"> building train, validation, and test datasets for {label} ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0(f"> finished creating {label} datasets ...")
    return datasets
