"""The experts of an MoE layer held by this rank: ``local_experts.{i}.linear_fc1/linear_fc2``
(Megatron Core's SequentialMLP names; i is the local index, the global expert is
ep_rank * experts_per_rank + i).

Initialization is layout-independent: every rank draws the full weights of every expert of the
layer in order (fc1 then fc2, expert 0 first) and keeps its experts' shards, so an EP=N, ETP=M
model starts with exactly the weights of the one-process model built from the same seed.

Expert tensor parallelism (ETP) shards each expert like a dense MLP: fc1 by output rows (with
SwiGLU, [gate_shard; up_shard]), fc2 by input columns; each ETP rank then returns a partial
output that the token dispatcher sums. fc2's bias is added by ETP rank 0 only, and its
gradient summed over ETP so the replicas stay equal.

``--moe-grouped-gemm`` computes the same function with one batched product per linear layer
over the experts (``torch._grouped_mm`` on CUDA, a padded ``bmm`` elsewhere) instead of one
product per expert.
"""

from typing import List

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_gelu import gelu_tanh
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes, shard_of
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.parameters import new_constant_param, param_device
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.utils import selectively_recomputed


class _ExpertLinear(torch.nn.Module):
    """A weight [out, in] (this ETP rank's shard) and an optional bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        if bias is not None:
            self.bias = bias
        else:
            self.register_parameter("bias", None)


class _Expert(torch.nn.Module):
    def __init__(self, fc1: _ExpertLinear, fc2: _ExpertLinear):
        super().__init__()
        self.linear_fc1 = fc1
        self.linear_fc2 = fc2


def _master(shape, config, init_method) -> torch.Tensor:
    master = torch.empty(shape, dtype=torch.float32, device="cpu")  # host: CPU initialisation
    if config.perform_initialization:
        with torch.no_grad():
            init_method(master)
    return master


class SequentialMLP(torch.nn.Module):
    """The local experts; forward takes the tokens sorted by local expert and the count of each."""

    def __init__(self, config, ep_rank: int = 0, ep_size: int = 1, etp_group=None):
        super().__init__()
        self.config = config
        self.etp_group = etp_group
        self.etp_size, self.etp_rank = C.group_size(etp_group), C.group_rank(etp_group)
        self.num_local_experts = config.num_moe_experts // ep_size
        self.gated = config.gated_linear_unit
        self.grouped = bool(config.moe_grouped_gemm)
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        if ffn % self.etp_size != 0:
            raise ValueError(
                f"--moe-ffn-hidden-size ({ffn}) must be divisible by "
                f"--expert-tensor-parallel-size ({self.etp_size})"
            )
        self.activation_func = config.activation_func
        self.recompute_activation = selectively_recomputed(config, "moe_act")
        if (
            config.bias_activation_fusion
            and config.add_bias_linear
            and self.activation_func is F.gelu
        ):
            self.activation_func = gelu_tanh  # as the dense MLP: Megatron's fused bias-GeLU
        fc1_rows = 2 * ffn if self.gated else ffn
        stride = 2 if self.gated else 1
        device = param_device(config)
        first = ep_rank * self.num_local_experts
        self.local_expert_offset = first
        """Global index of local expert 0 (checkpoints number the experts globally)."""
        experts = []
        for expert in range(config.num_moe_experts):
            fc1 = _master((fc1_rows, hidden), config, config.init_method)
            fc2 = _master((hidden, ffn), config, config.output_layer_init_method)
            if not first <= expert < first + self.num_local_experts:
                continue
            experts.append(self._build(fc1, fc2, stride, device))
        self.local_experts = torch.nn.ModuleList(experts)

    def _shard(self, master, dim, stride, device):
        local = shard_of(master, dim, self.etp_rank, self.etp_size, stride)
        return local.to(device=device, dtype=self.config.params_dtype)

    def _build(self, fc1_master, fc2_master, stride, device) -> _Expert:
        cfg = self.config
        fc1 = _ExpertLinear(self._shard(fc1_master, 0, stride, device))
        fc2 = _ExpertLinear(self._shard(fc2_master, 1, 1, device))
        if cfg.add_bias_linear:
            fc1.bias = new_constant_param((fc1_master.shape[0] // self.etp_size,), cfg, 0.0)
            fc2.bias = new_constant_param((fc2_master.shape[0],), cfg, 0.0)
        for linear, dim, s in ((fc1, 0, stride), (fc2, 1, 1)):
            for name, param in linear.named_parameters():
                param.allreduce = False  # expert parameters: reduced over expert DP only
                sharded = self.etp_size > 1 and (name == "weight" or linear is fc1)
                set_tensor_model_parallel_attributes(
                    param, sharded, 0 if name == "bias" else dim, s
                )
        return _Expert(fc1, fc2)

    def _fc2_of_activation(self, intermediate: torch.Tensor, fc2):
        """``fc2(activation(intermediate))``; with 'moe_act' selective recompute the
        activation's output is freed once fc2 has used it and recomputed in backward (when fc2's
        output gradient arrives, before fc2's backward needs it)."""
        if not (self.recompute_activation and self.training and torch.is_grad_enabled()):
            return fc2(self._activation(intermediate))
        act_checkpoint = CheckpointWithoutOutput()
        output = fc2(act_checkpoint.checkpoint(self._activation, intermediate))
        act_checkpoint.discard_output_and_register_recompute(output)
        return output

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * up
        return self.activation_func(intermediate)

    def _fc2_bias(self, expert: _Expert):
        bias = expert.linear_fc2.bias
        if bias is None or self.etp_size == 1:
            return bias
        # Added once (ETP rank 0) to the partial outputs the dispatcher sums; the gradient is
        # summed over ETP so every replica takes the same step.
        bias = copy_to_tensor_model_parallel_region(bias, self.etp_group)
        return bias if self.etp_rank == 0 else bias * 0.0

    def forward(self, tokens: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
        """tokens [N, h] sorted by local expert, ``tokens_per_expert`` their counts -> [N, h]
        (a partial sum over ETP when ETP > 1)."""
        if self.grouped:
            return self._forward_grouped(tokens, tokens_per_expert)
        # Gradient accumulation fusion: each expert's weights accumulate into their main_grad in
        # the products' backward (the grouped path's stacked weights take autograd and DDP's hook).
        fuse = getattr(self.config, "gradient_accumulation_fusion", False)
        outputs = []
        for expert, chunk in zip(self.local_experts, torch.split(tokens, tokens_per_expert)):
            hidden = layers.linear(chunk, expert.linear_fc1.weight, expert.linear_fc1.bias, fuse)
            fc2_weight, fc2_bias = expert.linear_fc2.weight, self._fc2_bias(expert)
            outputs.append(
                self._fc2_of_activation(
                    hidden, lambda act: layers.linear(act, fc2_weight, fc2_bias, fuse)
                )
            )
        if not outputs:
            return tokens[:0]
        return torch.cat(outputs, dim=0)

    def _forward_grouped(self, tokens, tokens_per_expert):
        fc1_w = torch.stack([e.linear_fc1.weight for e in self.local_experts])
        fc2_w = torch.stack([e.linear_fc2.weight for e in self.local_experts])
        hidden = grouped_linear(tokens, fc1_w, tokens_per_expert)
        if self.config.add_bias_linear:
            hidden = hidden + _per_row(
                [e.linear_fc1.bias for e in self.local_experts], tokens_per_expert
            )
        out = self._fc2_of_activation(
            hidden, lambda act: grouped_linear(act, fc2_w, tokens_per_expert)
        )
        if self.config.add_bias_linear:
            out = out + _per_row([self._fc2_bias(e) for e in self.local_experts], tokens_per_expert)
        return out


def _per_row(biases, counts) -> torch.Tensor:
    """Each expert's bias repeated for its rows."""
    device = biases[0].device
    index = torch.repeat_interleave(
        torch.arange(len(counts), device=device),
        torch.tensor(counts, dtype=torch.long, device=device),
        output_size=sum(counts),
    )
    return torch.stack(biases)[index]


def grouped_linear(tokens: torch.Tensor, weights: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Rows of ``tokens`` [N, in] in consecutive groups of ``counts``; group g times
    ``weights[g]``^T ([G, out, in]) -> [N, out]. ``torch._grouped_mm`` on CUDA where the
    shapes suit it; elsewhere the groups are zero-padded to the largest and multiplied with one
    ``bmm`` (the same products, so the same values)."""
    groups, out_features, in_features = weights.shape
    if (
        tokens.is_cuda
        and hasattr(torch, "_grouped_mm")
        and tokens.dtype == torch.bfloat16
        and in_features % 8 == 0
        and out_features % 8 == 0
    ):
        offsets = torch.cumsum(torch.tensor(counts, device=tokens.device), 0).to(torch.int32)
        return torch._grouped_mm(tokens, weights.transpose(1, 2), offs=offsets)
    longest = max(counts) if counts else 0
    if longest == 0:
        return tokens.new_zeros((tokens.shape[0], out_features))
    padded = tokens.new_zeros((groups, longest, in_features))
    device, total = tokens.device, sum(counts)
    sizes = torch.tensor(counts, dtype=torch.long, device=device)
    group_of = torch.repeat_interleave(
        torch.arange(groups, device=device), sizes, output_size=total
    )
    # Row r of group g sits at position r within it: its index minus where the group starts.
    rows = torch.arange(total, device=device) - (torch.cumsum(sizes, 0) - sizes)[group_of]
    padded = padded.index_put((group_of, rows), tokens)
    product = torch.bmm(padded, weights.transpose(1, 2))
    return product[group_of, rows]
