"""Data and tokenizer flags; ``add_tokenizer_args`` is shared with tools/preprocess_data.py."""

from typing import List, Optional

from megatron.training.flags.spec import add_group, flag, flag_group, off_switch, switch

# Read by GPT's dataset provider (megatron/training/model_families/gpt/data.py).
_FIM = "pretrain_gpt.train_valid_test_datasets_provider"


@flag_group(
    "data and dataloader",
    removed={
        (
            "--data-impl",
            "--dataset-impl",
        ): "the .bin/.idx (mmap) dataset format is the only one; drop the flag"
    },
)
class DataFlags:
    data_path: Optional[List[str]] = flag(
        None,
        'Dataset prefixes for train/valid/test, split by --split: "PREFIX", "PREFIX1 PREFIX2 '
        '..." (weighted by size) or "W1 PREFIX1 W2 PREFIX2 ...".',
        type=None,
        nargs="*",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    phase_transition_iterations: Optional[str] = flag(
        None, "Comma-separated iterations at which the data blend moves to its next phase."
    )
    split: Optional[str] = flag(
        None,
        'Train/valid/test proportions, e.g. "969,30,1" or "99/1/0" (default with '
        "--data-path: 969, 30, 1).",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    train_data_path: Optional[List[str]] = flag(
        None,
        "Dataset prefixes for the training split only.",
        type=None,
        nargs="*",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    valid_data_path: Optional[List[str]] = flag(
        None,
        "Dataset prefixes for the validation split only.",
        type=None,
        nargs="*",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    test_data_path: Optional[List[str]] = flag(
        None,
        "Dataset prefixes for the test split only.",
        type=None,
        nargs="*",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    data_args_path: Optional[str] = flag(
        None,
        "File holding the --data-path value.",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    per_split_data_args_path: Optional[str] = flag(
        None,
        'JSON file with "train", "valid", "test" data-path lists.',
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    per_dataset_sequences_path: Optional[str] = flag(
        None,
        "JSON file with the sequence count of each dataset (skips reading the indices).",
        type=None,
    )
    data_cache_path: Optional[str] = flag(
        None,
        "Directory for the dataset index caches (default: next to the data).",
        type=None,
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    mmap_bin_files: bool = off_switch(
        "Read .bin files with file reads instead of mmap.",
        options="--no-mmap-bin-files",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    mock_data: bool = switch(
        "Train on generated mock data instead of files.",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    seq_length: Optional[int] = flag(
        None,
        "Sequence length of a training sample.",
        honoured_at="pretrain_{bert,gpt}.train_valid_test_datasets_provider; "
        "training.train_step; evaluation.evaluate",
    )
    encoder_seq_length: Optional[int] = flag(
        None,
        "Encoder sequence length (alternative to --seq-length).",
        honoured_at="pretrain_t5.train_valid_test_datasets_provider",
    )
    decoder_seq_length: Optional[int] = flag(
        None,
        "Decoder sequence length (T5).",
        honoured_at="pretrain_t5.train_valid_test_datasets_provider; model_families.t5.check_args",
    )
    sample_rate: float = flag(1.0, "Fraction of the samples used (vision/audio datasets).")
    mask_prob: float = flag(
        0.15,
        "Masking probability (BERT/T5).",
        honoured_at="pretrain_{bert,t5}.train_valid_test_datasets_provider",
    )
    short_seq_prob: float = flag(
        0.1,
        "Probability of a short sample (BERT/T5).",
        honoured_at="pretrain_{bert,t5}.train_valid_test_datasets_provider",
    )
    num_workers: int = flag(
        2, "DataLoader worker processes.", honoured_at="data_samplers.build_pretraining_data_loader"
    )
    reset_position_ids: bool = switch(
        "Restart position ids after each end-of-document token.",
        honoured_at="pretrain_gpt.train_valid_test_datasets_provider",
    )
    reset_attention_mask: bool = switch(
        "Do not attend across end-of-document tokens.",
        honoured_at="model_families.gpt.step.get_batch; "
        "pretrain_gpt.train_valid_test_datasets_provider",
    )
    dataloader_inter_document_masking: bool = switch(
        "Let the data loader mask attention across documents (packed sequences)."
    )
    eod_mask_loss: bool = switch(
        "No loss on end-of-document tokens.",
        honoured_at="pretrain_gpt.train_valid_test_datasets_provider",
    )
    create_attention_mask_in_dataloader: bool = off_switch(
        "Do not build attention masks in the data loader.",
        options="--no-create-attention-mask-in-dataloader",
        honoured_at="the causal mask is implicit here; masks are built only for "
        "--reset-attention-mask",
    )
    num_dataset_builder_threads: int = flag(
        1,
        "Threads per rank building datasets.",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    object_storage_cache_path: Optional[str] = flag(
        None, "Cache directory for object-storage datasets."
    )
    mid_level_dataset_surplus: float = flag(
        0.005,
        "Sample surplus built for blended components.",
        honoured_at="pretrain_*.train_valid_test_datasets_provider",
    )
    allow_ambiguous_pad_tokens: bool = switch(
        "Treat every token equal to the pad id as padding even when the pad id collides with "
        "another special token."
    )
    dataloader_fast_cache_load: bool = switch("Load cached dataset indices without checks.")
    dataloader_defer_npy_index_mmap: bool = switch(
        "Memory-map the cached indices only when first used."
    )
    fim_data: bool = switch(
        "Apply fill-in-the-middle transformations to samples.", honoured_at=_FIM
    )
    fim_rate: float = flag(0.5, "Probability of a FIM transformation.", honoured_at=_FIM)
    fim_spm_rate: float = flag(
        0.5, "Probability of SPM (vs PSM) ordering for FIM.", honoured_at=_FIM
    )
    fim_split_sample: Optional[str] = flag(
        None, "Token at which FIM splits samples.", honoured_at=_FIM
    )
    fim_fragment_rate: Optional[float] = flag(None, "FIM rate per fragment.", honoured_at=_FIM)
    fim_no_prefix: Optional[str] = flag(
        None, "Do not apply FIM to samples with this prefix.", honoured_at=_FIM
    )
    fim_prefix_token: str = flag("<fim_prefix>", "FIM prefix token.", honoured_at=_FIM)
    fim_middle_token: str = flag("<fim_middle>", "FIM middle token.", honoured_at=_FIM)
    fim_suffix_token: str = flag("<fim_suffix>", "FIM suffix token.", honoured_at=_FIM)
    fim_pad_token: str = flag("<fim_pad>", "FIM pad token.", honoured_at=_FIM)
    fim_eod_token: str = flag("<|endoftext|>", "FIM eod token.", honoured_at=_FIM)


@flag_group("tokenizer", removed={"--tiktoken-special-tokens": "use --tokenizer-special-tokens"})
class TokenizerFlags:
    vocab_size: Optional[int] = flag(
        None,
        "Vocabulary size before padding (NullTokenizer).",
        honoured_at="tokenizer.build_tokenizer; core.models.common.language_module.LanguageModule",
    )
    padded_vocab_size: Optional[int] = flag(
        None,
        "Vocabulary size of the model; default: computed from the tokenizer and "
        "--make-vocab-size-divisible-by.",
        honoured_at="pretrain_*.model_provider; tokenizer.build_tokenizer",
    )
    pad_vocab_size: bool = off_switch(
        "Use the tokenizer vocabulary size as is.", honoured_at="tokenizer.build_tokenizer"
    )
    vocab_file: Optional[str] = flag(
        None, "Vocabulary file.", honoured_at="tokenizer.build_tokenizer"
    )
    merge_file: Optional[str] = flag(
        None, "BPE merges file.", honoured_at="tokenizer.build_tokenizer"
    )
    vocab_extra_ids: int = flag(
        0,
        "Extra sentinel tokens <extra_id_N> (T5 span masking).",
        honoured_at="tokenizer.build_tokenizer",
    )
    tokenizer_type: Optional[str] = flag(
        None,
        "Tokenizer.",
        choices=[
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
            "GPT2BPETokenizer",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "HuggingFaceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "MultimodalTokenizer",
            "NullTokenizer",
            "NullMultimodalTokenizer",
            "SFTTokenizer",
        ],
        honoured_at="model_families.gpt.step._check_token_ids; tokenizer.build_tokenizer; "
        "tools.preprocess_data.get_args",
    )
    tokenizer_model: Optional[str] = flag(
        None,
        "SentencePiece model, Hugging Face name/directory or tiktoken JSON.",
        honoured_at="tokenizer.build_tokenizer",
    )
    metadata_path: Optional[str] = flag(
        None, "Tokenizer metadata JSON.", options="--tokenizer-metadata"
    )
    special_tokens: Optional[List[str]] = flag(
        None,
        "Special tokens to add to the tokenizer.",
        options="--tokenizer-special-tokens",
        nargs="+",
    )
    tiktoken_pattern: Optional[str] = flag(
        None, "tiktoken pre-tokenization pattern.", choices=["v1", "v2"]
    )
    tiktoken_num_special_tokens: int = flag(1000, "Number of tiktoken special tokens.")
    tokenizer_sentencepiece_legacy: bool = switch("SentencePiece tokenizer in legacy mode.")
    tokenizer_sentencepiece_ignore_extra_whitespaces: bool = off_switch(
        "Keep repeated whitespace when tokenizing with SentencePiece."
    )
    tokenizer_hf_no_use_fast: bool = switch(
        "Use the slow (Python) Hugging Face tokenizer.", honoured_at="tokenizer.build_tokenizer"
    )
    tokenizer_hf_no_include_special_tokens: bool = switch(
        "Do not add special tokens when encoding with a Hugging Face tokenizer.",
        honoured_at="tokenizer.build_tokenizer",
    )
    trust_remote_code: bool = switch(
        "Let Hugging Face tokenizers run code from the model repo.",
        honoured_at="tokenizer.build_tokenizer",
    )
    null_tokenizer_eod_id: Optional[int] = flag(
        None, "End-of-document id of the NullTokenizer.", honoured_at="tokenizer.build_tokenizer"
    )
    null_tokenizer_pad_id: int = flag(
        -1, "Pad id of the NullTokenizer.", honoured_at="tokenizer.build_tokenizer"
    )
    chat_template: Optional[str] = flag(None, "Chat template (Jinja) for conversation data.")
    use_gigatoken: bool = switch("Use the GigaToken tokenizer library.")


@flag_group("sft")
class SFTFlags:
    sft: bool = switch("Supervised fine-tuning on conversation data.")
    sft_tokenizer_prompt_format: str = flag("nemotron-h-aligned", "SFT prompt format.")


# Tokenizer types that older Megatron releases had and old scripts still name
# (arguments.parse_args turns them into a hint before argparse rejects the choice).
REMOVED_TOKENIZER_TYPES = {
    "Llama3Tokenizer": "use HuggingFaceTokenizer (--tokenizer-model <HF dir or name>) or "
    "TikTokenizer",
    "MistralTokenizer": "use HuggingFaceTokenizer (--tokenizer-model <HF dir or name>)",
    "HFTokenizer": "renamed to HuggingFaceTokenizer",
}


def add_tokenizer_args(parser):
    """Add the 'tokenizer' group (also used by tools/preprocess_data.py). Returns the parser."""
    return add_group(parser, TokenizerFlags)
