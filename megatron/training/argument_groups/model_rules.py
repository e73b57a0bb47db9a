"""Cross-flag rules of the model flags: deprecated spellings, the model's shape (layers,
heads, sequence length, position embeddings, --spec) and how a layer computes
(--deterministic-mode, --cp-comm-type). Called by validate_args
(megatron/training/arguments.py)."""

from .validation import check, fail, flag_name, warn

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
_CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


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


def validate_model_shape(args):
    if args.num_layers is not None:
        check(
            args.encoder_num_layers in (None, args.num_layers),
            "--num-layers and --encoder-num-layers are mutually exclusive",
        )
        args.encoder_num_layers = args.num_layers
    else:
        args.num_layers = args.encoder_num_layers
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        value = getattr(args, dest)
        check(value is not None, f"{flag_name(dest)} is required")
        check(value > 0, f"{flag_name(dest)} must be > 0 (got {value})")

    hidden, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    if args.ffn_hidden_size is None:
        # SwiGLU has two input projections: 2/3 of 4h keeps the parameter count, rounded
        # down to a multiple of 64.
        args.ffn_hidden_size = int((4 * hidden * 2 / 3) / 64) * 64 if args.swiglu else 4 * hidden
    if args.kv_channels is None:
        check(
            hidden % heads == 0,
            f"--hidden-size ({hidden}) is not divisible by "
            f"--num-attention-heads ({heads}); pass --kv-channels to set the head size",
        )
        args.kv_channels = hidden // heads
    check(
        heads % tp == 0,
        f"--num-attention-heads ({heads}) is not divisible by --tensor-model-parallel-size ({tp})",
    )
    if args.group_query_attention:
        groups = args.num_query_groups
        check(groups is not None and groups > 0, f"--num-query-groups must be > 0 (got {groups})")
        check(
            heads % groups == 0,
            f"--num-attention-heads ({heads}) is not divisible by --num-query-groups ({groups})",
        )
        # Megatron's rule (TransformerConfig): every TP rank holds whole key/value groups. A
        # divisor of TP would need the groups replicated across ranks, which no layer builds.
        check(
            groups % tp == 0,
            f"--num-query-groups ({groups}) must be a multiple of "
            f"--tensor-model-parallel-size ({tp})",
        )
    else:
        args.num_query_groups = heads

    if args.seq_length is not None:
        check(
            args.encoder_seq_length in (None, args.seq_length),
            "--seq-length and --encoder-seq-length are mutually exclusive",
        )
        args.encoder_seq_length = args.seq_length
    else:
        args.seq_length = args.encoder_seq_length
    check(args.seq_length is not None, "--seq-length is required")
    check(args.seq_length > 0, f"--seq-length must be > 0 (got {args.seq_length})")
    cp = args.context_parallel_size
    if cp > 1:
        check(
            args.seq_length % (2 * cp) == 0,
            f"--seq-length ({args.seq_length}) must be a "
            f"multiple of 2 x --context-parallel-size ({cp}) = {2 * cp}",
        )
    for dest in ("seq_length", "decoder_seq_length"):
        length = getattr(args, dest)
        if length is not None:
            check(
                args.max_position_embeddings >= length,
                f"--max-position-embeddings ({args.max_position_embeddings}) must be >= "
                f"{flag_name(dest)} ({length})",
            )

    check(
        not (args.swiglu and args.squared_relu),
        "--swiglu and --squared-relu are mutually exclusive",
    )
    for dest in ("hidden_dropout", "attention_dropout"):
        check(
            0.0 <= getattr(args, dest) <= 1.0,
            f"{flag_name(dest)} must be in [0, 1] (got {getattr(args, dest)})",
        )
    check(
        0.0 < args.rotary_percent <= 1.0,
        f"--rotary-percent must be in (0, 1] (got {args.rotary_percent})",
    )
    check(
        args.make_vocab_size_divisible_by > 0,
        f"--make-vocab-size-divisible-by must be > 0 (got {args.make_vocab_size_divisible_by})",
    )
    if args.position_embedding_type == "mrope":
        check(
            args.mrope_section is not None, "--position-embedding-type mrope needs --mrope-section"
        )
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    else:
        # Biases everywhere include the QKV bias.
        args.add_qkv_bias = True
    if args.mtp_num_layers:
        check(
            args.position_embedding_type in ("rope", "none"),
            "--mtp-num-layers needs "
            f"--position-embedding-type rope or none (got {args.position_embedding_type})",
        )

    _validate_spec(args)
    if args.num_experts is not None:
        check(args.spec is None, "--num-experts cannot be combined with --spec")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        check(
            0 < args.moe_router_topk <= args.num_experts,
            f"--moe-router-topk "
            f"({args.moe_router_topk}) must be in [1, --num-experts ({args.num_experts})]",
        )
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])


def _validate_spec(args):
    """``--spec <module> <name>`` must name a layer spec; ``--spec local`` is the default."""
    if args.spec is None:
        return
    if list(args.spec) == ["local"]:
        args.spec = None
        return
    check(
        len(args.spec) == 2,
        f"--spec takes <module> <name> (or local), got {' '.join(args.spec) or 'nothing'}",
    )
    from megatron.core.transformer.spec_utils import import_spec

    try:
        import_spec(tuple(args.spec))
    except (ImportError, TypeError) as exc:
        fail(f"--spec {' '.join(args.spec)}: {exc}")


def validate_misc(args):
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
