"""Step 7: the pipeline split (virtual and uneven stages) and the schedule it allows (with the
overlap of expert-parallel communication across its micro-batches)."""

from .base import check, warn


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
    elif args.pipeline_model_parallel_layout is not None:
        _validate_layout(args, pp, uneven)
    else:
        if uneven:
            _validate_uneven_pipeline(args, pp)
        else:
            check(
                layers % pp == 0,
                f"number of layers ({described} = {layers}) is not "
                f"divisible by --pipeline-model-parallel-size ({pp})",
            )
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
    _validate_layer_split(args)
    _validate_moe_overlap(args)


def _validate_layout(args, pp, uneven):
    """--pipeline-model-parallel-layout: parsed and checked as megatron-core does; its stage
    count sets the virtual pipeline size."""
    from megatron.core.pipeline_parallel.layer_layout import (
        PipelineParallelLayerLayout,
    )

    flag = "--pipeline-model-parallel-layout"
    check(
        not uneven,
        f"{flag} cannot be combined with --decoder-first/last-pipeline-num-layers",
    )
    check(
        not (
            args.account_for_embedding_in_pipeline_split or args.account_for_loss_in_pipeline_split
        ),
        f"{flag} cannot be combined with --account-for-embedding/loss-in-pipeline-split",
    )
    try:
        layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
        standalone_mtp = layout.validate_layer_layout(args.num_layers, args.mtp_num_layers)
    except ValueError as exc:
        check(False, str(exc))
    check(
        not standalone_mtp,
        f"not supported yet: {flag} {args.pipeline_model_parallel_layout} (MTP layers on a "
        "pipeline rank before the last, a standalone MTP stage, are not implemented yet; put "
        "m in the last stage)",
    )
    args.virtual_pipeline_model_parallel_size = layout.virtual_pipeline_model_parallel_size


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
            args.pipeline_model_parallel_layout,
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


def _validate_moe_overlap(args):
    """Megatron's rules for ``--overlap-moe-expert-parallel-comm`` and ``--delay-wgrad-compute``
    (TransformerConfig's), once the virtual pipeline size is settled. The overlap itself changes
    speed only (the flag policy's note says so)."""
    if args.delay_wgrad_compute:
        check(
            args.overlap_moe_expert_parallel_comm,
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm",
        )
    if not args.overlap_moe_expert_parallel_comm:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if args.pipeline_model_parallel_size > 1:
        check(
            args.virtual_pipeline_model_parallel_size is not None,
            f"{flag} with --pipeline-model-parallel-size > 1 needs virtual pipeline stages "
            "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank)",
        )
    check(
        args.expert_model_parallel_size > 1,
        f"{flag} needs expert parallelism (--expert-model-parallel-size > 1)",
    )
    check(
        args.moe_token_dispatcher_type in ("alltoall", "flex"),
        f"{flag} needs --moe-token-dispatcher-type alltoall or flex "
        f"(got {args.moe_token_dispatcher_type})",
    )
    check(args.recompute_granularity != "full", f"{flag} cannot be combined with full recompute")
    check(args.recompute_method is None, f"{flag} cannot be combined with --recompute-method")
    check(
        args.recompute_num_layers is None, f"{flag} cannot be combined with --recompute-num-layers"
    )
    check(args.bf16 or args.fp16, f"{flag} needs --bf16 or --fp16")
    check(
        (args.mtp_num_layers or 0) <= 1,
        f"{flag} takes at most one MTP layer (--mtp-num-layers {args.mtp_num_layers})",
    )
    check(
        not args.moe_shared_expert_overlap,
        f"{flag} cannot be combined with --moe-shared-expert-overlap",
    )
