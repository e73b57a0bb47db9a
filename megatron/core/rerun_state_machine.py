"""Megatron's rerun state machine: re-run an iteration whose result looks wrong, to tell a
transient fault from a persistent one (or from a correct but unusual result).

Each validated result (the loss, a gradient norm) goes through
:meth:`RerunStateMachine.validate_result`. When one is rejected (NaN, Inf, a spike), the
iteration is run again in place on the same data and from the same RNG states (the data
iterators are :class:`RerunDataIterator`, which replay the micro-batches of the iteration):

* the re-run gives a different result: a *transient* error. A non-fatal check (spiky loss,
  large gradients) logs it and training continues with the re-run's gradients; a fatal one
  (NaN/Inf) saves a checkpoint and exits with :data:`EXIT_CODE_FAILED_ON_RESULT_VALIDATION`.
* the re-run reproduces the result: a fatal check saves a checkpoint (with this machine's state)
  and exits with :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE`, so that the job is restarted on other
  hardware; the restarted job re-runs the iteration from the checkpoint. If it differs there,
  the first device had a *persistent* error; if it matches, the result was correct. Either way
  the job exits with :data:`EXIT_CODE_FAILED_ON_RESULT_VALIDATION` (restarted on the same
  device: :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE` again).

``report_stats`` re-runs every iteration once and reports how much the results vary.

Megatron keeps one machine in a module-level singleton; here it is an object owned by the
training loop and handed to whoever validates results. Log lines and exit codes are Megatron's.
The data iterator (rerun_data_iterator.py) and the report_stats samples (rerun_stats.py) live in
modules of their own and are importable from here too, because Megatron defines them in this
module and its callers import them from it.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import math
import os
import random
import socket
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.device import collective_device, computes_on_cuda
from megatron.core.rerun_data_iterator import RerunDataIterator
from megatron.core.rerun_stats import QuickStats
from megatron.core.utils import NonFiniteValueError

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
"""The job must be restarted (on other hardware) from the checkpoint just saved."""
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17
"""Result validation failed: the job should not simply be restarted."""

COMPARISON_MATCH: float = 0.0
COMPARISON_MISMATCH: float = math.inf


class RerunDiagnostic(str, Enum):
    """What a re-run concluded (and what the error injector pretends)."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """``--rerun-mode``."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_STATS = "report_stats"


class RerunState(Enum):
    """Where the machine is within (or between) iterations."""

    NOT_RUNNING_YET = 0
    """Between iterations."""
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    """Second run of the iteration on the same device."""
    WILL_RERUN_FROM_CHECKPOINT = 3
    """The in-place re-run reproduced a fatal result: checkpoint, exit, restart elsewhere."""
    RERUNNING_FROM_CHECKPOINT = 4
    """The restarted job runs the suspicious iteration again."""
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5
    """The restarted job landed on the suspicious device again."""


class RerunValidationStatus(str, Enum):
    """The status column of the ``--result-rejected-tracker-filename`` file."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


class Caller(NamedTuple):
    """Who validates: the check's message and the rank."""

    message: str
    rank: int


class Call(NamedTuple):
    """One validation: its caller and how many times that caller validated in this run of the
    iteration (the re-run compares the n-th call with the n-th call)."""

    caller: Caller
    sequence: int


