"""Save and load sharded state dicts as Megatron's ``torch_dist`` checkpoint directory.

A directory holds PyTorch DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files (the tensors,
as chunks of the global tensors), ``common.pt`` (the non-tensor state, read back with
``torch.load(weights_only=True)``) and ``metadata.json`` = ``{"sharded_backend": "torch_dist",
"sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}`` (as
megatron-core writes it). ``metadata.json`` is written last, by the caller, once every
rank has finished: a directory without it is an incomplete save and is never loaded.

Loading checks before reading a tensor: the directory is complete, every data file that the
metadata names exists and is long enough, and the requested keys and shapes fit the checkpoint
(missing / unexpected keys handled per :class:`StrictHandling`). ``.metadata`` is read with an
unpickler that only accepts DCP's metadata classes, so no file in a checkpoint can run code.
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from .mapping import PlainObject, ShardedObject, ShardedTensor
from .planner import ShardedLoadPlanner, ShardedSavePlanner, ShardingError
from .safe_objects import megatron_state_globals

SHARDED_BACKEND = "torch_dist"
SHARDED_BACKEND_VERSION = 1
COMMON_BACKEND = "torch"
COMMON_BACKEND_VERSION = 1
METADATA_FILE = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA_FILE = ".metadata"
_MAX_LISTED = 5


class CheckpointingError(ValueError):
    """A distributed checkpoint that cannot be written or read; the message names the file or
    keys."""


class StrictHandling(enum.Enum):
    """What to do with keys the model asks for that the checkpoint lacks (missing) and keys the
    checkpoint holds that no rank asks for (unexpected). Megatron's ``--dist-ckpt-strictness``."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    """Unexpected keys are not looked for; missing keys are an error."""
    LOG_UNEXPECTED = "log_unexpected"
    """Unexpected keys are reported; missing keys are an error."""
    LOG_ALL = "log_all"
    """Both are reported; missing entries keep their current values."""
    RAISE_UNEXPECTED = "raise_unexpected"
    """Unexpected keys are an error; so are missing keys."""
    RAISE_ALL = "raise_all"
    """Any mismatch is an error."""
    RETURN_UNEXPECTED = "return_unexpected"
    """Unexpected keys are returned to the caller; missing keys are an error."""
    RETURN_ALL = "return_all"
    """Both are returned to the caller; missing entries keep their current values."""
    IGNORE_ALL = "ignore_all"
    """Both are ignored silently; missing entries keep their current values."""

    @property
    def tolerates_missing(self) -> bool:
        return self in (
            StrictHandling.LOG_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.IGNORE_ALL,
        )

    @property
    def checks_unexpected(self) -> bool:
        return self not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL)

    @property
    def raises_unexpected(self) -> bool:
        return self in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)


@dataclass
class LoadResult:
    """Key mismatches that the strictness let through (sorted)."""

    missing: List[str] = field(default_factory=list)
    """Requested by some rank, absent from the checkpoint (those entries were not loaded)."""
    unexpected: List[str] = field(default_factory=list)
    """In the checkpoint, requested by no rank (empty unless the strictness looks for them)."""


