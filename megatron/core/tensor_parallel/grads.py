"""Gradient reductions that tensor/sequence parallelism adds on top of data-parallel sync."""

from typing import Iterable, Union

import torch

from megatron.core.tensor_parallel import collectives as C


def _params(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    seen = set()
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield param


def allreduce_sequence_parallel_grads(model, tp_group) -> int:
    """Sum over the tensor-parallel group the gradients of parameters marked
    ``sequence_parallel = True`` (norm weights/biases and row-parallel biases: replicated across
    TP but each rank only saw its own s/TP tokens). Call it after the data-parallel gradient sync
    and before the optimizer step (Megatron's ``layernorm-grads-all-reduce``).

    ``model``: a module or a list of model chunks (DDP wrappers are fine). Uses ``main_grad``
    when present (DDP grad buffers), else ``grad``. The grads are flattened into one buffer per
    dtype so there is one all-reduce per dtype. Returns the number of tensors reduced.
    """
    if C.group_size(tp_group) == 1:
        return 0
    grads = []
    for param in _params(model):
        if not getattr(param, "sequence_parallel", False) or not param.requires_grad:
            continue
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads.append(grad)
    by_dtype = {}
    for grad in grads:
        by_dtype.setdefault((grad.dtype, grad.device), []).append(grad)
    for group_grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group_grads])
        C.all_reduce(flat, tp_group)
        offset = 0
        for g in group_grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
