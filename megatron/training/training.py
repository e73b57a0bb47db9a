"""The training loop: ``pretrain()``, ``train()`` and ``train_step()``, as in Megatron-LM."""

from __future__ import annotations

import gc
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron.core.distributed.distributed_data_parallel import bucket_size_for_num_buckets
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.torch_fully_sharded_data_parallel import broadcast_module_params
from megatron.core.enums import ModelType
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import NonFiniteValueError, get_model_config

from . import global_vars
from .argument_groups.validation import ArgumentValidationError
from .checkpointing import (
    CheckpointError,
    convert_checkpoint_and_exit,
    load_checkpoint,
    maybe_finalize_async_save,
    save_checkpoint,
)
from .checkpointing_common import check_save_dir_writable
from .checkpointing_dist import release_async_save_group
from .collective_watch import CollectiveTimeoutError, set_timeout, uninstall
from .configs import ddp_config_from_args, optimizer_config_from_args
from .data_samplers import build_pretraining_data_loader
from .flag_errors import BuildFromFlagsError, UserInputError, building
from .initialize import initialize_megatron, teardown_process_groups
from .model_families import get_model_family
from .moe_logging import collect_moe_losses, moe_loss_scalars, write_per_layer
from .progress_log import log_checkpoint_saved, log_job_start
from .replica_check import ReplicaMismatchError, check_weight_hashes_if_due
from .rerun import build_rerun_state_machine, results_not_validated, wrap_data_iterators
from .straggler import StragglerDetector
from .training_log import print_evaluation, training_log
from .utils import get_device, print_rank_0

_TRAIN_START_TIME = None


