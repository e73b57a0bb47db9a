"""Global gradient norm, clipping by that norm, and counting zero gradient entries.

The norm is computed over the *model-parallel* group only: after the data-parallel reduction
every DP rank holds the same gradients, while TP/PP ranks hold different slices of the model.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Union

import torch
import torch.distributed as dist

from megatron.core.device import collective_device


def param_is_counted_once(param: torch.Tensor, tp_rank: int = 0) -> bool:
    """True if this rank owns `param` for norm/zero statistics.

    A param marked ``shared`` is a copy of a param owned elsewhere (the tied output embedding on
    the last pipeline stage); a param that is not tensor-parallel is replicated on every TP rank
    and so counted on TP rank 0 only.
    """
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=group)


def sum_of_powered_norms(
    grads: List[torch.Tensor], norm_type: float, device, foreach: bool = False
) -> torch.Tensor:
    """sum(|g|^p) over all ``grads``, summed over tensors in float64 (a 0-d tensor on
    ``device``).

    ``foreach``: every tensor's norm comes from one multi-tensor kernel (torch._foreach_norm,
    asked for float64 results) and the p-th powers are summed in one reduction, instead of a
    norm kernel and an add per tensor. Each norm is still accumulated in float64 (on CUDA the
    kernel accumulates in the opmath type of the float64 output; on CPU it runs the per-tensor
    norm), so only the order of the float64 sum over tensors differs from the per-tensor path.
    """
    grads = [g for g in grads if g.numel() > 0]
    if foreach:
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        total = None
        for same_device in _by_device(grads):
            norms = torch._foreach_norm(same_device, norm_type, dtype=torch.float64)
            part = torch.stack(norms).pow_(norm_type).sum().to(device)
            total = part if total is None else total + part
        return total
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        norm = torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
        total += norm.to(device) ** norm_type
    return total


def _by_device(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``tensors`` split into lists of one device each (a multi-tensor kernel takes one)."""
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def get_grad_norm_fp32(
    grads_for_norm: Union[torch.Tensor, Iterable[torch.Tensor]],
    norm_type: Union[int, float] = 2,
    model_parallel_group=None,
    foreach: bool = False,
) -> float:
    """Norm of the concatenation of `grads_for_norm`, over all ranks of `model_parallel_group`.

    Each rank passes only the gradients it owns (see param_is_counted_once). L2: the per-rank
    sums of squares are added (in float64) across the group; inf: the max is taken.
    ``foreach``: multi-tensor kernels (see sum_of_powered_norms).
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = [g.detach() for g in grads_for_norm if g is not None and g.numel() > 0]
    norm_type = float(norm_type)
    device = collective_device(model_parallel_group)

    if norm_type == math.inf:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        if foreach and grads:
            for same_device in _by_device(grads):
                maxima = torch.stack(torch._foreach_norm(same_device, math.inf)).max()
                total = torch.maximum(total, maxima.to(device=device, dtype=torch.float64))
        else:
            for g in grads:
                total = torch.maximum(total, g.abs().max().to(device=device, dtype=torch.float64))
        _all_reduce(total, dist.ReduceOp.MAX, model_parallel_group)
        return float(total.item())

    if norm_type <= 0.0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    if grads:
        # Accumulated in float64: the total then hardly depends on how the gradients are split
        # into tensors, so the distributed optimizer (which sees shards) clips by the same norm.
        total = sum_of_powered_norms(grads, norm_type, device, foreach).reshape(1)
    else:
        total = torch.zeros(1, dtype=torch.float64, device=device)
    _all_reduce(total, dist.ReduceOp.SUM, model_parallel_group)
    return float(total.item()) ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: Union[int, float],
    total_norm: float,
) -> None:
    """Scale the ``.grad`` of `parameters` in place so that the global norm is at most max_norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    clip_coeff = float(max_norm) / (float(total_norm) + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(
    parameters: Iterable[torch.Tensor],
    grad_stats_parallel_group=None,
    tp_rank: int = 0,
) -> int:
    """Number of zero entries in the ``.grad`` of the params this rank owns, summed over the
    group."""
    parameters = list(parameters)
    grads = [
        p.grad.detach()
        for p in parameters
        if p.grad is not None and param_is_counted_once(p, tp_rank)
    ]
    device = collective_device(grad_stats_parallel_group)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g).to(device)
    _all_reduce(total, dist.ReduceOp.SUM, grad_stats_parallel_group)
    return int(total.item())
