"""Cross-flag rules of what a run reads and writes: checkpoints (--save/--load and their
formats), the data sources and tokenizer files, logging, evaluation and exit intervals.
Called by validate_args (megatron/training/arguments.py)."""

import signal

from .validation import check, flag_name, warn


def validate_checkpointing(args):
    if args.save is not None:
        check(
            args.save_interval is not None and args.save_interval > 0,
            f"--save needs --save-interval > 0 (got {args.save_interval})",
        )
    if args.save_retain_interval is not None:
        check(
            args.save_retain_interval > 0,
            f"--save-retain-interval must be > 0 (got {args.save_retain_interval})",
        )
        check(
            args.save_interval and args.save_retain_interval % args.save_interval == 0,
            f"--save-retain-interval ({args.save_retain_interval}) must be a multiple of "
            f"--save-interval ({args.save_interval})",
        )
    if args.load_main_params_from_ckpt:
        check(args.no_load_optim, "--load-main-params-from-ckpt needs --no-load-optim")
    if args.non_persistent_ckpt_type == "local":
        check(
            args.non_persistent_local_ckpt_dir is not None,
            "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir",
        )
    if args.ckpt_format == "torch_dcp":
        check(args.use_torch_fsdp2, "--ckpt-format torch_dcp needs --use-torch-fsdp2")
    if args.ckpt_format == "fsdp_dtensor":
        check(args.use_megatron_fsdp, "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp")
    if args.ckpt_convert_format is not None:
        check(args.ckpt_convert_save is not None, "--ckpt-convert-format needs --ckpt-convert-save")
    args.use_dist_ckpt = args.ckpt_format != "torch"


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
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    # Fixed-length samples: the pipeline never has to exchange sequence lengths.
    args.variable_seq_lengths = False


def validate_logging(args):
    for dest in ("log_interval", "tensorboard_log_interval"):
        check(getattr(args, dest) > 0, f"{flag_name(dest)} must be > 0 (got {getattr(args, dest)})")
    if args.log_memory_interval is not None:
        check(
            args.log_memory_interval > 0 and args.log_memory_interval % args.log_interval == 0,
            f"--log-memory-interval ({args.log_memory_interval}) must be a positive multiple "
            f"of --log-interval ({args.log_interval})",
        )
    if args.wandb_project:
        check(args.wandb_exp_name, "--wandb-project needs --wandb-exp-name")
    if args.log_progress and args.save is None:
        warn(args, "--log-progress writes progress.txt into --save, which is not set: no progress")
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None:
        check(
            interval > 0,
            f"--check-weight-hash-across-dp-replicas-interval must be > 0 (got {interval})",
        )
        check(
            not args.use_torch_fsdp2
            and not (
                args.use_megatron_fsdp
                and args.data_parallel_sharding_strategy == "optim_grads_params"
            ),
            "--check-weight-hash-across-dp-replicas-interval cannot be used with FSDP2 "
            "(--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads_params): the "
            "parameters are sharded, not replicated",
        )
    if args.eval_interval is not None:
        check(args.eval_interval > 0, f"--eval-interval must be > 0 (got {args.eval_interval})")
    check(args.eval_iters >= 0, f"--eval-iters must be >= 0 (got {args.eval_iters})")
    if isinstance(args.exit_signal, str):
        # Megatron hands the handler a signal.Signals member, not its name.
        args.exit_signal = getattr(signal, args.exit_signal)
    for dest in ("exit_interval", "exit_duration_in_mins"):
        value = getattr(args, dest)
        check(value is None or value > 0, f"{flag_name(dest)} must be > 0 (got {value})")
