"""Every gradient reduction between the last backward of an iteration and the optimizer step.

With pipeline parallelism and tied input/output embeddings, the first stage holds the word
embedding and the last stage a copy of it as the output layer's weight; each copy receives only
its own part of the gradient, so the two are summed over the embedding group (first + last stage)
and both copies then take the same optimizer step and stay equal.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.device import collective_device
from megatron.core.parallel_state import current_parallel_state
from megatron.core.tensor_parallel.grads import allreduce_sequence_parallel_grads
from megatron.core.utils import get_model_config, unwrap_model


def _grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def get_shared_embedding_weight(
    model_chunks: List[torch.nn.Module], is_first_stage: bool, is_last_stage: bool
) -> Optional[torch.nn.Parameter]:
    """The tied embedding / output weight this rank holds as a pipeline end, or None."""
    if not (is_first_stage or is_last_stage) or (is_first_stage and is_last_stage):
        return None
    inner = unwrap_model(model_chunks[0] if is_first_stage else model_chunks[-1])
    on_both_ends = getattr(inner, "_embedding_on_both_ends", None)  # LanguageModule's
    if on_both_ends is not None:
        if not on_both_ends():
            return None
    elif not getattr(inner, "share_embeddings_and_output_weights", False):
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
    model: List[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection=None,
    *,
    timers=None,
) -> None:
    """Everything the trainer does with gradients between the schedule and the optimizer step.

    1. each chunk's data-parallel reduction (``finish_grad_sync``: the dense gradients averaged
       over DP x CP, the expert gradients, ``allreduce = False``, summed over expert DP);
    2. the tied embedding gradient summed over the embedding group (pipeline ends);
    3. with per-token loss (``num_tokens`` given: this rank's token count, meaningful on the last
       stage) the count is broadcast from the last stage over the pipeline group, summed over
       DP x CP, and every gradient scaled by DP*CP / total so that gradients are
       sum(loss) / total tokens;
    4. with sequence parallelism, the gradients of the parameters replicated over TP whose
       input was split along the sequence (norms, row-parallel biases, MoE routers) summed over
       TP; with QK layernorm (each TP rank normalizes its own heads) its norms' too;
    5. MoE aux-loss-free balancing: each router's expert bias moved by this step's token counts,
       summed over TP x DP x CP (every rank then holds the same bias); the routers' global-batch
       token counts (``global_aux_loss``) start afresh for the next step.

    The schedules call it (the step context's ``finalize_model_grads_func``) after the last
    backward, with the token count of the iteration; a library caller may call it after the
    schedule. Megatron-core's signature: ``model`` is the list of model chunks,
    ``pg_collection`` the ``ParallelState`` whose groups to reduce over (None: the current
    ``parallel_state``'s, or one process without one). ``timers`` time the whole
    ('all-grads-sync') and the embedding and sequence-parallel reductions.
    """
    model_chunks = model
    parallel_state = pg_collection
    if parallel_state is None:
        parallel_state = current_parallel_state()

    def timer(name):
        return timers(name, log_level=1) if timers is not None else None

    sync_timer = timer("all-grads-sync")
    if sync_timer:
        sync_timer.start(barrier=get_model_config(model_chunks[0]).barrier_with_L1_time)
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    if parallel_state is not None:
        _reduce_across_model_parallel_groups(model_chunks, parallel_state, num_tokens, timer)
    _update_expert_biases(model_chunks, parallel_state)
    if sync_timer:
        sync_timer.stop()


def _reduce_across_model_parallel_groups(model_chunks, parallel_state, num_tokens, timer):
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
        num_tokens = num_tokens.clone()  # the collectives below work in place
        if pp_size > 1:
            pp_group = parallel_state.get_pipeline_model_parallel_group()
            num_tokens = num_tokens.to(collective_device(pp_group))
            last = dist.get_global_rank(pp_group, pp_size - 1)
            dist.broadcast(num_tokens, src=last, group=pp_group)
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if dp_cp > 1:
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            num_tokens = num_tokens.to(collective_device(dp_cp_group))
            dist.all_reduce(num_tokens, group=dp_cp_group)
        scale = dp_cp / max(1, int(num_tokens.item()))
        for chunk in model_chunks:
            chunk.scale_gradients(scale)
    config = get_model_config(model_chunks[0])
    if config.sequence_parallel or getattr(config, "qk_layernorm", False):
        t = timer("layernorm-grads-all-reduce")
        if t:
            t.start()
        allreduce_sequence_parallel_grads(
            model_chunks, parallel_state.get_tensor_model_parallel_group()
        )
        if t:
            t.stop()


def _update_expert_biases(model_chunks, parallel_state) -> None:
    group = None if parallel_state is None else parallel_state.group("tp-dp-cp")
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if getattr(module, "expert_bias", None) is not None and hasattr(
                module, "update_expert_bias"
            ):
                module.update_expert_bias(group)
            if hasattr(module, "reset_global_counts"):
                module.reset_global_counts()
