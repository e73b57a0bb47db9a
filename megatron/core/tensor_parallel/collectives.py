"""The one module that calls torch.distributed's tensor collectives for model parallelism.

Backends differ in what they offer (gloo on CPU lacks some collectives or only has them under
deprecated names; NCCL has everything). Every model-parallel collective goes through the small
functions here, so a gap gets one fallback in one place instead of ``if backend == 'gloo'``
checks spread over the layers.

A ``group`` of None means "no group": the caller runs alone (size 1, rank 0) and every
collective is the identity. This is how models built without process groups behave as TP=1.
"""

from typing import List

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    if group is None:
        return 1
    return dist.get_world_size(group=group)


def group_rank(group) -> int:
    """This process's rank inside ``group`` (0 for None)."""
    if group is None:
        return 0
    return dist.get_rank(group=group)


def global_rank(group, group_rank_: int) -> int:
    """The global rank of member ``group_rank_`` of ``group`` (for point-to-point calls)."""
    if group is None or group is dist.group.WORLD:
        return group_rank_
    return dist.get_global_rank(group, group_rank_)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; returns it (with ``async_op``: the work
    handle to ``wait()`` on, or None when there was nothing to do)."""
    work = None
    if group_size(group) > 1:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else tensor


def has_avg_op(group) -> bool:
    """Whether the backend of ``group`` can average inside the collective (``ReduceOp.AVG``).

    gloo cannot; callers then sum and divide by the group size afterwards.
    """
    if group_size(group) == 1:
        return True
    return dist.get_backend(group) == "nccl"


def all_gather_into_tensor(
    output: torch.Tensor, input_: torch.Tensor, group, async_op: bool = False
):
    """Fill ``output`` ([size * n, ...], contiguous) with every rank's ``input_`` ([n, ...]) in
    rank order.

    Returns ``output``; with ``async_op`` the work handle instead (None when already complete).
    """
    size = group_size(group)
    if size == 1:
        output.copy_(input_)
        return None if async_op else output
    input_ = input_.contiguous()
    gather_single = getattr(dist, "all_gather_single", None)
    if gather_single is not None:
        work = gather_single(output, input_, group=group, async_op=async_op)
    elif hasattr(dist, "all_gather_into_tensor"):
        work = dist.all_gather_into_tensor(output, input_, group=group, async_op=async_op)
    else:  # oldest API: a list of equal-sized tensors
        work = dist.all_gather(
            list(output.chunk(size, dim=0)), input_, group=group, async_op=async_op
        )
    return work if async_op else output


def reduce_scatter_tensor(
    output: torch.Tensor, input_: torch.Tensor, group, async_op: bool = False, op=dist.ReduceOp.SUM
):
    """Reduce ``input_`` ([size * n, ...]) over ``group`` and put this rank's slice [n, ...] in
    ``output``.

    Returns ``output``; with ``async_op`` the work handle instead (None when already complete).
    """
    size = group_size(group)
    if size == 1:
        output.copy_(input_)
        return None if async_op else output
    input_ = input_.contiguous()
    scatter_single = getattr(dist, "reduce_scatter_single", None)
    work = None
    if scatter_single is not None:
        work = scatter_single(output, input_, op=op, group=group, async_op=async_op)
    elif hasattr(dist, "reduce_scatter_tensor"):
        work = dist.reduce_scatter_tensor(output, input_, op=op, group=group, async_op=async_op)
    else:  # a backend without reduce-scatter: all-reduce a copy and keep our slice (synchronously)
        total = input_.clone()
        dist.all_reduce(total, op=op, group=group)
        output.copy_(total.chunk(size, dim=0)[group_rank(group)])
    return work if async_op else output


def all_gather_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on every rank -> [size * n, ...] (rank order)."""
    size = group_size(group)
    if size == 1:
        return input_
    output = torch.empty(
        (size * input_.shape[0],) + tuple(input_.shape[1:]),
        dtype=input_.dtype,
        device=input_.device,
    )
    return all_gather_into_tensor(output, input_, group)


def reduce_scatter_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """[size * n, ...] partial sums on every rank -> this rank's [n, ...] slice of the total."""
    size = group_size(group)
    if size == 1:
        return input_
    if input_.shape[0] % size != 0:
        raise ValueError(
            f"reduce-scatter: first dimension {input_.shape[0]} is not divisible by the "
            f"group size {size}"
        )
    output = torch.empty(
        (input_.shape[0] // size,) + tuple(input_.shape[1:]),
        dtype=input_.dtype,
        device=input_.device,
    )
    return reduce_scatter_tensor(output, input_, group)


def all_gather_uneven(input_: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's ``input_`` (first dimensions may differ; the rest must agree), in rank order.

    The backends' all-gather needs equal sizes, so the sizes are exchanged first and each tensor
    is padded to the largest one.
    """
    size = group_size(group)
    if size == 1:
        return [input_]
    length = torch.tensor([input_.shape[0]], dtype=torch.int64, device=input_.device)
    lengths = all_gather_along_first_dim(length, group).tolist()
    longest = max(lengths)
    padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = all_gather_along_first_dim(padded, group)
    return [chunk[:n] for chunk, n in zip(gathered.chunk(size, dim=0), lengths)]


def ring_exchange(send: torch.Tensor, group, shift: int = 1) -> torch.Tensor:
    """Send ``send`` to group rank (rank + shift) and return what rank (rank - shift) sent.

    Point-to-point through ``batch_isend_irecv`` so the send and the receive progress together
    (no ordering deadlock on a ring).
    """
    size = group_size(group)
    if size == 1:
        return send
    rank = group_rank(group)
    send = send.contiguous()
    recv = torch.empty_like(send)
    dst = global_rank(group, (rank + shift) % size)
    src = global_rank(group, (rank - shift) % size)
    ops = [
        dist.P2POp(dist.isend, send, dst, group=group),
        dist.P2POp(dist.irecv, recv, src, group=group),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


def broadcast(tensor: torch.Tensor, src_group_rank: int, group) -> torch.Tensor:
    """In-place broadcast from member ``src_group_rank`` of ``group``."""
    if group_size(group) > 1:
        dist.broadcast(tensor, src=global_rank(group, src_group_rank), group=group)
    return tensor


def check_group_size(expected: int, group, what: str, flag: str) -> None:
    """Raise a clear error when a config's parallel size and the process group disagree."""
    actual = group_size(group)
    if actual != expected:
        raise ValueError(
            f"{what} size {expected} ({flag}) does not match the process group passed to "
            "the model, "
            f"which has {actual} rank(s); build the model with the groups of "
            f"megatron.core.parallel_state.initialize_model_parallel(...) (pg_collection=...)"
        )


def all_to_all_uneven(input_: torch.Tensor, group, output_splits, input_splits) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 with per-member row counts (gloo and NCCL support
    uneven splits). With one member (or no group) the rows stay: a copy is returned."""
    if group_size(group) == 1:
        return input_.clone()
    output = input_.new_empty((sum(output_splits),) + tuple(input_.shape[1:]))
    dist.all_to_all_single(
        output,
        input_,
        output_split_sizes=list(output_splits),
        input_split_sizes=list(input_splits),
        group=group,
    )
    return output
