"""Step 17: how a layer computes: --deterministic-mode, --cp-comm-type, --cuda-graph-impl,
--compile-transformer-layers and the gated delta net layers (--experimental-attention-variant
gated_delta_net with --linear-attention-freq and the --linear-* sizes)."""

from megatron.core.transformer.config_rules import (
    CP_COMM_TYPES,
    compiled_layers_dropout_fits,
    compiled_layers_without_recompute,
    cp_comm_types_fit,
    linear_attention_pattern,
)

from .base import check, info


def validate_layer(args):
    validate_cuda_graphs(args)
    validate_gated_delta_net(args)
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
    _name_the_cp_exchange(args)


def validate_cuda_graphs(args):
    """What the per-layer graphs of ``--cuda-graph-impl local`` cannot replay (see
    megatron/core/transformer/cuda_graphs.py): one line naming the flag in the way."""
    if args.cuda_graph_impl != "local":
        return
    what = "--cuda-graph-impl local"
    check(
        args.cuda_graph_warmup_steps >= 1,
        f"--cuda-graph-warmup-steps must be at least 1 with {what}",
    )
    for ok, why in (
        (
            args.pipeline_model_parallel_size == 1,
            "--pipeline-model-parallel-size > 1 (several micro-batches in flight per layer)",
        ),
        (
            args.tensor_model_parallel_size == 1,
            "--tensor-model-parallel-size > 1 (collectives inside a layer)",
        ),
        (
            args.context_parallel_size == 1,
            "--context-parallel-size > 1 (collectives inside a layer)",
        ),
        (not args.num_experts, "--num-experts (MoE routing has data-dependent shapes)"),
        (
            args.hidden_dropout == 0 and args.attention_dropout == 0,
            "dropout (the RNG tracker swaps generator states on the host; pass "
            "--hidden-dropout 0 --attention-dropout 0)",
        ),
        (
            args.recompute_granularity is None,
            "--recompute-granularity (recompute replays forwards inside backward)",
        ),
        (
            not args.overlap_grad_reduce,
            "--overlap-grad-reduce (its readiness calls from backward would not replay)",
        ),
        (
            not args.compile_transformer_layers,
            "--compile-transformer-layers (a capture of compiled layers is not proven here)",
        ),
    ):
        check(ok, f"{what} does not support {why}")
    # That it needs a GPU is a fact of the machine, not of the flags: checked at start-up
    # (initialize.check_flags_against_the_machine), so that a dry run on a CPU validates a GPU
    # command line.


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


def validate_gated_delta_net(args):
    """Megatron's rules for gated delta net layers, plus what this code base lacks for them."""
    if args.experimental_attention_variant != "gated_delta_net":
        check(
            args.linear_attention_freq is None,
            "--linear-attention-freq needs --experimental-attention-variant gated_delta_net",
        )
        return
    check(
        args.linear_attention_freq is not None,
        "--experimental-attention-variant gated_delta_net needs --linear-attention-freq",
    )
    try:
        linear_attention_pattern(args.linear_attention_freq, args.num_layers)
    except ValueError as error:
        check(False, f"--linear-attention-freq {error}")
    check(
        args.linear_num_value_heads % args.linear_num_key_heads == 0,
        f"--linear-num-value-heads ({args.linear_num_value_heads}) must be a multiple of "
        f"--linear-num-key-heads ({args.linear_num_key_heads})",
    )
    tp = args.tensor_model_parallel_size
    for flag, heads in (
        ("--linear-num-key-heads", args.linear_num_key_heads),
        ("--linear-num-value-heads", args.linear_num_value_heads),
    ):
        check(
            heads % tp == 0,
            f"{flag} ({heads}) must be divisible by --tensor-model-parallel-size ({tp})",
        )
    check(
        args.context_parallel_size == 1,
        "--experimental-attention-variant gated_delta_net does not support "
        "--context-parallel-size > 1 (as in Megatron)",
    )
