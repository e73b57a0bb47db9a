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


def param_digests(
    model_chunks: Sequence[torch.nn.Module], experts: Optional[bool] = None
) -> List[Tuple[str, bytes]]:
    """(name, SHA-256 digest of the raw bytes) of every parameter, in a fixed order; only the
    expert parameters (``allreduce`` False) when ``experts`` is True, only the others when it is
    False."""
    digests = []
    for index, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            if experts is not None and experts != (not getattr(param, "allreduce", True)):
                continue
            data = param.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            digest = hashlib.sha256(data.numpy().tobytes()).digest()
            digests.append((f"chunk{index}.{name}" if len(model_chunks) > 1 else name, digest))
    return digests


def _first_difference(names: Iterable[str], ours: torch.Tensor, theirs: torch.Tensor) -> str:
    for name, a, b in zip(names, ours, theirs):
        if not torch.equal(a, b):
            return name
    return "?"


def _compare_with_first_replica(
    digests: List[Tuple[str, bytes]], group: Optional[dist.ProcessGroup], device: torch.device
) -> Optional[Tuple[int, str]]:
    """(global rank of the group's first replica, first differing name) when this rank's
    digests differ from that replica's, else None. A collective over ``group``."""
    group_ranks = dist.get_process_group_ranks(group) if group is not None else None
    if group_ranks is None or len(group_ranks) < 2:
        return None
    local = torch.tensor(
        [list(digest) for _, digest in digests] or [[0] * _DIGEST_BYTES],
        dtype=torch.uint8,
        device=device,
    )
    gathered = [torch.empty_like(local) for _ in group_ranks]
    dist.all_gather(gathered, local, group=group)
    if torch.equal(local, gathered[0]):
        return None
    return group_ranks[0], _first_difference([name for name, _ in digests], local, gathered[0])


def check_param_hashes_across_dp_replicas(
    model_chunks: Sequence[torch.nn.Module],
    dp_group: Optional[dist.ProcessGroup],
    expert_dp_group: Optional[dist.ProcessGroup] = None,
) -> List[ReplicaMismatch]:
    """Compare this rank's parameters with its data-parallel group's first replica.

    Expert parameters (``allreduce`` False) differ across expert-parallel ranks by design:
    given ``expert_dp_group``, they are compared over it (the ranks that hold the same experts)
    and the others over ``dp_group``, as Megatron does; without it, all over ``dp_group``.
    Collectives over the data-parallel groups and then over the world (call it on every rank).
    Returns the same list on every rank: every mismatching rank of the world, sorted. Without
    torch.distributed (or a group of one) there is nothing to compare and the list is empty.
    """
    if not dist.is_initialized():
        return []
    device = collective_device(dp_group)
    if expert_dp_group is None:
        comparisons = [(param_digests(model_chunks), dp_group)]
    else:
        comparisons = [
            (param_digests(model_chunks, experts=False), dp_group),
            (param_digests(model_chunks, experts=True), expert_dp_group),
        ]
    report = None
    for digests, group in comparisons:
        difference = _compare_with_first_replica(digests, group, device)
        report = report or difference
    # Make every rank of the world learn whether any replica anywhere differs.
    flag = torch.tensor([0 if report is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return []
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return [
        ReplicaMismatch(rank, reference, name)
        for rank, entry in enumerate(reports)
        if entry is not None
        for reference, name in [entry]
    ]