def print_datetime(message: str) -> None:
    from datetime import datetime

    if dist.is_initialized():
        dist.barrier()
    print_rank_0(f"[{message}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


# Errors caused by what the user gave us (files, flags): one line on stderr, exit code 1, no
# traceback. Anything else is a bug and keeps its traceback.
USER_INPUT_ERRORS = (
    CheckpointError,
    BuildFromFlagsError,
    UserInputError,
    NonFiniteValueError,
    CollectiveTimeoutError,
    ReplicaMismatchError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def pretrain(
    train_valid_test_dataset_provider: Callable,
    model_provider: Callable,
    model_type: ModelType,
    forward_step_func: Callable,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults=None,
    argv=None,
    model_family=None,
    **kwargs,
):
    """Initialize, build model/optimizer/data, train, evaluate, as Megatron's ``pretrain``.

    ``model_provider(pre_process, post_process, vp_stage=None)`` builds one model chunk: the
    layers of this rank's pipeline stage (and virtual stage ``vp_stage``). ``model_family`` (a
    :class:`~megatron.training.model_families.ModelFamily`; default GPT's) supplies the FLOPs,
    the theoretical memory and the checkpoint's model flags, and its ``args_defaults`` when
    ``args_defaults`` is None. ``argv`` (default ``sys.argv[1:]``) lets tests run a training
    in-process. Returns nothing, like Megatron's: a process group created here is torn down
    before returning.
    """
    if model_family is None:
        model_family = get_model_family("gpt")
    if args_defaults is None:
        args_defaults = dict(model_family.args_defaults)
    owns_process_group = not dist.is_initialized()
    try:
        global_vars.set_model_family(model_family)
        exit_code = _pretrain(
            train_valid_test_dataset_provider,
            model_provider,
            model_type,
            forward_step_func,
            process_non_loss_data_func,
            extra_args_provider,
            args_defaults,
            argv,
        )
    except USER_INPUT_ERRORS as exc:
        # Not every rank may have failed: no teardown (its barrier could wait for ever).
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SystemExit as exc:
        # --ckpt-convert-format and --exit-on-missing-checkpoint end the run on every rank together.
        exit_code = 0 if exc.code is None else exc.code
    # The model, optimizer and iterators were _pretrain's locals and are gone now.
    if owns_process_group:
        leave_process_group()
    if exit_code is not None:
        sys.exit(exit_code)


def _pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func,
    extra_args_provider,
    args_defaults,
    argv,
):
    global _TRAIN_START_TIME
    start = torch.tensor([time.time()], dtype=torch.double)
    initialize_megatron(
        extra_args_provider=extra_args_provider, args_defaults=args_defaults, argv=argv
    )
    try:  # the model's own rules (another model's flags, a parallelism it refuses)
        global_vars.get_model_family().check_args(global_vars.get_args())
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # every rank has the same flags: all leave here together
    args = global_vars.get_args()
    timers = global_vars.get_timers()
    if dist.is_initialized():
        start = start.to(get_device())
        dist.all_reduce(start, op=dist.ReduceOp.MIN)
    _TRAIN_START_TIME = start.item()
    if args.save:
        check_save_dir_writable(args.save)
    if args.log_progress:
        with building("progress log", args):  # a malformed progress.txt: one line naming it
            log_job_start(args)
    print_rank_0(
        "time to initialize megatron (seconds): {:.3f}".format(time.time() - _TRAIN_START_TIME)
    )
    print_datetime("after megatron is initialized")

    # Before the model: loading a checkpoint may hand it a re-run to finish.
    machine = build_rerun_state_machine(args)
    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    with building("model, optimizer and scheduler", args):
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
            model_provider, model_type
        )
    timers("model-and-optimizer-setup").stop()
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    if args.rank == 0:
        from .theoretical_memory import report_theoretical_memory

        report_theoretical_memory(
            args,
            num_microbatches=global_vars.get_num_microbatches(),
            family=global_vars.get_model_family(),
        )
    config = get_model_config(model[0])

    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    with building("datasets", args):
        train_iter, valid_iter, test_iter = build_train_valid_test_data_iterators(
            train_valid_test_dataset_provider
        )
    train_iter = wrap_data_iterators(train_iter, machine)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

    iteration = args.iteration
    flops = args.num_floating_point_operations_so_far
    exit_code = None
    if not args.skip_train and args.train_iters > 0:
        print_rank_0("training ...")
        iteration, flops, exit_code = train(
            forward_step_func,
            model,
            optimizer,
            opt_param_scheduler,
            train_iter,
            valid_iter,
            process_non_loss_data_func,
            config,
        )
        print_datetime("after training is done")
        if (
            exit_code is None
            and args.save
            and iteration != 0
            and iteration != args.last_saved_iteration
        ):
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops)
            args.last_saved_iteration = iteration
            if args.log_progress:
                log_checkpoint_saved(args, iteration, flops, _TRAIN_START_TIME)
    else:
        print_rank_0("skipping training (--skip-train is on) ...")
    maybe_finalize_async_save(blocking=True)  # an --async-save checkpoint is complete before exit

    if exit_code is None:
        if args.do_valid:
            evaluate_and_print_results(
                f"iteration {iteration} on validation set",
                forward_step_func,
                valid_iter,
                model,
                iteration,
                config,
                verbose=True,
            )
        if args.do_test:
            evaluate_and_print_results(
                f"iteration {iteration} on test set",
                forward_step_func,
                test_iter,
                model,
                iteration,
                config,
                verbose=True,
                test=True,
            )
    _finish_writers()
    return exit_code


def leave_process_group(wait_for_all: bool = True):
    """All ranks leave together (``wait_for_all``: a barrier first) and destroy the process
    groups while the interpreter still runs: a gloo worker thread left to interpreter shutdown
    can abort the rank ("terminate called without an active exception") after a successful
    run. Call it once the ranks no longer communicate and the models are released."""
    if not dist.is_initialized():
        return
    if wait_for_all:
        dist.barrier()
    global_vars.set_parallel_state(None)  # it holds every model-parallel group
    release_async_save_group()
    uninstall()
    leaked = teardown_process_groups()
    if leaked:
        print(
            f"WARNING: {leaked} gloo worker thread(s) outlived the process-group teardown "
            "(something "
            "still references a group); the process may abort at exit",
            file=sys.stderr,
            flush=True,
        )


def _finish_writers():
    writer = global_vars.get_tensorboard_writer()
    if writer is not None:
        writer.flush()
        writer.close()
    wandb_writer = global_vars.get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.finish()


