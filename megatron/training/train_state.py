"""The run's progress: what a checkpoint resumes from and the training loop advances.

Megatron keeps it in ``args`` (``args.iteration``, ``args.consumed_train_samples``, ...), which
makes the configuration mutable run state. Here it is one object, passed explicitly
(``run.state``), and the args are read-only once the run starts (frozen_args.py): reading
``get_args().iteration`` still works, and answers from this object.

On disk it is written and read as Megatron's entries, not as an object of its own, so that the
checkpoints stay Megatron's: the top-level ``iteration`` and
``num_floating_point_operations_so_far`` (save_checkpoint's arguments, which the loop takes from
this object: Megatron's signature) and the run-state names of the saved ``args`` Namespace
(:meth:`TrainState.args_entries`). A load fills it back (:meth:`TrainState.restore_sample_counts`,
then :meth:`TrainState.start` with the loaded iteration and FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Megatron's names on ``args`` -> the TrainState field that holds each. Megatron's
# args.num_floating_point_operations_so_far is the count at the job's start (its training loop
# keeps the running total in a local variable, and the progress log measures the job's throughput
# from it); the running total is a field of its own here.
ARGS_NAMES = {
    "consumed_train_samples": "consumed_train_samples",
    "skipped_train_samples": "skipped_train_samples",
    "consumed_valid_samples": "consumed_valid_samples",
    "iteration": "iteration",
    "num_floating_point_operations_so_far": "num_floating_point_operations_at_start",
    "last_saved_iteration": "last_saved_iteration",
    "do_train": "do_train",
    "do_valid": "do_valid",
    "do_test": "do_test",
}
_SAMPLE_COUNTS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
_START = ("iteration", "num_floating_point_operations_so_far", "last_saved_iteration")
_DATA = ("do_train", "do_valid", "do_test")


@dataclass
class TrainState:
    """Where the run is. ``started`` is set once the starting point is known (model set-up, after
    a checkpoint load); ``do_train``/``do_valid``/``do_test`` are None until the data iterators
    are built."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    num_floating_point_operations_so_far: float = 0.0  # the running total
    num_floating_point_operations_at_start: float = 0.0  # at this job's start (resumed from)
    last_saved_iteration: Optional[int] = None
    do_train: Optional[bool] = None
    do_valid: Optional[bool] = None
    do_test: Optional[bool] = None
    started: bool = False

    @classmethod
    def from_args(cls, args) -> "TrainState":
        """The state an unfrozen ``args`` describes under Megatron's names (validation sets the
        sample counts; callers that build their own args may set the others)."""
        state = cls()
        values = vars(args)
        for name, field in ARGS_NAMES.items():
            if name in values:
                setattr(state, field, values[name])
        state.num_floating_point_operations_so_far = state.num_floating_point_operations_at_start
        state.started = "iteration" in values
        return state

    def start(self, iteration: int, flops: float) -> None:
        """The run starts at ``iteration`` with ``flops`` done (0 and 0.0, or a checkpoint's);
        a checkpoint loaded is a checkpoint saved."""
        self.iteration = iteration
        self.num_floating_point_operations_so_far = flops
        self.num_floating_point_operations_at_start = flops
        self.last_saved_iteration = iteration if iteration > 0 else None
        self.started = True

    def restore_sample_counts(self, ckpt_args) -> None:
        """The sample counts of a checkpoint's saved ``args`` (0 where it has none)."""
        for name in _SAMPLE_COUNTS:
            setattr(self, name, getattr(ckpt_args, name, 0))

    def advance(self, samples: int, flops: float, skipped: bool) -> None:
        """One training iteration of ``samples`` samples and ``flops`` operations; a ``skipped``
        one (the optimizer did not step: inf/NaN gradients) counts its samples as skipped."""
        self.iteration += 1
        self.consumed_train_samples += samples
        self.num_floating_point_operations_so_far += flops
        if skipped:
            self.skipped_train_samples += samples

    def args_entries(self) -> dict:
        """The run-state names Megatron's ``args`` hold at this point of the run, with their
        values: the sample counts (validation sets them), then the iteration, the FLOPs at the
        job's start and the last save once started, then do_train/do_valid/do_test once the data
        iterators are built (the order in which Megatron's trainer adds them)."""
        names = list(_SAMPLE_COUNTS)
        if self.started:
            names += _START
        if self.do_train is not None:
            names += _DATA
        return {name: getattr(self, ARGS_NAMES[name]) for name in names}
