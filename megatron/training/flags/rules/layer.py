"""Step 17: how a layer computes: --deterministic-mode and --cp-comm-type."""

from megatron.core.transformer.config_rules import CP_COMM_TYPES, cp_comm_types_fit

from .base import check


def validate_layer(args):
    if args.deterministic_mode:
        check(
            not args.use_flash_attn, "--deterministic-mode cannot be combined with --use-flash-attn"
        )
        check(
            not args.cross_entropy_loss_fusion,
            "--deterministic-mode cannot be combined with --cross-entropy-loss-fusion",
        )
        import torch

        torch.use_deterministic_algorithms(True)
    for value in args.cp_comm_type:
        check(
            value in CP_COMM_TYPES,
            f"--cp-comm-type: unknown value {value!r} (choose from {', '.join(CP_COMM_TYPES)})",
        )
    check(
        cp_comm_types_fit(len(args.cp_comm_type), args.num_layers),
        f"--cp-comm-type takes one value or "
        f"one per layer ({args.num_layers}), got {len(args.cp_comm_type)}",
    )
