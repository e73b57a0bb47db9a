"""Step 1 of the pass: flags Megatron removed or deprecated (each ends with its hint, warns or
becomes its successor's value), before any rule reads their successors."""

from .base import check, flag_name, warn

# Flags Megatron still parses but refuses (its validate_args asserts they are unset).
_REMOVED_BUT_PARSED = (
    ("batch_size", "--batch-size", "use --micro-batch-size (and --global-batch-size)"),
    (
        "checkpoint_activations",
        "--checkpoint-activations",
        "use --recompute-activations, or for more control "
        "--recompute-granularity and --recompute-method",
    ),
    ("warmup", "--warmup", "use --lr-warmup-fraction, --lr-warmup-iters or --lr-warmup-samples"),
    ("model_parallel_size", "--model-parallel-size", "use --tensor-model-parallel-size"),
)


def translate_deprecated(args):
    for dest, flag, hint in _REMOVED_BUT_PARSED:
        check(not getattr(args, dest, None), f"{flag} is no longer supported: {hint}")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    from megatron.core.transformer.enums import AttnBackend

    if args.use_flash_attn and args.attention_backend in (AttnBackend.auto, "auto"):
        # The older spelling of "run the flash kernel": keep 'auto' from picking the unfused path.
        args.attention_backend = AttnBackend.flash
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        warn(args, "--no-position-embedding is deprecated; using --position-embedding-type none")
        args.position_embedding_type = "none"
    for old, impl in (
        ("enable_cuda_graph", "local"),
        ("external_cuda_graph", "transformer_engine"),
    ):
        if getattr(args, old):
            check(
                args.cuda_graph_impl == "none",
                f"{flag_name(old)} is deprecated and cannot be "
                f"combined with --cuda-graph-impl {args.cuda_graph_impl}",
            )
            warn(args, f"{flag_name(old)} is deprecated; using --cuda-graph-impl {impl}")
            args.cuda_graph_impl = impl
    # Megatron drops the alias once applied (pop: validate_args may run twice on one args).
    if vars(args).pop("recompute_activations", False):
        args.recompute_granularity = "selective"
    for dest, flag in (
        ("use_dist_ckpt_deprecated", "--use-dist-ckpt"),
        ("dist_ckpt_format_deprecated", "--dist-ckpt-format"),
        ("ckpt_fully_parallel_save_deprecated", "--ckpt-fully-parallel-save"),
    ):
        if getattr(args, dest):
            warn(
                args,
                f"{flag} is deprecated and has no effect; see --ckpt-format and "
                "--no-ckpt-fully-parallel-save",
            )
    if args.num_experts == 0:
        args.num_experts = None
