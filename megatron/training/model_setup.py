"""Building this rank's model chunks (device, precision, DDP or FSDP2 wrapper), the optimizer and
its LR / weight-decay scheduler, and loading a checkpoint into them: Megatron's
``get_model`` and ``setup_model_and_optimizer``."""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.device import compute_device
from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron.core.distributed.distributed_data_parallel import bucket_size_for_num_buckets
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import broadcast_module_params
from megatron.core.enums import ModelType
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.step_context import StepContext
from megatron.core.tensor_parallel import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from . import global_vars
from .checkpointing import convert_checkpoint_and_exit, load_checkpoint
from .configs import ddp_config_from_args, optimizer_config_from_args
from .run import Run


def get_model(
    model_provider: Callable,
    model_type: ModelType = ModelType.encoder_or_decoder,
    wrap_with_ddp: bool = True,
    *,
    run: Optional[Run] = None,
) -> List[torch.nn.Module]:
    """Build this rank's model chunk(s), move them to the device, cast and wrap in DDP
    (``run``: default the current one)."""
    run = run or global_vars.get_run()
    args, state = run.args, run.parallel_state
    # One chunk per virtual stage; the model builds the layers of its (virtual) stage itself.
    pp_rank, pp_size = state.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size
    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(num_chunks):
        model = model_provider(
            pre_process=pp_rank == 0 and vp_stage == 0,
            post_process=pp_rank == pp_size - 1 and vp_stage == num_chunks - 1,
            vp_stage=vp_stage if num_chunks > 1 else None,
        )
        chunks.extend(model if isinstance(model, list) else [model])
    for chunk in chunks:
        chunk.model_type = model_type

    if state.get_data_parallel_rank() == 0 and state.get_context_parallel_rank() == 0:
        num_params = sum(sum(p.nelement() for p in chunk.parameters()) for chunk in chunks)
        print(
            " > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}".format(
                state.get_tensor_model_parallel_rank(),
                state.get_pipeline_model_parallel_rank(),
                num_params,
            ),
            flush=True,
        )

    device = compute_device()
    chunks = [chunk.to(device) for chunk in chunks]
    if args.fp16 or args.bf16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config_from_args(args)
    dp_cp_group = state.get_data_parallel_group(with_context_parallel=True)
    if uses_torch_fsdp2(args):
        # FSDP2 (also --use-megatron-fsdp with optim_grads_params): no DDP wrapper, grads come
        # from FSDP's reduce-scatter. Each rank shards its own copy, so they must agree first.
        wrapped = []
        for chunk in chunks:
            if getattr(args, "data_parallel_random_init", False):
                broadcast_module_params(chunk, dp_cp_group)
            wrapped.append(
                TorchFullyShardedDataParallel(
                    ddp_config,
                    chunk,
                    dp_cp_group,
                    reshard_after_forward=getattr(args, "torch_fsdp2_reshard_after_forward", True),
                    expert_data_parallel_group=state.get_expert_data_parallel_group(),
                )
            )
        return wrapped
    if args.ddp_num_buckets:
        ddp_config.bucket_size = bucket_size_for_num_buckets(chunks, args.ddp_num_buckets)
    wrapped = []
    for chunk in chunks:
        ddp = DistributedDataParallel(
            get_model_config(chunk),
            ddp_config,
            chunk,
            pg_collection=ProcessGroupCollection(
                dp_cp=dp_cp_group, expt_dp=state.get_expert_data_parallel_group()
            ),
        )
        # Replicas are seeded identically, so their weights agree unless seeded per DP rank.
        if getattr(args, "data_parallel_random_init", False):
            ddp.broadcast_params()
        if run.rerun is not None:  # tools build models without one
            ddp.set_rerun_state_machine(run.rerun)
        wrapped.append(ddp)
    return wrapped


def uses_torch_fsdp2(args) -> bool:
    """Whether the chunks are sharded with FSDP2: --use-torch-fsdp2, or --use-megatron-fsdp with
    --data-parallel-sharding-strategy optim_grads_params (the strategy this code base maps onto
    FSDP2; optim/optim_grads map onto the distributed optimizer, no_shard onto plain DDP)."""
    if getattr(args, "use_torch_fsdp2", False):
        return True
    return (
        bool(getattr(args, "use_megatron_fsdp", False))
        and getattr(args, "data_parallel_sharding_strategy", None) == "optim_grads_params"
    )


