"""Do the data-parallel replicas of a model hold the same parameters? (Megatron's
``check_param_hashes_across_dp_replicas``, run by
``--check-weight-hash-across-dp-replicas-interval``.)

Every rank hashes each of its parameters (SHA-256 of the raw bytes: exact for every dtype), the
digests are all-gathered over the data-parallel group and compared with the group's first
replica. Replicas that differ are made known to every rank of the world, so that all ranks can
stop together: a check that only some ranks failed would leave the others waiting in their next
collective.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.device import collective_device

__all__ = ["ReplicaMismatch", "check_param_hashes_across_dp_replicas", "param_digests"]

_DIGEST_BYTES = 32


@dataclass(frozen=True)
class ReplicaMismatch:
    """One rank whose parameters differ from those of its data-parallel group's first replica."""

    rank: int
    """The global rank that differs."""

    reference_rank: int
    """The global rank of its group's first replica."""

    first_parameter: str
    """The name of the first parameter that differs."""


def param_digests(model_chunks: Sequence[torch.nn.Module]) -> List[Tuple[str, bytes]]:
    """(name, SHA-256 digest of the raw bytes) of every parameter, in a fixed order."""
    digests = []
    for index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            data = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            digest = hashlib.sha256(data.numpy().tobytes()).digest()
            digests.append((f"chunk{index}.{name}" if len(model_chunks) > 1 else name, digest))
    return digests


def _first_difference(names: Iterable[str], ours: torch.Tensor, theirs: torch.Tensor) -> str:
    for name, a, b in zip(names, ours, theirs):
        if not torch.equal(a, b):
            return name
    return "?"


def check_param_hashes_across_dp_replicas(
    model_chunks: Sequence[torch.nn.Module], dp_group: Optional[dist.ProcessGroup]
) -> List[ReplicaMismatch]:
    """Compare this rank's parameters with its data-parallel group's first replica.

    A collective over the data-parallel group and then over the world (call it on every rank).
    Returns the same list on every rank: every mismatching rank of the world, sorted. Without
    torch.distributed (or a group of one) there is nothing to compare and the list is empty.
    """
    if not dist.is_initialized():
        return []
    digests = param_digests(model_chunks)
    names = [name for name, _ in digests]
    device = collective_device(dp_group)
    local = torch.tensor(
        [list(digest) for _, digest in digests] or [[0] * _DIGEST_BYTES],
        dtype=torch.uint8,
        device=device,
    )
    group_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else None
    mismatch_here = False
    if group_ranks is not None and len(group_ranks) > 1:
        gathered = [torch.empty_like(local) for _ in group_ranks]
        dist.all_gather(gathered, local, group=dp_group)
        mismatch_here = not torch.equal(local, gathered[0])
        reference_rank = group_ranks[0]
    else:
        gathered, reference_rank = [local], dist.get_rank()
    # Make every rank of the world learn whether any replica anywhere differs.
    flag = torch.tensor([1 if mismatch_here else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return []
    report = None
    if mismatch_here:
        report = (reference_rank, _first_difference(names, local, gathered[0]))
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return [
        ReplicaMismatch(rank, reference, name)
        for rank, entry in enumerate(reports)
        if entry is not None
        for reference, name in [entry]
    ]
