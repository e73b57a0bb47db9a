"""The RNG state and the rerun state machine's state in a ``torch_dist`` checkpoint, in the form
Megatron-LM gives them, so that either code base resumes the other's random streams.

RNG: one object ``rng_state`` on a (PP, TP) grid, i.e. the checkpoint entry
``rng_state/shard_<pp>.<tp>_<PP>.<TP>``, written by the rank at data-parallel (with context
parallel) rank 0 of each (pp, tp) and read back by every rank of that (pp, tp). It holds a list
of per-rank dicts with Megatron's fields:

* ``random_rng_state``: ``random.getstate()``;
* ``np_rng_state``: ``numpy.random.get_state()`` (the legacy tuple with a uint32 array);
* ``torch_rng_state``: ``torch.get_rng_state()``;
* ``cuda_rng_state``: ``torch.cuda.get_rng_state()``, only where there is a CUDA device;
* ``rng_tracker_states``: the model-parallel tracker's named states.

A run without CUDA has no CUDA generator to save, so its entries lack ``cuda_rng_state``:
Megatron-LM (which always writes the key) then stops its RNG restore with its own line
("Unable to load rng state ... Specify --no-load-rng"), the right outcome, since the CPU
generator states of such a run (the tracker's too) cannot seed CUDA generators. With None in
the key it would fail in ``torch.cuda.set_rng_state`` instead, with a traceback.

The list has one entry (data-parallel ranks share their seeds), or one per data-parallel rank
with ``--data-parallel-random-init``. The state is restored only where the checkpoint's TP and PP
sizes equal this run's, since with another layout no rank has a counterpart; Megatron-LM also
ignores the RNG state after a (TP, PP) change.

Rerun state machine: the common part (mode, state, iteration) stays in ``common.pt`` under
``rerun_state_machine``; each rank's part is the object ``rerun_state_machine_state`` on a
(world size,) grid at the rank's global rank. Both hold megatron-core's types (the ``RerunMode``
and ``RerunState`` enums, the failed validation as a ``Call`` of a ``Caller``, the injected
error types as ``RerunDiagnostic``): this code base has classes of the same module path, names
and values, so the pickles are the same both ways, and reading allows just those classes. The
machine itself keeps plain values (:func:`to_megatron_rerun_state`,
:func:`plain_rerun_common`, :func:`plain_rerun_part` convert).

Checkpoints written here before keep ``rng_state`` (a list of every rank's state with its
coordinates) and the machine's per-rank parts (``sharded``, a list by global rank) inside
``common.pt``; they still load, with the RNG restored exactly as before.
"""

from __future__ import annotations

import random
import re
from typing import Iterable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.device import computes_on_cuda

RNG_KEY = "rng_state"
RERUN_KEY = "rerun_state_machine_state"
_SHARD = re.compile(r"^(?P<key>[^/]+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")


def megatron_rng_state(tracker) -> dict:
    """This process's RNG states as one entry of Megatron-LM's ``rng_state`` list."""
    states = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if computes_on_cuda():
        states["cuda_rng_state"] = torch.cuda.get_rng_state()
    states["rng_tracker_states"] = tracker.get_states() if tracker is not None else {}
    return states


def _grid(state) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((PP, TP) sizes, (pp, tp) ranks) of this rank."""
    shape = (
        state.get_pipeline_model_parallel_world_size(),
        state.get_tensor_model_parallel_world_size(),
    )
    offset = (state.get_pipeline_model_parallel_rank(), state.get_tensor_model_parallel_rank())
    return shape, offset


def rng_sharded_object(state, tracker, data_parallel_random_init: bool) -> dc.ShardedObject:
    """The ``rng_state`` entry this rank contributes to a save (collective over the
    data-parallel group with ``data_parallel_random_init`` and DP > 1)."""
    states = [megatron_rng_state(tracker)]
    dp_size = state.get_data_parallel_world_size()
    if data_parallel_random_init and dp_size > 1 and dist.is_initialized():
        mine = states[0]
        states = [None] * dp_size
        dist.all_gather_object(states, mine, group=state.get_data_parallel_group())
    shape, offset = _grid(state)
    replica = state.get_data_parallel_rank(with_context_parallel=True) != 0
    return dc.ShardedObject(RNG_KEY, states, shape, offset, replica=replica)


def saved_grid(object_keys: Iterable[str], key: str) -> Optional[Tuple[int, ...]]:
    """The grid shape of the objects named ``key`` among a checkpoint's object keys (None when
    there are none)."""
    for name in object_keys:
        match = _SHARD.match(name)
        if match and match["key"] == key:
            return tuple(int(v) for v in match["shape"].split("."))
    return None


def rng_request(state) -> dc.ShardedObject:
    """The entry that reads this rank's (pp, tp) ``rng_state`` back (its ``data`` is the list)."""
    shape, offset = _grid(state)
    return dc.ShardedObject(RNG_KEY, None, shape, offset, read_back=True)


