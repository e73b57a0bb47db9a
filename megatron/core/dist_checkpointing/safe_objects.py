"""Reading the objects of a checkpoint safely: ``torch.load(weights_only=True)`` with only the
classes Megatron-LM's state holds allowed. Apart from :mod:`.planner` because the ``torch``
checkpoint format reads with them too and should not load torch.distributed.checkpoint."""

from __future__ import annotations

import io

import torch


def _numpy_globals() -> list:
    """The numpy classes an array's pickle names. Under both module names of ``_reconstruct``:
    numpy 2 moved ``numpy.core`` to ``numpy._core``, and files written with numpy 1 name the
    old one."""
    import numpy as np

    try:
        reconstruct = np._core.multiarray._reconstruct
    except AttributeError:  # numpy 1
        reconstruct = np.core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        *(getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")),
    ]


def megatron_state_globals() -> list:
    """The classes, besides tensors and plain values, that Megatron-LM's checkpoint state holds
    and that reading may construct: numpy arrays (the RNG state) and the rerun state machine's
    enums and call records (megatron-core's, under the same module path and names here)."""
    from megatron.core.rerun_state_machine import (
        Call,
        Caller,
        RerunDiagnostic,
        RerunMode,
        RerunState,
    )

    return _numpy_globals() + [RerunMode, RerunState, RerunDiagnostic, Call, Caller]


def load_object(buffer: io.BytesIO, key: str, in_list: bool = True):
    """The object saved under ``key`` (megatron-core stores a one-element list per key;
    ``in_list`` False: the value itself, as DCP's own planners store it), read with
    ``weights_only=True``: tensors, plain values, argparse.Namespace (the saved args) and
    :func:`megatron_state_globals` only."""
    import argparse

    try:
        with torch.serialization.safe_globals([argparse.Namespace, *megatron_state_globals()]):
            saved = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refusals and damaged bytes raise several types
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # torch's refusal is a paragraph; its one informative line names the global.
        reason = next((line for line in lines if "Unsupported global" in line), None)
        reason = reason or (lines[0] if lines else type(exc).__name__)
        raise ValueError(f"{key}: cannot read the object safely ({reason})") from None
    if not in_list:
        return saved
    if not isinstance(saved, list) or len(saved) != 1:
        raise ValueError(f"{key}: expected a list of one object, got {type(saved).__name__}")
    return saved[0]
