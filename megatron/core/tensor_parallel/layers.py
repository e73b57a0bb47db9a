"""Tensor-parallel linear and embedding layers (Megatron's names, signatures and [out, in] weights).

``ColumnParallelLinear`` splits its weight along the output dimension (rows), ``RowParallelLinear``
along the input dimension (columns), ``VocabParallelEmbedding`` along the vocabulary. Each takes
the tensor-parallel group as ``tp_group``; without one (None) it is the plain TP=1 layer, and a
config with tensor_model_parallel_size > 1 but no matching group is rejected.

Initialization (``--use-cpu-initialization`` semantics, always): every rank draws the full master
weight with the default CPU generator, in the same order as the TP=1 model, and keeps its slice.
A TP=N model therefore starts with exactly the shards of the TP=1 model built from the same seed,
on any device. ``stride`` > 1 interleaves the slices the way Megatron's fused layers need: the
master's rows are cut into ``stride`` blocks and each rank keeps its part of every block
(SwiGLU's fc1 = [gate; up] gives each shard [gate_shard; up_shard]). Megatron's grouped QKV layout
needs no stride: its rows are already ordered by query group and TP shards whole groups.

The linear layers return ``(output, output_bias)``, the pair Megatron's parallel linear layers
return: with ``skip_bias_add`` the
bias is returned for the caller to fuse into a later op, otherwise it is added (after the
reduction for row-parallel layers) and ``output_bias`` is None.

Gradient accumulation fusion (``config.gradient_accumulation_fusion``, Megatron's
``--no-gradient-accumulation-fusion`` turns it off): when the layer's own weight has a
``main_grad`` (DDP's gradient buffer), :class:`LinearWithGradAccumulation` adds the weight gradient
straight into it in backward and hands autograd no ``.grad`` for the weight, so DDP's per-param
post-accumulate hook never runs for it. A weight passed to ``forward`` (the tied output layer)
takes the plain path: its other use (the embedding) accumulates through autograd and the hook.
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.parameters import new_constant_param, new_weight, param_device


class LinearWithGradAccumulation(torch.autograd.Function):
    """``F.linear(input_, weight, bias)`` whose backward adds the weight gradient into
    ``weight.main_grad`` (Megatron's LinearWithGradAccumulationAndAsyncCommunication without its
    communication, which the mappings around the call do here). The input and bias gradients are
    autograd's.

    The weight enters as a detached alias (``weight_data``) with the parameter itself in a tuple,
    which autograd does not look into: the graph then has no edge to the parameter's
    AccumulateGrad node, so neither that node nor the post-accumulate hooks on it run (an input
    given back a None gradient would still run them).

    If ``weight.mark_main_grad_ready`` is set (DDP with overlap-grad-reduce), it is called after
    the add: the weight's gradient for this micro-batch is complete, the bucket may launch."""

    @staticmethod
    def forward(ctx, input_, weight_data, bias, weight_holder):
        ctx.save_for_backward(input_, weight_data)
        ctx.weight = weight_holder[0]
        ctx.has_bias = bias is not None
        return F.linear(input_, weight_data, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight_data = ctx.saved_tensors
        weight = ctx.weight
        grad_input = grad_output.matmul(weight_data) if ctx.needs_input_grad[0] else None
        # The products autograd's linear backward computes, on the rows folded into one dim.
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        accumulate_weight_grad(weight, grad_output_2d, input_.reshape(-1, input_.shape[-1]))
        mark_ready = getattr(weight, "mark_main_grad_ready", None)
        if mark_ready is not None:
            mark_ready(weight)
        grad_bias = grad_output_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias, None


def accumulate_weight_grad(
    weight: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor
) -> None:
    """``weight.main_grad += grad_output_2d^T @ input_2d``.

    With half-precision operands and an fp32 ``main_grad`` on CUDA, one addmm with fp32 output
    accumulates the product into ``main_grad`` without rounding it to half precision first (what
    Megatron's fused wgrad kernel does). Elsewhere, or where this torch's CUDA addmm refuses an
    fp32 addend (its checks run on the host before any launch; remembered on the weight), the
    product is computed in the operands' dtype and added, which is exactly the sum autograd and
    DDP's hook would form. Under torch.compile (--compile-transformer-layers) the second form is
    used: dynamo's fake tensors reject addmm's ``out_dtype`` (torch 2.11 on an H200)."""
    # With gradients sharded over DP (ZeRO-2) the full-size main_grad exists only while its
    # bucket accumulates: the DDP wrapper gives ``get_main_grad`` to allocate it on demand.
    get_main_grad = getattr(weight, "get_main_grad", None)
    main_grad = weight.main_grad if get_main_grad is None else get_main_grad()
    if (
        main_grad.is_cuda
        and not torch.compiler.is_compiling()
        and main_grad.dtype == torch.float32
        and grad_output_2d.dtype in (torch.bfloat16, torch.float16)
        and getattr(weight, "mixed_dtype_addmm", True)
    ):
        try:
            torch.addmm(
                main_grad,
                grad_output_2d.t(),
                input_2d,
                out_dtype=torch.float32,
                out=main_grad,
            )
            return
        except (RuntimeError, TypeError):
            weight.mixed_dtype_addmm = False
    main_grad.add_(grad_output_2d.t().mm(input_2d))


def linear(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    accumulate_into_main_grad: bool,
) -> torch.Tensor:
    """``F.linear``, or with ``accumulate_into_main_grad`` and a weight that has a ``main_grad``
    (wrapped by DDP) the fused :class:`LinearWithGradAccumulation`. Without one (no DDP; FSDP,
    whose unsharded weights have none) the plain path runs: there is nothing to accumulate into.
    So it does when neither the input nor the bias needs a gradient: the output would not need
    one either, and backward would never reach the weight."""
    if (
        accumulate_into_main_grad
        and weight.requires_grad
        and getattr(weight, "main_grad", None) is not None
        and torch.is_grad_enabled()
        and (input_.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return LinearWithGradAccumulation.apply(input_, weight.detach(), bias, (weight,))
    return F.linear(input_, weight, bias)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator} "
            "(--tensor-model-parallel-size)"
        )
    return numerator // denominator


def shard_of(
    master: torch.Tensor, partition_dim: int, rank: int, size: int, stride: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor split into ``size`` parts along ``partition_dim``,
    with ``stride`` interleaved blocks (see the module docstring). Returns a new tensor."""
    if size == 1:
        return master.clone()
    length = master.shape[partition_dim]
    piece = divide(
        length,
        size * stride,
        f"dimension {partition_dim} of a {tuple(master.shape)} weight / stride {stride}:",
    )
    pieces = torch.split(master, piece, dim=partition_dim)
    return torch.cat(pieces[rank::size], dim=partition_dim).contiguous()


def full_from_shards(shards, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_of`: the full tensor from every rank's shard (in rank order)."""
    if stride == 1:
        return torch.cat(list(shards), dim=partition_dim)
    blocks = [torch.chunk(s, stride, dim=partition_dim) for s in shards]
    return torch.cat(
        [blocks[r][k] for k in range(stride) for r in range(len(shards))], dim=partition_dim
    )


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim if is_parallel else -1
    param.partition_stride = stride if is_parallel else 1


def new_partitioned_weight(
    full_shape,
    partition_dim: int,
    config,
    init_method: Callable,
    tp_rank: int,
    tp_size: int,
    stride: int = 1,
) -> torch.nn.Parameter:
    """This rank's shard of a weight whose master (full) value is drawn on the CPU and sliced."""
    if tp_size == 1:
        return new_weight(full_shape, config, init_method)  # unchanged TP=1 path (same RNG draws)
    local_shape = list(full_shape)
    local_shape[partition_dim] = divide(
        full_shape[partition_dim],
        tp_size,
        f"dimension {partition_dim} of weight {tuple(full_shape)}:",
    )
    device = param_device(config)
    weight = torch.empty(local_shape, dtype=config.params_dtype, device=device)
    if config.perform_initialization and device.type != "meta":
        master_dtype = torch.float64 if config.params_dtype == torch.float64 else torch.float32
        master = torch.empty(
            tuple(full_shape),
            dtype=master_dtype,
            device="cpu",  # host: drawn by the CPU generator
        )
        with torch.no_grad():
            init_method(master)
            weight.copy_(shard_of(master, partition_dim, tp_rank, tp_size, stride))
    param = torch.nn.Parameter(weight)
    set_tensor_model_parallel_attributes(param, True, partition_dim, stride)
    return param


def new_partitioned_bias(
    full_size: int, config, tp_size: int, stride: int = 1
) -> torch.nn.Parameter:
    bias = new_constant_param((divide(full_size, tp_size, "bias size"),), config, 0.0)
    if tp_size > 1:
        set_tensor_model_parallel_attributes(bias, True, 0, stride)
    return bias


def _check_group(config, tp_group, layer: str) -> None:
    if C.group_size(tp_group) != config.tensor_model_parallel_size:
        raise ValueError(
            f"{layer}: tensor_model_parallel_size={config.tensor_model_parallel_size} "
            f"(--tensor-model-parallel-size) but the tensor-parallel group passed has "
            f"{C.group_size(tp_group)} rank(s); pass tp_group (or pg_collection to the model)"
        )


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A [output_size, input_size] split along rows: rank t holds
    A[t * out/TP : (t + 1) * out/TP] (with ``stride``, interleaved blocks).

    Input [.., input_size] (with sequence parallelism [s/TP, b, input_size], gathered along the
    sequence first). Output [.., output_size/TP], or [.., output_size] with ``gather_output``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
    ):
        super().__init__()
        _check_group(config, tp_group, "ColumnParallelLinear")
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.tp_rank = C.group_rank(tp_group)
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size")
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp_size > 1
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = new_partitioned_weight(
                (output_size, input_size),
                0,
                config,
                init_method,
                self.tp_rank,
                self.tp_size,
                stride,
            )
            self.weight.allreduce = not is_expert
        if bias:
            self.bias = new_partitioned_bias(output_size, config, self.tp_size, stride)
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)

    def forward(
        self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``weight`` overrides the layer's own (the tied output layer passes the embedding
        shard)."""
        fuse = weight is None and getattr(self.config, "gradient_accumulation_fusion", False)
        if weight is None:
            weight = self.weight
            if weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True; "
                    "pass the weight to forward()"
                )
        if self.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, self.tp_group)
        else:
            input_ = copy_to_tensor_model_parallel_region(input_, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        output = linear(input_, weight, bias, fuse)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}"
        )


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A [output_size, input_size] split along columns: rank t holds
    A[:, t * in/TP : (t + 1) * in/TP].

    Input [.., input_size/TP] (``input_is_parallel``) or [.., input_size] (scattered first).
    The partial products are all-reduced, or with sequence parallelism reduce-scattered along the
    sequence to [s/TP, b, output_size]; the (replicated) bias is added after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
    ):
        super().__init__()
        _check_group(config, tp_group, "RowParallelLinear")
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.tp_rank = C.group_rank(tp_group)
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size")
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear with sequence parallelism needs input_is_parallel=True"
            )
        self.weight = new_partitioned_weight(
            (output_size, input_size), 1, config, init_method, self.tp_rank, self.tp_size, stride
        )
        self.weight.allreduce = not is_expert
        if bias:
            self.bias = new_constant_param((output_size,), config, 0.0)
            self.bias.allreduce = not is_expert
            # Under sequence parallelism each rank sees only its tokens, so this bias's grad is
            # partial and must be all-reduced across TP (allreduce_sequence_parallel_grads).
            self.bias.sequence_parallel = bool(config.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        fuse = getattr(self.config, "gradient_accumulation_fusion", False)
        if self.tp_size == 1:
            if self.skip_bias_add:
                return linear(input_, self.weight, None, fuse), self.bias
            return linear(input_, self.weight, self.bias, fuse), None
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        partial = linear(input_, self.weight, None, fuse)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding [num_embeddings, embedding_dim] split along the vocabulary: rank t holds
    rows [t * V/TP, (t + 1) * V/TP). Ids outside a rank's range look up zeros there and the
    partial results are summed across TP (all-reduce, or with ``reduce_scatter_embeddings`` a
    reduce-scatter along dim 0, which then must be the sequence dim)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        config,
        reduce_scatter_embeddings: bool = False,
        tp_group=None,
    ):
        super().__init__()
        _check_group(config, tp_group, "VocabParallelEmbedding")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.tp_size = C.group_size(tp_group)
        self.tp_rank = C.group_rank(tp_group)
        if num_embeddings % self.tp_size != 0:
            raise ValueError(
                f"vocabulary size {num_embeddings} is not divisible by "
                f"the tensor-parallel size {self.tp_size}; "
                "pad it (--make-vocab-size-divisible-by, padded vocab = multiple of divisor * TP)"
            )
        self.num_embeddings_per_partition = num_embeddings // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.weight = new_partitioned_weight(
            (num_embeddings, embedding_dim), 0, config, init_method, self.tp_rank, self.tp_size
        )
        self.weight.allreduce = True

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            output = F.embedding(input_, self.weight)
        else:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
            if self.reduce_scatter_embeddings:
                return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
            output = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return output

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}"
