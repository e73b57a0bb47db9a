"""``--log-params-norm``: the L2 norm of all the model's parameters, the same number at every
parallel layout (Megatron's ``calc_params_l2_norm``).

Each parameter is counted once over the ranks: one not split over (expert-)tensor parallelism
is counted on its (expert-)tensor-parallel rank 0 only, and the copy of the tied embedding on the
last pipeline stage (``shared``) not at all. The per-rank sums of squares are added over the
model-parallel group (TP x PP) for dense parameters and over the expert-tensor x expert x
pipeline group for expert parameters (``allreduce = False``).

With --bf16 the norm is that of the fp32 main params the optimizer keeps (the bf16 model params
are their rounding), as Megatron's; under the distributed optimizer each rank holds a slice of
them, whose sums of squares are first added over the slices' (expert-)data-parallel group. With
--fp16 and fp32 it is that of the model params, as Megatron's. Under FSDP2 each rank holds a
shard of every parameter (and of its main param): their sums of squares are first added over the
FSDP group.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.device import collective_device
from megatron.core.optimizer.clip_grads import param_is_counted_once, sum_of_powered_norms
from megatron.core.optimizer.optimizer import MainParamCopy
from megatron.core.tensor_parallel import collectives as C


class _Part:
    """The tensors of one kind (dense or expert) whose sums of squares are added over one group
    before the model-parallel reduction: whole params (``shard_group`` None) or main-param
    slices of one data-parallel group."""

    def __init__(self, shard_group=None):
        self.shard_group = shard_group
        self.tensors: List[torch.Tensor] = []


def params_l2_norm(model, optimizer, state, use_main_params: bool) -> float:
    """The norm of the parameters of all model chunks of all ranks. Every rank must call it
    (it reduces across ranks) and gets the same value."""
    copies: Dict[torch.Tensor, MainParamCopy] = (
        optimizer.main_param_copies() if use_main_params else {}
    )
    tp_rank = state.get_tensor_model_parallel_rank()
    etp_rank = state.get_expert_tensor_parallel_rank()
    # (expert, sharded) -> part; at most one shard group per kind (the optimizer's buffers of
    # one kind share their data-parallel group).
    parts: Dict[Tuple[bool, bool], _Part] = {}
    for chunk in model:
        # FSDP2: the tensors the optimizer steps (its main params' keys) are this rank's shards,
        # which make up the params over the chunk's data-parallel (x context-parallel) group.
        fsdp = hasattr(chunk, "local_shards")
        params = chunk.local_shards().parameters() if fsdp else chunk.parameters()
        for param in params:
            expert = not getattr(param, "allreduce", True)
            if not param_is_counted_once(param, etp_rank if expert else tp_rank):
                continue
            copy: Optional[MainParamCopy] = copies.get(param)
            group = None if copy is None else copy.shard_group
            if fsdp:
                group = chunk.data_parallel_group
            data = param if copy is None else copy.data
            part = parts.setdefault((expert, group is not None), _Part(group))
            if part.shard_group is not group:
                raise ValueError(
                    "--log-params-norm: the optimizer shards the main params of one kind over two "
                    "different groups"
                )
            if data is not None:
                part.tensors.append(data.detach())

    device = collective_device(state.get_model_parallel_group())
    sums = {}
    # A fixed order of collectives: every rank of a group takes the same steps.
    for expert in (False, True):
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for sharded in (False, True):
            part = parts.get((expert, sharded))
            if part is None:
                continue
            partial = sum_of_powered_norms(part.tensors, 2.0, device).reshape(1)
            if sharded:
                # Data-parallel ranks of one stage hold the same params: all have this part.
                C.all_reduce(partial, part.shard_group)
            total += partial
        sums[expert] = total
    if sorted(state.ranks.get("mp", [])) == sorted(state.ranks.get("tp-ep-pp", [])):
        total = sums[False] + sums[True]
        C.all_reduce(total, state.get_model_parallel_group())
    else:
        # Every rank joins both reductions, also one without expert params (a stage without MoE
        # layers), or the others would wait for it.
        C.all_reduce(sums[False], state.get_model_parallel_group())
        C.all_reduce(sums[True], state.group("tp-ep-pp"))
        total = sums[False] + sums[True]
    return float(total.item()) ** 0.5
