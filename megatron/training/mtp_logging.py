"""The multi-token-prediction losses in the log line and TensorBoard (Megatron's names
``mtp_1 loss``, ``mtp_2 loss``, ...).

Each depth's value is the mean of its loss over the tokens that have a target, per
micro-batch, averaged over the micro-batches and data-parallel replicas of the step: the
value of the one-process run at every layout (the context-parallel ranks' parts of a
sequence's mean add up; tensor-parallel ranks hold the same value)."""

from __future__ import annotations

from typing import Dict

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.utils import unwrap_model


def collect_mtp_losses(model, state, num_microbatches: int) -> Dict[str, torch.Tensor]:
    """name -> 0-d tensor on the device, on the ranks of the last pipeline stage (the others
    return {}); the blocks' sums are cleared. Called by every rank of the last stage (it
    reduces over their context- and data-parallel groups)."""
    blocks = [getattr(unwrap_model(chunk), "mtp", None) for chunk in model]
    blocks = [b for b in blocks if b is not None]
    if not blocks:
        return {}
    values = sum(b.mtp_metrics() for b in blocks)
    for block in blocks:
        block.reset_mtp_metrics()
    if state is not None:
        values = C.all_reduce(values, state.get_context_parallel_group())
        dp = state.get_data_parallel_group()
        values = C.all_reduce(values, dp) / C.group_size(dp)
    values = values / num_microbatches
    return {f"mtp_{i + 1} loss": values[i] for i in range(values.shape[0])}
