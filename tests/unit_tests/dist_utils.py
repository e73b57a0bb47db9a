"""Run a function in a small gloo world of spawned CPU processes."""

import os
import socket
import traceback

import torch.multiprocessing as mp

from megatron.training.initialize import (
    import_torch_dynamo_before_process_groups,
    teardown_process_groups,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import_torch_dynamo_before_process_groups()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        leaked = teardown_process_groups()
    if leaked:
        message = (
            f"rank {rank}: {leaked} gloo worker thread(s) outlived destroy_process_group(): something "
            "the test built still references a process group (a leaked model, hook or cache)"
        )
        errors.put(message)
        raise RuntimeError(message)


def run_distributed(fn, world_size: int, *args):
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; re-raise failures."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(
            _worker,
            args=(world_size, port, fn, args, errors),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
    except mp.ProcessRaisedException as exc:
        details = errors.get() if not errors.empty() else str(exc)
        raise AssertionError(details) from None
