"""The cross-flag rules of validate_args (megatron/training/arguments.py).

Each `validate_*` function checks one family of flags, fills in the values derived from
them and raises ArgumentValidationError with a message naming the flags and values.
"""

import math
import os
import signal


class ArgumentValidationError(ValueError):
    """A flag value, or a combination of flags, that cannot work. The message names them."""


def fail(message):
    raise ArgumentValidationError(message)


def check(condition, message):
    if not condition:
        fail(message)


def flag_name(dest):
    return "--" + dest.replace("_", "-")


def warn(args, message):
    if args.rank == 0:
        print(f"WARNING: {message}", flush=True)


def info(args, message):
    if args.rank == 0:
        print(message, flush=True)


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


def validate_parallel_sizes(args):
    for dest in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
    ):
        value = getattr(args, dest)
        check(value >= 1, f"{flag_name(dest)} must be >= 1 (got {value})")
    check(args.world_size >= 1, f"world size (WORLD_SIZE={args.world_size}) must be >= 1")
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    model_size = tp * pp * cp
    check(
        args.world_size % model_size == 0,
        f"world size ({args.world_size}) is not divisible by tensor-model-parallel size ({tp}) "
        f"x pipeline-model-parallel size ({pp}) x context-parallel size ({cp}) = {model_size}",
    )
    args.transformer_pipeline_model_parallel_size = pp
    args.data_parallel_size = args.world_size // model_size
    info(
        args,
        f"using world size: {args.world_size}, data-parallel size: "
        f"{args.data_parallel_size}, context-parallel size: {cp}, hierarchical "
        f"context-parallel sizes: {args.hierarchical_context_parallel_sizes}, "
        f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp}",
    )

    sizes = args.hierarchical_context_parallel_sizes
    if sizes:
        check(
            math.prod(sizes) == cp,
            f"--hierarchical-context-parallel-sizes {sizes} multiply "
            f"to {math.prod(sizes)}, not --context-parallel-size ({cp})",
        )
    if "a2a+p2p" in args.cp_comm_type:
        check(
            sizes is not None, "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"
        )

    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    check(etp >= 1, f"--expert-tensor-parallel-size must be >= 1 (got {etp})")
    if ep > 1:
        check(
            args.num_experts is not None, f"--expert-model-parallel-size {ep} needs --num-experts"
        )
        check(not args.fp16, f"--expert-model-parallel-size {ep} does not support --fp16")
    if args.num_experts is not None:
        check(
            args.num_experts % ep == 0,
            f"--num-experts ({args.num_experts}) is not divisible "
            f"by --expert-model-parallel-size ({ep})",
        )
    expert_model_size = etp * ep * pp
    check(
        args.world_size % expert_model_size == 0,
        f"world size ({args.world_size}) is not divisible by expert-tensor-parallel size "
        f"({etp}) x expert-model-parallel size ({ep}) x pipeline-model-parallel size ({pp}) "
        f"= {expert_model_size}",
    )


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
        if args.moe_grouped_gemm:
            check(args.bf16, "--moe-grouped-gemm needs --bf16")
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