def get_optimizer_param_scheduler(optimizer, *, args=None) -> OptimizerParamScheduler:
    """The learning-rate and weight-decay scheduler (Megatron's); its steps count samples.
    ``args``: the run's flags (default the current run's)."""
    args = args if args is not None else global_vars.get_args()
    if args.train_iters is not None and args.train_samples is None:
        lr_decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        wsd_decay_steps = (
            args.lr_wsd_decay_iters * args.global_batch_size
            if getattr(args, "lr_wsd_decay_iters", None)
            else None
        )
        warmup_steps = (
            args.lr_warmup_fraction * lr_decay_steps
            if args.lr_warmup_fraction is not None
            else args.lr_warmup_iters * args.global_batch_size
        )
    else:
        lr_decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = getattr(args, "lr_wsd_decay_samples", None)
        warmup_steps = (
            args.lr_warmup_fraction * lr_decay_steps
            if args.lr_warmup_fraction is not None
            else args.lr_warmup_samples
        )
    start_wd = args.start_weight_decay if args.start_weight_decay is not None else args.weight_decay
    end_wd = args.end_weight_decay if args.end_weight_decay is not None else args.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def setup_model_and_optimizer(
    model_provider: Callable, model_type: ModelType, *, run: Optional[Run] = None
):
    """The model chunks, optimizer and scheduler of ``run`` (default the current one), loaded
    from --load / --pretrained-checkpoint when given; ``run.state`` starts from there."""
    run = run or global_vars.get_run()
    args, state, timers = run.args, run.parallel_state, run.timers
    fsdp2 = uses_torch_fsdp2(args)
    model = get_model(model_provider, model_type, run=run)
    stats_group = state.get_model_parallel_group() if state.size("mp") > 1 else None
    if fsdp2:
        # The optimizer steps this rank's shards; a parameter's shards live on different DP ranks,
        # so norms, zero counts and the inf check reduce over TP x DP x CP (PP is 1 with FSDP2).
        chunks_to_optimize = [chunk.local_shards() for chunk in model]
        stats_group = state.group("tp-dp-cp") if state.size("tp-dp-cp") > 1 else None
    elif args.use_distributed_optimizer:
        # The distributed optimizer shards the DDP buckets, so it needs the DDP wrappers.
        chunks_to_optimize = model
    else:
        chunks_to_optimize = [chunk.module for chunk in model]
    if getattr(args, "use_layer_wise_distributed_optimizer", False):
        # Each DP rank owns whole params: their norms and inf flags are summed over all ranks.
        stats_group = dist.group.WORLD if dist.is_initialized() else None
    optimizer_config = optimizer_config_from_args(args, timers)
    model_config = get_model_config(model[0])
    if getattr(model_config, "use_mup", False):
        optimizer_config.mup_width_mult = model_config.mup_width_mult
    optimizer = get_megatron_optimizer(
        optimizer_config,
        chunks_to_optimize,
        model_parallel_group=stats_group,
        tp_rank=state.get_tensor_model_parallel_rank(),
        tp_group=state.get_tensor_model_parallel_group(),
        data_parallel_group=state.get_data_parallel_group(with_context_parallel=True),
    )
    if dist.is_initialized() and _any_rank_has_expert_params(model):
        # Expert grads differ across EP ranks: their norms and inf flags also reduce over
        # the expert-tensor x expert x pipeline group.
        # Under FSDP2 the expert shards also differ across expert DP: the whole (PP = 1) world.
        optimizer.expert_parallel_group = state.group("tp-dp-cp" if fsdp2 else "tp-ep-pp")
        optimizer.expert_tp_rank = state.get_expert_tensor_parallel_rank()
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer, args=args)
    # The layers draw dropout from config.rng_tracker, else from the run's current tracker
    # (transformer.utils.rng_tracker_of): a user's model_provider needs to set neither.

    iteration, flops = 0, 0.0
    if args.load is not None or getattr(args, "pretrained_checkpoint", None) is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        iteration, flops = load_checkpoint(
            model,
            optimizer,
            opt_param_scheduler,
            load_arg="load" if args.load is not None else "pretrained_checkpoint",
            run=run,
        )
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    run.state.start(iteration, flops)
    if getattr(args, "ckpt_convert_format", None) is not None:
        convert_checkpoint_and_exit(model, optimizer, opt_param_scheduler, run=run)
    return model, optimizer, opt_param_scheduler


def build_step_context(args, optimizer, parallel_state, timers) -> StepContext:
    """What the forward/backward schedules take from the trainer (Megatron's trainer sets it on
    every chunk's model config): built once per run, for training and evaluation."""
    return StepContext(
        grad_scale_func=optimizer.scale_loss if args.fp16 else None,
        # The schedules hand the gradients (and the token count) to it after the last backward.
        finalize_model_grads_func=partial(
            finalize_model_grads, pg_collection=parallel_state, timers=timers
        ),
        timers=timers,
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )


def _has_expert_params(model) -> bool:
    return any(not getattr(p, "allreduce", True) for chunk in model for p in chunk.parameters())


def _any_rank_has_expert_params(model) -> bool:
    """Whether the model has experts on any rank: a pipeline stage of dense layers only (a
    dense first layer, or a layout placing them so) still joins the expert reductions of the
    grad norm, the zero count and the inf check, which span the pipeline."""
    flag = torch.tensor([float(_has_expert_params(model))], device=compute_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
