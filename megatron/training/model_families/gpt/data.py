"""GPT's datasets (Megatron's ``train_valid_test_datasets_provider``)."""

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.gpt_fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.core.datasets.utils import get_blend_and_blend_per_split
from megatron.training import get_args, get_tokenizer, print_rank_0


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """GPT datasets from --data-path / per-split paths, or mock data; FIM-rewritten with
    --fim-data."""
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
    fim = {}
    if args.fim_data:
        fim = dict(
            fim_rate=args.fim_rate,
            fim_spm_rate=args.fim_spm_rate,
            fim_extra_tokens={
                "prefix": args.fim_prefix_token,
                "middle": args.fim_middle_token,
                "suffix": args.fim_suffix_token,
                "pad": args.fim_pad_token,
                "eod": args.fim_eod_token,
            },
            fim_split_sample=args.fim_split_sample,
            fim_fragment_rate=args.fim_fragment_rate,
            fim_no_prefix=args.fim_no_prefix,
        )
    config = (GPTFIMDatasetConfig if fim else GPTDatasetConfig)(
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
        **fim,
    )
    if config.mock:
        dataset_type = MockGPTDataset
    else:
        dataset_type = GPTFIMDataset if fim else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds
