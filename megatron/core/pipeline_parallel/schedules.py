"""Forward/backward schedules over the micro-batches of one iteration.

Only the no-pipelining schedule exists so far; pipeline schedules land with the pipeline issue.
The schedule reads its options from the model config (attributes set by the trainer):
``grad_scale_func`` (loss scaling for fp16), ``calculate_per_token_loss`` and ``timers``.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Iterator, List, Optional, Union

import torch


def get_model_config(model: torch.nn.Module):
    """The TransformerConfig of a (possibly wrapped) model chunk."""
    inner = model
    while not hasattr(inner, "config") and hasattr(inner, "module"):
        inner = inner.module
    return inner.config


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None) -> Callable:
    """The schedule for a layout; only PP=1 is implemented yet."""
    if pipeline_model_parallel_size > 1 or virtual_pipeline_model_parallel_size:
        raise ValueError("not supported yet: --pipeline-model-parallel-size > 1")
    return forward_backward_no_pipelining


def _timer(config, name):
    timers = getattr(config, "timers", None)
    return timers(name, log_level=2) if timers is not None else None


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, config,
                 forward_data_store: list, forward_only: bool, collect_non_loss_data: bool = False):
    """Run one micro-batch forward and turn its loss into the tensor that backward starts from.

    A loss function may return ``(loss_sum, num_tokens, reported)`` (per-token averaging) or the
    legacy ``(loss, reported)``. Unless ``calculate_per_token_loss``, the loss is divided by its
    token count and by the number of micro-batches, so gradients are the mean over micro-batches.
    Returns ``(output_tensor, num_tokens)``.
    """
    timer = _timer(config, "forward-compute")
    if timer:
        timer.start()
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    outputs = loss_func(output_tensor)
    num_tokens = torch.tensor(0, dtype=torch.int)
    if collect_non_loss_data:
        forward_data_store.append(outputs)
    elif len(outputs) == 3:
        output_tensor, num_tokens, reported = outputs
        if not getattr(config, "calculate_per_token_loss", False):
            output_tensor = output_tensor / num_tokens
            output_tensor = output_tensor / num_microbatches
        forward_data_store.append(reported)
    elif len(outputs) == 2:
        output_tensor, reported = outputs
        output_tensor = output_tensor / num_microbatches
        forward_data_store.append(reported)
    else:
        raise ValueError(f"loss function returned {len(outputs)} values; expected 2 or 3")
    if timer:
        timer.stop()
    return output_tensor, num_tokens


def backward_step(output_tensor: torch.Tensor, config) -> None:
    timer = _timer(config, "backward-compute")
    if timer:
        timer.start()
    scale = getattr(config, "grad_scale_func", None)
    if scale is not None:
        output_tensor = scale(output_tensor)
    torch.autograd.backward(output_tensor)
    if timer:
        timer.stop()


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
) -> List[Any]:
    """All micro-batches forward then backward, one at a time; returns the reported losses.

    Gradient synchronisation happens after the last micro-batch (the trainer calls the DDP
    wrapper's ``finish_grad_sync``). The total token count is stored on ``config`` as
    ``last_num_tokens`` for per-token loss scaling.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("non-pipeline schedule needs exactly one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    config = get_model_config(model)
    no_sync = getattr(model, "no_sync", nullcontext)
    forward_data_store: List[Any] = []
    total_tokens = torch.tensor(0, dtype=torch.int)
    with no_sync():
        for _ in range(num_microbatches - 1):
            output, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, config,
                                              forward_data_store, forward_only, collect_non_loss_data)
            total_tokens += num_tokens
            if not forward_only:
                backward_step(output, config)
    # The last micro-batch runs outside no_sync so that overlapped reductions could start.
    output, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, config,
                                      forward_data_store, forward_only, collect_non_loss_data)
    total_tokens += num_tokens
    if not forward_only:
        backward_step(output, config)
    config.last_num_tokens = total_tokens
    return forward_data_store
