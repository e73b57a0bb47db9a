"""Layer-wise distributed optimizer: the optimizer state sharded over data parallelism by whole
parameters (Megatron's choice for Muon, whose update needs each matrix whole).

Gradients are all-reduced over the data-parallel group as without a distributed optimizer (the
DDP wrapper's plain mode). Each DP rank then owns a share of the parameters (assigned largest
first to the least loaded rank, the same on every rank) and keeps master weights and optimizer
state for those only; its step updates them, and every rank broadcasts the params it owns so
that all replicas agree again. Grad norm, clipping, zero counts and the inf/NaN check span all
ranks (``stats_group`` must be the world): each parameter is owned, and so counted, once.

Experts (MoE, ``allreduce = False``): the ranks of the DP group hold different experts, so the
expert parameters are shared out, and broadcast, over the expert-data-parallel group (the
ranks holding the same experts) instead.

Checkpoints: in torch_dist only, where each rank writes the state of the params it owns
(dist_checkpointing/optimizer_state.py reads its ``mixed_precision`` optimizer); the torch
format's whole-optimizer state dict is not implemented (the arguments refuse it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.tensor_parallel import collectives

from .grad_scaler import ConstantGradScaler
from .optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MainParamCopy,
    MegatronOptimizer,
)
from .optimizer_config import OptimizerConfig


def assign_owners(params: List[torch.Tensor], dp_size: int) -> List[int]:
    """DP rank owning each of ``params``: largest first onto the least loaded rank (ties: the
    earlier param, the lower rank), so the shares are balanced and every rank computes the same."""
    load = [0] * dp_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += params[i].numel()
    return owners


class LayerWiseDistributedOptimizer(MegatronOptimizer):
    """Wraps the mixed-precision optimizer of this DP rank's share of the params."""

    def __init__(
        self,
        build_inner: Callable[[List[Dict[str, Any]]], torch.optim.Optimizer],
        param_groups: List[Dict[str, Any]],
        config: OptimizerConfig,
        data_parallel_group,
        stats_group=None,
        tp_rank: int = 0,
        expert_data_parallel_group=None,
    ):
        if config.fp16:
            raise ValueError("the layer-wise distributed optimizer does not support --fp16")
        self.data_parallel_group = data_parallel_group
        self.dp_size = collectives.group_size(data_parallel_group)
        self.dp_rank = collectives.group_rank(data_parallel_group)
        params = [p for group in param_groups for p in group["params"]]
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        self.shares: List[Tuple[Any, int, List[List[torch.Tensor]]]] = []
        """(group, this rank's place in it, the params each of its ranks owns): the dense
        params over DP, the expert params over expert DP."""
        self.is_owned: Dict[torch.Tensor, bool] = {}
        for share_params, group in (
            (dense, data_parallel_group),
            (experts, expert_data_parallel_group),
        ):
            if not share_params:
                continue
            size, rank = collectives.group_size(group), collectives.group_rank(group)
            owners = assign_owners(share_params, size)
            by_owner = [[p for p, o in zip(share_params, owners) if o == r] for r in range(size)]
            self.shares.append((group, rank, by_owner))
            for p, o in zip(share_params, owners):
                self.is_owned[p] = o == rank
        # Every group stays, possibly empty on this rank: the scheduler and logs see the same
        # groups on every rank.
        owned_groups = [
            {**group, "params": [p for p in group["params"] if self.is_owned[p]]}
            for group in param_groups
        ]
        inner = build_inner(owned_groups)
        if config.bf16:
            scaler = None
            if config.loss_scale is not None:
                scaler = ConstantGradScaler(config.loss_scale, device=params[0].device)
            self.mixed_precision = Float16OptimizerWithFloat16Params(
                inner, config, scaler, stats_group, tp_rank
            )
        else:
            self.mixed_precision = FP32Optimizer(inner, config, stats_group, tp_rank)
        super().__init__(inner, config, stats_group, tp_rank)

    def get_loss_scale(self) -> torch.Tensor:
        return self.mixed_precision.get_loss_scale()

    def main_param_copies(self) -> Dict[torch.Tensor, MainParamCopy]:
        """The masters of the half-precision params this DP rank owns; a param owned by another
        DP rank has its master there (each param is whole on exactly one DP rank)."""
        owned = self.mixed_precision.main_param_copies()
        return {
            p: MainParamCopy(owned[p].data if p in owned else None, group)
            for group, _rank, by_owner in self.shares
            for params in by_owner
            for p in params
            if p.dtype in (torch.float16, torch.bfloat16)
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mixed_precision.zero_grad(set_to_none)
        for p, owned in self.is_owned.items():
            if not owned:
                p.grad = None

    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        update_successful, grad_norm, num_zeros = self.mixed_precision.step()
        if update_successful:
            self._broadcast_params()
        return update_successful, grad_norm, num_zeros

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every rank sends the params it updated to the other DP ranks (one flat tensor each)."""
        timer = self._start("params-all-gather")
        for process_group, my_rank, by_owner in self.shares:
            for rank, params in enumerate(by_owner):
                if not params or len(by_owner) == 1:
                    continue
                by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
                for p in params:
                    by_dtype.setdefault(p.dtype, []).append(p)
                for group in by_dtype.values():
                    flat = _flatten_dense_tensors([p.detach() for p in group])
                    collectives.broadcast(flat, rank, process_group)
                    if rank != my_rank:
                        for p, value in zip(group, _unflatten_dense_tensors(flat, group)):
                            p.copy_(value)
        timer.stop()

    def reload_model_params(self) -> None:
        self.mixed_precision.reload_model_params()

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError(
            "checkpoints of the layer-wise distributed optimizer are not implemented yet"
        )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError(
            "checkpoints of the layer-wise distributed optimizer are not implemented yet"
        )
