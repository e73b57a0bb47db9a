"""Step 17: how a layer computes: --deterministic-mode, --cp-comm-type and
--compile-transformer-layers."""

from megatron.core.transformer.config_rules import (
    CP_COMM_TYPES,
    compiled_layers_dropout_fits,
    compiled_layers_without_recompute,
    cp_comm_types_fit,
)

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
    compiled = args.compile_transformer_layers
    check(
        compiled_layers_without_recompute(compiled, args.recompute_granularity),
        "--compile-transformer-layers cannot be combined with --recompute-granularity "
        f"{args.recompute_granularity} (or --recompute-activations)",
    )
    check(
        compiled_layers_dropout_fits(
            compiled, args.tensor_model_parallel_size, args.hidden_dropout, args.attention_dropout
        ),
        "--compile-transformer-layers needs --hidden-dropout 0 and --attention-dropout 0 with "
        "--tensor-model-parallel-size > 1",
    )
