"""``--log-progress``: Megatron's ``progress.txt`` in the ``--save`` directory.

Rank 0 appends one line per event, fields separated by tabs::

    2024-05-01 10:00:00<TAB>Job ID: <$SLURM_JOB_ID><TAB># GPUs: <world size><TAB><event>

The events are ``Starting job`` (at start-up), after every checkpoint save ``Saved checkpoint``
(``Saving async checkpoint`` with ``--async-save``) followed by ``Iteration: N``, ``Job
throughput: X TFLOP/s/GPU`` (this job's floating-point operations over its wall time),
``Cumulative throughput: X TFLOP/s/GPU`` (since the first job of this world size, from the
file's own lines), ``Floating-point operations: X.XXe+YY`` (since the start of training) and
``Tokens (in billions): X.XX``; and ``Saved async checkpoint`` + ``Iteration: N`` when an
asynchronous save is committed. The file outlives jobs: a resumed job appends to it.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import List, Optional, Tuple

import torch.distributed as dist

PROGRESS_FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
STARTING_JOB = "Starting job"
SAVED_CHECKPOINT = "Saved checkpoint"


def progress_path(save_dir: str) -> str:
    return os.path.join(save_dir, PROGRESS_FILE)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def append_to_progress_log(
    save_dir: Optional[str], world_size: int, text: str, barrier: bool = True
) -> None:
    """Append one event line (rank 0 writes; with `barrier` every rank must call it)."""
    if save_dir is None:
        return
    if barrier and dist.is_initialized():
        dist.barrier()
    if _rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        with open(progress_path(save_dir), "a") as f:
            f.write(
                f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}"
                f"\t# GPUs: {world_size}\t{text}\n"
            )


def _field(token: str) -> str:
    return token.split(": ", 1)[1]


def _read_events(path: str) -> List[Tuple[datetime, int, List[str]]]:
    """(time, world size, event fields) of every line; a line that is not Megatron's format
    raises ValueError naming the file and the line."""
    events = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            tokens = line.rstrip("\n").split("\t")
            try:
                when = datetime.strptime(tokens[0], _TIME_FORMAT)
                world_size = int(_field(tokens[2]))
                fields = tokens[3:]
                if fields[0] == SAVED_CHECKPOINT:
                    float(_field(fields[4]))  # the floating-point operations of the save
            except (ValueError, IndexError):
                raise ValueError(
                    f"--log-progress: {path} line {number} is not a progress line "
                    f"({line.strip()[:80]!r})"
                ) from None
            events.append((when, world_size, fields))
    return events


def check_progress_log(save_dir: Optional[str]) -> None:
    """Fail now (every rank reads the same file) rather than at the first save."""
    if save_dir is not None and os.path.isfile(progress_path(save_dir)):
        _read_events(progress_path(save_dir))


def start_of_this_world_size(save_dir: str, world_size: int) -> Tuple[datetime, float]:
    """When the first job of the latest run of jobs with `world_size` started, and the
    floating-point operations of the last checkpoint saved before it (Megatron's rule: a job
    with another world size starts the count again)."""
    start_time, start_flops, latest_flops = None, None, 0.0
    for when, size, fields in _read_events(progress_path(save_dir)):
        if fields[0] == SAVED_CHECKPOINT:
            latest_flops = float(_field(fields[4]))
        if size != world_size:
            start_time = start_flops = None
            continue
        if fields[0] == STARTING_JOB and start_time is None:
            start_time, start_flops = when, latest_flops
    if start_time is None:
        raise ValueError(
            f"--log-progress: {progress_path(save_dir)} has no '{STARTING_JOB}' line for "
            f"world size {world_size}"
        )
    return start_time, start_flops


def log_job_start(args) -> None:
    """The 'Starting job' line (collective)."""
    check_progress_log(args.save)
    append_to_progress_log(args.save, args.world_size, STARTING_JOB)


def log_checkpoint_saved(args, state, iteration: int, flops: float, job_start_time: float) -> None:
    """The line after a checkpoint save (collective). `flops`: floating-point operations since
    the start of training; `state` (the run's TrainState): those at this job's start and the
    consumed samples; `job_start_time`: time.time() when this job started."""
    if args.save is None:
        return
    scale = 1e12 * args.world_size
    job_throughput = (flops - state.num_floating_point_operations_at_start) / (
        max(time.time() - job_start_time, 1e-6) * scale
    )
    text = None
    if _rank() == 0:
        start_time, start_flops = start_of_this_world_size(args.save, args.world_size)
        elapsed = max((datetime.now() - start_time).total_seconds(), 1e-6)
        cumulative = (flops - start_flops) / (elapsed * scale)
        tokens = state.consumed_train_samples * args.seq_length
        prefix = "Saving async checkpoint" if args.async_save else SAVED_CHECKPOINT
        text = (
            f"{prefix}\tIteration: {iteration}\t"
            f"Job throughput: {job_throughput:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )
    append_to_progress_log(args.save, args.world_size, text)


def log_async_checkpoint_committed(save_dir: str, world_size: int, iteration: int) -> None:
    """The line written when an asynchronous save is committed (rank 0, no barrier)."""
    append_to_progress_log(
        save_dir, world_size, f"Saved async checkpoint\tIteration: {iteration}", barrier=False
    )
