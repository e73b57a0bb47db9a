"""The training loop: ``pretrain()``, ``train()`` and ``train_step()``, with Megatron-LM's names
and signatures.

Building the model and optimizer is in model_setup.py, the data iterators in data_iterators.py,
evaluation in evaluation.py and the save/exit decision after each iteration in
exit_decision.py."""

from __future__ import annotations

import gc
import sys
import time
from datetime import timedelta
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.checkpointing.layout import check_save_dir_writable
from megatron.core.device import collective_device, compute_device
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import NonFiniteValueError, get_model_config

from . import global_vars
from .checkpointing import CheckpointError, maybe_finalize_async_save, save_checkpoint
from .checkpointing_dist import abandon_async_save, release_async_save_group
from .collective_watch import CollectiveTimeoutError, set_timeout, uninstall
from .data_iterators import build_train_valid_test_data_iterators, get_train_valid_test_num_samples
from .evaluation import evaluate, evaluate_and_print_results
from .exit_decision import checkpoint_and_decide_exit, save_if_not_saved
from .failed_run import enable_fault_handler, end_failed_run, watch_for_interrupt
from .flag_errors import ArgumentValidationError, BuildFromFlagsError, UserInputError, building
from .initialize import initialize_megatron, teardown_process_groups
from .model_families import get_model_family
from .model_setup import (
    build_step_context,
    get_model,
    get_optimizer_param_scheduler,
    setup_model_and_optimizer,
    uses_torch_fsdp2,
)
from .moe_logging import collect_moe_losses, moe_loss_scalars, write_per_layer
from .mtp_logging import collect_mtp_losses
from .params_norm import params_l2_norm
from .progress_log import log_job_start
from .replica_check import ReplicaMismatchError, check_weight_hashes_if_due
from .rerun import build_rerun_state_machine, set_machine_iteration, wrap_data_iterators
from .run import Run
from .straggler import StragglerDetector
from .training_log import training_log
from .utils import pipeline_schedule_kwargs, print_datetime, print_rank_0

