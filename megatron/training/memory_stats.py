"""The memory scalars of ``--log-memory-to-tensorboard`` under Megatron's tag names.

On a GPU they are the CUDA caching allocator's statistics, which Megatron writes under these
tags too. A CPU has no such
allocator statistics, so what can be measured is written instead: the process's resident set
size as ``mem-reserved-bytes`` and ``mem-allocated-bytes`` and its peak as
``mem-max-allocated-bytes``; ``mem-allocated-count`` (live allocations) is not measured there.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Dict

import torch

CPU_NOTE = (
    "--log-memory-to-tensorboard on CPU: mem-reserved-bytes and mem-allocated-bytes are the "
    "process's resident set size, mem-max-allocated-bytes its peak; mem-allocated-count is not "
    "measured"
)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak is the best we have
        return _peak_resident_bytes()


def _peak_resident_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def memory_scalars(device: torch.device) -> Dict[str, float]:
    """Tag -> value for this process on `device`."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"],
        }
    resident = _resident_bytes()
    return {
        "mem-reserved-bytes": resident,
        "mem-allocated-bytes": resident,
        "mem-max-allocated-bytes": max(_peak_resident_bytes(), resident),
    }
