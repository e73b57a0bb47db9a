"""--exit-duration-in-mins is decided on the slowest rank's clock: every rank stops at the same
iteration even when only one of them has run past the limit (otherwise the ranks still training
would wait forever in their next collective)."""

import argparse
import multiprocessing as mp
import time

import pytest

from megatron.training import exit_decision, global_vars
from tests.unit_tests.dist_utils import run_distributed


def _decide(rank, world_size, minutes_running, results):
    global_vars.set_args(
        argparse.Namespace(
            save=None,
            save_interval=None,
            exit_duration_in_mins=1,
            exit_interval=None,
            log_progress=False,
            last_saved_iteration=None,
        )
    )
    global_vars.set_signal_handler(None)
    start = time.time() - 60.0 * minutes_running[rank]
    results.put((rank, exit_decision.checkpoint_and_decide_exit(None, None, None, 7, 0.0, start)))


@pytest.mark.parametrize(
    "minutes_running, expected",
    [
        ((0.0, 2.0), {0: 0, 1: 0}),  # only rank 1 is past the limit: both stop (exit code 0)
        ((0.0, 0.0), {0: None, 1: None}),  # neither is: both train on
    ],
)
def test_exit_duration_is_agreed_across_ranks(minutes_running, expected):
    results = mp.get_context("spawn").SimpleQueue()
    # The harness's default time limit: a spawned world's start alone took 69 s in a full-suite
    # run on the 2-core machine (a limit of 60 s failed there, the ranks still starting).
    run_distributed(_decide, 2, minutes_running, results)
    decisions = dict(results.get() for _ in range(2))
    assert decisions == expected