# Megatron's megatron/training/training.py defines these; they live in their own modules here
# (model_setup, data_iterators, evaluation, utils) and stay importable from this one.
__all__ = [
    "build_train_valid_test_data_iterators",
    "evaluate",
    "evaluate_and_print_results",
    "get_model",
    "get_optimizer_param_scheduler",
    "get_train_valid_test_num_samples",
    "leave_process_group",
    "pretrain",
    "print_datetime",
    "setup_model_and_optimizer",
    "train",
    "train_step",
    "uses_torch_fsdp2",
]


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
    in-process. Returns nothing (Megatron's returns None too): a process group created here is
    torn down before returning.

    Run as the program (``argv`` None), an unexpected exception or Ctrl-C ends the process at
    once with its traceback (see :mod:`.failed_run`), so that torchrun can end the job; an
    in-process caller (``argv`` given) gets the exception instead.
    """
    if model_family is None:
        model_family = get_model_family("gpt")
    if args_defaults is None:
        args_defaults = dict(model_family.args_defaults)
    owns_process_group = not dist.is_initialized()
    is_the_program = argv is None  # pretrain_gpt.py & co; in-process callers pass argv
    enable_fault_handler()
    if is_the_program:
        watch_for_interrupt()
    run = global_vars.get_run()  # initialize_megatron fills it; passed explicitly from there on
    run.family = model_family
    try:
        exit_code = _pretrain(
            run,
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
    except BaseException as exc:  # a bug, Ctrl-C, a collective that lost its peer
        if not is_the_program:
            raise  # the caller owns the process
        # Ends now, with no barrier, no teardown and no exit handler (they can wait for ever on
        # other ranks, on data-loader workers or on the background save).
        while True:
            try:
                end_failed_run(
                    exc,
                    cleanups=(
                        partial(_note_abandoned_async_save, run),
                        partial(_finish_writers, run),
                    ),
                )
            except KeyboardInterrupt as interrupt:  # a SIGINT pending as the failure came
                exc = interrupt
    # The model, optimizer and iterators were _pretrain's locals and are gone now.
    if owns_process_group:
        leave_process_group()
    if exit_code is not None:
        sys.exit(exit_code)


def _pretrain(
    run: Run,
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func,
    extra_args_provider,
    args_defaults,
    argv,
):
    start_time = time.time()
    args = initialize_megatron(
        extra_args_provider=extra_args_provider,
        args_defaults=args_defaults,
        argv=argv,
        watch_collectives=True,
    )
    try:  # the model's own rules (another model's flags, a parallelism it refuses)
        run.model_family.check_args(args)
    except ArgumentValidationError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # every rank has the same flags: all leave here together
    timers = run.timers
    # The earliest start of any rank.
    start = torch.tensor([start_time], dtype=torch.double, device=collective_device())
    if dist.is_initialized():
        dist.all_reduce(start, op=dist.ReduceOp.MIN)
    run.start_time = start.item()
    if args.save:
        check_save_dir_writable(args.save)
    if args.log_progress:
        with building("progress log", args):  # a malformed progress.txt: one line naming it
            log_job_start(args)
    print_rank_0(
        "time to initialize megatron (seconds): {:.3f}".format(time.time() - run.start_time)
    )
    print_datetime("after megatron is initialized")

    # Before the model: loading a checkpoint may hand it a re-run to finish.
    run.rerun = build_rerun_state_machine(args, run.rng_tracker)
    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    with building("model, optimizer and scheduler", args):
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
            model_provider, model_type, run=run
        )
    timers("model-and-optimizer-setup").stop()
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    if args.rank == 0:
        from .theoretical_memory import report_theoretical_memory

        report_theoretical_memory(
            args,
            num_microbatches=run.num_microbatches,
            family=run.model_family,
            device_type=compute_device().type,
        )
    config = get_model_config(model[0])
    run.step_context = build_step_context(args, optimizer, run.parallel_state, timers)

    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    with building("datasets", args):
        train_iter, valid_iter, test_iter = build_train_valid_test_data_iterators(
            train_valid_test_dataset_provider, run=run
        )
    train_iter = wrap_data_iterators(train_iter, run.rerun)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

    state = run.state
    exit_code = None
    if not args.skip_train and args.train_iters > 0:
        print_rank_0("training ...")
        _, _, exit_code = train(
            forward_step_func,
            model,
            optimizer,
            opt_param_scheduler,
            train_iter,
            valid_iter,
            process_non_loss_data_func,
            config,
            run=run,
        )
        print_datetime("after training is done")
        if exit_code is None and state.iteration != 0:
            save_if_not_saved(
                state.iteration,
                model,
                optimizer,
                opt_param_scheduler,
                state.num_floating_point_operations_so_far,
                run.start_time,
                run,
            )
    else:
        print_rank_0("skipping training (--skip-train is on) ...")
    # An --async-save checkpoint is complete before exit.
    maybe_finalize_async_save(blocking=True, run=run)

    if exit_code is None:
        iteration = state.iteration
        if state.do_valid:
            evaluate_and_print_results(
                f"iteration {iteration} on validation set",
                forward_step_func,
                valid_iter,
                model,
                iteration,
                config,
                verbose=True,
                run=run,
            )
        if state.do_test:
            evaluate_and_print_results(
                f"iteration {iteration} on test set",
                forward_step_func,
                test_iter,
                model,
                iteration,
                config,
                verbose=True,
                test=True,
                run=run,
            )
    _finish_writers(run)
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
    run = global_vars.get_run()
    # It holds the gradient finalization's groups (the parallel state is forgotten by teardown).
    run.step_context = None
    release_async_save_group(run)
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


def _note_abandoned_async_save(run: Run):
    work_dir = abandon_async_save(run)
    if work_dir is not None:
        print(
            f"[rank {dist.get_rank() if dist.is_initialized() else 0}] the asynchronous save "
            f"into {work_dir} was abandoned; it is not marked complete, the last complete "
            "checkpoint stays the one to resume from",
            file=sys.stderr,
        )


def _finish_writers(run: Run):
    if run.tensorboard is not None:
        run.tensorboard.flush()
        run.tensorboard.close()
    if run.wandb is not None:
        run.wandb.finish()


def train_step(
    forward_step_func,
    data_iterator,
    model,
    optimizer,
    opt_param_scheduler,
    config,
    *,
    run: Optional[Run] = None,
):
    """One iteration: all micro-batches, gradient sync, optimizer and scheduler step.

    ``run`` (default: the current one) supplies the flags, groups, timers, rerun state machine
    and the step context, what the schedule takes from the trainer
    (model_setup.build_step_context); without a step context the schedule reads it from
    ``config``, as Megatron Core's schedules do."""
    run = run or global_vars.get_run()
    args, state, timers, machine = run.args, run.parallel_state, run.timers, run.rerun
    forward_backward_func = get_forward_backward_func(
        args.pipeline_model_parallel_size,
        getattr(args, "virtual_pipeline_model_parallel_size", None),
    )
    num_microbatches = run.num_microbatches
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
            step_context=run.step_context,
            **pipeline_schedule_kwargs(args, state),
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
        loss_reduced.update(collect_mtp_losses(model, state, num_microbatches))
    writer = run.tensorboard
    iteration = run.state.iteration + 1
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


def _reduce_losses(losses_reduced, state):
    """Per-token average over micro-batches and DP×CP for [sum, count] entries; mean otherwise.

    The values stay 0-d float32 tensors on the device: training_log moves them to the host only
    when it prints or writes them (as Megatron's), not every iteration."""
    result = {}
    if not losses_reduced:
        return result
    dp_cp_group = state.get_data_parallel_group(with_context_parallel=True)
    device = collective_device(dp_cp_group)
    for key in losses_reduced[0]:
        values = [x[key] for x in losses_reduced]
        first = values[0]
        if torch.is_tensor(first) and first.numel() == 2:
            total = torch.vstack([v.detach().float().view(2) for v in values]).sum(0).to(device)
            if dist.is_initialized():
                dist.all_reduce(total, group=dp_cp_group)
            result[key] = total[0] / total[1]
        else:
            stacked = torch.stack(
                [torch.as_tensor(v, device=device).detach().float().view(()) for v in values]
            ).mean()
            if dist.is_initialized():
                dist.all_reduce(stacked, group=dp_cp_group)
                stacked = stacked / state.get_data_parallel_world_size(with_context_parallel=True)
            result[key] = stacked
    return result


def _params_norm_is_logged(args, iteration: int) -> bool:
    """Whether training_log prints or writes this iteration's params norm, decided from the flags
    (the same on every rank: the norm is a reduction over them, and a host synchronisation)."""
    writes = bool(args.tensorboard_dir or getattr(args, "wandb_project", None))
    return iteration % args.log_interval == 0 or (
        writes and iteration % args.tensorboard_log_interval == 0
    )


def train(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    process_non_loss_data_func,
    config,
    *,
    run: Optional[Run] = None,
):
    """The loop, from and into ``run.state`` (default: the current run's); returns (iteration,
    flops so far, exit code or None)."""
    run = run or global_vars.get_run()
    args, timers = run.args, run.timers
    for chunk in model:
        chunk.train()
    set_machine_iteration(run.rerun, run.state.iteration)
    if args.distributed_timeout_seconds_after_init is not None and dist.is_initialized():
        # Set-up (dataset indices, checkpoint loads) may be slow; iterations are not.
        set_timeout(timedelta(seconds=args.distributed_timeout_seconds_after_init))
    timers("interval-time", log_level=0).start(barrier=True)
    check_weight_hashes_if_due(model, run.state.iteration, run, before_training=True)
    if args.manual_gc:
        # Megatron's manual GC: no automatic collections, one every --manual-gc-interval.
        gc.disable()
        gc.collect()
    try:
        exit_code = _train_loop(
            forward_step_func,
            model,
            optimizer,
            opt_param_scheduler,
            train_data_iterator,
            valid_data_iterator,
            config,
            run,
        )
    finally:
        if args.manual_gc:
            gc.enable()  # later work in this process (tests run several trainings) collects again
    return run.state.iteration, run.state.num_floating_point_operations_so_far, exit_code


def _train_loop(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    config,
    run: Run,
):
    """Train until --train-iters, an exit or a re-run request; returns the exit code or None."""
    args, state, family = run.args, run.state, run.model_family
    total_loss_dict = {}
    report_memory_flag = True
    exit_code = None
    stragglers = None
    train_forward_step = forward_step_func  # evaluation keeps the untimed one
    if args.log_straggler:
        stragglers = StragglerDetector(args.straggler_minmax_count)
        train_forward_step = stragglers.timed(forward_step_func)
    while state.iteration < args.train_iters:
        # Commits a finished --async-save checkpoint.
        maybe_finalize_async_save(blocking=False, run=run)
        run.num_microbatches_calculator.update(state.consumed_train_samples, consistency_check=True)
        try:
            loss_dict, skipped_iter, grad_norm, num_zeros = train_step(
                train_forward_step,
                train_data_iterator,
                model,
                optimizer,
                opt_param_scheduler,
                config,
                run=run,
            )
        except RerunExit as stop:
            # Saved at the start of the iteration (step, RNG, consumed samples), with the
            # machine's state, so that a restarted job runs the same iteration again.
            if stop.should_checkpoint and args.save:
                save_checkpoint(
                    state.iteration,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    state.num_floating_point_operations_so_far,
                    rerun_state=run.rerun.state_dict(train_data_iterator),
                    run=run,
                )
                state.last_saved_iteration = state.iteration
            exit_code = stop.exit_code
            break
        batch_size = args.micro_batch_size * args.data_parallel_size * run.num_microbatches
        state.advance(
            batch_size, family.num_floating_point_operations(args, batch_size), bool(skipped_iter)
        )
        iteration = state.iteration
        loss_scale = optimizer.get_loss_scale().item()
        params_norm = None
        if args.log_params_norm and _params_norm_is_logged(args, iteration):
            params_norm = params_l2_norm(
                model, optimizer, run.parallel_state, use_main_params=args.bf16
            )
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
            run=run,
        )

        if stragglers is not None and iteration % args.log_interval == 0:
            # Every rank: the report gathers the forward times of all of them.
            report = stragglers.report(
                family.num_floating_point_operations(args, batch_size), args.log_interval
            )
            if report:
                print(report, flush=True)
        check_weight_hashes_if_due(model, iteration, run)
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        if args.eval_interval and iteration % args.eval_interval == 0 and state.do_valid:
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
                run=run,
            )
            if args.manual_gc and args.manual_gc_eval:
                gc.collect()
        exit_code = checkpoint_and_decide_exit(
            model,
            optimizer,
            opt_param_scheduler,
            iteration,
            state.num_floating_point_operations_so_far,
            run.start_time,
            run=run,
        )
        if exit_code is not None:
            break
    return exit_code
