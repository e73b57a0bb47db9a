"""glibc allocator settings for training on the CPU.

By default glibc serves every allocation above a (dynamic, at most 32 MiB) threshold with a fresh
``mmap`` and returns it to the kernel on ``free``. A training step allocates and frees the same
large activation and gradient tensors every step, so each one is zero-filled by the kernel, page
by page, on first touch, every step (tens of thousands of minor page faults per step for a small
GPT). Raising the mmap threshold and the trim threshold keeps those blocks in the process heap,
where the next step reuses them (after the first few steps: glibc places 64-byte-aligned
blocks such that the heap grows for a few rounds before it settles). The price is that the heap
keeps its high-water mark: memory freed by training is not handed back to the system until the
process ends.

``MEGATRON_CPU_MALLOPT=0`` in the environment turns this off. Nothing happens on a GPU device or
where glibc's ``mallopt`` is not available (macOS, musl, Windows).
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

ENV_VAR = "MEGATRON_CPU_MALLOPT"

# <malloc.h>: mallopt parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to 1 GiB come from the heap; mallopt takes a C int, so the trim threshold is the
# largest int (2 GiB - 1): the heap is practically never trimmed.
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1


def _libc_mallopt():
    """glibc's mallopt, or None where this is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded into this process
        # musl has no gnu_get_libc_version; its mallopt is a no-op stub.
        libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def configure_cpu_allocator(device=None) -> bool:
    """Keep large CPU tensors in glibc's heap (see the module docstring).

    ``device``: the device this process trains on (a torch.device or string); only "cpu" does
    anything. Returns True when both settings were applied, False when skipped (GPU device,
    ``MEGATRON_CPU_MALLOPT=0``, no glibc, or glibc refused a value). Never raises.
    """
    if device is not None and torch.device(device).type != "cpu":
        return False
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    mallopt = _libc_mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and ok
    return ok