def validate_batch_size(args):
    mbs = args.micro_batch_size
    check(mbs is not None, "--micro-batch-size is required")
    check(mbs > 0, f"--micro-batch-size must be > 0 (got {mbs})")
    if args.step_batch_size_schedule is not None:
        check(
            args.global_batch_size is None,
            "--step-batch-size-schedule and "
            "--global-batch-size are mutually exclusive (the schedule sets the batch size)",
        )
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
        info(args, f"setting global batch size to {args.global_batch_size}")
    gbs = args.global_batch_size
    check(gbs > 0, f"--global-batch-size must be > 0 (got {gbs})")
    per_step = mbs * dp
    sizes = [("--global-batch-size", gbs)]

    if args.rampup_batch_size is not None:
        values = args.rampup_batch_size  # the parser takes exactly three integers
        start, incr, samples = values
        check(
            start > 0 and incr > 0 and samples >= 0,
            f"--rampup-batch-size needs start > 0, increment > 0 and samples >= 0 (got {values})",
        )
        check(
            start <= gbs,
            f"--rampup-batch-size start ({start}) must be <= --global-batch-size ({gbs})",
        )
        check(
            (gbs - start) % incr == 0,
            f"--global-batch-size ({gbs}) minus the "
            f"--rampup-batch-size start ({start}) is not divisible by the increment ({incr})",
        )
        check(
            args.train_samples is not None,
            "--rampup-batch-size needs sample-based "
            "training: use --train-samples instead of --train-iters",
        )
        # Every batch size of the ramp (start + k * increment) must split into micro-batches.
        sizes.append(("the --rampup-batch-size start", start))
        if start < gbs:
            sizes.append(("the --rampup-batch-size increment", incr))
    eval_mbs = args.eval_micro_batch_size or mbs
    check(eval_mbs > 0, f"--eval-micro-batch-size must be > 0 (got {eval_mbs})")
    if args.eval_global_batch_size is not None or args.eval_micro_batch_size is not None:
        eval_gbs = args.eval_global_batch_size or gbs
        check(
            eval_gbs > 0 and eval_gbs % (eval_mbs * dp) == 0,
            f"evaluation global batch size ({eval_gbs}) is not divisible by evaluation micro "
            f"batch size ({eval_mbs}) x data-parallel size ({dp}) = {eval_mbs * dp} (see "
            "--eval-global-batch-size / --eval-micro-batch-size)",
        )
    if not args.decrease_batch_size_if_needed:
        for name, size in sizes:
            check(
                size % per_step == 0,
                f"{name} ({size}) is not divisible by "
                f"--micro-batch-size ({mbs}) x data-parallel size ({dp}) = {per_step}",
            )


def _layers_for_pipeline_split(args):
    """Layer count used to split layers over pipeline stages, and how it was formed."""
    count, parts = args.num_layers, f"--num-layers {args.num_layers}"
    if args.account_for_embedding_in_pipeline_split:
        count, parts = count + 1, parts + " + 1 (--account-for-embedding-in-pipeline-split)"
    if args.account_for_loss_in_pipeline_split:
        count, parts = count + 1, parts + " + 1 (--account-for-loss-in-pipeline-split)"
    return count, parts


