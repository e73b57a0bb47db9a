"""Autograd-aware collectives between the regions of a tensor-parallel model.

Each mapping is a pair of (forward, backward) communication patterns that are adjoint to each
other, so gradients are exact:

=========================================  ==========================  ==========================
mapping                                    forward                     backward
=========================================  ==========================  ==========================
copy_to_tensor_model_parallel_region       identity                    all-reduce
reduce_from_tensor_model_parallel_region   all-reduce                  identity
scatter_to_tensor_model_parallel_region    keep own last-dim chunk     all-gather last dim
gather_from_tensor_model_parallel_region   all-gather last dim         keep own last-dim chunk
scatter_to_sequence_parallel_region        keep own dim-0 chunk        all-gather dim 0
gather_from_sequence_parallel_region       all-gather dim 0            reduce-scatter dim 0 (*)
reduce_scatter_to_sequence_parallel_region reduce-scatter dim 0        all-gather dim 0
=========================================  ==========================  ==========================

(*) or "keep own dim-0 chunk" with ``tensor_parallel_output_grad=False``, for consumers whose
gradient is already complete on every rank.

Dimension 0 is the sequence dimension of Megatron's [s, b, h] layout. With ``group`` None or of
size 1 every mapping returns its input unchanged.
"""

import torch

from megatron.core.tensor_parallel import collectives as C


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = C.group_size(group)
    if x.shape[-1] % size != 0:
        raise ValueError(
            f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {size}"
        )
    return x.chunk(size, dim=-1)[C.group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = C.group_size(group)
    # Gather along dim 0 (contiguous chunks), then move the rank axis next to the last dim.
    gathered = C.all_gather_along_first_dim(x.contiguous(), group)
    parts = gathered.chunk(size, dim=0)
    return torch.cat(parts, dim=-1).contiguous()


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = C.group_size(group)
    if x.shape[0] % size != 0:
        raise ValueError(
            f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {size} "
            "(sequence parallelism splits the sequence across --tensor-model-parallel-size ranks)"
        )
    return x.chunk(size, dim=0)[C.group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_first_dim(grad.contiguous(), ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return C.all_gather_along_first_dim(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return C.reduce_scatter_along_first_dim(grad.contiguous(), ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter_along_first_dim(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_first_dim(grad.contiguous(), ctx.group), None


def _trivial(group) -> bool:
    return C.group_size(group) == 1


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _ScatterToSequenceParallel.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group=None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    return (
        x
        if _trivial(group)
        else _GatherFromSequenceParallel.apply(x, group, tensor_parallel_output_grad)
    )


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return x if _trivial(group) else _ReduceScatterToSequenceParallel.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return C.all_to_all_uneven(x.contiguous(), group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        # The gradient travels back the way the rows came: the splits swap roles.
        back = C.all_to_all_uneven(
            grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits
        )
        return back, None, None, None


def all_to_all(x: torch.Tensor, group, output_splits, input_splits) -> torch.Tensor:
    """Rows of ``x`` [n, ...] exchanged within ``group``: ``input_splits[r]`` consecutive rows go
    to member r and ``output_splits[r]`` rows arrive from it (uneven splits allowed). Autograd:
    the gradient takes the reverse exchange."""
    if _trivial(group):
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))
