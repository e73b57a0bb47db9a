"""Step 12: --save/--load, their intervals and formats, and checkpoint conversion."""

from .base import check


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
