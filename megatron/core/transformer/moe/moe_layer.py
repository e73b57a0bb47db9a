"""The MoE layer that takes the MLP's place in a transformer layer (Megatron Core's
``MoELayer``: submodules ``router``, ``experts``, ``shared_experts``).

hidden [s, b, h] (with sequence parallelism [s/TP, b, h]) -> tokens [T, h] -> router ->
dispatcher (runs the experts) -> [s, b, h], plus the shared expert's output when there is one.
"""

from typing import Optional, Tuple

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.utils import recompute, selectively_recomputed


def _tp_cp_group(pgs):
    """The ranks that split one sequence: TP (sequence parallel) x CP. The MoE losses count the
    tokens over it; it is a subgroup of ParallelState's 'tp-cp' group."""
    return getattr(pgs, "tp_cp", None)


class MoELayer(MegatronModule):
    """Router, local experts, token dispatcher and optional shared expert."""

    def __init__(self, config, pg_collection=None, submodules=None):
        super().__init__(config)
        pgs = resolve_pg_collection(config, pg_collection)
        self.ep_size, self.ep_rank = pgs.ep_size, pgs.ep_rank
        self.router = TopKRouter(
            config, tp_cp_group=_tp_cp_group(pgs), tp_dp_cp_group=getattr(pgs, "tp_dp_cp", None)
        )
        self.experts = SequentialMLP(config, self.ep_rank, self.ep_size, pgs.expt_tp)
        num_local = self.experts.num_local_experts
        if C.group_size(pgs.tp_ep) != self.ep_size * pgs.expt_tp_size:
            raise ValueError(
                "the MoE layer needs the expert tensor x expert parallel group (pg_collection "
                "from megatron.core.parallel_state.initialize_model_parallel)"
            )
        if config.moe_token_dispatcher_type == "allgather":
            self.dispatcher = MoEAllGatherTokenDispatcher(num_local, self.ep_rank, pgs.tp_ep)
        else:  # alltoall, and flex (DeepEP kernels are not available here: same exchange)
            self.dispatcher = MoEAlltoAllTokenDispatcher(
                num_local, self.ep_size, pgs.expt_tp_size, pgs.tp_ep
            )
        self.shared_experts = (
            SharedExpertMLP(config, pg_collection=pgs)
            if config.moe_shared_expert_intermediate_size
            else None
        )
        self.recompute_layer = bool(config.moe_layer_recompute) or selectively_recomputed(
            config, "moe"
        )
        self.recompute_shared = selectively_recomputed(config, "shared_experts")

    def _routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        seq, batch, hidden = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden)
        probs, routing_map = self.router(tokens, seq)
        output = self.dispatcher.run(tokens, probs, routing_map, self.experts)
        return output.view(seq, batch, hidden)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = self._routed(hidden_states)
        if self.shared_experts is not None:
            if self.recompute_shared and self.training and not self.recompute_layer:
                shared = recompute(self.config, self.shared_experts, hidden_states)
            else:
                shared = self.shared_experts(hidden_states)
            output = output + shared
        return output

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[s, b, h] -> (output [s, b, h], None)."""
        if self.recompute_layer and self.training:
            return recompute(self.config, self._forward, hidden_states), None
        return self._forward(hidden_states), None
