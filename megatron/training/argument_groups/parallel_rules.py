"""Cross-flag rules of the parallel layout: the TP/PP/CP/EP/ETP sizes and the data-parallel
size they leave, the pipeline split (virtual and uneven stages) and the data-parallel strategy
(DDP buckets, the distributed optimizer, FSDP2, Megatron-FSDP). Called by validate_args
(megatron/training/arguments.py)."""

import math
import os

from .validation import check, flag_name, info, warn


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
