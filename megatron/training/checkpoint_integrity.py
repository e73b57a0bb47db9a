"""``--verify-integrity``: a SHA-256 manifest of a checkpoint's files, written when it is saved
and checked before it is loaded.

The manifest is ``integrity.sha256`` inside the iteration directory, in ``sha256sum``'s format
(``<hex digest>  <path relative to the directory>`` per line, sorted), so ``cd iter_0000100 &&
sha256sum -c integrity.sha256`` checks a checkpoint by hand too. It is complete before the
tracker names the checkpoint. A load with ``--verify-integrity`` ends, on every rank, with one
error naming each file that changed, is missing, or is not in the manifest; a checkpoint saved
without the manifest cannot be loaded with the flag.

Hashing is spread over the ranks (each hashes every world-size-th file of the sorted list; the
digests are gathered), so every rank must see the checkpoint directory, as the formats already
require. Every function here is a collective when torch.distributed is initialized.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Iterable, List, Optional

import torch.distributed as dist

from megatron.checkpointing.errors import CheckpointError

MANIFEST_NAME = "integrity.sha256"
_CHUNK = 1 << 20


class CheckpointIntegrityError(CheckpointError):
    """Files of a checkpoint that do not match its manifest; the message names them."""


def sha256_of_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _listing(directory: str) -> List[str]:
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST_NAME:
                names.append(relative.replace(os.sep, "/"))
    return sorted(names)


def _broadcast_from_rank0(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _hash_files(directory: str, names: List[str]) -> Dict[str, Optional[str]]:
    """Digest of every name (None: the file is gone); the work is spread over the ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = {}
    for name in names[rank::world]:
        path = os.path.join(directory, name)
        mine[name] = sha256_of_file(path) if os.path.isfile(path) else None
    if not dist.is_initialized():
        return mine
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    return {name: digest for share in shares for name, digest in share.items()}


def manifest_path(directory: str) -> str:
    return os.path.join(directory, MANIFEST_NAME)


def hash_checkpoint_files(directory: str, exclude: Iterable[str] = ()) -> Dict[str, str]:
    """Digests of the files now in `directory` (rank 0's listing), without `exclude`."""
    names = _broadcast_from_rank0(
        [n for n in _listing(directory) if n not in set(exclude)]
        if not dist.is_initialized() or dist.get_rank() == 0
        else None
    )
    digests = _hash_files(directory, names)
    missing = sorted(name for name, digest in digests.items() if digest is None)
    if missing:
        raise CheckpointIntegrityError(
            f"--verify-integrity: {', '.join(missing)} disappeared from {directory} while it "
            "was being hashed"
        )
    return digests


def write_manifest(directory: str, digests: Dict[str, str]) -> None:
    """Write the manifest of `digests` atomically (call on one rank)."""
    tmp = manifest_path(directory) + ".tmp"
    with open(tmp, "w") as f:
        for name in sorted(digests):
            f.write(f"{digests[name]}  {name}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, manifest_path(directory))


def integrity_digests(args, directory: str) -> Optional[Dict[str, str]]:
    """--verify-integrity: the digests of the files of `directory` written so far (a
    collective), or None without the flag."""
    if not getattr(args, "verify_integrity", False):
        return None
    return hash_checkpoint_files(directory)


def seal(directory: str, digests: Optional[Dict[str, str]]) -> None:
    """On rank 0, once the checkpoint's last files are written: the manifest of `digests` plus
    the files written after they were taken (e.g. metadata.json). No-op for `digests` None."""
    if digests is None:
        return
    late = {name: sha256_of_file(os.path.join(directory, name)) for name in _listing(directory)}
    write_manifest(directory, {**late, **digests})


def read_manifest(directory: str) -> Dict[str, str]:
    path = manifest_path(directory)
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(
            f"--verify-integrity: {directory} has no {MANIFEST_NAME} (it was saved without "
            "--verify-integrity); drop the flag to load it unchecked"
        )
    entries = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            digest, sep, name = line.rstrip("\n").partition("  ")
            if not sep or len(digest) != 64 or not name:
                raise CheckpointIntegrityError(
                    f"--verify-integrity: {path} line {number} is malformed"
                )
            entries[name] = digest
    return entries


def verify_checkpoint(directory: str) -> None:
    """Check every file of `directory` against its manifest; raises CheckpointIntegrityError
    on every rank (naming the files) when one changed, is missing or is not in the manifest."""
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            expected = read_manifest(directory)
            listed = _listing(directory)
            problem = None
        except CheckpointIntegrityError as exc:
            expected, listed, problem = None, None, str(exc)
    else:
        expected = listed = None
    expected, listed, problem = _broadcast_from_rank0((expected, listed, problem))
    if problem is not None:
        raise CheckpointIntegrityError(problem)
    digests = _hash_files(directory, sorted(expected))
    missing = sorted(name for name, digest in digests.items() if digest is None)
    changed = sorted(
        name for name, digest in digests.items() if digest is not None and digest != expected[name]
    )
    extra = sorted(set(listed) - set(expected))
    problems = [f"{name} changed (its SHA-256 differs from the manifest)" for name in changed]
    problems += [f"{name} is missing" for name in missing]
    problems += [f"{name} is not in the manifest" for name in extra]
    if problems:
        raise CheckpointIntegrityError(
            f"--verify-integrity: checkpoint {directory} does not match {MANIFEST_NAME}: "
            + "; ".join(problems)
        )