# ---------------------------------------------------------------------------------- small files
def write_metadata_json(directory: str) -> None:
    """Mark ``directory`` as a complete torch_dist checkpoint (atomic write)."""
    path = os.path.join(directory, METADATA_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "sharded_backend": SHARDED_BACKEND,
                "sharded_backend_version": SHARDED_BACKEND_VERSION,
                "common_backend": COMMON_BACKEND,
                "common_backend_version": COMMON_BACKEND_VERSION,
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metadata_json(directory: str) -> Optional[dict]:
    """The parsed metadata.json, or None when there is none; raises on a corrupt one."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointingError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointingError(f"{path} does not hold a JSON object")
    return value


def is_distributed_checkpoint(directory: str) -> bool:
    """True when ``directory`` holds a (complete) torch_dist checkpoint."""
    try:
        value = read_metadata_json(directory)
    except CheckpointingError:
        return False
    return value is not None and value.get("sharded_backend") == SHARDED_BACKEND


def save_common(state: dict, directory: str) -> None:
    """Write the non-tensor state (call on one rank); atomic."""
    path = os.path.join(directory, COMMON_FILE)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_common(directory: str, safe_globals: Sequence = ()) -> dict:
    """Read common.pt with ``weights_only=True`` (plus the allow-listed ``safe_globals`` and
    the classes of Megatron-LM's state, :func:`.safe_objects.megatron_state_globals`)."""
    path = os.path.join(directory, COMMON_FILE)
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"{path} is missing: {directory} is not a complete torch_dist checkpoint"
        )
    try:
        with torch.serialization.safe_globals(list(safe_globals) + megatron_state_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise CheckpointingError(
            f"cannot read {path}: {type(exc).__name__}: {lines[0] if lines else ''}"
        ) from None


# ---------------------------------------------------------------------------------- DCP metadata
_ALLOWED_GLOBALS = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        # megatron-core's .metadata also pickles the save plans (plain dataclasses and an enum).
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"global '{module}.{name}' is not allowed in checkpoint metadata"
        )


def read_dcp_metadata(directory: str) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read without running code from the file."""
    path = os.path.join(directory, DCP_METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointingError(
            f"{path} is missing: {directory} is not a complete torch_dist checkpoint"
        )
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as exc:
        raise CheckpointingError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointingError(f"{path} does not hold DCP metadata")
    return metadata


class _SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(str(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def tensor_shapes(metadata: Metadata) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor in the checkpoint."""
    return {
        k: (tuple(v.size), v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }


def check_storage_files(directory: str, metadata: Metadata) -> List[str]:
    """Problems with the data files that ``metadata`` refers to (missing or too short)."""
    needed: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[path] = max(needed.get(path, 0), end)
    problems = []
    for name in sorted(needed):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) < needed[name]:
            problems.append(
                f"{path} is truncated ({os.path.getsize(path)} bytes, "
                f"expected at least {needed[name]})"
            )
    return problems


# ---------------------------------------------------------------------------------- collectives
def _use_dist(process_group) -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather_object(obj, process_group) -> list:
    if not _use_dist(process_group):
        return [obj]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, obj, group=process_group)
    return out


def _broadcast_from_first(obj, process_group):
    if not _use_dist(process_group):
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box,
        src=dist.get_global_rank(process_group, 0) if process_group is not None else 0,
        group=process_group,
    )
    return box[0]


def _is_first(process_group) -> bool:
    return not _use_dist(process_group) or dist.get_rank(process_group) == 0


def _listed(items: Sequence[str]) -> str:
    items = list(items)
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def _dcp_failure(exc: CheckpointException, directory: str) -> CheckpointingError:
    failures = getattr(exc, "failures", {}) or {}
    reasons = []
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        reasons.append(
            f"rank {rank}: {type(inner).__name__}: "
            f"{str(inner).splitlines()[0] if str(inner) else ''}"
        )
    return CheckpointingError(
        f"checkpoint {directory}: " + ("; ".join(reasons[:_MAX_LISTED]) or str(exc))
    )


