"""Step 10: the data-parallel strategy: DDP buckets, the distributed optimizer, FSDP2 and
Megatron-FSDP, and sequence parallelism without TP."""

import os

from .base import check, info, warn


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
        if args.gradient_accumulation_fusion:
            # Megatron-LM turns it off with a warning: the fused kernel writes a main_grad buffer
            # that FSDP does not own.
            warn(
                args,
                "Gradient accumulation fusion is not supported with Megatron-FSDP, "
                "setting to False",
            )
            args.gradient_accumulation_fusion = False
        check(
            args.ckpt_format == "fsdp_dtensor",
            f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got {args.ckpt_format})",
        )
        check(
            not one_connection, "--use-megatron-fsdp does not support CUDA_DEVICE_MAX_CONNECTIONS=1"
        )
        # Megatron-FSDP is mapped onto this code base's machinery (README "Memory options"):
        # no_shard = plain DDP, optim = the distributed optimizer (ZeRO-1: a full-size gradient
        # buffer), optim_grads = the distributed optimizer keeping only its slice of the
        # gradients (ZeRO-2, DistributedDataParallelConfig.shard_grads), optim_grads_params =
        # FSDP2. The strategy
        # decides the optimizer; --use-distributed-optimizer (which Megatron's guide passes
        # along) is implied by it.
        if strategy == "optim_grads_params":
            _validate_fsdp2(
                args,
                f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}",
                one_connection,
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
    _validate_optimizer_instances(args)


def _validate_optimizer_instances(args):
    """--num-distributed-optimizer-instances: Megatron's partial distributed optimizer, sharded
    within each block of DP x CP (and expert-DP) ranks and replicated across the blocks."""
    n = args.num_distributed_optimizer_instances
    if n == 1:
        return
    check(n > 1, f"--num-distributed-optimizer-instances must be >= 1 (got {n})")
    check(
        args.use_distributed_optimizer and not args.use_torch_fsdp2,
        "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer",
    )
    dp_cp = args.data_parallel_size * args.context_parallel_size
    check(
        dp_cp % n == 0,
        f"--num-distributed-optimizer-instances {n} does not divide the data-parallel x "
        f"context-parallel size {dp_cp}",
    )
    if args.num_experts:
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        expert_dp = args.world_size // (
            etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size
        )
        check(
            expert_dp % n == 0,
            f"--num-distributed-optimizer-instances {n} does not divide the expert-data-parallel "
            f"size {expert_dp}",
        )


def _validate_fsdp2(args, what, one_connection):
    """The limits Megatron puts on its FSDP paths, for --use-torch-fsdp2 and for
    --use-megatron-fsdp with optim_grads_params (which runs on FSDP2 here). Megatron-LM also
    asks for --untie-embeddings-and-output-weights; FSDP2 shards the tied weight as one
    parameter here (embedding and output layer are in the same FSDP unit), so it is allowed.
    Expert parallelism is Megatron-FSDP's (experts sharded over expert DP), not torch FSDP2's."""
    for ok, why in (
        (args.pipeline_model_parallel_size == 1, "pipeline parallelism"),
        (
            args.expert_model_parallel_size == 1 or args.use_megatron_fsdp,
            "expert parallelism",
        ),
        (
            not args.gradient_accumulation_fusion,
            "gradient accumulation fusion (pass --no-gradient-accumulation-fusion)",
        ),
        (not args.fp16, "--fp16"),
        (not one_connection, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
    ):
        check(ok, f"{what} does not support {why}")
