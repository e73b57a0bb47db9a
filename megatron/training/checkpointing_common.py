"""What the trainer's two checkpoint formats share beyond the format layer: the RNG states of
the ``torch`` format and the log lines of a save and a load.

The format layer (names, tracker, format detection, saved args, retention, failed writes) is the
package :mod:`megatron.checkpointing`, shared with the offline converters. ``checkpointing.py``
(the ``torch`` format and the entry points) and ``checkpointing_dist.py`` (the ``torch_dist``
format) import from both and never from each other's internals.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.device import computes_on_cuda

from .utils import print_rank_0


# ------------------------------------------------------------------------------ RNG states
def rng_state(tracker) -> dict:
    """This process's Python, numpy, torch (CPU and CUDA) and model-parallel RNG states, with
    numpy's state as tensors and plain values (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),  # host: a checkpoint entry
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if computes_on_cuda() else None,
        "rng_tracker_states": tracker.get_states() if tracker is not None else {},
    }


def set_rng_state(state: dict, tracker) -> None:
    """Restore what :func:`rng_state` saved."""
    random.setstate(_as_random_state(state["random_rng_state"]))
    np_state = state["np_rng_state"]
    if isinstance(np_state, dict):
        np.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype(np.uint32),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )
    else:
        np.random.set_state(np_state)
    torch.set_rng_state(state["torch_rng_state"])
    if computes_on_cuda() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if tracker is not None and state.get("rng_tracker_states"):
        tracker.set_states(state["rng_tracker_states"])


def _as_random_state(value):
    # torch.load turns the inner tuple of random.getstate() into a list; random wants tuples.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


# ------------------------------------------------------------------------------ misc
def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _layout_suffix(state) -> str:
    return "[ t {}/{}, p {}/{} ]".format(
        state.get_tensor_model_parallel_rank() + 1,
        state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_rank() + 1,
        state.get_pipeline_model_parallel_world_size(),
    )


def print_saved_checkpoint(iteration: int, save_dir: str, state) -> None:
    """Megatron's line once a checkpoint is complete (rank 0)."""
    print_rank_0(
        "  successfully saved checkpoint from iteration {:7d} to {} {}".format(
            iteration, save_dir, _layout_suffix(state)
        )
    )


def print_loaded_checkpoint(load_dir: str, iteration: int, state) -> None:
    """Megatron's line once a checkpoint is loaded (rank 0)."""
    print_rank_0(
        "  successfully loaded checkpoint from {} {} at iteration {}".format(
            load_dir, _layout_suffix(state), iteration
        )
    )
