"""The shared expert: a dense MLP every token passes through beside the routed experts
(Megatron Core's ``SharedExpertMLP``: ``shared_experts.linear_fc1/linear_fc2`` and, with the
gate, ``shared_experts.gate_weight`` [1, h])."""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.parameters import new_weight
from megatron.core.transformer.mlp import MLP


class SharedExpertMLP(MLP):
    """An MLP of width ``moe_shared_expert_intermediate_size`` under the dense tensor
    parallelism; with ``moe_shared_expert_gate`` its output is scaled per token by
    sigmoid(x . gate_weight)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(
            config,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
            pg_collection=pg_collection,
        )
        if config.moe_shared_expert_gate:
            self.gate_weight = new_weight((1, config.hidden_size), config, config.init_method)
            self.gate_weight.sequence_parallel = bool(config.sequence_parallel)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor):
        output, bias = super().forward(hidden_states)
        if bias is not None:
            output = output + bias
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output