def get_model(
    model_provider: Callable,
    model_type: ModelType = ModelType.encoder_or_decoder,
    wrap_with_ddp: bool = True,
) -> List[torch.nn.Module]:
    """Build this rank's model chunk(s), move them to the device, cast and wrap in DDP."""
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
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

    device = get_device()
    chunks = [chunk.to(device) for chunk in chunks]
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        # The last stage's output weight starts as a copy of the first stage's word embedding.
        if state.is_pipeline_first_stage():
            chunks[0].sync_shared_embedding(state.get_embedding_group())
        if state.is_pipeline_last_stage():
            chunks[-1].sync_shared_embedding(state.get_embedding_group())
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
                )
            )
        return wrapped
    if args.ddp_num_buckets:
        ddp_config.bucket_size = bucket_size_for_num_buckets(chunks, args.ddp_num_buckets)
    wrapped = []
    for chunk in chunks:
        ddp = DistributedDataParallel(
            ddp_config,
            chunk,
            dp_cp_group,
            expert_data_parallel_group=state.get_expert_data_parallel_group(),
        )
        # Replicas are seeded identically, so their weights agree unless seeded per DP rank.
        if getattr(args, "data_parallel_random_init", False):
            ddp.broadcast_params()
        machine = global_vars.get_rerun_state_machine()
        if machine is not None:  # tools build models without one
            ddp.set_rerun_state_machine(machine)
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


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """The learning-rate and weight-decay scheduler (Megatron's); its steps count samples."""
    args = global_vars.get_args()
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


def setup_model_and_optimizer(model_provider: Callable, model_type: ModelType):
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    timers = global_vars.get_timers()
    fsdp2 = uses_torch_fsdp2(args)
    if fsdp2 and (
        args.load is not None
        or getattr(args, "pretrained_checkpoint", None) is not None
        or args.save is not None
    ):
        raise ValueError(
            "checkpoints of FSDP2-sharded models (--use-torch-fsdp2 / --use-megatron-fsdp) "
            "cannot be saved or loaded yet: drop --save/--load/--pretrained-checkpoint"
        )
    model = get_model(model_provider, model_type)
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
    if _has_expert_params(model) and dist.is_initialized():
        # Expert grads differ across EP ranks: their norms and inf flags also reduce over
        # the expert-tensor x expert x pipeline group.
        optimizer.expert_parallel_group = state.group("tp-ep-pp")
        optimizer.expert_tp_rank = state.get_expert_tensor_parallel_rank()
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    for chunk in model:
        config = get_model_config(chunk)
        config.grad_scale_func = optimizer.scale_loss if args.fp16 else None
        config.timers = timers
        config.calculate_per_token_loss = getattr(args, "calculate_per_token_loss", False)
        config.microbatch_group_size_per_vp_stage = args.microbatch_group_size_per_vp_stage
        config.rng_tracker = global_vars.get_rng_tracker()
        # The schedules hand the gradients (and the token count) to it after the last backward.
        config.finalize_model_grads_func = partial(
            finalize_model_grads, parallel_state=state, timers=timers
        )

    args.iteration, args.num_floating_point_operations_so_far = 0, 0.0
    if args.load is not None or getattr(args, "pretrained_checkpoint", None) is not None:
        timers("load-checkpoint", log_level=0).start(barrier=True)
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model,
            optimizer,
            opt_param_scheduler,
            load_arg="load" if args.load is not None else "pretrained_checkpoint",
        )
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    args.last_saved_iteration = args.iteration if args.iteration > 0 else None
    if getattr(args, "ckpt_convert_format", None) is not None:
        convert_checkpoint_and_exit(model, optimizer, opt_param_scheduler)
    return model, optimizer, opt_param_scheduler


