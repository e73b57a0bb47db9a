"""run_distributed, the harness of every spawned-world test: a hang ends in seconds with the
hung rank named, not in gloo's 30-minute timeout; a rank that leaves early through sys.exit(0)
(as pretrain does on --exit-interval) fails the test instead of passing it unseen."""

import sys
import time

import pytest

from tests.unit_tests.dist_utils import run_distributed


def _rank_1_never_returns(rank, world_size):
    if rank == 1:
        time.sleep(3600)


def test_a_hung_rank_is_named_and_killed():
    start = time.monotonic()
    # Rank 0 is named too if a loaded machine kept it from even starting within the limit.
    with pytest.raises(AssertionError, match=r"rank\(s\) \[(0, )?1\] had not finished after 5 s"):
        run_distributed(_rank_1_never_returns, 2, timeout_s=5)
    assert time.monotonic() - start < 30


def _rank_1_exits_cleanly(rank, world_size):
    if rank == 1:
        sys.exit(0)


def test_a_rank_that_exits_early_is_named():
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] exited without finishing"):
        run_distributed(_rank_1_exits_cleanly, 2)
