"""Linear and embedding layers with Megatron's names, call signatures and [out, in] weights.

These are the tensor-parallel size 1 forms of ``megatron.core.tensor_parallel.layers``'
``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding``: the attention,
MLP and models build their projections from them, so the tensor-parallel versions can replace
them without touching the callers. They reject a config with tensor_model_parallel_size > 1
rather than silently computing an unsplit layer.

Like Megatron's, the linear layers return ``(output, output_bias)``: with ``skip_bias_add`` the
bias is returned for the caller to fuse into a later op, otherwise it is added inside the GEMM
(one ``addmm``) and ``output_bias`` is None.
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.utils import new_constant_param, new_weight


def _require_tp1(config, layer: str) -> None:
    if config.tensor_model_parallel_size != 1:
        raise ValueError(
            f"{layer}: tensor_model_parallel_size={config.tensor_model_parallel_size} is not "
            "supported yet (--tensor-model-parallel-size must be 1)"
        )


class _LinearBase(torch.nn.Module):
    def __init__(self, input_size, output_size, config, init_method, bias, skip_bias_add,
                 skip_weight_param_allocation, is_expert):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = new_weight((output_size, input_size), config, init_method)
            self.weight.allreduce = not is_expert
        if bias:
            self.bias = new_constant_param((output_size,), config, 0.0)
            self.bias.allreduce = not is_expert
        else:
            self.register_parameter("bias", None)

    def _linear(self, input_: torch.Tensor, weight: Optional[torch.Tensor]):
        if weight is None:
            weight = self.weight
            if weight is None:
                raise ValueError(
                    f"{type(self).__name__} was built with skip_weight_param_allocation=True; "
                    "pass the weight to forward()"
                )
        if self.skip_bias_add:
            return F.linear(input_, weight), self.bias
        return F.linear(input_, weight, self.bias), None

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(_LinearBase):
    """Y = XA^T + b with A of shape [output_size, input_size] (split along rows under TP)."""

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
        _require_tp1(config, "ColumnParallelLinear")
        super().__init__(input_size, output_size, config, init_method, bias, skip_bias_add,
                         skip_weight_param_allocation, is_expert)
        self.gather_output = gather_output

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``weight`` overrides the layer's own (the tied output layer passes the embedding)."""
        return self._linear(input_, weight)


class RowParallelLinear(_LinearBase):
    """Y = XA^T + b with A of shape [output_size, input_size] (split along columns under TP)."""

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
        _require_tp1(config, "RowParallelLinear")
        super().__init__(input_size, output_size, config, init_method, bias, skip_bias_add,
                         False, is_expert)
        self.input_is_parallel = input_is_parallel
        if self.bias is not None:
            # Under sequence parallelism this bias's grad must be all-reduced across TP ranks.
            self.bias.sequence_parallel = config.sequence_parallel

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self._linear(input_, None)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding table of shape [num_embeddings, embedding_dim] (split by vocab under TP)."""

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
        _require_tp1(config, "VocabParallelEmbedding")
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = new_weight((num_embeddings, embedding_dim), config, init_method)
        self.weight.allreduce = True

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
