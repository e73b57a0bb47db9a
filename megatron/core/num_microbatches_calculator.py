"""Number of micro-batches per iteration, constant or with a global-batch-size ramp-up.

Objects only: the training side keeps the calculator it builds and asks it each iteration.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Union

logger = logging.getLogger(__name__)


def _check_positive(name: str, value: int) -> int:
    if int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


class NumMicroBatchesCalculator:
    """Interface: get() is the number of micro-batches of the current iteration."""

    def __init__(self):
        self.num_micro_batches: int = 0
        self.current_global_batch_size: int = 0
        self.current_running_global_batch_size: int = 0
        self.micro_batch_size: int = 0

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Global batch size the schedule asks for at this point of training."""
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """Global batch size actually run: num_micro_batches * micro_batch_size * dp.

        Differs from get_current_global_batch_size() only with decrease_batch_size_if_needed.
        """
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def update(
        self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False
    ) -> None:
        raise NotImplementedError


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """global_batch_size / (micro_batch_size * data_parallel_size) micro-batches, always."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        decrease_batch_size_if_needed: bool = False,
        rank: int = 0,
    ):
        super().__init__()
        global_batch_size = _check_positive(
            "global batch size (--global-batch-size)", global_batch_size
        )
        micro_batch_size = _check_positive(
            "micro batch size (--micro-batch-size)", micro_batch_size
        )
        data_parallel_size = _check_positive("data parallel size", data_parallel_size)
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step != 0:
            if not decrease_batch_size_if_needed:
                raise ValueError(
                    f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                    f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
                )
        running = global_batch_size // per_step * per_step
        if running == 0:
            raise ValueError(
                f"global batch size ({global_batch_size}) is smaller than micro batch size "
                f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
            )
        if running != global_batch_size and rank == 0:
            logger.info(
                "decreasing global batch size from %d to %d (a multiple of micro batch size %d "
                "times data parallel size %d)",
                global_batch_size,
                running,
                micro_batch_size,
                data_parallel_size,
            )
        self.micro_batch_size = micro_batch_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // per_step
        if rank == 0:
            logger.info("setting number of micro-batches to constant %d", self.num_micro_batches)

    def update(
        self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False
    ) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size grows from `start` by `incr` every samples/((gbs-start)/incr) samples.

    rampup_batch_size = [start, incr, samples] (--rampup-batch-size); once more than `samples`
    samples have been consumed the global batch size is `global_batch_size`.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: Sequence[Union[int, str]],
        decrease_batch_size_if_needed: bool = False,
        rank: int = 0,
    ):
        super().__init__()
        if rampup_batch_size is None or len(rampup_batch_size) != 3:
            raise ValueError(
                "--rampup-batch-size expects 3 values: <start batch size> <batch size increment> "
                f"<ramp-up samples>, got {rampup_batch_size!r}"
            )
        try:
            start, incr, samples = (int(v) for v in rampup_batch_size)
        except (TypeError, ValueError):
            raise ValueError(
                f"--rampup-batch-size values must be integers, got {rampup_batch_size!r}"
            ) from None
        self.global_batch_size = _check_positive(
            "global batch size (--global-batch-size)", global_batch_size
        )
        self.micro_batch_size = _check_positive(
            "micro batch size (--micro-batch-size)", micro_batch_size
        )
        self.data_parallel_size = _check_positive("data parallel size", data_parallel_size)
        self.start_global_batch_size = _check_positive(
            "--rampup-batch-size start batch size", start
        )
        self.batch_size_increment = _check_positive(
            "--rampup-batch-size batch size increment", incr
        )
        if samples < 0:
            raise ValueError(f"--rampup-batch-size ramp-up samples must be >= 0, got {samples}")
        self.rampup_samples = samples
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.micro_batch_times_data_parallel_size = self.micro_batch_size * self.data_parallel_size

        diff = self.global_batch_size - self.start_global_batch_size
        if diff < 0:
            raise ValueError(
                f"global batch size ({self.global_batch_size}) must be >= "
                "the --rampup-batch-size start "
                f"batch size ({self.start_global_batch_size})"
            )
        if diff % self.batch_size_increment != 0:
            raise ValueError(
                f"global batch size ({self.global_batch_size}) minus "
                "the --rampup-batch-size start batch "
                f"size ({self.start_global_batch_size}) must be divisible by "
                "the batch size increment "
                f"({self.batch_size_increment})"
            )
        num_increments = diff // self.batch_size_increment
        # No increments: the "ramp" is already at the target batch size.
        self.rampup_samples_per_increment = (
            self.rampup_samples / num_increments if num_increments > 0 else float("inf")
        )
        if rank == 0:
            logger.info(
                "will use batch size rampup starting from global batch size %d "
                "to global batch size "
                "%d with batch size increments %d over %d samples.",
                self.start_global_batch_size,
                self.global_batch_size,
                self.batch_size_increment,
                self.rampup_samples,
            )
        self.update(0, consistency_check=False)

    def update(
        self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False
    ) -> None:
        if consumed_samples > self.rampup_samples:
            gbs = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            gbs = min(
                self.start_global_batch_size + steps * self.batch_size_increment,
                self.global_batch_size,
            )
        self.current_global_batch_size = gbs
        per_step = self.micro_batch_times_data_parallel_size
        if gbs % per_step != 0:
            if self.decrease_batch_size_if_needed:
                running = gbs // per_step * per_step
            elif consistency_check:
                raise ValueError(
                    f"current global batch size ({gbs}) is not divisible by micro batch size "
                    f"({self.micro_batch_size}) times data parallel size "
                    f"({self.data_parallel_size}); "
                    "choose --rampup-batch-size values that are multiples of it or pass "
                    "--decrease-batch-size-if-needed"
                )
            else:
                running = gbs
        else:
            running = gbs
        if self.decrease_batch_size_if_needed and running == 0:
            raise ValueError(
                f"current global batch size ({gbs}) is smaller than micro batch size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})"
            )
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // per_step
        if verbose:
            logger.info(
                "setting number of micro-batches to %d (global batch size %d)",
                self.num_micro_batches,
                running,
            )


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[Sequence[Union[int, str]]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    decrease_batch_size_if_needed: bool = False,
) -> NumMicroBatchesCalculator:
    """Constant calculator without ramp-up, ramp-up calculator otherwise."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(
            global_batch_size,
            micro_batch_size,
            data_parallel_size,
            decrease_batch_size_if_needed,
            rank,
        )
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        rampup_batch_size,
        decrease_batch_size_if_needed,
        rank,
    )


def simulate_rampup_train_iters(
    train_samples: int,
    global_batch_size: int,
    rampup_batch_size: Optional[Sequence[Union[int, str]]] = None,
    micro_batch_size: int = 1,
    data_parallel_size: int = 1,
    decrease_batch_size_if_needed: bool = False,
) -> int:
    """Iterations needed to consume `train_samples` samples (Megatron's train_iters in sample mode).

    Without ramp-up: train_samples // global_batch_size. With ramp-up: iterations of the ramp are
    simulated one by one (while consumed <= ramp samples and <= train_samples), then full batches
    follow; a partial last batch is dropped.
    """
    if train_samples < 0:
        raise ValueError(f"--train-samples must be >= 0, got {train_samples}")
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    calc = RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        rampup_batch_size,
        decrease_batch_size_if_needed,
        rank=-1,
    )
    iterations = 0
    consumed = 0
    while consumed <= calc.rampup_samples and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


__all__: List[str] = [
    "NumMicroBatchesCalculator",
    "ConstantNumMicroBatchesCalculator",
    "RampupBatchsizeNumMicroBatchesCalculator",
    "build_num_microbatches_calculator",
    "simulate_rampup_train_iters",
]
