"""Step 17: how a layer computes: --deterministic-mode and --cp-comm-type."""

from .base import check

_CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


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
            value in _CP_COMM_TYPES,
            f"--cp-comm-type: unknown value {value!r} (choose from {', '.join(_CP_COMM_TYPES)})",
        )
    if len(args.cp_comm_type) != 1:
        check(
            len(args.cp_comm_type) == args.num_layers,
            f"--cp-comm-type takes one value or "
            f"one per layer ({args.num_layers}), got {len(args.cp_comm_type)}",
        )