def choose_rng_state(saved: list, state, data_parallel_random_init: bool) -> dict:
    """This rank's entry of a loaded ``rng_state`` list (Megatron-LM's rule: the data-parallel
    rank's own with ``--data-parallel-random-init``, else the first)."""
    index = state.get_data_parallel_rank() if data_parallel_random_init else 0
    if not isinstance(saved, list) or index >= len(saved) or not isinstance(saved[index], dict):
        count = len(saved) if isinstance(saved, list) else 0
        raise ValueError(
            f"the checkpoint's rng_state holds {count} data-parallel state(s); data-parallel "
            f"rank {index} has none"
            + (" (was it saved without --data-parallel-random-init?)" if count == 1 else "")
        )
    return saved[index]


def to_megatron_rerun_state(rerun_state: dict) -> dict:
    """The machine's ``state_dict()`` (plain values) with megatron-core's types."""
    from megatron.core.rerun_state_machine import (
        Call,
        Caller,
        RerunDiagnostic,
        RerunMode,
        RerunState,
    )

    part = dict(rerun_state["sharded"])
    failed = part["failed_validation_call"]
    if failed is not None:
        part["failed_validation_call"] = Call(Caller(failed[0], int(failed[1])), int(failed[2]))
    injector = dict(part["error_injector_checkpoint"])
    for name in ("error_injection_type", "injected_error_type"):
        if injector[name] is not None:
            injector[name] = RerunDiagnostic(injector[name])
    part["error_injector_checkpoint"] = injector
    return {
        **rerun_state,
        "mode": RerunMode(rerun_state["mode"]),
        "state": RerunState(rerun_state["state"]),
        "sharded": part,
    }


def plain_rerun_common(saved: Optional[dict]) -> Optional[dict]:
    """A checkpoint's ``rerun_state_machine`` entry with plain mode and state values (it holds
    enums when written by megatron-core or by this code base's writer, plain values in files of
    this code base's earlier releases, which must still load)."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState

    if not isinstance(saved, dict) or "state" not in saved:
        return saved
    plain = dict(saved, state=RerunState(saved["state"]).value)
    if "mode" in saved:
        plain["mode"] = RerunMode(saved["mode"]).value
    return plain


def plain_rerun_part(part: dict) -> dict:
    """A rank's part of the machine's state with plain values, as the machine loads it."""
    from megatron.core.rerun_state_machine import Call

    plain = dict(part)
    failed = plain.get("failed_validation_call")
    if isinstance(failed, Call):
        plain["failed_validation_call"] = [
            failed.caller.message,
            failed.caller.rank,
            failed.sequence,
        ]
    injector = dict(plain.get("error_injector_checkpoint") or {})
    for name in ("error_injection_type", "injected_error_type"):
        if hasattr(injector.get(name), "value"):
            injector[name] = injector[name].value
    plain["error_injector_checkpoint"] = injector
    return plain


def check_tracker_states(saved: dict, tracker) -> None:
    """Refuse tracker states this run's generators cannot take: a CUDA generator's (Megatron-LM
    on a GPU) in a run without CUDA, or the other way round, would fail only at the first
    dropout."""
    if tracker is None:
        return
    current = tracker.get_states()
    for name, state in (saved or {}).items():
        if name in current and state.numel() != current[name].numel():
            raise ValueError(
                f"rng_tracker_states[{name!r}] is a generator state of {state.numel()} bytes; "
                f"this run's {tracker.device.type} generator takes {current[name].numel()} "
                "(saved on another kind of device?)"
            )


def rerun_entries(rerun_state: dict, rank: int, world_size: int) -> Tuple[dict, dc.ShardedObject]:
    """Split the machine's state into its common part and this rank's object, in
    megatron-core's types."""
    megatron_state = to_megatron_rerun_state(rerun_state)
    common = {k: v for k, v in megatron_state.items() if k != "sharded"}
    obj = dc.ShardedObject(RERUN_KEY, megatron_state["sharded"], (world_size,), (rank,))
    return common, obj


def rerun_request(rank: int, world_size: int) -> dc.ShardedObject:
    """The entry that reads this rank's part of the machine's state back."""
    return dc.ShardedObject(RERUN_KEY, None, (world_size,), (rank,), read_back=True)
