"""A failing run ends: an unexpected exception, Ctrl-C or a hard crash ends this rank's process
promptly, with its traceback, so that torchrun can end the job.

Why it is needed: the data-loader workers ignore SIGTERM and SIGINT (a scheduler's signal to the
whole process group is for the trainer, see data_samplers.py). After an uncaught exception the
traceback keeps the data iterators alive, so at interpreter exit multiprocessing's exit handler
sends SIGTERM to those workers and joins them for ever. Collectives, an in-flight asynchronous
save and W&B can block interpreter shutdown in the same way. So a failed command-line run never
goes through interpreter shutdown: :func:`end_failed_run` prints the traceback, kills this
process's children and leaves through ``os._exit``.

A rank blocked in C++ (a gloo collective waiting for a peer, a CUDA synchronisation) cannot run
Python's SIGINT handler until the call returns. :func:`watch_for_interrupt` wakes a thread
through ``signal.set_wakeup_fd`` (written by the C-level handler at once, whatever the main
thread does) that gives the main thread a short grace, then dumps every thread's stack and
ends the process. Ends that no Python code can run any more use faulthandler's C watchdog
(``dump_traceback_later(exit=True)``), which needs no GIL either. So every path after a SIGINT
is bounded, even one where the KeyboardInterrupt escapes (the watchdog armed the deadline).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Iterable, NoReturn

# The crash path's own steps (closing writers, killing children) normally take well under a
# second; past this, faulthandler dumps every thread's stack and ends the process.
CRASH_STEPS_SECONDS = 5.0
# After SIGINT, the main thread gets this long to end by itself (KeyboardInterrupt, then
# end_failed_run) before the watchdog ends the process. torchrun waits 30 s before SIGKILL.
INTERRUPT_GRACE_SECONDS = 3.0
STDERR_FD = 2

_deadline_lock = threading.Lock()
_deadline = [float("inf")]  # monotonic time at which faulthandler ends the process


def enable_fault_handler() -> None:
    """Print every thread's Python stack on a hard crash (segfault, abort, bus error).

    Left as it is when already enabled (pytest, ``python -X faulthandler``): its owner chose
    where it writes. Writes to file descriptor 2, so it keeps working when ``sys.stderr`` is
    replaced by an object without a file descriptor (a test's redirect, a log wrapper)."""
    if faulthandler.is_enabled():
        return
    faulthandler.enable(file=STDERR_FD, all_threads=True)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _end_by(seconds: float) -> None:
    """Make sure the process is gone ``seconds`` from now (an earlier deadline stands)."""
    with _deadline_lock:
        deadline = time.monotonic() + seconds
        if deadline >= _deadline[0]:
            return
        _deadline[0] = deadline
        faulthandler.dump_traceback_later(seconds, exit=True, file=STDERR_FD)


def watch_for_interrupt() -> bool:
    """Start the SIGINT watchdog (main thread only; once per process). Returns False where it
    cannot run: not the main thread, or another wakeup fd (an event loop) is installed.

    A SIGINT arriving while Python's default SIGINT handler is installed ends the process
    within INTERRUPT_GRACE_SECONDS. A program that installed its own SIGINT handler
    (``--exit-signal-handler --exit-signal SIGINT``) keeps the signal's meaning."""
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: the C handler never blocks
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    threading.Thread(
        target=_interrupt_watchdog, args=(read_fd,), name="sigint-watchdog", daemon=True
    ).start()
    return True


def _interrupt_watchdog(read_fd: int) -> None:
    while True:
        received = os.read(read_fd, 64)  # one byte per signal that has a Python-level handler
        if signal.SIGINT not in received:
            continue
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            continue
        print(
            f"[rank {_rank()}] got SIGINT: this rank ends within {INTERRUPT_GRACE_SECONDS:g} s "
            "(its threads' stacks are printed if it has to be ended)",
            file=sys.stderr,
            flush=True,
        )
        _end_by(INTERRUPT_GRACE_SECONDS)


def end_failed_run(exc: BaseException, cleanups: Iterable[Callable[[], None]] = ()) -> NoReturn:
    """End this process after ``exc``: its traceback (naming the rank) on stderr, this
    process's children (data-loader workers) killed, ``cleanups`` run, exit code 1 (130 after
    Ctrl-C). Nothing here waits for another rank or a child, and no exit handler runs.

    Call it from the main thread, where ``exc`` was caught."""
    _end_by(CRASH_STEPS_SECONDS)
    interrupted = isinstance(exc, KeyboardInterrupt)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
    except ValueError:  # not the main thread: the deadline above still holds
        pass
    _flush()
    what = "interrupted (SIGINT)" if interrupted else f"failed with {type(exc).__name__}"
    print(f"[rank {_rank()}] training {what}; ending this process", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    _flush()
    _kill_children()
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception as cleanup_error:  # the traceback above is what matters
            print(
                f"[rank {_rank()}] while ending: {type(cleanup_error).__name__}: {cleanup_error}",
                file=sys.stderr,
            )
    _flush()
    os._exit(128 + signal.SIGINT if interrupted else 1)


def _kill_children() -> None:
    """SIGKILL this process's multiprocessing children: data-loader workers ignore SIGTERM and
    SIGINT, and nothing they hold is worth saving."""
    try:
        # The DataLoader's SIGCHLD handler would raise in this thread when its workers die.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
    deadline = time.monotonic() + 1.0
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
