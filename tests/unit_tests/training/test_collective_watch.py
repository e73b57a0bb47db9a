"""The collective watch: a collective that one rank never joins ends on the other rank with a
CollectiveTimeoutError naming the operation, the group and the missing rank, after a dump of
the last collectives; completed collectives are traced and the originals come back."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.training import collective_watch
from tests.unit_tests.dist_utils import run_distributed


def _away_until_rank_0_timed_out():
    """Away (as a stopped rank would be) until rank 0's operation has timed out (it posts that
    to the store), and through its grace period, however slow a loaded machine makes rank 0."""
    store = dist.distributed_c10d._get_default_store()
    store.wait([f"{collective_watch._STORE_PREFIX}/0"], timedelta(seconds=50))
    time.sleep(collective_watch.GRACE_SECONDS + 1)


def _one_rank_stays_away(rank, world_size, results):
    original = dist.all_reduce
    collective_watch.install(timedelta(seconds=60))
    collective_watch.GRACE_SECONDS = 1.0  # this spawned process's copy of the module only
    assert dist.all_reduce is not original
    try:
        collective_watch.set_timeout(timedelta(seconds=2))
        dist.all_reduce(torch.ones(2))  # both ranks: completes and is traced
        dist.barrier()
        if rank == 1:
            _away_until_rank_0_timed_out()
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


def _peer_never_sends(rank, world_size, results):
    collective_watch.install(timedelta(seconds=60))
    collective_watch.GRACE_SECONDS = 1.0  # this spawned process's copy of the module only
    peer = 1 - rank
    try:
        collective_watch.set_timeout(timedelta(seconds=2))
        # A matched exchange, as a pipeline stage posts it, and a blocking send/recv: traced
        # with their peers and completed.
        received = torch.zeros(2)
        ops = [
            dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer),
            dist.P2POp(dist.irecv, received, peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert received.tolist() == [float(peer)] * 2
        if rank == 0:
            dist.send(torch.ones(2), dst=1)
        else:
            dist.recv(received, src=0)
            _away_until_rank_0_timed_out()
            results.put((rank, "away", None))
            return
        try:
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(2), 1)])[0].wait()
        except collective_watch.CollectiveTimeoutError as exc:
            trace = [(entry[1], entry[4] is not None) for entry in collective_watch._WATCH.trace]
            results.put((rank, str(exc), trace))
    finally:
        collective_watch.set_timeout(timedelta(seconds=60))
        collective_watch.uninstall()


def test_a_p2p_receive_whose_peer_never_sends_names_the_peer(capfd):
    import multiprocessing

    results = multiprocessing.get_context("spawn").Manager().Queue()
    run_distributed(_peer_never_sends, 2, results, timeout_s=60)
    got = {}
    while not results.empty():
        rank, message, trace = results.get()
        got[rank] = (message, trace)
    message, trace = got[0]
    assert message == (
        "rank 0: operation #4 irecv from rank 1 over group ranks [0, 1] did not complete within "
        "2 s (--distributed-timeout-minutes / --distributed-timeout-seconds-after-init): "
        "ranks [1] did not arrive"
    ), message
    assert trace == [
        ("isend to rank 1", True),
        ("irecv from rank 1", True),
        ("send to rank 1", True),
        ("irecv from rank 1", False),
    ], trace
    assert "[rank 0]   #4 irecv from rank 1 group ranks [0, 1]: did not complete" in (
        capfd.readouterr().err
    )
