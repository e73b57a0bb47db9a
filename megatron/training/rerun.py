"""The training side of the rerun state machine: built from the flags, the loss checks of the
pretrain scripts, and its state in checkpoints.

``--rerun-mode`` (Megatron's default ``validate_results``), ``--error-injection-rate`` /
``--error-injection-type``, ``--result-rejected-tracker-filename``,
``--check-for-nan-in-loss-and-grad``, ``--check-for-spiky-loss`` and
``--check-for-large-grads`` are read here; the machine itself is in
``megatron/core/rerun_state_machine.py``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.device import compute_device
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
)
from megatron.core.utils import NonFiniteValueError

from . import global_vars
from .utils import print_rank_0

SPIKY_LOSS_FACTOR = 10.0
"""``--check-for-spiky-loss``: a loss this many times the largest of the first 100 is a spike."""


def build_rerun_state_machine(args, tracker) -> RerunStateMachine:
    """The machine for this run (``run.rerun``, where the loss functions find it through
    get_rerun_state_machine()); a re-run restores ``tracker``'s RNG streams too."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = compute_device().index
    if device is None:  # on CPU a "device" is the process's slot on its node
        device = int(os.environ.get("LOCAL_RANK", "0"))
    return RerunStateMachine(
        mode=RerunMode(args.rerun_mode),
        error_injector=RerunErrorInjector(
            error_injection_rate=args.error_injection_rate,
            error_injection_type=RerunDiagnostic(args.error_injection_type),
            rank=rank,
        ),
        rank=rank,
        device=device,
        save_extra_state=(tracker.get_states if tracker is not None else None),
        restore_extra_state=(tracker.set_states if tracker is not None else None),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename,
    )


def set_machine_iteration(machine: Optional[RerunStateMachine], iteration: int) -> None:
    """Megatron's start of training: the machine counts iterations from the loaded one (its
    first is ``iteration + 1``, the number the log line shows). A machine that a checkpoint
    asks to re-run an iteration keeps that iteration's number: the re-run is that iteration
    (Megatron would reset it to the checkpoint's, one less, and count one behind afterwards)."""
    if machine is None or machine.current_iteration == iteration:
        return
    if machine.state != RerunState.NOT_RUNNING_YET:
        return
    print_rank_0(f"Setting rerun_state_machine.current_iteration to {iteration}...")
    machine.current_iteration = iteration


def wrap_data_iterators(iterators, machine: RerunStateMachine):
    """Train iterators that can replay an iteration's micro-batches (one per model chunk)."""
    record = machine.mode != RerunMode.DISABLED
    if iterators is None:
        return None
    if isinstance(iterators, list):
        return [None if it is None else RerunDataIterator(it, record) for it in iterators]
    return RerunDataIterator(iterators, record)


@contextmanager
def results_not_validated(machine: Optional[RerunStateMachine] = None):
    """Evaluation: the loss functions run outside of any training iteration, so the machine
    (default the current run's) is disabled meanwhile (Megatron's evaluate() disables it too): a
    NaN loss ends the run with one line, nothing re-runs.
    """
    if machine is None:
        machine = global_vars.get_rerun_state_machine()
    if machine is None or machine.mode == RerunMode.DISABLED:
        yield
        return
    mode = machine.mode
    machine.set_mode(RerunMode.DISABLED)
    try:
        yield
    finally:
        machine.set_mode(mode)


def check_loss(loss: torch.Tensor, args, iteration: Optional[int] = None) -> None:
    """Megatron's loss checks, on this rank's loss before any reduction: NaN and Inf
    (``--check-for-nan-in-loss-and-grad``, fatal) and spikes (``--check-for-spiky-loss``,
    non-fatal). With ``--rerun-mode disabled`` a NaN/Inf loss ends the run with one line naming
    ``iteration`` (default: the one the current run is in, its TrainState's next)."""
    run = global_vars.get_run()
    machine: Optional[RerunStateMachine] = run.rerun
    if iteration is None:
        iteration = run.state.iteration + 1
    if args.check_for_nan_in_loss_and_grad:
        if machine is None or machine.mode == RerunMode.DISABLED:
            if not torch.isfinite(loss).item():
                raise NonFiniteValueError(
                    f"found {'NaN' if torch.isnan(loss).item() else 'Inf'} in local forward loss "
                    f"calculation at iteration {iteration} (--check-for-nan-in-loss-and-grad)"
                )
        else:
            # Forward computations are deterministic: any difference in the re-run is a fault.
            machine.validate_result(
                loss, torch.isnan, "found NaN in local forward loss calculation", tolerance=0.0
            )
            machine.validate_result(
                loss, torch.isinf, "found Inf in local forward loss calculation", tolerance=0.0
            )
    if args.check_for_spiky_loss and machine is not None:
        machine.validate_result(
            loss,
            partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            "Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
