"""Step 14: activation recomputation."""

from .base import check, fail

_RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)


# Modules whose inputs fine-grained activation offloading can move to host memory
# (megatron-core's TransformerConfig).
_OFFLOAD_MODULES = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
)


def validate_activation_offloading(args):
    """Megatron's rules for --fine-grained-activation-offloading (which moves memory only, so
    the flag policy names it as without effect here)."""
    if not args.fine_grained_activation_offloading:
        return
    check(
        not args.cpu_offloading_num_layers,
        "--fine-grained-activation-offloading cannot be combined with --cpu-offloading-num-layers",
    )
    modules = list(args.offload_modules or ())
    for module in modules:
        check(
            module in _OFFLOAD_MODULES,
            f"--offload-modules: unknown module {module!r} "
            f"(choose from {', '.join(_OFFLOAD_MODULES)})",
        )
    check(
        "attn_proj" not in modules or "core_attn" in modules,
        "--offload-modules attn_proj needs core_attn too (the input of attn_proj is the output "
        "of core_attn, which core_attn's backward needs)",
    )
    check(
        args.min_offloaded_tensor_size >= 0,
        f"--min-offloaded-tensor-size must be >= 0 (got {args.min_offloaded_tensor_size})",
    )


def validate_recompute(args):
    granularity, method = args.recompute_granularity, args.recompute_method
    if args.distribute_saved_activations:
        check(
            args.tensor_model_parallel_size > 1,
            "--distribute-saved-activations needs --tensor-model-parallel-size > 1",
        )
        check(
            granularity == "full",
            "--distribute-saved-activations needs "
            f"--recompute-granularity full (got {granularity})",
        )
        check(method is not None, "--distribute-saved-activations needs --recompute-method")
        check(
            not args.sequence_parallel,
            "--distribute-saved-activations cannot be used with "
            "--sequence-parallel (the checkpointed activations are already split across TP)",
        )
    layers = args.recompute_num_layers
    if granularity == "selective":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers)):
            check(
                value is None,
                f"{flag} {value} cannot be used with --recompute-granularity "
                "selective (or --recompute-activations)",
            )
    elif granularity == "full":
        check(
            method is not None,
            "--recompute-granularity full needs --recompute-method uniform or block",
        )
        check(layers is not None, "--recompute-granularity full needs --recompute-num-layers")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        # uniform: layers per checkpointed chunk; block: checkpointed layers per stage.
        low = 1 if method == "uniform" else 0
        check(
            low <= layers <= per_stage,
            f"--recompute-num-layers ({layers}) must be in "
            f"[{low}, {per_stage}] with --recompute-method {method} ({per_stage} layers per "
            "pipeline stage)",
        )
    elif method is not None or layers is not None:
        fail("--recompute-method/--recompute-num-layers need --recompute-granularity full")
    for module in args.recompute_modules or ():
        check(
            module in _RECOMPUTE_MODULES,
            f"--recompute-modules: unknown module {module!r} "
            f"(choose from {', '.join(_RECOMPUTE_MODULES)})",
        )
    check(
        "mla_up_proj" not in (args.recompute_modules or ()) or args.multi_latent_attention,
        "--recompute-modules mla_up_proj needs --multi-latent-attention",
    )
