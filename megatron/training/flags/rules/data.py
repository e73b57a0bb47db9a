"""Step 15: the data sources, the data loader and the tokenizer files."""

from .base import check, flag_name, warn

# Which tokenizer files each tokenizer type needs (dest names).
_TOKENIZER_NEEDS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def validate_data(args):
    per_split = [
        flag_name(dest)
        for dest in ("train_data_path", "valid_data_path", "test_data_path")
        if getattr(args, dest) is not None
    ]
    sources = [
        flag
        for flag, given in (
            ("--mock-data", args.mock_data),
            ("--data-path", bool(args.data_path)),
            ("/".join(per_split), bool(per_split)),
        )
        if given
    ]
    check(len(sources) <= 1, f"only one data source can be given, got {' and '.join(sources)}")
    check(
        args.data_path is None or args.data_args_path is None,
        "--data-path and --data-args-path are mutually exclusive",
    )
    check(
        not per_split or args.per_split_data_args_path is None,
        f"{'/'.join(per_split)} and --per-split-data-args-path are mutually exclusive",
    )
    if args.data_path is not None and args.split is None:
        args.split = "969, 30, 1"
        warn(
            args,
            "please specify --split when using --data-path; using the legacy default "
            f'"{args.split}"',
        )
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    check(args.num_workers >= 0, f"--num-workers must be >= 0 (got {args.num_workers})")
    check(
        args.num_dataset_builder_threads > 0,
        f"--num-dataset-builder-threads must be > 0 (got {args.num_dataset_builder_threads})",
    )
    if args.tokenizer_type is not None:
        missing = [
            flag_name(dest)
            for dest in _TOKENIZER_NEEDS.get(args.tokenizer_type, ())
            if getattr(args, dest) is None
        ]
        check(not missing, f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    if args.fim_data:
        _validate_fim(args)
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    # Fixed-length samples: the pipeline never has to exchange sequence lengths.
    args.variable_seq_lengths = False


def _validate_fim(args):
    # Megatron's rules (a zero --fim-rate or --fim-spm-rate is refused there too).
    check(not args.mock_data, "--fim-data does not work with --mock-data (it rewrites text)")
    check(args.fim_rate, "--fim-data needs a non-zero --fim-rate")
    check(args.fim_spm_rate, "--fim-data needs a non-zero --fim-spm-rate")
    for dest in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(args, dest)
        check(
            value is None or 0.0 <= value <= 1.0,
            f"{flag_name(dest)} is a probability, between 0 and 1 (got {value})",
        )
    check(
        args.fim_split_sample is None or args.fim_fragment_rate is not None,
        "--fim-split-sample needs --fim-fragment-rate (the FIM rate of each fragment)",
    )