# ---------------------------------------------------------------------------------- save / load
def save_shards(
    sharded_state_dict: Dict[str, Union[ShardedTensor, ShardedObject]],
    directory: str,
    process_group=None,
    thread_count: int = 1,
) -> None:
    """Write every non-replica chunk of ``sharded_state_dict`` (a collective over ``process_group``,
    default the world) into ``directory`` as DCP files. Does not write metadata.json."""
    os.makedirs(directory, exist_ok=True)
    writer = FileSystemWriter(
        directory,
        single_file_per_rank=True,
        sync_files=True,
        thread_count=thread_count,
        overwrite=True,
    )
    no_dist = not _use_dist(process_group)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                sharded_state_dict,
                storage_writer=writer,
                planner=ShardedSavePlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        for failure in (getattr(exc, "failures", {}) or {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, ShardingError):
                raise CheckpointingError(str(inner)) from None
        raise _dcp_failure(exc, directory) from None
    except ShardingError as exc:
        raise CheckpointingError(str(exc)) from None


def check_complete(directory: str) -> None:
    """Raise unless ``directory`` is a finished torch_dist checkpoint (metadata.json present)."""
    if not os.path.isdir(directory):
        raise CheckpointingError(f"checkpoint directory {directory} does not exist")
    meta = read_metadata_json(directory)
    if meta is None:
        raise CheckpointingError(
            f"{directory} has no {METADATA_FILE}: the save that wrote it did not finish "
            "(or it is not a torch_dist checkpoint)"
        )
    if meta.get("sharded_backend") != SHARDED_BACKEND:
        raise CheckpointingError(
            f"{os.path.join(directory, METADATA_FILE)} names backend "
            f"{meta.get('sharded_backend')!r}; only {SHARDED_BACKEND!r} can be read"
        )


def load_shards(
    sharded_state_dict: Dict[str, Union[ShardedTensor, ShardedObject]],
    directory: str,
    process_group=None,
    strictness: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    counts_as_unexpected: Optional[Callable[[str], bool]] = None,
    bare_dcp: bool = False,
) -> LoadResult:
    """Read the chunks every rank holds from ``directory`` into the local tensors, in place (a
    collective over ``process_group``, default the world).

    Shape mismatches are always an error; missing and unexpected keys follow ``strictness``
    (``counts_as_unexpected(key)`` narrows which checkpoint keys may be unexpected, e.g. not the
    optimizer state when the optimizer is not being loaded). Every rank raises the same
    :class:`CheckpointingError`, listing the first mismatches, or none does.
    :class:`ShardedObject` entries are read into their ``data`` when marked ``read_back`` (a
    missing one counts as a missing key), and left alone otherwise (``_extra_state``); so are
    :class:`PlainObject` entries. ``bare_dcp``: ``directory`` is a plain DCP directory without
    metadata.json (Megatron-LM's fsdp_dtensor layout).
    """
    objects = {
        v.unique_key: v
        for v in sharded_state_dict.values()
        if isinstance(v, (ShardedObject, PlainObject)) and v.read_back
    }
    sharded_state_dict = {
        k: v for k, v in sharded_state_dict.items() if isinstance(v, ShardedTensor)
    }
    problem = None
    if _is_first(process_group):
        try:
            if bare_dcp:
                if not os.path.isdir(directory):
                    raise CheckpointingError(f"checkpoint directory {directory} does not exist")
            else:
                check_complete(directory)
            files = check_storage_files(directory, read_dcp_metadata(directory))
            if files:
                problem = f"checkpoint {directory} is damaged: " + "; ".join(files[:_MAX_LISTED])
        except CheckpointingError as exc:
            problem = str(exc)
    problem = _broadcast_from_first(problem, process_group)
    if problem:
        raise CheckpointingError(problem)

    dcp_metadata = read_dcp_metadata(directory)
    shapes = tensor_shapes(dcp_metadata)
    saved_objects = {
        k
        for k, v in dcp_metadata.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata)
    }
    local_keys = {v.key for v in sharded_state_dict.values()}
    optional = {v.key for v in sharded_state_dict.values() if v.optional}
    local_missing = sorted(k for k in local_keys if k not in shapes and k not in optional)
    local_missing += sorted(k for k in objects if k not in saved_objects)
    local_bad_shapes = sorted(
        {
            f"{v.key}: checkpoint {shapes[v.key][0]} vs model {tuple(v.global_shape)}"
            for v in sharded_state_dict.values()
            if v.key in shapes and tuple(shapes[v.key][0]) != tuple(v.global_shape)
        }
    )
    gathered = _all_gather_object(
        (sorted(local_keys), local_missing, local_bad_shapes), process_group
    )
    requested = set()
    missing, bad_shapes = set(), []
    for keys, miss, bad in gathered:
        requested.update(keys)
        missing.update(miss)
        bad_shapes.extend(b for b in bad if b not in bad_shapes)
    unexpected = []
    if strictness.checks_unexpected:
        unexpected = sorted(
            k
            for k in shapes
            if k not in requested and (counts_as_unexpected is None or counts_as_unexpected(k))
        )

    problems = []
    if bad_shapes:
        problems.append("shape mismatches: " + _listed(sorted(bad_shapes)))
    if missing and not strictness.tolerates_missing:
        problems.append("missing in checkpoint: " + _listed(sorted(missing)))
    if unexpected and strictness.raises_unexpected:
        problems.append("unexpected in checkpoint: " + _listed(unexpected))
    if problems:
        raise CheckpointingError(
            f"checkpoint {directory} does not fit this model ({' | '.join(problems)})"
        )

    to_read = {
        k: v for k, v in sharded_state_dict.items() if v.key not in missing and v.key in shapes
    }
    to_read.update({k: v for k, v in objects.items() if k in saved_objects})
    no_dist = not _use_dist(process_group)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                to_read,
                storage_reader=_SafeFileSystemReader(directory),
                planner=ShardedLoadPlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise _dcp_failure(exc, directory) from None
    return LoadResult(missing=sorted(missing), unexpected=unexpected)


# ---------------------------------------------------------- megatron-core's save / load
_SHARDED_STRATEGIES = (None, SHARDED_BACKEND)
_COMMON_STRATEGIES = (None, COMMON_BACKEND)


def _strategy_name(strategy, allowed, argument: str):
    name = strategy[0] if isinstance(strategy, (tuple, list)) and strategy else strategy
    if name not in allowed:
        raise ValueError(
            f"dist_checkpointing: {argument}={strategy!r} is not supported; only "
            f"{allowed[1]!r} checkpoints are written and read here"
        )


