"""Gradient reductions after all micro-batches of an iteration, across the non-data-parallel groups.

With pipeline parallelism and tied input/output embeddings, the first stage holds the word
embedding and the last stage a copy of it as the output layer's weight; each copy receives only
its own part of the gradient, so the two are summed over the embedding group (first + last stage)
and both copies then take the same optimizer step and stay equal.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


def _unwrap(module):
    inner = module
    while not hasattr(inner, "shared_embedding_or_output_weight") and hasattr(inner, "module"):
        inner = inner.module
    return inner


def _grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def get_shared_embedding_weight(
    model_chunks: List[torch.nn.Module], is_first_stage: bool, is_last_stage: bool
) -> Optional[torch.nn.Parameter]:
    """The tied embedding / output weight this rank holds as a pipeline end, or None."""
    if not (is_first_stage or is_last_stage) or (is_first_stage and is_last_stage):
        return None
    inner = _unwrap(model_chunks[0] if is_first_stage else model_chunks[-1])
    if not getattr(inner, "share_embeddings_and_output_weights", False):
        return None
    if getattr(inner, "pre_process", False) and getattr(inner, "post_process", False):
        return None
    return inner.shared_embedding_or_output_weight()


def allreduce_embedding_grads(
    model_chunks: List[torch.nn.Module], embedding_group, is_first_stage: bool, is_last_stage: bool
) -> None:
    """Sum the tied word-embedding gradient over the first and last pipeline stage
    (``main_grad`` when the DDP wrapper gave the parameter one, else ``grad``)."""
    if embedding_group is None or dist.get_world_size(embedding_group) < 2:
        return
    weight = get_shared_embedding_weight(model_chunks, is_first_stage, is_last_stage)
    if weight is None:
        return
    grad = _grad_of(weight)
    if grad is None:
        # A stage that saw no gradient still has to take part in the collective.
        grad = torch.zeros_like(weight)
        weight.grad = grad
    dist.all_reduce(grad, group=embedding_group)


def finalize_model_grads(
    model_chunks: List[torch.nn.Module],
    parallel_state=None,
    num_tokens: Optional[torch.Tensor] = None,
    timers=None,
) -> None:
    """Everything the trainer does with gradients between the schedule and the optimizer step.

    1. each chunk's data-parallel reduction (``finish_grad_sync``, averaging over DP x CP);
    2. the tied embedding gradient summed over the embedding group (pipeline ends);
    3. with per-token loss (``num_tokens`` given: this rank's token count, meaningful on the last
       stage) the count is broadcast from the last stage over the pipeline group, summed over
       DP x CP, and every gradient buffer scaled by DP*CP / total so that gradients are
       sum(loss) / total tokens.

    ``parallel_state`` is the ``ParallelState`` of ``initialize_model_parallel`` (None: one process).
    Sequence-parallel norm gradients are reduced separately (``allreduce_sequence_parallel_grads``).
    """

    def timer(name):
        return timers(name, log_level=1) if timers is not None else None

    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if parallel_state is None:
        return
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1:
        t = timer("embedding-grads-all-reduce")
        if t:
            t.start()
        allreduce_embedding_grads(
            model_chunks,
            parallel_state.get_embedding_group(),
            parallel_state.is_pipeline_first_stage(),
            parallel_state.is_pipeline_last_stage(),
        )
        if t:
            t.stop()
    if num_tokens is not None:
        num_tokens = num_tokens.clone()
        if pp_size > 1:
            last = dist.get_global_rank(
                parallel_state.get_pipeline_model_parallel_group(), pp_size - 1
            )
            dist.broadcast(
                num_tokens, src=last, group=parallel_state.get_pipeline_model_parallel_group()
            )
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if dp_cp > 1:
            dist.all_reduce(
                num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        scale = dp_cp / max(1, int(num_tokens.item()))
        for chunk in model_chunks:
            scale_gradients = getattr(chunk, "scale_gradients", None)
            if scale_gradients is not None:  # FSDP2: the gradients are sharded DTensors
                scale_gradients(scale)
                continue
            for buffer in getattr(chunk, "buffers", []):
                buffer.data.mul_(scale)
