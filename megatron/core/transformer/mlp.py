"""The transformer's MLP: linear_fc1 -> activation (or gated activation) -> linear_fc2."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import bias_gelu_tanh, gelu_tanh
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule


class MLP(MegatronModule):
    """h -> ffn -> h. With ``gated_linear_unit`` linear_fc1 is 2 * ffn wide and its output rows
    are [gate; up] (Megatron's SwiGLU layout); the MLP computes act(gate) * up.

    Under tensor parallelism fc1 is column-parallel with stride 2, so each shard holds
    [gate_shard; up_shard] (Megatron's per-shard layout), and fc2 is row-parallel."""

    def __init__(
        self,
        config,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        is_expert: bool = False,
        pg_collection=None,
    ):
        super().__init__(config)
        tp_group = resolve_pg_collection(config, pg_collection).tp
        self.input_size = config.hidden_size if input_size is None else input_size
        ffn = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.gated = config.gated_linear_unit
        self.linear_fc1 = ColumnParallelLinear(
            self.input_size,
            2 * ffn if self.gated else ffn,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear,
            gather_output=False,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
            stride=2 if self.gated else 1,
            tp_group=tp_group,
        )
        self.activation_func = config.activation_func
        if (
            config.bias_activation_fusion
            and config.add_bias_linear
            and config.activation_func is F.gelu
        ):
            # Megatron's fused bias-GeLU (and TE's GeLU) is the tanh approximation.
            self.activation_func = gelu_tanh
        # gelu(x + bias) in one function (one compiled kernel on CUDA). fc1 adds its bias inside
        # its matrix product (no skip_bias_add), so the bias it hands over is None.
        self.bias_gelu = self.activation_func is gelu_tanh and not self.gated
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] -> (output [s, b, h], bias or None)."""
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.bias_gelu:
            return self.linear_fc2(bias_gelu_tanh(intermediate, bias))
        if bias is not None:
            intermediate = intermediate + bias
        if self.gated:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            intermediate = self.activation_func(gate) * up
        else:
            intermediate = self.activation_func(intermediate)
        return self.linear_fc2(intermediate)
