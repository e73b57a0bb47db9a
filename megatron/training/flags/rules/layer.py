"""Step 17: how a layer computes: --deterministic-mode and --cp-comm-type."""

from megatron.core.transformer.config_rules import CP_COMM_TYPES, cp_comm_types_fit

from .base import check, info


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
    _name_the_cp_exchange(args)


def _name_the_cp_exchange(args):
    """One start-up line naming the exchange context parallelism actually runs, when the flags
    ask for another (a2a, allgather, a2a+p2p over --hierarchical-context-parallel-sizes): every
    exchange computes the same attention, and here it is always the p2p ring over the whole
    context-parallel group."""
    cp = args.context_parallel_size
    asked = sorted(set(args.cp_comm_type) - {"p2p"})
    if cp == 1 or not asked:
        return
    levels = args.hierarchical_context_parallel_sizes
    hierarchy = ""
    if "a2a+p2p" in asked:
        hierarchy = f" with --hierarchical-context-parallel-sizes {' '.join(map(str, levels))}"
    info(
        args,
        f" > context parallelism: --cp-comm-type {' '.join(args.cp_comm_type)}{hierarchy} runs "
        f"as the p2p ring over all {cp} context-parallel ranks (the same attention)",
    )
