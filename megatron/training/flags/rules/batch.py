"""Step 6: micro-batch, global batch and evaluation batch sizes, and the batch-size ramp-up."""

from .base import check, info


def validate_batch_size(args):
    mbs = args.micro_batch_size
    check(mbs is not None, "--micro-batch-size is required")
    check(mbs > 0, f"--micro-batch-size must be > 0 (got {mbs})")
    if args.step_batch_size_schedule is not None:
        check(
            args.global_batch_size is None,
            "--step-batch-size-schedule and "
            "--global-batch-size are mutually exclusive (the schedule sets the batch size)",
        )
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
        info(args, f"setting global batch size to {args.global_batch_size}")
    gbs = args.global_batch_size
    check(gbs > 0, f"--global-batch-size must be > 0 (got {gbs})")
    per_step = mbs * dp
    sizes = [("--global-batch-size", gbs)]

    if args.rampup_batch_size is not None:
        values = args.rampup_batch_size  # the parser takes exactly three integers
        start, incr, samples = values
        check(
            start > 0 and incr > 0 and samples >= 0,
            f"--rampup-batch-size needs start > 0, increment > 0 and samples >= 0 (got {values})",
        )
        check(
            start <= gbs,
            f"--rampup-batch-size start ({start}) must be <= --global-batch-size ({gbs})",
        )
        check(
            (gbs - start) % incr == 0,
            f"--global-batch-size ({gbs}) minus the "
            f"--rampup-batch-size start ({start}) is not divisible by the increment ({incr})",
        )
        check(
            args.train_samples is not None,
            "--rampup-batch-size needs sample-based "
            "training: use --train-samples instead of --train-iters",
        )
        # Every batch size of the ramp (start + k * increment) must split into micro-batches.
        sizes.append(("the --rampup-batch-size start", start))
        if start < gbs:
            sizes.append(("the --rampup-batch-size increment", incr))
    eval_mbs = args.eval_micro_batch_size or mbs
    check(eval_mbs > 0, f"--eval-micro-batch-size must be > 0 (got {eval_mbs})")
    if args.eval_global_batch_size is not None or args.eval_micro_batch_size is not None:
        eval_gbs = args.eval_global_batch_size or gbs
        check(
            eval_gbs > 0 and eval_gbs % (eval_mbs * dp) == 0,
            f"evaluation global batch size ({eval_gbs}) is not divisible by evaluation micro "
            f"batch size ({eval_mbs}) x data-parallel size ({dp}) = {eval_mbs * dp} (see "
            "--eval-global-batch-size / --eval-micro-batch-size)",
        )
    if not args.decrease_batch_size_if_needed:
        for name, size in sizes:
            check(
                size % per_step == 0,
                f"{name} ({size}) is not divisible by "
                f"--micro-batch-size ({mbs}) x data-parallel size ({dp}) = {per_step}",
            )
