"""Step 5: the mixture-of-experts flags beyond the layer's shape (Megatron's rules, plus what
this code base does not build). The expert-parallel sizes are step 2's."""

from megatron.core.transformer.config_rules import (
    aux_loss_coeffs_match_types,
    capacity_padding_has_capacity,
    moe_layer_pattern_covers_layers,
    moe_tokens_split_over_tp,
)

from .base import check


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def validate_moe(args):
    _validate_grouped_gemm(args)
    if args.num_experts is None:
        return
    tp = args.tensor_model_parallel_size
    check(
        moe_tokens_split_over_tp(tp, args.sequence_parallel),
        f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
        "(the MoE layer's token exchange assumes every tensor-parallel rank holds other tokens)",
    )
    # (--moe-ffn-hidden-size's default and --moe-router-topk's range are the shape's, step 4.)
    types = _as_list(args.moe_router_load_balancing_type)
    coeffs = _as_list(args.moe_aux_loss_coeff)
    check(
        aux_loss_coeffs_match_types(types, coeffs),
        f"--moe-aux-loss-coeff takes one value per --moe-router-load-balancing-type "
        f"({len(types)}), got {len(coeffs)}",
    )
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        check(
            moe_layer_pattern_covers_layers(freq, args.num_layers),
            f"--moe-layer-freq lists {len(freq)} layers, --num-layers is {args.num_layers}",
        )
    check(
        capacity_padding_has_capacity(
            args.moe_pad_expert_input_to_capacity, args.moe_expert_capacity_factor
        ),
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )
    if args.moe_token_dispatcher_type == "flex":
        # DeepEP is not available: the same exchange as alltoall (the start-up note says so).
        args.moe_token_dispatcher_type = "alltoall"


GROUPED_GEMM_MIN_CAPABILITY = (8, 0)


def _validate_grouped_gemm(args):
    """Megatron-LM's rule for ``--moe-grouped-gemm``: a GPU of compute capability 8.0 or higher
    (its grouped GEMM kernels need it), in any precision. Without CUDA there is no capability
    to ask for: the grouped experts here are plain PyTorch (a padded ``bmm``) and run anywhere."""
    import torch  # here so that importing the rules stays torch-free

    if not args.moe_grouped_gemm or not torch.cuda.is_available():
        return
    capability = tuple(torch.cuda.get_device_capability())
    check(
        capability >= GROUPED_GEMM_MIN_CAPABILITY,
        "--moe-grouped-gemm needs a GPU of compute capability 8.0 or higher, this one has "
        f"{capability[0]}.{capability[1]}",
    )
