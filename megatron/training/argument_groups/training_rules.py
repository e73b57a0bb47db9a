"""Cross-flag rules of the training run itself: batch sizes and their ramp-up, precision
(fp16/bf16, loss scaling), the LR and weight-decay schedules and activation recompute.
Called by validate_args (megatron/training/arguments.py)."""

from .validation import check, fail, flag_name, info, warn


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


def validate_precision(args):
    import torch  # here so that importing the flag definitions stays torch-free

    check(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    dtypes = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8": torch.uint8,
    }
    for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, dest)
        if not isinstance(value, torch.dtype):
            setattr(args, dest, dtypes[value])
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.float16
        if not args.loss_scale:
            # With dynamic scaling an inf/NaN gradient is the signal to back off, not an error.
            args.check_for_nan_in_loss_and_grad = False
            warn(
                args,
                "setting check_for_nan_in_loss_and_grad to False: dynamic loss scaling is in use",
            )
    if args.bf16:
        args.params_dtype = torch.bfloat16
        if args.accumulate_allreduce_grads_in_fp32:
            check(
                args.main_grads_dtype == torch.float32,
                "--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32",
            )
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        elif not args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype == torch.float32:
            args.accumulate_allreduce_grads_in_fp32 = True
            info(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    info(args, f"using {args.params_dtype} for parameters ...")
    if args.fp16_lm_cross_entropy:
        check(args.fp16, "--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection:
        check(args.fp16 or args.bf16, "--fp32-residual-connection needs --fp16 or --bf16")
    if args.loss_scale is not None:
        check(args.loss_scale > 0, f"--loss-scale must be > 0 (got {args.loss_scale})")
    for dest in ("initial_loss_scale", "min_loss_scale", "loss_scale_window"):
        check(getattr(args, dest) > 0, f"{flag_name(dest)} must be > 0 (got {getattr(args, dest)})")
    check(
        args.min_loss_scale <= args.initial_loss_scale,
        f"--min-loss-scale "
        f"({args.min_loss_scale}) must be <= --initial-loss-scale ({args.initial_loss_scale})",
    )
    check(args.hysteresis >= 1, f"--hysteresis must be >= 1 (got {args.hysteresis})")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True


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


_RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)


def validate_recompute(args):
    granularity, method = args.recompute_granularity, args.recompute_method
    if args.distribute_saved_activations:
        check(
            args.tensor_model_parallel_size > 1,
            "--distribute-saved-activations needs --tensor-model-parallel-size > 1",
        )
        check(
            granularity == "full",
            "--distribute-saved-activations needs "
            f"--recompute-granularity full (got {granularity})",
        )
        check(method is not None, "--distribute-saved-activations needs --recompute-method")
        check(
            not args.sequence_parallel,
            "--distribute-saved-activations cannot be used with "
            "--sequence-parallel (the checkpointed activations are already split across TP)",
        )
    layers = args.recompute_num_layers
    if granularity == "selective":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            check(
                value is None,
                f"{flag} {value} cannot be used with --recompute-granularity "
                "selective (or --recompute-activations)",
            )
    elif granularity == "full":
        check(
            method is not None,
            "--recompute-granularity full needs --recompute-method uniform or block",
        )
        check(layers is not None, "--recompute-granularity full needs --recompute-num-layers")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        # uniform: layers per checkpointed chunk; block: checkpointed layers per stage.
        low = 1 if method == "uniform" else 0
        check(
            low <= layers <= per_stage,
            f"--recompute-num-layers ({layers}) must be in "
            f"[{low}, {per_stage}] with --recompute-method {method} ({per_stage} layers per "
            "pipeline stage)",
        )
    elif method is not None or layers is not None:
        fail("--recompute-method/--recompute-num-layers need --recompute-granularity full")
    for module in args.recompute_modules or ():
        check(
            module in _RECOMPUTE_MODULES,
            f"--recompute-modules: unknown module {module!r} "
            f"(choose from {', '.join(_RECOMPUTE_MODULES)})",
        )
