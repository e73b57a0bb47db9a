"""The collective watch: a collective that one rank never joins ends on the other rank with a
CollectiveTimeoutError naming the operation, the group and the missing rank, after a dump of
the last collectives; completed collectives are traced and the originals come back."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.training import collective_watch
from tests.unit_tests.dist_utils import run_distributed


def _one_rank_stays_away(rank, world_size, results):
    original = dist.all_reduce
    collective_watch.install(timedelta(seconds=60))
    assert dist.all_reduce is not original
    try:
        collective_watch.set_timeout(timedelta(seconds=2))
        dist.all_reduce(torch.ones(2))  # both ranks: completes and is traced
        dist.barrier()
        if rank == 1:
            # Away (as a stopped rank would be) until rank 0 has timed out and reported.
            time.sleep(2 + collective_watch.GRACE_SECONDS + 2)
            results.put((rank, "away", None))
            return
        try:
            dist.all_reduce(torch.ones(2))
        except collective_watch.CollectiveTimeoutError as exc:
            trace = [(entry[1], entry[4] is not None) for entry in collective_watch._WATCH.trace]
            results.put((rank, str(exc), trace))
    finally:
        collective_watch.set_timeout(timedelta(seconds=60))
        collective_watch.uninstall()
        assert dist.all_reduce is original


def test_a_collective_one_rank_never_joins_names_it(capfd):
    import multiprocessing

    results = multiprocessing.get_context("spawn").Manager().Queue()
    run_distributed(_one_rank_stays_away, 2, results, timeout_s=60)
    got = {}
    while not results.empty():
        rank, message, trace = results.get()
        got[rank] = (message, trace)
    message, trace = got[0]
    assert message == (
        "rank 0: collective #3 all_reduce over group ranks [0, 1] did not complete within 2 s "
        "(--distributed-timeout-minutes / --distributed-timeout-seconds-after-init): "
        "ranks [1] did not arrive"
    ), message
    assert trace == [("all_reduce", True), ("barrier", True), ("all_reduce", False)], trace
    assert "[rank 0]   #3 all_reduce group ranks [0, 1]: did not complete" in capfd.readouterr().err