def get_train_valid_test_num_samples():
    """Samples the train, validation and test datasets must hold (Megatron's targets)."""
    args = global_vars.get_args()
    train_samples = (
        args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    )
    eval_iters = args.eval_iters
    eval_gbs = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    if getattr(args, "full_validation", False):
        valid = None
    elif args.eval_interval:
        valid = (args.train_iters // args.eval_interval + 1) * eval_iters * eval_gbs
    else:
        valid = eval_iters * eval_gbs
    test = eval_iters * eval_gbs
    return train_samples, valid, test


def build_train_valid_test_data_iterators(provider: Callable):
    """Datasets (once), samplers from the consumed-sample counts, loaders, iterators."""
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    if args.iteration > 0 and args.consumed_train_samples == 0:
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.eval_interval:
        args.consumed_valid_samples = (
            (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
        )
    train_n, valid_n, test_n = get_train_valid_test_num_samples()
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0("    train:      {}".format(train_n))
    print_rank_0("    validation: {}".format(valid_n))
    print_rank_0("    test:       {}".format(test_n))
    train_ds, valid_ds, test_ds = provider([train_n, valid_n, test_n])
    dp_rank = state.get_data_parallel_rank()
    dp_size = state.get_data_parallel_world_size()
    train_loader = build_pretraining_data_loader(
        train_ds, args.consumed_train_samples, args, dp_rank, dp_size
    )
    valid_loader = (
        build_pretraining_data_loader(valid_ds, args.consumed_valid_samples, args, dp_rank, dp_size)
        if valid_ds is not None and len(valid_ds) > args.consumed_valid_samples
        else None
    )
    test_loader = (
        build_pretraining_data_loader(test_ds, 0, args, dp_rank, dp_size)
        if test_ds is not None
        else None
    )
    args.do_train = train_loader is not None and args.train_iters > 0
    args.do_valid = valid_loader is not None and args.eval_iters > 0
    args.do_test = test_loader is not None and args.eval_iters > 0

    def as_iter(loader):
        if loader is None:
            return None
        return iter(loader) if args.dataloader_type == "single" else _cyclic(loader)

    num_chunks = args.virtual_pipeline_model_parallel_size or 1
    if num_chunks == 1:
        return as_iter(train_loader), as_iter(valid_loader), as_iter(test_loader)

    # Interleaved schedule: every model chunk walks its own iterator over the same samples.
    def per_chunk(dataset, consumed):
        if dataset is None or len(dataset) <= consumed:
            return None
        return [
            as_iter(build_pretraining_data_loader(dataset, consumed, args, dp_rank, dp_size))
            for _ in range(num_chunks)
        ]

    return (
        per_chunk(train_ds, args.consumed_train_samples),
        per_chunk(valid_ds, args.consumed_valid_samples),
        per_chunk(test_ds, 0),
    )


def _cyclic(loader):
    while True:
        for batch in loader:
            yield batch


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """One iteration: all micro-batches, gradient sync, optimizer and scheduler step."""
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    timers = global_vars.get_timers()
    machine = global_vars.get_rerun_state_machine()
    forward_backward_func = get_forward_backward_func(
        args.pipeline_model_parallel_size,
        getattr(args, "virtual_pipeline_model_parallel_size", None),
    )
    num_microbatches = global_vars.get_num_microbatches()
    # The machine runs the forward-backward pass again (same data, same RNG states) when a
    # validated result was rejected, or every time with --rerun-mode report_stats.
    while machine.should_run_forward_backward(data_iterator):
        optimizer.zero_grad()
        for chunk in model:
            chunk.zero_grad_buffer()
        timers("forward-backward", log_level=1).start(barrier=args.barrier_with_L1_time)
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
            **_pipeline_kwargs(args, state),
        )
        timers("forward-backward").stop()
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:
        raise RerunExit(should_checkpoint, exit_code)

    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        increment = num_microbatches * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1

    moe_per_layer = collect_moe_losses(model, state, num_microbatches)
    loss_reduced = {}
    if state.is_pipeline_last_stage():
        loss_reduced = _reduce_losses(losses_reduced, state)
        loss_reduced.update(moe_loss_scalars(moe_per_layer, config))
    writer = global_vars.get_tensorboard_writer()
    iteration = getattr(args, "iteration", 0) + 1
    if (
        moe_per_layer
        and writer is not None
        and args.moe_per_layer_logging
        and iteration % args.tensorboard_log_interval == 0
    ):
        write_per_layer(writer, moe_per_layer, config, iteration)
    return loss_reduced, skipped_iter, grad_norm, num_zeros


class RerunExit(Exception):
    """The rerun state machine ends the job (after a checkpoint when ``should_checkpoint``)
    with ``exit_code``: the iteration is not applied."""

    def __init__(self, should_checkpoint: bool, exit_code: int):
        super().__init__(f"rerun state machine exit {exit_code}")
        self.should_checkpoint = should_checkpoint
        self.exit_code = exit_code


def _has_expert_params(model) -> bool:
    return any(not getattr(p, "allreduce", True) for chunk in model for p in chunk.parameters())


def _pipeline_kwargs(args, state) -> dict:
    """The pipeline schedules need the groups; the no-pipelining schedule takes none."""
    return {"pg_collection": state} if args.pipeline_model_parallel_size > 1 else {}


def _reduce_losses(losses_reduced, state):
    """Per-token average over micro-batches and DP×CP for [sum, count] entries; mean otherwise."""
    result = {}
    if not losses_reduced:
        return result
    for key in losses_reduced[0]:
        values = [x[key] for x in losses_reduced]
        first = values[0]
        if torch.is_tensor(first) and first.numel() == 2:
            total = (
                torch.vstack([v.detach().float().view(2) for v in values]).sum(0).to(get_device())
            )
            if dist.is_initialized():
                dist.all_reduce(
                    total, group=state.get_data_parallel_group(with_context_parallel=True)
                )
            result[key] = (total[0] / total[1]).item()
        else:
            stacked = (
                torch.stack([torch.as_tensor(v).float().view(()) for v in values])
                .mean()
                .to(get_device())
            )
            if dist.is_initialized():
                dist.all_reduce(
                    stacked, group=state.get_data_parallel_group(with_context_parallel=True)
                )
                stacked = stacked / state.get_data_parallel_world_size(with_context_parallel=True)
            result[key] = stacked.item()
    return result


def _params_norm(model) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model:
        for p in chunk.parameters():
            total += p.detach().double().pow(2).sum().cpu()
    return total.sqrt().item()


def train(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    process_non_loss_data_func,
    config,
):
    """The loop; returns (iteration, flops so far, exit code or None)."""
    args = global_vars.get_args()
    timers = global_vars.get_timers()
    for chunk in model:
        chunk.train()
    iteration = args.iteration
    flops = args.num_floating_point_operations_so_far
    if args.distributed_timeout_seconds_after_init is not None and dist.is_initialized():
        # Set-up (dataset indices, checkpoint loads) may be slow; iterations are not.
        set_timeout(timedelta(seconds=args.distributed_timeout_seconds_after_init))
    timers("interval-time", log_level=0).start(barrier=True)
    check_weight_hashes_if_due(model, iteration, before_training=True)
    if args.manual_gc:
        # Megatron's manual GC: no automatic collections, one every --manual-gc-interval.
        gc.disable()
        gc.collect()
    try:
        iteration, flops, exit_code = _train_loop(
            forward_step_func,
            model,
            optimizer,
            opt_param_scheduler,
            train_data_iterator,
            valid_data_iterator,
            config,
            iteration,
            flops,
        )
    finally:
        if args.manual_gc:
            gc.enable()  # later work in this process (tests run several trainings) collects again
    return iteration, flops, exit_code


def _train_loop(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    config,
    iteration,
    flops,
):
    args = global_vars.get_args()
    family = global_vars.get_model_family()
    total_loss_dict = {}
    report_memory_flag = True
    exit_code = None
    stragglers = None
    train_forward_step = forward_step_func  # evaluation keeps the untimed one
    if args.log_straggler:
        stragglers = StragglerDetector(args.straggler_minmax_count)
        train_forward_step = stragglers.timed(forward_step_func)
    while iteration < args.train_iters:
        maybe_finalize_async_save(blocking=False)  # commits a finished --async-save checkpoint
        global_vars.update_num_microbatches(args.consumed_train_samples, consistency_check=True)
        try:
            loss_dict, skipped_iter, grad_norm, num_zeros = train_step(
                train_forward_step,
                train_data_iterator,
                model,
                optimizer,
                opt_param_scheduler,
                config,
            )
        except RerunExit as stop:
            # Saved at the start of the iteration (step, RNG, consumed samples), with the
            # machine's state, so that a restarted job runs the same iteration again.
            if stop.should_checkpoint and args.save:
                save_checkpoint(
                    iteration,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    flops,
                    rerun_state=global_vars.get_rerun_state_machine().state_dict(
                        train_data_iterator
                    ),
                )
                args.last_saved_iteration = iteration
            exit_code = stop.exit_code
            break
        iteration += 1
        args.iteration = iteration
        batch_size = (
            args.micro_batch_size * args.data_parallel_size * global_vars.get_num_microbatches()
        )
        args.consumed_train_samples += batch_size
        flops += family.num_floating_point_operations(args, batch_size)
        if skipped_iter:
            args.skipped_train_samples = getattr(args, "skipped_train_samples", 0) + batch_size
        loss_scale = optimizer.get_loss_scale().item()
        params_norm = _params_norm(model) if args.log_params_norm else None
        learning_rate = optimizer.param_groups[0]["lr"]
        report_memory_flag = training_log(
            loss_dict,
            total_loss_dict,
            learning_rate,
            iteration,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            params_norm,
            num_zeros,
        )

        if stragglers is not None and iteration % args.log_interval == 0:
            # Every rank: the report gathers the forward times of all of them.
            report = stragglers.report(
                family.num_floating_point_operations(args, batch_size), args.log_interval
            )
            if report:
                print(report, flush=True)
        check_weight_hashes_if_due(model, iteration)
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
            if args.manual_gc and args.manual_gc_eval:
                gc.collect()
            evaluate_and_print_results(
                f"iteration {iteration}",
                forward_step_func,
                valid_data_iterator,
                model,
                iteration,
                config,
                verbose=False,
            )
            if args.manual_gc and args.manual_gc_eval:
                gc.collect()
        exit_code = _checkpoint_and_decide_exit(
            model, optimizer, opt_param_scheduler, iteration, flops
        )
        if exit_code is not None:
            break
    return iteration, flops, exit_code


def _checkpoint_and_decide_exit(
    model, optimizer, opt_param_scheduler, iteration, flops
) -> Optional[int]:
    """Save on the interval; on a signal, --exit-interval or --exit-duration-in-mins save and
    stop."""
    args = global_vars.get_args()
    handler = global_vars.get_signal_handler()

    def save():
        if args.save and args.last_saved_iteration != iteration:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops)
            args.last_saved_iteration = iteration
            if args.log_progress:
                log_checkpoint_saved(args, iteration, flops, _TRAIN_START_TIME)

    if handler is not None and handler.signals_received():
        save()
        print_datetime(
            "exiting program after receiving "
            f"{handler.sig.name if hasattr(handler.sig, 'name') else 'a signal'}"
        )
        return 0
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        save()
    if args.exit_duration_in_mins:
        elapsed = torch.tensor([(time.time() - _TRAIN_START_TIME) / 60.0], device=get_device())
        if dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if elapsed.item() > args.exit_duration_in_mins:
            save()
            print_datetime(f"exiting program after {elapsed.item():.2f} minutes")
            return 0
    if args.exit_interval and iteration % args.exit_interval == 0:
        save()
        print_datetime(f"exiting program at iteration {iteration}")
        return 0
    return None