def compare_floats(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two scalars: 0 when equal (NaN equals NaN), inf when one is finite
    and the other not, else ``|a - b| / mean(a, b)``."""
    af, bf = _as_float(a), _as_float(b)
    if af == bf or (math.isnan(af) and math.isnan(bf)):
        return COMPARISON_MATCH
    if math.isnan(af) or math.isnan(bf) or math.isinf(af) or math.isinf(bf):
        return COMPARISON_MISMATCH
    return math.fabs((af - bf) / (af + bf) * 2)


class RerunErrorInjector:
    """``--error-injection-rate N`` / ``--error-injection-type``: on about one validation in N
    (per rank), reject a good result and make the re-runs behave as the chosen diagnostic would.
    """

    _NAMES = {
        RerunDiagnostic.CORRECT_RESULT: "Expected result",
        RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
        RerunDiagnostic.PERSISTENT_ERROR: "Persistent error",
    }

    def __init__(
        self,
        error_injection_rate: int = 0,
        error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR,
        rank: int = 0,
    ) -> None:
        if error_injection_rate < 0:
            raise ValueError(f"--error-injection-rate must be >= 0, got {error_injection_rate}")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.rank = rank
        self.injected_error_type: Optional[RerunDiagnostic] = None
        """Set while an injected error is being diagnosed."""

    def maybe_inject(self) -> bool:
        """Whether to reject this (good) result. Draws from Python's ``random``, seeded by
        ``--seed``; the rank offset makes ranks inject at different validations."""
        if self.error_injection_rate <= 0 or self.injected_error_type is not None:
            return False
        draw = random.randint(0, self.error_injection_rate - 1)
        if (draw + self.rank) % self.error_injection_rate != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning(f"Injecting error type {self._NAMES[self.error_injection_type]}")
        return True

    def maybe_miscompare(
        self,
        comparison_func: Callable[[Any, Any], float],
        initial_result: Any,
        result: Any,
        state: RerunState,
    ) -> float:
        """The comparison of a re-run with the initial run; forced while an injected error is
        diagnosed: a transient error differs in place; a persistent one matches in place and
        differs on the other device; a correct result matches both times."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        self.injected_error_type = None
        if injected == RerunDiagnostic.PERSISTENT_ERROR:
            return COMPARISON_MISMATCH
        return COMPARISON_MATCH

    def state_dict(self) -> dict:
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type.value,
            "injected_error_type": (
                None if self.injected_error_type is None else self.injected_error_type.value
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        self.error_injection_rate = int(state["error_injection_rate"])
        self.error_injection_type = RerunDiagnostic(state["error_injection_type"])
        injected = state["injected_error_type"]
        self.injected_error_type = None if injected is None else RerunDiagnostic(injected)


DataIterators = Optional[Union[RerunDataIterator, List[Optional[RerunDataIterator]]]]


class RerunStateMachine:
    """The machine; see the module docstring. Use::

        while machine.should_run_forward_backward(data_iterator):
            ... zero grads, forward and backward (validate_result() calls inside) ...
        should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

    ``rank``, ``node`` and ``device`` identify this process in the log lines and decide whether
    a restarted job runs on the suspicious device (on CPU the device is the local rank).
    ``group`` is the process group over which the ranks agree (default: the world, when
    torch.distributed is initialized). ``save_extra_state`` / ``restore_extra_state`` capture
    what else a re-run must start from (the model-parallel RNG tracker); Python's, numpy's and
    torch's RNG states are captured here.
    """

    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(
        self,
        mode: Union[RerunMode, str] = RerunMode.DISABLED,
        error_injector: Optional[RerunErrorInjector] = None,
        rank: int = 0,
        node: Optional[str] = None,
        device: int = 0,
        group: Optional[dist.ProcessGroup] = None,
        save_extra_state: Optional[Callable[[], Any]] = None,
        restore_extra_state: Optional[Callable[[Any], None]] = None,
        result_rejected_tracker_filename: Optional[str] = None,
    ) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.first_iteration_complete = False
        # Per-rank requests, agreed on by all ranks (any rank asking wins).
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.logged_sdc_enabled = False
        self.error_injector = error_injector or RerunErrorInjector(rank=rank)
        self.rank = rank
        self.node = node if node is not None else socket.gethostname()
        self.device = device
        self.group = group
        self.validation_counts: dict = defaultdict(int)
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            try:
                with open(result_rejected_tracker_filename, "a"):
                    pass
            except OSError as exc:  # the same kind of error, naming the flag
                raise type(exc)(
                    f"--result-rejected-tracker-filename {result_rejected_tracker_filename} "
                    f"cannot be appended to: {exc.strerror or exc}"
                ) from None
        self.saved_state: Optional[dict] = None
        self.save_extra_state = save_extra_state
        self.restore_extra_state = restore_extra_state
        self.data_iterator_checkpoints: Optional[List[dict]] = None
        self.large_value_counts: dict = {}
        self.max_values: dict = {}
        self.saved_results: dict = {}
        self.stats: dict = defaultdict(QuickStats)
        if self.rank == 0:
            logger.warning(f"RerunStateMachine initialized in mode {self.mode}")

    def set_mode(self, mode: Union[RerunMode, str]) -> None:
        """Change the mode (evaluation runs with the machine disabled)."""
        self._log_rank_0(f"Setting RerunStateMachine mode {RerunMode(mode)}")
        self.mode = RerunMode(mode)

    # ------------------------------------------------------------------ agreement across ranks
    def _reduce_any(self, values: List[bool]) -> Tuple[bool, ...]:
        flags = torch.tensor(
            [int(v) for v in values], dtype=torch.int32, device=collective_device(self.group)
        )
        if dist.is_initialized():
            dist.all_reduce(flags, group=self.group)
        return tuple(bool(x > 0) for x in flags.tolist())

    def _log_rank_0(self, message: str) -> None:
        if self.rank == 0:
            logger.warning(message)

    # ------------------------------------------------------------------ the loop
    def should_run_forward_backward(self, data_iterator: DataIterators) -> bool:
        """Whether to run (or run again) the forward-backward pass of this iteration. Every rank
        calls it the same number of times (it reduces across ranks)."""
        self.validation_counts = defaultdict(int)
        iterators = self._iterators(data_iterator)
        if self.state == RerunState.NOT_RUNNING_YET:
            if self.mode == RerunMode.DISABLED:
                self.state = RerunState.INITIAL_RUN
                self.current_iteration += 1
                return True
            if self.data_iterator_checkpoints is not None:
                # Restarted to re-run: replay the micro-batches saved with the checkpoint.
                if len(self.data_iterator_checkpoints) != len(iterators):
                    raise RuntimeError(
                        f"the checkpoint holds {len(self.data_iterator_checkpoints)} data "
                        f"iterators to replay, this run has {len(iterators)}"
                    )
                for it, saved in zip(iterators, self.data_iterator_checkpoints):
                    it.load_state_dict(saved)
                self.data_iterator_checkpoints = None
            self._save_state()
            for it in iterators:
                it.advance()
            self.rerun_requested = False
            self.checkpoint_requested = False
            self.restart_again_requested = False
            self.continue_requested = False
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            return True
        if self.state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            (will_rerun,) = self._reduce_any([self.rerun_requested])
            if not will_rerun:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if self.mode == RerunMode.VALIDATE_RESULTS:
                self._log_rank_0("Need to rerun step to check reproducibility of initial result")
            self.state = RerunState.RERUNNING_IN_PLACE
            self._restore_state()
            for it in iterators:
                it.rewind()
            return True
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_STATS:
                self.state = RerunState.NOT_RUNNING_YET
                self._maybe_report_stats()
                self.saved_results = {}
                return False
            will_continue, will_checkpoint = self._reduce_any(
                [self.continue_requested, self.checkpoint_requested]
            )
            if will_continue:
                self._log_rank_0(
                    "Continuing normal execution because failed validation was not fatal"
                )
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if will_checkpoint:
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            # The checkpoint is saved with the iteration's starting point and data.
            self._restore_state()
            for it in iterators:
                it.rewind()
            return False
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            will_restart_again, will_continue = self._reduce_any(
                [self.restart_again_requested, self.continue_requested]
            )
            if will_restart_again:
                self._log_rank_0(
                    "Need to restart job from the same checkpoint "
                    "because it was scheduled on the same node/GPU"
                )
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif will_continue:
                self._log_rank_0(
                    "Continuing normal execution because failed validation was not fatal"
                )
                self.state = RerunState.NOT_RUNNING_YET
            return False
        raise RuntimeError(f"should_run_forward_backward() called in state {self.state}")

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint?, exit?, exit code), after the forward-backward loop."""
        self.first_iteration_complete = True
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            self._log_rank_0(
                "Exiting now. A checkpoint at the last iteration is being saved "
                "if further examination is needed"
            )
            return True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self._log_rank_0(
                "Saving a checkpoint and exiting now. Please resume the job "
                "from the checkpoint to rerun the last iteration "
                "and establish a diagnostic"
            )
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            self._log_rank_0(
                "Exiting now. A checkpoint at the last iteration already exists "
                "if further examination is needed"
            )
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            self._log_rank_0(
                "Exiting now. Please resume the job from the same checkpoint "
                "to rerun the last iteration and establish a diagnostic"
            )
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # ------------------------------------------------------------------ validation
    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], Any],
        message: str,
        comparison_func: Optional[Callable[[Any, Any], float]] = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check ``result`` (``rejection_func(result)`` true means wrong); on the re-runs,
        compare it with the initial run's (``comparison_func``, a relative difference; default
        :func:`compare_floats`) within ``tolerance``. ``fatal``: whether a confirmed wrong
        result ends the job (NaN) or is only logged (a spike)."""
        if self.mode == RerunMode.DISABLED:
            if bool(rejection_func(result)):
                self._log_validation_error_to_file(
                    RerunValidationStatus.RERUN_DISABLED, result, message
                )
                text = (
                    f"Rank {self.rank}, node {self.node}, device {self.device}, "
                    f"iteration {self.current_iteration}: "
                    f"Unexpected result {result} (message='{message}')"
                )
                if fatal:
                    raise NonFiniteValueError(text)
                logger.warning(text)
            return
        if comparison_func is None:
            comparison_func = compare_floats
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result() called outside of the forward-backward pass")
        call = self._validation_call(message)

        if self.mode == RerunMode.REPORT_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = (
                    result.detach().clone() if torch.is_tensor(result) else result
                )
            elif self.state == RerunState.RERUNNING_IN_PLACE:
                initial = self.saved_results.get(call)
                if initial is None:
                    raise RuntimeError(f"no initial result for validation {call}")
                self.stats[Caller(message=message, rank=0)].record(comparison_func(initial, result))
            return

        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            self._log_rank_0("Result validation enabled")

        if self.state == RerunState.INITIAL_RUN and not self.rerun_requested:
            # No checkpoint can be taken before the optimizer has stepped once.
            if not self.first_iteration_complete:
                return
            if self.error_injector.maybe_inject() or bool(rejection_func(result)):
                self.failed_validation_call = call
                self.initial_result = result.detach().clone() if torch.is_tensor(result) else result
                self.rerun_requested = True
                self._log_validation_error_to_file(
                    RerunValidationStatus.INITIAL_RUN, result, message
                )
                caller = inspect.getframeinfo(inspect.currentframe().f_back)
                logger.error(
                    f"Unexpected result {result} at {caller.filename} line {caller.lineno}, "
                    f"invokation #{call.sequence} at iteration #{self.current_iteration} "
                    f"(message='{message}')"
                )
            return
        if call != self.failed_validation_call or self.state not in (
            RerunState.RERUNNING_IN_PLACE,
            RerunState.RERUNNING_FROM_CHECKPOINT,
        ):
            return
        comparison = self.error_injector.maybe_miscompare(
            comparison_func, self.initial_result, result, self.state
        )
        initial = self.initial_result
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if comparison > tolerance:
                if not fatal:
                    self.continue_requested = True
                logger.warning(
                    "First rerun: unexpected result is not reproducible within the tolerance "
                    f"({result} != {initial})"
                )
                self._log_validation_error_to_file(
                    RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message
                )
                self._log_failure("Possible transient error!")
            else:
                if fatal:
                    self.checkpoint_requested = True
                else:
                    self.continue_requested = True
                self.suspicious_node = self.node
                self.suspicious_device = self.device
                self._log_validation_error_to_file(
                    RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message
                )
                logger.warning(
                    "First rerun: unexpected result is reproducible within the tolerance "
                    f"({result} = {initial}). "
                    "Need to rerun on a different GPU to verify correctness"
                )
            return
        # The second re-run, in the job restarted from the checkpoint.
        if self.node == self.suspicious_node and self.device == self.suspicious_device:
            logger.error(
                "Got rescheduled on the same GPU. Need to resume again from the same "
                f"checkpoint (node: {self.suspicious_node}, gpu: {self.suspicious_device})"
            )
            self.restart_again_requested = True
        elif comparison > tolerance:
            self._log_validation_error_to_file(
                RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message
            )
            logger.warning(
                "Second rerun: unexpected result is not reproducible on a different GPU, "
                f"therefore was likely incorrect ({result} != {initial})"
            )
            self._log_failure("Possible persistent error!")
            if not fatal:
                self.continue_requested = True
        else:
            self._log_validation_error_to_file(
                RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message
            )
            logger.warning(
                "Second rerun: unexpected result is reproducible on a different GPU, "
                f"therefore it was likely correct ({result} = {initial})"
            )
            self._log_failure(f"Correct result (but possible Application error) ({message})")
            if not fatal:
                self.continue_requested = True

    def is_unexpectedly_large(
        self,
        result: torch.Tensor,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """A rejection function: the first ``num_samples`` values of ``context`` set a maximum
        (of absolute values); afterwards a value >= ``threshold`` x that maximum is rejected.
        NaN and Inf are left to the NaN/Inf checks."""
        value = math.fabs(_as_float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                logger.warning(f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, data_iterator: DataIterators, force: bool = False) -> Optional[dict]:
        """What a checkpoint keeps (None between iterations unless ``force``): the common part
        and this rank's part (``"sharded"``), as plain values loadable with
        ``weights_only=True``. The saved micro-batches let the restarted job replay the
        iteration on the same data."""
        if not force and self.state == RerunState.NOT_RUNNING_YET:
            return None
        iterators = self._iterators(data_iterator)
        failed = self.failed_validation_call
        sharded = {
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": (
                None
                if failed is None
                else [failed.caller.message, failed.caller.rank, failed.sequence]
            ),
            "initial_result": self.initial_result,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": (
                [it.state_dict() for it in iterators] if iterators else None
            ),
            "large_value_counts": dict(self.large_value_counts),
            "max_values": dict(self.max_values),
        }
        return {
            "mode": self.mode.value,
            "state": self.state.value,
            "current_iteration": self.current_iteration,
            "sharded": sharded,
        }

    @staticmethod
    def validate_state_dict(state: Optional[dict]) -> bool:
        """Whether a checkpoint's state asks for a re-run."""
        return bool(state) and state.get("state", 0) != RerunState.NOT_RUNNING_YET.value

    def load_state_dict(self, state: dict) -> None:
        if self.mode == RerunMode.DISABLED:
            self._log_rank_0(
                "RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint"
            )
            return
        self._log_rank_0("Getting RerunStateMachine state from checkpoint, CLI rerun args ignored")
        self.mode = RerunMode(state["mode"])
        self.current_iteration = int(state["current_iteration"])
        self.state = RerunState(state["state"])
        sharded = state["sharded"]
        self.rerun_requested = sharded["rerun_requested"]
        self.checkpoint_requested = sharded["checkpoint_requested"]
        self.restart_again_requested = sharded["restart_again_requested"]
        self.continue_requested = sharded["continue_requested"]
        self.error_injector.load_state_dict(sharded["error_injector_checkpoint"])
        failed = sharded["failed_validation_call"]
        self.failed_validation_call = (
            None if failed is None else Call(Caller(failed[0], int(failed[1])), int(failed[2]))
        )
        self.initial_result = sharded["initial_result"]
        self.suspicious_node = sharded["suspicious_node"]
        self.suspicious_device = sharded["suspicious_device"]
        self.data_iterator_checkpoints = sharded["data_iterator_checkpoints"]
        self.large_value_counts = dict(sharded["large_value_counts"])
        self.max_values = dict(sharded["max_values"])
        # The restarted job validates from its first iteration on: the re-run is that one.
        self.first_iteration_complete = True

    # ------------------------------------------------------------------ internals
    def _iterators(self, data_iterator: DataIterators) -> List[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED or data_iterator is None:
            return []
        items = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        items = [it for it in items if it is not None]
        for it in items:
            if not isinstance(it, RerunDataIterator):
                raise TypeError(
                    f"--rerun-mode {self.mode.value} needs RerunDataIterator data iterators, "
                    f"got {type(it).__name__}"
                )
        return items

    def _validation_call(self, message: str) -> Call:
        caller = Caller(message=message, rank=self.rank)
        self.validation_counts[caller] += 1
        return Call(caller=caller, sequence=self.validation_counts[caller])

    def _save_state(self) -> None:
        self.saved_state = {
            "random": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if computes_on_cuda() else None,
            "extra": self.save_extra_state() if self.save_extra_state else None,
        }

    def _restore_state(self) -> None:
        saved = self.saved_state
        if saved is None:  # restarted from a checkpoint: the checkpoint restored the RNGs
            return
        random.setstate(saved["random"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state_all(saved["cuda"])
        if saved["extra"] is not None and self.restore_extra_state:
            self.restore_extra_state(saved["extra"])

    def _log_failure(self, message: str) -> None:
        logger.error(f"Rank {self.rank}, node {self.node}, device {self.device}: {message}!")

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        stats = dict(self.stats)
        if dist.is_initialized():
            world = dist.get_world_size(self.group)
            gathered = [None] * world if self.rank == 0 else None
            dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.gather_object(stats, gathered, dst=dst, group=self.group)
            if self.rank != 0:
                for each in self.stats.values():
                    each.reset()
                return
            for caller in {c for s in gathered for c in s}:
                self.stats[caller].combine([s[caller] for s in gathered[1:] if caller in s])
        logger.info("Stats on computation determinism in validation calls")
        for caller, each in self.stats.items():
            logger.info(f"  From '{caller.message}':")
            logger.info(f"    {each.print_stats()}")

    def _log_validation_error_to_file(
        self, status: RerunValidationStatus, result: Any, message: str
    ) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        try:
            with open(self.result_rejected_tracker_filename, "a") as f:
                f.write(
                    f"ts={datetime.datetime.now()} node={self.node} device={self.device} "
                    f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={self.rank} "
                    f"iteration={self.current_iteration} status={status.value} "
                    f"result={result} message='{message}'\n"
                )
        except OSError as exc:
            logger.error(f"Could not log validation error! ({exc})")


def _as_float(value: Any) -> float:
    return float(value.detach()) if torch.is_tensor(value) else float(value)