def validate_pipeline(args):
    pp = args.pipeline_model_parallel_size
    vpp_flags = [
        flag
        for dest, flag in (
            ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
            ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"),
            ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
        )
        if getattr(args, dest) is not None
    ]
    check(len(vpp_flags) <= 1, f"{' and '.join(vpp_flags)} are mutually exclusive")
    uneven = (
        args.decoder_first_pipeline_num_layers is not None
        or args.decoder_last_pipeline_num_layers is not None
    )
    layers, described = _layers_for_pipeline_split(args)

    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_virtual = args.num_layers_per_virtual_pipeline_stage
        check(
            not uneven,
            "--num-layers-per-virtual-pipeline-stage cannot be combined with "
            "--decoder-first/last-pipeline-num-layers; use "
            "--num-virtual-stages-per-pipeline-rank",
        )
        check(
            per_virtual > 0,
            f"--num-layers-per-virtual-pipeline-stage must be > 0 (got {per_virtual})",
        )
        check(
            layers % pp == 0,
            f"number of layers ({described} = {layers}) is not divisible "
            f"by --pipeline-model-parallel-size ({pp})",
        )
        check(
            (layers // pp) % per_virtual == 0,
            f"layers per pipeline stage ({layers // pp}) "
            f"are not divisible by --num-layers-per-virtual-pipeline-stage ({per_virtual})",
        )
        args.virtual_pipeline_model_parallel_size = (layers // pp) // per_virtual
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        check(
            args.num_virtual_stages_per_pipeline_rank > 0,
            "--num-virtual-stages-per-"
            f"pipeline-rank must be > 0 (got {args.num_virtual_stages_per_pipeline_rank})",
        )
        args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    elif args.pipeline_model_parallel_layout is None:
        if uneven:
            _validate_uneven_pipeline(args, pp)
        else:
            check(
                layers % pp == 0,
                f"number of layers ({described} = {layers}) is not "
                f"divisible by --pipeline-model-parallel-size ({pp})",
            )
    # The layout string is not parsed here: custom layouts are rejected as not supported yet.
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None

    if args.virtual_pipeline_model_parallel_size is not None:
        if args.overlap_p2p_comm:
            check(
                pp > 1,
                "the interleaved (virtual pipeline) schedule needs "
                f"--pipeline-model-parallel-size > 1 (got {pp})",
            )
        else:
            check(
                pp > 2,
                "the interleaved schedule with --no-overlap-p2p-communication needs "
                f"--pipeline-model-parallel-size > 2 (got {pp})",
            )
    else:
        # Only the interleaved schedule overlaps p2p communication and aligns param gathers.
        if pp > 1:
            warn(
                args,
                "setting overlap_p2p_comm and align_param_gather to False: the "
                "non-interleaved schedule supports neither",
            )
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    if args.pipeline_model_parallel_layout is None:
        _validate_layer_split(args)


def _validate_layer_split(args):
    """The split the trainer will build, computed now so a bad one fails before any process
    group exists; with virtual stages also Megatron's micro-batch rules of the interleaved
    schedule."""
    from megatron.core.pipeline_parallel.layer_split import (
        check_interleaved_microbatches,
        compute_layer_split,
    )

    try:
        compute_layer_split(
            args.num_layers,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            args.decoder_first_pipeline_num_layers,
            args.decoder_last_pipeline_num_layers,
            args.account_for_embedding_in_pipeline_split,
            args.account_for_loss_in_pipeline_split,
        )
        if args.virtual_pipeline_model_parallel_size is not None and args.global_batch_size:
            check_interleaved_microbatches(
                args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
                args.pipeline_model_parallel_size,
                args.microbatch_group_size_per_vp_stage,
            )
    except ValueError as exc:
        check(False, str(exc))


def _validate_uneven_pipeline(args, pp):
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    check(
        pp > 1,
        "--decoder-first/last-pipeline-num-layers need "
        f"--pipeline-model-parallel-size > 1 (got {pp})",
    )
    for flag, value in (
        ("--decoder-first-pipeline-num-layers", first),
        ("--decoder-last-pipeline-num-layers", last),
    ):
        check(value is None or value >= 0, f"{flag} must be >= 0 (got {value})")
    middle_stages = pp - (first is not None) - (last is not None)
    rest = args.num_layers - (first or 0) - (last or 0)
    check(
        rest >= 0 and (rest % middle_stages == 0 if middle_stages else rest == 0),
        f"--num-layers ({args.num_layers}) minus the first/last stage layers "
        f"({first}/{last}) = {rest} cannot be split evenly over the other {middle_stages} "
        f"pipeline stages",
    )


def validate_data_parallel_strategy(args):
    check(
        args.ddp_num_buckets is None or args.ddp_bucket_size is None,
        f"--ddp-num-buckets {args.ddp_num_buckets} and --ddp-bucket-size {args.ddp_bucket_size} "
        "are mutually exclusive",
    )
    if args.ddp_num_buckets is not None:
        check(
            args.ddp_num_buckets > 0,
            f"--ddp-num-buckets must be positive, got {args.ddp_num_buckets}",
        )
    if args.overlap_param_gather:
        check(
            args.use_distributed_optimizer or args.use_megatron_fsdp,
            "--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)",
        )
        check(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step:
        check(
            args.use_distributed_optimizer,
            "--overlap-param-gather-with-optimizer-step needs --use-distributed-optimizer",
        )
        check(
            args.overlap_param_gather,
            "--overlap-param-gather-with-optimizer-step needs --overlap-param-gather",
        )
        check(
            args.virtual_pipeline_model_parallel_size is not None,
            "--overlap-param-gather-with-optimizer-step needs virtual pipeline stages",
        )
    check(
        not (args.use_torch_fsdp2 and args.use_megatron_fsdp),
        "--use-torch-fsdp2 and --use-megatron-fsdp are mutually exclusive",
    )
    one_connection = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    strategy = args.data_parallel_sharding_strategy
    if args.use_torch_fsdp2:
        _validate_fsdp2(args, "--use-torch-fsdp2", one_connection)
        check(
            not args.use_distributed_optimizer,
            "--use-torch-fsdp2 does not support --use-distributed-optimizer",
        )
        check(
            args.ckpt_format in ("torch_dist", "torch_dcp"),
            "--use-torch-fsdp2 does not "
            f"support --ckpt-format {args.ckpt_format} (use torch_dist or torch_dcp)",
        )
        check(
            strategy == "optim_grads_params",
            f"--data-parallel-sharding-strategy {strategy} "
            "cannot be used with --use-torch-fsdp2 (FSDP2 shards optimizer state, gradients "
            "and params: optim_grads_params)",
        )
    elif args.use_megatron_fsdp:
        check(
            args.ckpt_format == "fsdp_dtensor",
            f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got {args.ckpt_format})",
        )
        check(
            not one_connection, "--use-megatron-fsdp does not support CUDA_DEVICE_MAX_CONNECTIONS=1"
        )
        # Megatron-FSDP is mapped onto this code base's machinery (README "Memory options"):
        # no_shard = plain DDP, optim/optim_grads = the distributed optimizer (its gradients are
        # reduce-scattered, so both are ZeRO-2 here), optim_grads_params = FSDP2. The strategy
        # decides the optimizer; --use-distributed-optimizer (which Megatron's guide passes
        # along) is implied by it.
        if strategy == "optim_grads_params":
            _validate_fsdp2(
                args,
                f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}",
                one_connection,
            )
        check(
            not (args.save or args.load or args.pretrained_checkpoint),
            "--use-megatron-fsdp "
            "cannot save or load checkpoints yet (--ckpt-format fsdp_dtensor is not implemented)",
        )
        args.use_distributed_optimizer = strategy in ("optim", "optim_grads")
        check(
            strategy != "no_shard" or not args.overlap_param_gather,
            "--overlap-param-gather "
            "has nothing to gather with --use-megatron-fsdp --data-parallel-sharding-strategy "
            "no_shard",
        )
        info(
            args,
            f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}: running as "
            + {
                "no_shard": "plain data-parallel DDP",
                "optim": "the distributed optimizer",
                "optim_grads": "the distributed optimizer",
                "optim_grads_params": "torch FSDP2 (fully_shard)",
            }[strategy],
        )
    else:
        check(
            strategy == "optim_grads_params",
            f"--data-parallel-sharding-strategy {strategy} "
            "needs --use-megatron-fsdp (for ZeRO-1/2 alone use --use-distributed-optimizer, "
            "for ZeRO-3 --use-torch-fsdp2)",
        )
    if args.optimizer == "muon":
        for ok, why in (
            (not args.use_torch_fsdp2, "--use-torch-fsdp2"),
            (not args.use_megatron_fsdp, "--use-megatron-fsdp"),
        ):
            check(ok, f"--optimizer muon does not support {why}")
    if args.optimizer_cpu_offload:
        check(
            args.use_precision_aware_optimizer,
            "--optimizer-cpu-offload needs --use-precision-aware-optimizer",
        )
    if args.fp8_param_gather:
        check(
            args.use_distributed_optimizer or args.use_torch_fsdp2 or args.use_megatron_fsdp,
            "--fp8-param-gather needs --use-distributed-optimizer or FSDP",
        )

    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        # Megatron turns it off rather than failing: SP without TP would only change numerics.
        warn(args, "disabling --sequence-parallel because --tensor-model-parallel-size is 1")
        args.sequence_parallel = False
    if args.tp_comm_overlap:
        check(
            args.sequence_parallel,
            "--tp-comm-overlap needs --sequence-parallel (and --tensor-model-parallel-size > 1)",
        )


