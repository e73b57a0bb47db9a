"""What both checkpoint formats share: directory and file names, the tracker file, the saved
``args`` and RNG states, the retention of old checkpoints and the log lines.

``checkpointing.py`` (the ``torch`` format and the entry points) and ``checkpointing_dist.py``
(the ``torch_dist`` format) both import from here and never from each other's internals.

Layout: ``<save>/latest_checkpointed_iteration.txt`` (the tracker: an iteration number or
``release``) names the checkpoint to load, ``<save>/iter_0000100`` (or ``<save>/release``).
"""

from __future__ import annotations

import argparse
import enum
import errno
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.device import computes_on_cuda

from .utils import get_rank, print_rank_0

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
_PLAIN = (int, float, str, bool, type(None))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


# ------------------------------------------------------------------------------ names
def tracker_path(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def checkpoint_dir(checkpoints_path: str, iteration, release: bool = False) -> str:
    return os.path.join(checkpoints_path, "release" if release else "iter_{:07d}".format(iteration))


def checkpoint_name(
    checkpoints_path: str,
    iteration,
    release: bool = False,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> str:
    """``.../iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` as Megatron names it."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp_size > 1:
        name += f"_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return os.path.join(
        checkpoint_dir(checkpoints_path, iteration, release), name, "model_optim_rng.pt"
    )


# ------------------------------------------------------------------------------ tracker
def commit_tracker(save_dir: str, iteration: int) -> None:
    """Point the tracker at ``iteration`` atomically; rank 0 calls it once the checkpoint is
    complete."""
    tmp = tracker_path(save_dir) + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker_path(save_dir))


def read_tracker(load_dir: str):
    """(iteration, release) from the tracker; raises CheckpointError on a corrupt tracker."""
    path = tracker_path(load_dir)
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(
            f"{path} holds '{text[:40]}', expected an iteration number or 'release'"
        ) from None
    if iteration < 0:
        raise CheckpointError(f"{path} holds a negative iteration ({iteration})")
    return iteration, False


_ITER_DIR = re.compile(r"iter_(\d{7,})(\.tmp)?$")


def remove_unretained(args, save_dir: str, iteration: int) -> None:
    """``--save-retain-interval N``: after a successful save of ``iteration``, delete (on rank 0)
    the older checkpoints whose iteration is not a multiple of N; never the one just saved, nor
    the one the tracker points at, nor newer ones. Also drops unfinished ``.tmp`` saves of older
    iterations, which can never complete."""
    if get_rank() != 0 or not os.path.isdir(save_dir):
        return
    interval = getattr(args, "save_retain_interval", None)
    try:
        tracked = read_tracker(save_dir)[0] if os.path.isfile(tracker_path(save_dir)) else None
    except (CheckpointError, OSError):
        tracked = None
    for name in sorted(os.listdir(save_dir)):
        match = _ITER_DIR.match(name)
        if not match:
            continue
        it = int(match.group(1))
        if it >= iteration or it == tracked:
            continue
        unfinished = match.group(2) is not None
        if unfinished or (interval and it % interval != 0):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            if not unfinished:
                print(
                    f"  removed checkpoint {os.path.join(save_dir, name)} "
                    f"(--save-retain-interval {interval})",
                    flush=True,
                )


# ------------------------------------------------------------------------------ failed writes
def why_write_failed(exc: BaseException, path: str) -> str:
    """A failed checkpoint write in plain words. torch's zip writer reports a short write (a full
    disk, a file-size limit) only as "unexpected pos N vs M"."""
    errno_ = getattr(exc, "errno", None)
    if errno_ == errno.ENOSPC or "unexpected pos" in str(exc) or "No space left" in str(exc):
        try:
            free = shutil.disk_usage(os.path.dirname(path) or ".").free
            room = f" ({free / 2**20:.1f} MiB free there)"
        except OSError:
            room = ""
        return f"the disk is full or a file-size limit was reached{room}"
    if errno_ == errno.EFBIG or "File too large" in str(exc):
        return "a file-size limit was reached (ulimit -f)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split())[:300]


def check_save_dir_writable(save_dir: str) -> None:
    """Find a --save directory that cannot be written at start-up, not at the first save after
    the compute is spent: create it and a probe file in it."""
    probe = os.path.join(save_dir, f".write_probe.{get_rank()}")
    try:
        os.makedirs(save_dir, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"\0")
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"--save {save_dir} is not writable: {exc.strerror or exc}") from None


def remove_partial(path: str) -> None:
    """Delete what a failed save left (a ``.tmp`` file or directory): it holds disk space and
    is never loaded."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


# ------------------------------------------------------------------------------ saved args
def _plain(value):
    if type(value) in _PLAIN or isinstance(value, torch.dtype):
        return value, True
    if isinstance(value, enum.IntEnum):  # e.g. signal.Signals: store the number
        return _plain(value.value)
    if isinstance(value, enum.Enum):  # e.g. AttnBackend: store the name the flag takes
        return value.name, True
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if all(ok for _, ok in items):
            return type(value)(v for v, _ in items), True
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items() if isinstance(k, str)}
        if all(ok for _, ok in items.values()):
            return {k: v for k, (v, _) in items.items()}, True
    return None, False


def checkpoint_args(args) -> argparse.Namespace:
    """A copy of ``args`` with only plain values, so it loads under ``weights_only=True``."""
    saved = argparse.Namespace()
    for key, value in vars(args).items():
        plain, ok = _plain(value)
        if ok:
            setattr(saved, key, plain)
    return saved


def check_model_args(ckpt_args, args, model_arg_names, path: str) -> None:
    """Refuse a checkpoint whose model flags differ from this run's: a model with other heads or
    groups can have the very same tensor shapes, so loading it would train another model."""
    if ckpt_args is None:
        return
    for name in model_arg_names:
        ours, theirs = getattr(args, name, None), getattr(ckpt_args, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise CheckpointError(
                f"checkpoint {path} was saved with --{name.replace('_', '-')} {theirs}, "
                f"but this run uses {ours}"
            )


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
