"""Where checkpoints live on disk, and which format a directory holds.

Layout: ``<save>/latest_checkpointed_iteration.txt`` (the tracker: an iteration number or
``release``) names the checkpoint to load, ``<save>/iter_0000100`` (or ``<save>/release``). A
``torch``-format directory holds ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel
rank; a ``torch_dist`` one holds ``metadata.json``, ``common.pt`` and DCP's files.

Also here: the retention of old checkpoints (``--save-retain-interval``), what a failed write
leaves and why it failed, the start-up check of ``--save``, and the safe read of one torch-format
file.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .errors import CheckpointError, ConversionError

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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
def commit_tracker(save_dir: str, iteration: int, release: bool = False) -> None:
    """Point the tracker at ``iteration`` (or ``release``) atomically; called once the
    checkpoint is complete, so an interrupted save never looks complete."""
    tmp = tracker_path(save_dir) + ".tmp"
    with open(tmp, "w") as f:
        f.write("release" if release else str(iteration))
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


def find_iteration_dir(load_dir: str) -> Tuple[str, Optional[int], bool]:
    """(directory, iteration, release) that the tracker of ``load_dir`` names, for the offline
    tools (errors name ``--load-dir``)."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"--load-dir {load_dir} does not exist")
    if not os.path.isfile(tracker_path(load_dir)):
        raise ConversionError(
            f"{tracker_path(load_dir)} not found: --load-dir must be a checkpoint directory "
            f"written by --save (holding {TRACKER_FILENAME})"
        )
    try:
        iteration, release = read_tracker(load_dir)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    return checkpoint_dir(load_dir, iteration, release), iteration, release


# ------------------------------------------------------------------------------ formats
# Megatron-LM's fsdp_dtensor checkpoints key the model weights so (the unwrapped model is its
# Megatron-FSDP module, whose state dict prefixes "module."; the default of its converter
# tools/checkpoint/checkpoint_inspector.py, --output-model-weight-prefix).
FSDP_DTENSOR_MODEL_PREFIX = "model.module."


def is_fsdp_dtensor_checkpoint(directory: str) -> bool:
    """A bare DCP directory (``.metadata``, no metadata.json) holding Megatron-LM's fsdp_dtensor
    keys (Megatron's ``_get_checkpoint_format`` takes any bare DCP directory for fsdp_dtensor
    under Megatron-FSDP; a torch_dist save that did not finish has no ``model.`` keys)."""
    from megatron.core.dist_checkpointing import read_dcp_metadata

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return False
    try:
        keys = read_dcp_metadata(directory).state_dict_metadata
    except Exception:  # an unreadable .metadata is not this format: the caller says what it is
        return False
    return any(k.startswith(FSDP_DTENSOR_MODEL_PREFIX) for k in keys)


def detect_format(directory: str) -> Optional[str]:
    """``torch_dist`` (a complete metadata.json), ``torch`` (mp_rank_* entries),
    ``fsdp_dtensor`` (Megatron-LM's bare DCP layout of that format), or None (Megatron's
    rule)."""
    # Imported here, as below: the converter plugins that only name files load no DCP code.
    from megatron.core.dist_checkpointing import is_distributed_checkpoint

    if not os.path.isdir(directory):
        return None
    if is_distributed_checkpoint(directory):
        return "torch_dist"
    if any(name.startswith("mp_rank_0") for name in os.listdir(directory)):
        return "torch"
    if is_fsdp_dtensor_checkpoint(directory):
        return "fsdp_dtensor"
    return None


def format_to_load(args, directory: str) -> str:
    """The format to read ``directory`` in: --ckpt-format, or what the directory holds with
    --auto-detect-ckpt-format (and when converting); a clear error otherwise."""
    found = detect_format(directory)
    if found is None:
        if not os.path.isdir(directory):
            raise CheckpointError(
                f"checkpoint directory {directory} does not exist (the tracker points at a "
                "deleted checkpoint, or --ckpt-step names an iteration that was not saved)"
            )
        if os.path.isfile(os.path.join(directory, ".metadata")):
            raise CheckpointError(
                f"{directory} has no metadata.json and no fsdp_dtensor model keys: its "
                "torch_dist save did not finish"
            )
        raise CheckpointError(
            f"{directory} holds neither a torch_dist (metadata.json), a torch-format "
            "(mp_rank_*) nor an fsdp_dtensor (model.module.* keys) checkpoint"
        )
    # Megatron-LM reads neither torch_dist as fsdp_dtensor nor the reverse (its
    # checkpoint_inspector.py converts them): one line saying so, unless asked to detect.
    wanted = args.ckpt_format
    if (
        found == wanted
        or getattr(args, "auto_detect_ckpt_format", False)
        or getattr(args, "ckpt_convert_format", None) is not None
    ):
        return found
    raise CheckpointError(
        f"{directory} is a {found}-format checkpoint but --ckpt-format is {wanted}: pass "
        f"--ckpt-format {found} or --auto-detect-ckpt-format"
        + (
            f", or convert it (--ckpt-convert-format {wanted} --ckpt-convert-save DIR)"
            if "fsdp_dtensor" in (found, wanted)
            else ""
        )
    )


def load_torch_file(path: str) -> dict:
    """One torch-format checkpoint file, read with ``weights_only=True``."""
    from megatron.core.dist_checkpointing.safe_objects import megatron_state_globals

    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint file {path} does not exist (the tracker points at an incomplete "
            "or deleted checkpoint, or it was saved with another parallel layout)"
        )
    try:
        # numpy arrays (Megatron-LM's numpy RNG state), the rerun machine's records: as torch_dist
        with torch.serialization.safe_globals([argparse.Namespace, *megatron_state_globals()]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next(
            (line for line in lines if "Unpickler error" in line), lines[0] if lines else ""
        )
        raise CheckpointError(
            f"cannot read checkpoint file {path}: {type(exc).__name__}: {reason}"
        ) from None


# ------------------------------------------------------------------------------ retention
_ITER_DIR = re.compile(r"iter_(\d{7,})(\.tmp)?$")


def remove_unretained(args, save_dir: str, iteration: int) -> None:
    """``--save-retain-interval N``: after a successful save of ``iteration``, delete (on rank 0)
    the older checkpoints whose iteration is not a multiple of N; never the one just saved, nor
    the one the tracker points at, nor newer ones. Also drops unfinished ``.tmp`` saves of older
    iterations, which can never complete."""
    if _rank() != 0 or not os.path.isdir(save_dir):
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
    probe = os.path.join(save_dir, f".write_probe.{_rank()}")
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
