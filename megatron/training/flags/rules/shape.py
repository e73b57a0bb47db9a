"""Steps 3 and 4: the model's shape (layers, heads, sequence length, position embeddings,
--spec), then the shape of its MoE layers."""

from megatron.core.transformer.config_rules import (
    heads_split_into_query_groups,
    heads_split_over_tp,
    hidden_splits_into_heads,
    query_groups_split_over_tp,
    router_topk_in_range,
)

from .base import check, fail, flag_name


def validate_model_shape(args):
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(
        args, "hybrid_override_pattern", None
    )
    if args.num_layers is None and args.encoder_num_layers is None and pattern:
        # Megatron derives a hybrid model's depth from its layer pattern.
        from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols

        try:
            args.num_layers = len(layer_symbols(pattern))
        except ValueError as exc:
            fail(str(exc))
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
            hidden_splits_into_heads(hidden, heads),
            f"--hidden-size ({hidden}) is not divisible by "
            f"--num-attention-heads ({heads}); pass --kv-channels to set the head size",
        )
        args.kv_channels = hidden // heads
    check(
        heads_split_over_tp(heads, tp),
        f"--num-attention-heads ({heads}) is not divisible by --tensor-model-parallel-size ({tp})",
    )
    if args.group_query_attention:
        groups = args.num_query_groups
        check(groups is not None and groups > 0, f"--num-query-groups must be > 0 (got {groups})")
        check(
            heads_split_into_query_groups(heads, groups),
            f"--num-attention-heads ({heads}) is not divisible by --num-query-groups ({groups})",
        )
        # Megatron's rule (TransformerConfig): every TP rank holds whole key/value groups. A
        # divisor of TP would need the groups replicated across ranks, which no layer builds.
        check(
            query_groups_split_over_tp(groups, tp),
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
    if args.mtp_num_layers is not None:
        check(
            args.mtp_num_layers >= 0,
            f"--mtp-num-layers must be >= 0 (got {args.mtp_num_layers})",
        )
    if args.mtp_num_layers:
        check(
            args.position_embedding_type in ("rope", "none"),
            "--mtp-num-layers needs "
            f"--position-embedding-type rope or none (got {args.position_embedding_type})",
        )

    _validate_spec(args)


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


def validate_moe_shape(args):
    """The MoE layer routes each token to --moe-router-topk of --num-experts experts of
    --moe-ffn-hidden-size (default: --ffn-hidden-size); a single load-balancing type and
    coefficient given as a list become scalars, as Megatron's are."""
    if args.num_experts is not None:
        check(args.spec is None, "--num-experts cannot be combined with --spec")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        check(
            router_topk_in_range(args.moe_router_topk, args.num_experts),
            f"--moe-router-topk "
            f"({args.moe_router_topk}) must be in [1, --num-experts ({args.num_experts})]",
        )
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])
