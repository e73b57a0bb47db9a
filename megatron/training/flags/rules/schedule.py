"""Step 13: the length of training and the learning-rate and weight-decay schedules."""

from .base import check, flag_name


def validate_schedule(args):
    iters, samples = args.train_iters, args.train_samples
    check(
        iters is None or samples is None, "--train-iters and --train-samples are mutually exclusive"
    )
    check(
        iters is not None or samples is not None or args.skip_train,
        "one of --train-iters or --train-samples is required (or pass --skip-train)",
    )
    for dest in ("train_iters", "train_samples"):
        value = getattr(args, dest)
        check(value is None or value >= 0, f"{flag_name(dest)} must be >= 0 (got {value})")
    if iters is not None:
        wrong_mode = (
            ("lr_decay_samples", None),
            ("lr_warmup_samples", 0),
            ("lr_wsd_decay_samples", None),
        )
        mode, other, suffix = "--train-iters (iteration-based training)", "iters", "samples"
    else:
        wrong_mode = (
            ("lr_decay_iters", None),
            ("lr_warmup_iters", 0),
            ("lr_wsd_decay_iters", None),
        )
        mode, other, suffix = "--train-samples (sample-based training)", "samples", "iters"
    if iters is not None or samples is not None:
        for dest, unset in wrong_mode:
            value = getattr(args, dest)
            check(
                value == unset,
                f"{flag_name(dest)} ({value}) cannot be used with {mode}; use "
                f"{flag_name(dest).replace(suffix, other)}",
            )

    fraction = args.lr_warmup_fraction
    if fraction is not None:
        for dest in ("lr_warmup_iters", "lr_warmup_samples"):
            check(
                getattr(args, dest) == 0,
                f"--lr-warmup-fraction and {flag_name(dest)} are mutually exclusive",
            )
        check(0.0 <= fraction < 1.0, f"--lr-warmup-fraction must be in [0, 1) (got {fraction})")
    for unit in ("iters", "samples"):
        warmup, decay = getattr(args, f"lr_warmup_{unit}"), getattr(args, f"lr_decay_{unit}")
        decay_name = f"--lr-decay-{unit}"
        if decay is None:
            decay, decay_name = getattr(args, f"train_{unit}"), f"--train-{unit}"
        if warmup > 0 and decay is not None:
            check(
                warmup < decay,
                f"--lr-warmup-{unit} ({warmup}) must be smaller than the "
                f"decay length {decay_name} ({decay})",
            )
        check(warmup >= 0, f"--lr-warmup-{unit} must be >= 0 (got {warmup})")
    if args.lr_decay_style == "WSD" and (iters is not None or samples is not None):
        unit = "iters" if iters is not None else "samples"
        check(
            getattr(args, f"lr_wsd_decay_{unit}") is not None,
            f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}",
        )

    if args.lr is not None:
        check(args.lr >= 0, f"--lr must be >= 0 (got {args.lr})")
        check(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
        check(
            args.lr_warmup_init <= args.lr,
            f"--lr-warmup-init ({args.lr_warmup_init}) must be <= --lr ({args.lr})",
        )
    if args.decoupled_lr is not None and args.decoupled_min_lr is not None:
        check(
            args.decoupled_min_lr <= args.decoupled_lr,
            f"--decoupled-min-lr "
            f"({args.decoupled_min_lr}) must be <= --decoupled-lr ({args.decoupled_lr})",
        )

    if args.weight_decay_incr_style == "constant":
        # (== weight_decay: already filled in by an earlier validate_args on these args)
        check(
            args.start_weight_decay in (None, args.weight_decay)
            and args.end_weight_decay in (None, args.weight_decay),
            "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear "
            "or cosine (got constant)",
        )
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        check(
            args.start_weight_decay is not None and args.end_weight_decay is not None,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
            "--start-weight-decay and --end-weight-decay",
        )