def evaluate(
    forward_step_func, data_iterator, model, config, verbose: bool = False, eval_iters: int = None
):
    """Forward-only over --eval-iters batches; Σ loss / Σ tokens, reduced over DP×CP."""
    args = global_vars.get_args()
    state = global_vars.get_parallel_state()
    for chunk in model:
        chunk.eval()
    eval_iters = eval_iters if eval_iters is not None else args.eval_iters
    forward_backward_func = get_forward_backward_func(
        args.pipeline_model_parallel_size,
        getattr(args, "virtual_pipeline_model_parallel_size", None),
    )
    totals = {}
    eval_gbs = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    eval_mbs = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    num_microbatches = eval_gbs // (eval_mbs * args.data_parallel_size)
    with torch.no_grad(), results_not_validated():
        for step in range(eval_iters):
            if verbose:
                print_rank_0(f"Evaluating iter {step + 1}/{eval_iters}")
            losses = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=eval_mbs,
                forward_only=True,
                **_pipeline_kwargs(args, state),
            )
            if state.is_pipeline_last_stage():
                for loss in losses:
                    for key, value in loss.items():
                        value = value.detach().float().view(-1).to(get_device())
                        if value.numel() != 2:
                            value = torch.stack([value.sum(), torch.ones((), device=value.device)])
                        totals[key] = totals.get(key, torch.zeros(2, device=value.device)) + value
            args.consumed_valid_samples += eval_gbs
    for chunk in model:
        chunk.train()
    result = {}
    for key, total in totals.items():
        if dist.is_initialized():
            dist.all_reduce(total, group=state.get_data_parallel_group(with_context_parallel=True))
        result[key] = (total[0] / total[1]).item()
    return result


def evaluate_and_print_results(
    prefix, forward_step_func, data_iterator, model, iteration, config, verbose=False, test=False
):
    args = global_vars.get_args()
    totals = evaluate(forward_step_func, data_iterator, model, config, verbose)
    return print_evaluation(prefix, totals, iteration, args.consumed_train_samples, test=test)
