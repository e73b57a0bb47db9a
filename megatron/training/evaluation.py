"""Evaluation on the validation and test sets: forward-only passes over --eval-iters batches
and Megatron's report of their loss."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.device import collective_device
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

from . import global_vars
from .rerun import results_not_validated
from .run import Run
from .training_log import print_evaluation
from .utils import pipeline_schedule_kwargs, print_rank_0


def evaluate(
    forward_step_func,
    data_iterator,
    model,
    config,
    verbose: bool = False,
    eval_iters: int = None,
    *,
    run: Optional[Run] = None,
):
    """Forward-only over --eval-iters batches; Σ loss / Σ tokens, reduced over DP×CP; the
    samples count into ``run.state.consumed_valid_samples``. ``run``: as for train_step."""
    run = run or global_vars.get_run()
    args, state = run.args, run.parallel_state
    for chunk in model:
        chunk.eval()
    eval_iters = eval_iters if eval_iters is not None else args.eval_iters
    forward_backward_func = get_forward_backward_func(
        args.pipeline_model_parallel_size,
        getattr(args, "virtual_pipeline_model_parallel_size", None),
    )
    totals = {}
    eval_gbs = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    eval_mbs = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
    num_microbatches = eval_gbs // (eval_mbs * args.data_parallel_size)
    dp_cp_group = state.get_data_parallel_group(with_context_parallel=True)
    device = collective_device(dp_cp_group)  # the totals are summed over DP x CP below
    with torch.no_grad(), results_not_validated(run.rerun):
        for step in range(eval_iters):
            if verbose:
                print_rank_0(f"Evaluating iter {step + 1}/{eval_iters}")
            losses = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=eval_mbs,
                forward_only=True,
                step_context=run.step_context,
                **pipeline_schedule_kwargs(args, state),
            )
            if state.is_pipeline_last_stage():
                for loss in losses:
                    for key, value in loss.items():
                        value = value.detach().float().view(-1).to(device)
                        if value.numel() != 2:
                            value = torch.stack([value.sum(), torch.ones((), device=value.device)])
                        totals[key] = totals.get(key, torch.zeros(2, device=value.device)) + value
            run.state.consumed_valid_samples += eval_gbs
    for chunk in model:
        chunk.train()
    result = {}
    for key, total in totals.items():
        if dist.is_initialized():
            dist.all_reduce(total, group=dp_cp_group)
        result[key] = (total[0] / total[1]).item()
    return result


def evaluate_and_print_results(
    prefix,
    forward_step_func,
    data_iterator,
    model,
    iteration,
    config,
    verbose=False,
    test=False,
    *,
    run: Optional[Run] = None,
):
    run = run or global_vars.get_run()
    totals = evaluate(forward_step_func, data_iterator, model, config, verbose, run=run)
    return print_evaluation(
        prefix, totals, iteration, run.state.consumed_train_samples, test=test, run=run
    )
