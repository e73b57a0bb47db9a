"""Run a function in a small gloo world of spawned CPU processes, bounded in time."""

import datetime
import faulthandler
import os
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from megatron.training.initialize import (
    import_torch_dynamo_before_process_groups,
    teardown_process_groups,
)

# A spawned world of tiny models takes seconds alone; the slowest took 81 s on a 2-core machine
# shared with other test runs (load 15). Below pytest-timeout's 300 s, so that this harness,
# not pytest, reports the hang and names the rank.
DEFAULT_TIMEOUT_S = 240.0
# Time given to a world whose ranks have all returned from fn to tear down and exit.
EXIT_GRACE_S = 60.0


def _worker(rank, world_size, store_path, timeout_s, fn, args, errors, finished):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import_torch_dynamo_before_process_groups()
    # A file store: no port to pick, so two worlds started at once cannot meet by mistake.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # A rank still running just before the parent gives up prints where it is stuck. Armed after
    # start-up: a dump that fires while the process is still importing can kill it (seen once
    # under load with a 5 s limit: the rank died with SIGSEGV instead of being reported).
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5.0), exit=False, file=sys.stderr)
    try:
        fn(rank, world_size, *args)
        finished[rank] = 1
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        leaked = teardown_process_groups()
        faulthandler.cancel_dump_traceback_later()
    if leaked:
        message = (
            f"rank {rank}: {leaked} gloo worker thread(s) outlived destroy_process_group(): "
            "something the test built still references a process group (a leaked model, hook "
            "or cache)"
        )
        errors.put(message)
        raise RuntimeError(message)


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raise the
    first failure. A world still running after ``timeout_s`` seconds is killed and the test
    fails naming the ranks that did not finish (their stacks are printed to stderr)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    finished = ctx.Array("b", world_size)  # rank r sets finished[r] once fn has returned
    with tempfile.TemporaryDirectory(prefix="gloo_store_") as tmp:
        store_path = os.path.join(tmp, "store")
        context = mp.start_processes(
            _worker,
            args=(world_size, store_path, timeout_s, fn, args, errors, finished),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        deadline = time.monotonic() + timeout_s
        exit_grace_given = False
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    hung = [rank for rank in range(world_size) if not finished[rank]]
                    if not hung and not exit_grace_given:
                        # Every rank has returned from fn and is only tearing down and exiting,
                        # which a heavily loaded machine can make slow (seen at load 40: both
                        # ranks done, the world still up at 60 s). That is not a hang: give the
                        # exit its own time once.
                        exit_grace_given = True
                        deadline = time.monotonic() + EXIT_GRACE_S
                        continue
                    for p in context.processes:
                        if p.is_alive():
                            p.kill()
                    for p in context.processes:
                        p.join(timeout=10)
                    raise AssertionError(
                        f"run_distributed({getattr(fn, '__name__', fn)}, {world_size}): rank(s) "
                        f"{hung} had not finished after {timeout_s:.0f} s (a hang: a collective "
                        "that not every rank reached?); their stacks are in the captured stderr"
                    )
        except ProcessException as exc:  # a rank raised, or died without a word
            details = errors.get() if not errors.empty() else str(exc)
            raise AssertionError(details) from None
        # A rank that left fn through sys.exit(0) (as pretrain does on --exit-interval) exits
        # cleanly without having run fn to its end.
        unfinished = [rank for rank in range(world_size) if not finished[rank]]
        if unfinished:
            raise AssertionError(
                f"run_distributed({getattr(fn, '__name__', fn)}, {world_size}): rank(s) "
                f"{unfinished} exited without finishing (sys.exit in fn?)"
            )
