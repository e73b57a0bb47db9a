"""No silent hang on gloo: a collective that does not complete within the process groups'
timeout (``--distributed-timeout-minutes``, or ``--distributed-timeout-seconds-after-init`` once
set up) ends the run with one line naming the operation, its group and the ranks that did not
arrive, after a dump of this rank's last collectives.

The watch is opt-in: ``pretrain`` asks for it (``initialize_megatron(watch_collectives=True)``);
tools and library callers of ``initialize_megatron`` leave torch.distributed as it is. It is
installed on gloo runs only. gloo's collectives block until they complete or time out, so
Python sees both; NCCL's return once queued on a CUDA stream, so timing them here would
measure nothing: NCCL runs rely on PyTorch's watchdog and flight recorder instead
(nccl_flight_recorder.py). ``set_timeout`` serves both backends.

The watch wraps torch.distributed's collectives (the ones this code base calls) and its
point-to-point operations (``batch_isend_irecv``, as the pipeline schedules and context-parallel
ring use it, and blocking ``send``/``recv``) for the life of the run: each call is appended to a
small per-rank trace. A point-to-point operation is reported with its peer; the ranks that
must arrive are this rank and the peer. gloo raises when a peer does not show up in time; the
wrapper turns that into :class:`CollectiveTimeoutError`. Which ranks
did not arrive is found through the launcher's store: every rank whose collective timed out
posts there, and the ranks of the group that do not post within a short grace period (stopped,
killed or stuck elsewhere) are named.

Why it replaces torch.distributed's functions rather than wrapping the process groups (a
"watched gloo" registered with ``torch.distributed.Backend.register_backend``, tried on torch
2.13):

* Python may subclass ``ProcessGroup`` but not ``Backend`` (its binding has no constructor), so
  such a backend must return a whole ProcessGroup of its own. That group registers no device
  backend: ``_get_backend(device)`` fails, ``monitored_barrier`` refuses it,
  ``dist.get_backend()`` reports the plugin's name instead of ``gloo``, and
  ``distributed_c10d._set_pg_timeout`` silently does nothing, so
  ``--distributed-timeout-seconds-after-init`` would no longer apply (measured: a 3 s timeout
  set after start-up still timed out after the 20 s given at start-up).
* The methods torch calls on a group depend on its version: 2.13's ``all_gather_into_tensor``,
  ``reduce_scatter_tensor`` and ``all_to_all_single`` call ``all_gather_single``,
  ``reduce_scatter_single`` and ``all_to_all_single``; earlier releases (read in their source)
  call the private ``_allgather_base``, ``_reduce_scatter_base`` and ``alltoall_base``. A
  wrapper for 2.11 and 2.13 would follow torch's internal dispatch names, private ones included.
* A group sees less than the caller: ``send`` and ``isend`` both arrive as ``send``, and
  ``broadcast_object_list`` / ``all_gather_object`` as two ``broadcast`` / ``all_gather`` calls,
  so the error line and the trace would name other operations than the caller's.
* A group's backend is fixed when it is made: the watch could not be installed on a group that
  exists already (as tests do), and torch marks third-party backends experimental.
"""

from __future__ import annotations

import collections
import inspect
import sys
import time
from datetime import timedelta
from typing import Deque, List, Optional, Tuple

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
# Point-to-point operations: the peer is the only other rank that has to arrive.
WATCHED_P2P = ("send", "recv")
# Labels of point-to-point operations start with one of these ("irecv from rank 1").
P2P_NAMES = ("send", "recv", "isend", "irecv")
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


def _peer_rank(group, peer: Optional[int], group_peer: Optional[int]) -> Optional[int]:
    """The peer's global rank, given as one (``peer``) or as its rank in ``group``."""
    if peer is not None or group_peer is None:
        return peer
    return group_peer if group is None else dist.get_global_rank(group, group_peer)


def _p2p_label(name: str, peer: Optional[int]) -> Tuple[str, List[int]]:
    """(label, ranks that must arrive) of a point-to-point operation."""
    direction = "to" if "send" in name else "from"
    me = dist.get_rank()
    return f"{name} {direction} rank {peer}", sorted({me, peer} - {None})