def _validate_fsdp2(args, what, one_connection):
    """The limits Megatron puts on its FSDP paths, for --use-torch-fsdp2 and for
    --use-megatron-fsdp with optim_grads_params (which runs on FSDP2 here)."""
    for ok, why in (
        (args.pipeline_model_parallel_size == 1, "pipeline parallelism"),
        (args.expert_model_parallel_size == 1, "expert parallelism"),
        (
            not args.gradient_accumulation_fusion,
            "gradient accumulation fusion (pass --no-gradient-accumulation-fusion)",
        ),
        (
            args.untie_embeddings_and_output_weights,
            "tied embeddings (pass --untie-embeddings-and-output-weights)",
        ),
        (not args.fp16, "--fp16"),
        (not one_connection, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
        (
            not (args.save or args.load or args.pretrained_checkpoint),
            "saving or loading checkpoints yet (--save/--load/--pretrained-checkpoint)",
        ),
        (not args.log_params_norm, "--log-params-norm yet"),
    ):
        check(ok, f"{what} does not support {why}")


def validate_precision(args):
    import torch  # here so that importing the flag definitions stays torch-free

    check(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    dtypes = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8": torch.uint8,
    }
    for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, dest)
        if not isinstance(value, torch.dtype):
            setattr(args, dest, dtypes[value])
    args.params_dtype = torch.float32
    if args.fp16:
        args.params_dtype = torch.float16
        if not args.loss_scale:
            # With dynamic scaling an inf/NaN gradient is the signal to back off, not an error.
            args.check_for_nan_in_loss_and_grad = False
            warn(
                args,
                "setting check_for_nan_in_loss_and_grad to False: dynamic loss scaling is in use",
            )
    if args.bf16:
        args.params_dtype = torch.bfloat16
        if args.accumulate_allreduce_grads_in_fp32:
            check(
                args.main_grads_dtype == torch.float32,
                "--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32",
            )
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
        elif not args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype == torch.float32:
            args.accumulate_allreduce_grads_in_fp32 = True
            info(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    info(args, f"using {args.params_dtype} for parameters ...")
    if args.fp16_lm_cross_entropy:
        check(args.fp16, "--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection:
        check(args.fp16 or args.bf16, "--fp32-residual-connection needs --fp16 or --bf16")
    if args.loss_scale is not None:
        check(args.loss_scale > 0, f"--loss-scale must be > 0 (got {args.loss_scale})")
    for dest in ("initial_loss_scale", "min_loss_scale", "loss_scale_window"):
        check(getattr(args, dest) > 0, f"{flag_name(dest)} must be > 0 (got {getattr(args, dest)})")
    check(
        args.min_loss_scale <= args.initial_loss_scale,
        f"--min-loss-scale "
        f"({args.min_loss_scale}) must be <= --initial-loss-scale ({args.initial_loss_scale})",
    )
    check(args.hysteresis >= 1, f"--hysteresis must be >= 1 (got {args.hysteresis})")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True


def validate_schedule(args):
    iters, samples = args.train_iters, args.train_samples
    check(
        iters is None or samples is None, "--train-iters and --train-samples are mutually exclusive"
    )
    check(
        iters is not None or samples is not None or args.skip_train,
        "one of --train-iters or --train-samples is required (or pass --skip-train)",
    )
    for dest in ("train_iters", "train_samples"):
        value = getattr(args, dest)
        check(value is None or value >= 0, f"{flag_name(dest)} must be >= 0 (got {value})")
    if iters is not None:
        wrong_mode = (
            ("lr_decay_samples", None),
            ("lr_warmup_samples", 0),
            ("lr_wsd_decay_samples", None),
        )
        mode, other, suffix = "--train-iters (iteration-based training)", "iters", "samples"
    else:
        wrong_mode = (
            ("lr_decay_iters", None),
            ("lr_warmup_iters", 0),
            ("lr_wsd_decay_iters", None),
        )
        mode, other, suffix = "--train-samples (sample-based training)", "samples", "iters"
    if iters is not None or samples is not None:
        for dest, unset in wrong_mode:
            value = getattr(args, dest)
            check(
                value == unset,
                f"{flag_name(dest)} ({value}) cannot be used with {mode}; use "
                f"{flag_name(dest).replace(suffix, other)}",
            )

    fraction = args.lr_warmup_fraction
    if fraction is not None:
        for dest in ("lr_warmup_iters", "lr_warmup_samples"):
            check(
                getattr(args, dest) == 0,
                f"--lr-warmup-fraction and {flag_name(dest)} are mutually exclusive",
            )
        check(0.0 <= fraction < 1.0, f"--lr-warmup-fraction must be in [0, 1) (got {fraction})")
    for unit in ("iters", "samples"):
        warmup, decay = getattr(args, f"lr_warmup_{unit}"), getattr(args, f"lr_decay_{unit}")
        decay_name = f"--lr-decay-{unit}"
        if decay is None:
            decay, decay_name = getattr(args, f"train_{unit}"), f"--train-{unit}"
        if warmup > 0 and decay is not None:
            check(
                warmup < decay,
                f"--lr-warmup-{unit} ({warmup}) must be smaller than the "
                f"decay length {decay_name} ({decay})",
            )
        check(warmup >= 0, f"--lr-warmup-{unit} must be >= 0 (got {warmup})")
    if args.lr_decay_style == "WSD" and (iters is not None or samples is not None):
        unit = "iters" if iters is not None else "samples"
        check(
            getattr(args, f"lr_wsd_decay_{unit}") is not None,
            f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}",
        )

    if args.lr is not None:
        check(args.lr >= 0, f"--lr must be >= 0 (got {args.lr})")
        check(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
        check(
            args.lr_warmup_init <= args.lr,
            f"--lr-warmup-init ({args.lr_warmup_init}) must be <= --lr ({args.lr})",
        )
    if args.decoupled_lr is not None and args.decoupled_min_lr is not None:
        check(
            args.decoupled_min_lr <= args.decoupled_lr,
            f"--decoupled-min-lr "
            f"({args.decoupled_min_lr}) must be <= --decoupled-lr ({args.decoupled_lr})",
        )

    if args.weight_decay_incr_style == "constant":
        # (== weight_decay: already filled in by an earlier validate_args on these args)
        check(
            args.start_weight_decay in (None, args.weight_decay)
            and args.end_weight_decay in (None, args.weight_decay),
            "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear "
            "or cosine (got constant)",
        )
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        check(
            args.start_weight_decay is not None and args.end_weight_decay is not None,
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
            "--start-weight-decay and --end-weight-decay",
        )


_RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
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


def validate_checkpointing(args):
    if args.save is not None:
        check(
            args.save_interval is not None and args.save_interval > 0,
            f"--save needs --save-interval > 0 (got {args.save_interval})",
        )
    if args.save_retain_interval is not None:
        check(
            args.save_retain_interval > 0,
            f"--save-retain-interval must be > 0 (got {args.save_retain_interval})",
        )
        check(
            args.save_interval and args.save_retain_interval % args.save_interval == 0,
            f"--save-retain-interval ({args.save_retain_interval}) must be a multiple of "
            f"--save-interval ({args.save_interval})",
        )
    if args.load_main_params_from_ckpt:
        check(args.no_load_optim, "--load-main-params-from-ckpt needs --no-load-optim")
    if args.non_persistent_ckpt_type == "local":
        check(
            args.non_persistent_local_ckpt_dir is not None,
            "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir",
        )
    if args.ckpt_format == "torch_dcp":
        check(args.use_torch_fsdp2, "--ckpt-format torch_dcp needs --use-torch-fsdp2")
    if args.ckpt_format == "fsdp_dtensor":
        check(args.use_megatron_fsdp, "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp")
    if args.ckpt_convert_format is not None:
        check(args.ckpt_convert_save is not None, "--ckpt-convert-format needs --ckpt-convert-save")
    args.use_dist_ckpt = args.ckpt_format != "torch"


# Which tokenizer files each tokenizer type needs (dest names).
_TOKENIZER_NEEDS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def validate_data(args):
    per_split = [
        flag_name(dest)
        for dest in ("train_data_path", "valid_data_path", "test_data_path")
        if getattr(args, dest) is not None
    ]
    sources = [
        flag
        for flag, given in (
            ("--mock-data", args.mock_data),
            ("--data-path", bool(args.data_path)),
            ("/".join(per_split), bool(per_split)),
        )
        if given
    ]
    check(len(sources) <= 1, f"only one data source can be given, got {' and '.join(sources)}")
    check(
        args.data_path is None or args.data_args_path is None,
        "--data-path and --data-args-path are mutually exclusive",
    )
    check(
        not per_split or args.per_split_data_args_path is None,
        f"{'/'.join(per_split)} and --per-split-data-args-path are mutually exclusive",
    )
    if args.data_path is not None and args.split is None:
        args.split = "969, 30, 1"
        warn(
            args,
            "please specify --split when using --data-path; using the legacy default "
            f'"{args.split}"',
        )
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    check(args.num_workers >= 0, f"--num-workers must be >= 0 (got {args.num_workers})")
    check(
        args.num_dataset_builder_threads > 0,
        f"--num-dataset-builder-threads must be > 0 (got {args.num_dataset_builder_threads})",
    )
    if args.tokenizer_type is not None:
        missing = [
            flag_name(dest)
            for dest in _TOKENIZER_NEEDS.get(args.tokenizer_type, ())
            if getattr(args, dest) is None
        ]
        check(not missing, f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    # Fixed-length samples: the pipeline never has to exchange sequence lengths.
    args.variable_seq_lengths = False


def validate_logging(args):
    for dest in ("log_interval", "tensorboard_log_interval"):
        check(getattr(args, dest) > 0, f"{flag_name(dest)} must be > 0 (got {getattr(args, dest)})")
    if args.log_memory_interval is not None:
        check(
            args.log_memory_interval > 0 and args.log_memory_interval % args.log_interval == 0,
            f"--log-memory-interval ({args.log_memory_interval}) must be a positive multiple "
            f"of --log-interval ({args.log_interval})",
        )
    if args.wandb_project:
        check(args.wandb_exp_name, "--wandb-project needs --wandb-exp-name")
    if args.log_progress and args.save is None:
        warn(args, "--log-progress writes progress.txt into --save, which is not set: no progress")
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None:
        check(
            interval > 0,
            f"--check-weight-hash-across-dp-replicas-interval must be > 0 (got {interval})",
        )
        check(
            not args.use_torch_fsdp2
            and not (
                args.use_megatron_fsdp
                and args.data_parallel_sharding_strategy == "optim_grads_params"
            ),
            "--check-weight-hash-across-dp-replicas-interval cannot be used with FSDP2 "
            "(--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads_params): the "
            "parameters are sharded, not replicated",
        )
    if args.eval_interval is not None:
        check(args.eval_interval > 0, f"--eval-interval must be > 0 (got {args.eval_interval})")
    check(args.eval_iters >= 0, f"--eval-iters must be >= 0 (got {args.eval_iters})")
    if isinstance(args.exit_signal, str):
        # Megatron hands the handler a signal.Signals member, not its name.
        args.exit_signal = getattr(signal, args.exit_signal)
    for dest in ("exit_interval", "exit_duration_in_mins"):
        value = getattr(args, dest)
        check(value is None or value > 0, f"{flag_name(dest)} must be > 0 (got {value})")


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
