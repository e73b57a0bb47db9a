"""Step 18: the rerun state machine (--rerun-mode, --error-injection-*, --check-for-large-grads)."""

from .base import check


def validate_rerun(args):
    check(
        args.error_injection_rate >= 0,
        f"--error-injection-rate must be >= 0 (0: no injection), got {args.error_injection_rate}",
    )
    # Only result validation injects (report_stats re-runs every iteration and never rejects).
    check(
        args.error_injection_rate == 0 or args.rerun_mode == "validate_results",
        f"--error-injection-rate {args.error_injection_rate} needs --rerun-mode validate_results "
        f"(got --rerun-mode {args.rerun_mode})",
    )
    # The FSDP wrappers check their gradients themselves, not through the rerun state machine.
    check(
        not (args.check_for_large_grads and (args.use_torch_fsdp2 or args.use_megatron_fsdp)),
        "--check-for-large-grads needs the DDP gradient buffers: it cannot be used with "
        "--use-torch-fsdp2 or --use-megatron-fsdp",
    )