def _describe(name, signature, args, kwargs) -> Tuple[str, List[int]]:
    """(label for the trace and the message, ranks that must arrive) of one call."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {}  # let the call itself report its wrong arguments
    if name not in WATCHED_P2P:
        return name, _group_ranks(bound.get("group"))
    end = "dst" if name == "send" else "src"
    peer = _peer_rank(bound.get("group"), bound.get(end), bound.get(f"group_{end}"))
    return _p2p_label(name, peer)


def _wrap(name, original):
    signature = inspect.signature(original)

    def watched(*args, **kwargs):
        watch = _WATCH
        if watch is None or not dist.is_initialized():
            return original(*args, **kwargs)
        label, ranks = _describe(name, signature, args, kwargs)
        watch.count += 1
        entry = [watch.count, label, ranks, time.time(), None]
        watch.trace.append(entry)
        try:
            result = original(*args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveTimeoutError) or not _is_timeout(exc):
                raise
            raise _timed_out(watch, label, ranks) from None
        if isinstance(result, dist.Work):  # async_op=True: the wait is where it completes
            return _WatchedWork(result, watch, entry)
        entry[4] = time.time()
        return result

    watched.__wrapped__ = original
    watched.__name__ = name
    return watched


def _wrap_batch_isend_irecv(original):
    """Each operation of the batch gets its own trace entry and a watched handle: a receive
    whose peer never sends ends, at its ``wait``, like a collective nobody joined."""

    def watched(p2p_op_list):
        watch = _WATCH
        if watch is None or not dist.is_initialized():
            return original(p2p_op_list)
        works = original(p2p_op_list)
        handles = []
        for op, work in zip(p2p_op_list, works):
            name = getattr(op.op, "__name__", str(op.op))
            peer = _peer_rank(op.group, op.peer, getattr(op, "group_peer", None))
            label, ranks = _p2p_label(name, peer)
            watch.count += 1
            entry = [watch.count, label, ranks, time.time(), None]
            watch.trace.append(entry)
            cpu = op.tensor.device.type == "cpu"
            handles.append(_WatchedWork(work, watch, entry, cpu_p2p=cpu))
        return handles

    watched.__wrapped__ = original
    watched.__name__ = "batch_isend_irecv"
    return watched


class _WatchedWork:
    """An async collective's handle whose ``wait`` is watched like a blocking call."""

    def __init__(self, work, watch: _Watch, entry: list, cpu_p2p: bool = False):
        self._work, self._watch, self._entry = work, watch, entry
        self._cpu_p2p = cpu_p2p

    def wait(self, *args, **kwargs):
        if self._cpu_p2p and not args and not kwargs:
            # gloo's send/recv wait for the timeout their group had when it was made, not the
            # one --distributed-timeout-seconds-after-init set later: pass the current one.
            # (Not on GPUs: there a timeout would make NCCL's wait block the CPU thread.)
            kwargs["timeout"] = self._watch.timeout
        try:
            done = self._work.wait(*args, **kwargs)
        except RuntimeError as exc:
            if not _is_timeout(exc):
                raise
            _, name, ranks, _, _ = self._entry
            raise _timed_out(self._watch, name, ranks, self._entry[0]) from None
        self._entry[4] = time.time()
        return done

    def is_completed(self) -> bool:
        completed = self._work.is_completed()
        if completed and self._entry[4] is None:  # a send nobody waits on: done by now
            self._entry[4] = time.time()
        return completed

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
    for traced, op, group, started, finished in watch.trace:
        took = f"{finished - started:.3f} s" if finished else "did not complete"
        print(
            f"[rank {rank}]   #{traced} {op} group ranks {group}: {took}",
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
    what = "operation" if name.split()[0] in P2P_NAMES else "collective"
    return CollectiveTimeoutError(
        f"rank {rank}: {what} #{number} {name} over group ranks {ranks} did not "
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
    for name in WATCHED + WATCHED_P2P:
        original = getattr(dist, name, None)
        if original is not None:
            watch.originals[name] = original
            setattr(dist, name, _wrap(name, original))
    watch.originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _wrap_batch_isend_irecv(dist.batch_isend_irecv)
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
