"""Step 2: the TP/PP/CP/EP/ETP sizes and the data-parallel size they leave."""

import math

from megatron.core.transformer.config_rules import (
    expert_parallelism_has_experts,
    experts_split_over_ep,
)

from .base import check, flag_name, info


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
            all(size >= 1 for size in sizes),
            f"--hierarchical-context-parallel-sizes must be >= 1 (got {sizes})",
        )
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
            expert_parallelism_has_experts(args.num_experts, ep),
            f"--expert-model-parallel-size {ep} needs --num-experts",
        )
        check(not args.fp16, f"--expert-model-parallel-size {ep} does not support --fp16")
    if args.num_experts is not None:
        check(
            experts_split_over_ep(args.num_experts, ep),
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
