"""No silent hang: a collective that does not complete within the process groups' timeout
(``--distributed-timeout-minutes``, or ``--distributed-timeout-seconds-after-init`` once set up)
ends the run with one line naming the operation, its group and the ranks that did not arrive,
after a dump of this rank's last collectives.

The watch wraps torch.distributed's collectives (the ones this code base calls) for the life of
the run: each call is appended to a small per-rank trace. gloo and NCCL raise when a peer does
not show up in time; the wrapper turns that into :class:`CollectiveTimeoutError`. Which ranks
did not arrive is found through the launcher's store: every rank whose collective timed out
posts there, and the ranks of the group that do not post within a short grace period (stopped,
killed or stuck elsewhere) are named.
"""

from __future__ import annotations

import collections
import inspect
import sys
import time
from datetime import timedelta
from typing import Deque, List, Optional

import torch.distributed as dist

# The collectives the code base issues (directly or through torch's helpers).
WATCHED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "all_to_all_single",
    "barrier",
    "reduce",
    "gather",
    "scatter",
)
TRACE_LENGTH = 16
# How long a timed-out rank waits for the other ranks of the group to report the same timeout.
GRACE_SECONDS = 5.0
_STORE_PREFIX = "collective_watch"


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time; the message names it, its group and the ranks
    that did not arrive."""


class _Watch:
    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self.trace: Deque[list] = collections.deque(maxlen=TRACE_LENGTH)
        self.count = 0
        self.originals = {}


_WATCH: Optional[_Watch] = None


def _group_ranks(group) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in text


def _wrap(name, original):
    signature = inspect.signature(original)

    def watched(*args, **kwargs):
        watch = _WATCH
        if watch is None or not dist.is_initialized():
            return original(*args, **kwargs)
        try:
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            group = None  # let the call itself report its wrong arguments
        ranks = _group_ranks(group)
        watch.count += 1
        entry = [watch.count, name, ranks, time.time(), None]
        watch.trace.append(entry)
        try:
            result = original(*args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveTimeoutError) or not _is_timeout(exc):
                raise
            raise _timed_out(watch, name, ranks) from None
        if isinstance(result, dist.Work):  # async_op=True: the wait is where it completes
            return _WatchedWork(result, watch, entry)
        entry[4] = time.time()
        return result

    watched.__wrapped__ = original
    watched.__name__ = name
    return watched


class _WatchedWork:
    """An async collective's handle whose ``wait`` is watched like a blocking call."""

    def __init__(self, work, watch: _Watch, entry: list):
        self._work, self._watch, self._entry = work, watch, entry

    def wait(self, *args, **kwargs):
        try:
            done = self._work.wait(*args, **kwargs)
        except RuntimeError as exc:
            if not _is_timeout(exc):
                raise
            _, name, ranks, _, _ = self._entry
            raise _timed_out(self._watch, name, ranks, self._entry[0]) from None
        self._entry[4] = time.time()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _missing_ranks(ranks: List[int], number: int) -> Optional[List[int]]:
    """Post this rank's timeout to the store; the ranks of the group that post nothing within
    the grace period did not arrive. None if the store cannot be reached."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_STORE_PREFIX}/{dist.get_rank()}", str(number))
        deadline = time.monotonic() + GRACE_SECONDS
        keys = {rank: f"{_STORE_PREFIX}/{rank}" for rank in ranks}
        while True:
            missing = [rank for rank, key in keys.items() if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # the store went down with the launcher: say so rather than guess
        return None


def _timed_out(
    watch: _Watch, name: str, ranks: List[int], number: Optional[int] = None
) -> CollectiveTimeoutError:
    rank = dist.get_rank()
    number = watch.count if number is None else number
    missing = _missing_ranks(ranks, watch.count)
    print(f"[rank {rank}] last {len(watch.trace)} collectives (oldest first):", file=sys.stderr)
    for number, op, group, started, finished in watch.trace:
        took = f"{finished - started:.3f} s" if finished else "did not complete"
        print(
            f"[rank {rank}]   #{number} {op} group ranks {group}: {took}",
            file=sys.stderr,
        )
    sys.stderr.flush()
    if missing is None:
        who = "the launcher's store is gone, so which ranks are missing is unknown"
    elif missing:
        who = f"ranks {missing} did not arrive"
    else:
        who = "every rank of the group reports the same timeout"
    seconds = watch.timeout.total_seconds()
    return CollectiveTimeoutError(
        f"rank {rank}: collective #{number} {name} over group ranks {ranks} did not "
        f"complete within {seconds:g} s (--distributed-timeout-minutes / "
        f"--distributed-timeout-seconds-after-init): {who}"
    )


def install(timeout: timedelta) -> None:
    """Start watching (idempotent); ``timeout`` is the groups' timeout, for the message."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.timeout = timeout
        return
    watch = _Watch(timeout)
    for name in WATCHED:
        original = getattr(dist, name, None)
        if original is not None:
            watch.originals[name] = original
            setattr(dist, name, _wrap(name, original))
    _WATCH = watch


def set_timeout(timeout: timedelta) -> None:
    """Give every existing process group ``timeout`` (Megatron's
    --distributed-timeout-seconds-after-init)."""
    set_pg_timeout = dist.distributed_c10d._set_pg_timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        set_pg_timeout(timeout, group)
    if _WATCH is not None:
        _WATCH.timeout = timeout


def uninstall() -> None:
    """Put torch.distributed's own functions back (a test may run several trainings)."""
    global _WATCH
    if _WATCH is None:
        return
    for name, original in _WATCH.originals.items():
        setattr(dist, name, original)
    _WATCH = None
