"""Step 11: fp16/bf16, loss scaling and the optimizer-state dtypes."""

from .base import check, flag_name, info, warn


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
