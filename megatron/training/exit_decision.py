"""After each iteration: a checkpoint on --save-interval, and on an exit signal,
--exit-interval or --exit-duration-in-mins a checkpoint and the end of training (Megatron's
checkpoint-and-decide-exit)."""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.device import collective_device

from . import global_vars
from .checkpointing import save_checkpoint
from .progress_log import log_checkpoint_saved
from .run import Run
from .utils import print_datetime


def save_if_not_saved(
    iteration, model, optimizer, opt_param_scheduler, flops, train_start_time, run: Run
):
    """Save the checkpoint of `iteration` unless there is no --save or it is saved already;
    `train_start_time` (time.time() when this job started) goes into the --log-progress line."""
    args, state = run.args, run.state
    if args.save and state.last_saved_iteration != iteration:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, run=run)
        state.last_saved_iteration = iteration
        if args.log_progress:
            log_checkpoint_saved(args, state, iteration, flops, train_start_time)


def checkpoint_and_decide_exit(
    model,
    optimizer,
    opt_param_scheduler,
    iteration,
    flops,
    train_start_time,
    *,
    run: Optional[Run] = None,
) -> Optional[int]:
    """Save on the interval; on a signal, --exit-interval or --exit-duration-in-mins save and
    stop: returns the exit code then (0), None to train on. Collective: every rank decides the
    same (the duration is the slowest rank's). ``run``: default the current one."""
    run = run or global_vars.get_run()
    args, handler = run.args, run.signal_handler

    def save():
        save_if_not_saved(
            iteration, model, optimizer, opt_param_scheduler, flops, train_start_time, run
        )

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
        elapsed = torch.tensor(
            [(time.time() - train_start_time) / 60.0], device=collective_device()
        )
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
