"""Step 16: logging, evaluation and exit intervals, and the check of data-parallel replicas."""

import signal

from .base import check, flag_name, warn


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