def _split(state_dict, path=()):
    """(sharded entries by path, the state dict without them): megatron-core's split of a
    (nested) sharded state dict into what the sharded backend and common.pt hold."""
    sharded, common = {}, {}
    for key, value in state_dict.items():
        if isinstance(value, (ShardedTensor, ShardedObject)):
            sharded[path + (key,)] = value
        elif isinstance(value, dict):
            inner_sharded, inner_common = _split(value, path + (key,))
            sharded.update(inner_sharded)
            if inner_common or not inner_sharded:
                common[key] = inner_common
        else:
            common[key] = value
    return sharded, common


def _by_entry_name(sharded: dict) -> dict:
    """The entries keyed by their checkpoint names (a tensor tied under two model keys is one
    entry)."""
    out = {}
    for path, entry in sharded.items():
        previous = out.setdefault(entry.name, entry)
        if previous is not entry and not (
            isinstance(entry, ShardedTensor) and previous.data.data_ptr() == entry.data.data_ptr()
        ):
            raise CheckpointingError(
                f"two entries of this rank ({'.'.join(map(str, path))}, ...) use the checkpoint "
                f"name {entry.name}"
            )
    return out


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(
    sharded_state_dict: Dict[str, object],
    checkpoint_dir: str,
    sharded_strategy=None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable] = None,
    content_metadata: Optional[dict] = None,
) -> None:
    """megatron-core 0.16's ``dist_checkpointing.save`` (a collective over the world): the
    ShardedTensors / ShardedObjects of ``sharded_state_dict`` (nested dicts allowed) go to the
    DCP files, everything else to ``common.pt`` (written by rank 0), then ``metadata.json``.

    Only the ``torch_dist`` / ``torch`` backends exist here; the coverage of every global tensor
    is always checked (``validate_access_integrity`` changes nothing), and
    ``preprocess_common_before_consistancy_check`` only concerns a cross-rank check of the
    common state that is not made here. Asynchronous saving and ``content_metadata`` are refused.
    """
    del validate_access_integrity, preprocess_common_before_consistancy_check
    _strategy_name(sharded_strategy, _SHARDED_STRATEGIES, "sharded_strategy")
    _strategy_name(common_strategy, _COMMON_STRATEGIES, "common_strategy")
    if async_sharded_save:
        raise ValueError("dist_checkpointing.save: async_sharded_save=True is not supported")
    if content_metadata is not None:
        raise ValueError("dist_checkpointing.save: content_metadata is not supported")
    directory = str(checkpoint_dir)
    sharded, common = _split(sharded_state_dict)
    save_shards(_by_entry_name(sharded), directory)
    if _is_first(None):
        save_common(common, directory)
    _barrier()  # every rank's files are written before the directory is marked complete
    if _is_first(None):
        write_metadata_json(directory)
    _barrier()  # and no rank reads it before that


def _merge(into: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        into = into.setdefault(key, {})
    into[path[-1]] = value


def load(
    sharded_state_dict: Dict[str, object],
    checkpoint_dir: str,
    sharded_strategy=None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
):
    """megatron-core 0.16's ``dist_checkpointing.load`` (a collective over the world): the
    checkpoint's ``common.pt`` with, at the places of ``sharded_state_dict``'s ShardedTensors,
    the loaded tensors (in the shape the model holds them, so that ``model.load_state_dict``
    takes the result of ``model.sharded_state_dict()``) and the objects read back (RNG state).
    Objects the model never reads back (the layers' ``_extra_state``) and the second keys of
    aliased tensors (``optional`` entries) are left out.

    The tensors are loaded in place into the entries' ``data`` (the model's parameters, for a
    model's sharded state dict). With ``strict`` = ``return_unexpected`` / ``return_all`` the
    result is ``(state dict, missing keys, unexpected keys)``, as in megatron-core.
    """
    del validate_access_integrity
    _strategy_name(sharded_strategy, _SHARDED_STRATEGIES, "sharded_strategy")
    _strategy_name(common_strategy, _COMMON_STRATEGIES, "common_strategy")
    strict = StrictHandling(strict)
    directory = str(checkpoint_dir)
    sharded, _ = _split(sharded_state_dict)
    result = load_shards(_by_entry_name(sharded), directory, strictness=strict)
    loaded = load_common(directory)
    missing = set(result.missing)
    for path, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            if entry.read_back:
                _merge(loaded, path, entry.data)
        elif entry.key not in missing and not entry.optional:
            data = entry.data
            if entry.local_shape is not None:
                data = data.view(entry.local_shape)
            _merge(loaded, path, data)
    if strict in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL):
        return loaded, set(result.missing), set(result.unexpected)
    return loaded
