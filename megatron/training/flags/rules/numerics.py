"""Steps 8 and 9: the optimizer (Muon and its distributed optimizer), then muP and the MLP
activations. Before the data-parallel strategy (step 10), since Muon turns
--use-distributed-optimizer into its layer-wise distributed optimizer."""

from megatron.core.transformer.config_rules import mup_settings_given, mup_width_mult_matches

from .base import check, fail, info, warn


def validate_optimizer(args):
    """--optimizer dist_muon, and muon with --use-distributed-optimizer, run Muon with the
    layer-wise distributed optimizer (Megatron's mapping); Muon's own flags are checked here."""
    args.use_layer_wise_distributed_optimizer = False
    if args.optimizer == "dist_muon":
        warn(
            args,
            "--optimizer dist_muon is deprecated: running --optimizer muon with the layer-wise "
            "distributed optimizer (--optimizer muon --use-distributed-optimizer)",
        )
        args.optimizer = "muon"
        args.use_layer_wise_distributed_optimizer = True
    if args.optimizer != "muon":
        return
    if args.use_distributed_optimizer:
        info(
            args,
            "--optimizer muon with --use-distributed-optimizer: each data-parallel rank updates "
            "whole parameters (the layer-wise distributed optimizer)",
        )
        args.use_distributed_optimizer = False
        args.use_layer_wise_distributed_optimizer = True
    check(not args.fp16, "--optimizer muon does not support --fp16 (use --bf16)")
    check(
        args.muon_fp32_matmul_prec != "low",
        "--muon-fp32-matmul-prec low is not available (torch's float32 matmul precision has "
        "no level below medium); use medium or high",
    )
    from megatron.core.optimizer.muon import newton_schulz_coefficients

    try:
        newton_schulz_coefficients(args.muon_coefficient_type, args.muon_num_ns_steps)
    except ValueError as exc:
        fail(str(exc))
    if args.use_layer_wise_distributed_optimizer:
        check(
            not args.overlap_param_gather,
            "--overlap-param-gather is not implemented for Muon's layer-wise distributed "
            "optimizer (its params are broadcast after the step)",
        )
        check(
            args.ckpt_format == "torch_dist"
            or not (args.save or args.load or args.pretrained_checkpoint),
            "Muon's layer-wise distributed optimizer (--optimizer muon with "
            "--use-distributed-optimizer, or dist_muon) saves and loads its state in "
            f"--ckpt-format torch_dist only (got {args.ckpt_format})",
        )


def validate_numerics(args):
    """muP and the MLP activation flags."""
    given = mup_settings_given(args)
    if not args.use_mup:
        check(
            not given,
            f"{', '.join('--' + d.replace('_', '-') for d in given)} only take effect with "
            "--use-mup",
        )
    else:
        base = args.mup_base_hidden_size
        check(base is None or base > 0, f"--mup-base-hidden-size must be > 0 (got {base})")
        derived = args.hidden_size / (base or args.hidden_size)
        check(
            mup_width_mult_matches(args.mup_width_mult, args.hidden_size, base),
            f"--mup-width-mult {args.mup_width_mult} does not match --hidden-size "
            f"{args.hidden_size} / --mup-base-hidden-size {base} = {derived:g}",
        )
    if args.openai_gelu:
        for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu)):
            check(not on, f"--openai-gelu and {flag} choose different MLP activations")
