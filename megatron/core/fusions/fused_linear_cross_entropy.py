"""Output layer and cross entropy in one autograd Function, over chunks of tokens
(``--cross-entropy-loss-fusion``).

The unfused path keeps [N, V] logits, their fp32 copy and the fp32 softmax. Here the logits exist
one chunk of rows at a time: the forward computes a chunk's logits (in the matmul's dtype), turns
them in place into the fp32 numerator exp(logit - row max), and keeps only three numbers per token
(row max, sum of exponentials, target logit). The backward walks the chunks in reverse, recomputes
each chunk's logits and numerator, turns the numerator in place into the logits' gradient
(softmax - onehot, scaled by the incoming gradient) and multiplies it into the rows of the hidden
states' gradient and into the weight's gradient. The last chunk's numerator is kept from the
forward, so a batch that fits in one chunk costs no recompute (the CPU benchmark's case), and a
large one recomputes every chunk but the last: one extra output-layer matmul, against
[N, V] fp32 never being held. The values are those of
``F.cross_entropy(hidden @ W^T, target, reduction='none')`` up to rounding; with several chunks
the weight's gradient is summed over chunks (in fp32 for half-precision weights).

A chunk holds at most ``CHUNK_ELEMENTS`` logits (the rows are split evenly): at GPT-2's vocabulary
(50,304) that is ~2,600 tokens, 512 MB of fp32 numerator, against 6.6 GB of fp32 logits for a
micro-batch of 32 x 1024 tokens.

Tensor parallelism: ``weight`` may be this rank's vocabulary shard [V/TP, h] (rank t owns ids
[t V/TP, (t + 1) V/TP)). Each chunk's numerator uses this rank's row max; after the last chunk
the row max is all-reduced (MAX), and the target logit and the sum of exponentials (rescaled to
the global max) in one SUM all-reduce: the three reductions of Megatron's vocab-parallel cross
entropy, once per call, not per chunk. The gradient returned for ``hidden`` is this rank's
partial sum: the caller passes the hidden states through ``copy_to_tensor_model_parallel_region``
(or the sequence-parallel gather) first, whose backward all-reduces (reduce-scatters) it, exactly
as for the output layer.

No label smoothing (Megatron's fused cross entropy has none either). A second backward through
the same graph fails autograd's in-place version check instead of returning wrong gradients.
"""

import math
from typing import Optional

import torch

from megatron.core.tensor_parallel import collectives as C

CHUNK_ELEMENTS = 2**27
_HALF = (torch.float16, torch.bfloat16)


def chunk_rows(rows: int, partition: int, chunk_elements: Optional[int] = None) -> int:
    """Tokens per chunk: the rows split evenly into chunks of at most ``chunk_elements`` logits
    (at least one row per chunk; default ``CHUNK_ELEMENTS``)."""
    chunk_elements = chunk_elements or CHUNK_ELEMENTS
    chunks = max(1, math.ceil(rows * partition / chunk_elements))
    return max(1, math.ceil(rows / chunks))


def _logits(hidden, weight, fp32_softmax: bool):
    """One chunk's logits hidden @ weight^T, upcast to fp32 for the softmax if asked."""
    logits = torch.mm(hidden, weight.t())
    if fp32_softmax and logits.dtype in _HALF:
        logits = logits.float()
    return logits


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss[n] = logsumexp_v(hidden[n] . weight[v]) - hidden[n] . weight[target[n]]."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        tp_group,
        fp32_softmax: bool,
        chunk: int,
    ) -> torch.Tensor:
        # hidden [N, h], weight [Vp, h], target [N] (global ids)
        size = C.group_size(tp_group)
        rows, partition = hidden.shape[0], weight.shape[0]
        if size > 1:
            start = C.group_rank(tp_group) * partition
            outside = (target < start) | (target >= start + partition)
            local_target = (target - start).masked_fill_(outside, 0)
        else:
            outside, local_target = None, target
        dtype = torch.float32 if fp32_softmax and weight.dtype in _HALF else weight.dtype
        stats = torch.empty(3, rows, dtype=dtype, device=hidden.device)
        local_max, sum_exp, target_logit = stats[0], stats[1], stats[2]
        numer = None
        for begin in range(0, rows, chunk):
            part = slice(begin, min(begin + chunk, rows))
            numer = None  # the previous chunk's numerator is freed before the next is made
            logits = _logits(hidden[part], weight, fp32_softmax)
            target_logit[part] = logits.gather(1, local_target[part].unsqueeze(1)).squeeze(1)
            local_max[part] = logits.amax(dim=1)
            numer = logits.sub_(local_max[part].unsqueeze(1)).exp_()
            del logits
            sum_exp[part] = numer.sum(dim=1)
        # The softmax of a row is numerator / denominator, the numerator relative to this rank's
        # row max; the denominator is the sum of exponentials relative to that max too.
        if size > 1:
            target_logit.masked_fill_(outside, 0.0)
            row_max = local_max.clone()
            C.all_reduce(row_max, tp_group, op=torch.distributed.ReduceOp.MAX)
            to_global = (local_max - row_max).exp_()
            reduced = C.all_reduce(torch.stack([target_logit, sum_exp * to_global]), tp_group)
            target_logit, sum_exp = reduced[0], reduced[1]
            denominator = sum_exp / to_global
        else:
            row_max, denominator = local_max, sum_exp
        loss = sum_exp.log().add_(row_max).sub_(target_logit)
        ctx.save_for_backward(
            hidden,
            weight,
            local_target,
            local_max,
            denominator,
            numer,
            outside
            if outside is not None
            else torch.empty(0, dtype=torch.bool, device=loss.device),
        )
        ctx.tp_size, ctx.chunk, ctx.fp32_softmax = size, chunk, fp32_softmax
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, local_target, local_max, denominator, last, outside = ctx.saved_tensors
        g = grad_loss.to(denominator.dtype)
        scale = g / denominator  # softmax * g = numerator * scale, per row
        minus_g = g.neg()
        if ctx.tp_size > 1:
            minus_g = minus_g.masked_fill_(outside, 0.0)
        rows, chunk = hidden.shape[0], ctx.chunk
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight: Optional[torch.Tensor] = None
        starts = list(range(0, rows, chunk))
        accumulate = torch.float32 if weight.dtype in _HALF else weight.dtype
        for begin in reversed(starts):
            part = slice(begin, min(begin + chunk, rows))
            if begin == starts[-1]:
                numer = last
            else:
                numer = _logits(hidden[part], weight, ctx.fp32_softmax)
                numer.sub_(local_max[part].unsqueeze(1)).exp_()
            grad = numer.mul_(scale[part].unsqueeze(1))
            grad.scatter_add_(1, local_target[part].unsqueeze(1), minus_g[part].unsqueeze(1))
            grad = grad.to(weight.dtype)
            if want_hidden:
                torch.mm(grad, weight, out=grad_hidden[part])
            if want_weight:
                if grad_weight is None:
                    grad_weight = grad.t().mm(hidden[part])
                    if len(starts) > 1:
                        grad_weight = grad_weight.to(accumulate)
                elif grad_weight.dtype == weight.dtype:
                    grad_weight.addmm_(grad.t(), hidden[part])
                else:
                    grad_weight.add_(grad.t().mm(hidden[part]))
            del numer, grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    fp32_softmax: bool = True,
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight^T`` against ``target``, without keeping logits.

    hidden [..., h]; weight [V, h] (or this rank's vocab shard [V/TP, h] with ``tp_group``);
    target [...] global token ids. Returns the losses [...]. With ``fp32_softmax`` half-precision
    logits are turned into fp32 for the softmax and the loss (float32 and float64 stay as they
    are); without it everything stays in the matmul's dtype (``fp16_lm_cross_entropy``).
    ``chunk_tokens``: tokens per chunk (default: ``chunk_rows`` of ``CHUNK_ELEMENTS``).
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"target of shape {tuple(target.shape)} does not match hidden states of shape "
            f"{tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}"
        )
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    rows = flat_hidden.shape[0]
    chunk = chunk_tokens or chunk_rows(rows, weight.shape[0])
    flat = LinearCrossEntropyFunction.apply(
        flat_hidden, weight, target.reshape(-1), tp_group, bool(fp32_softmax), max(1, chunk)
    )
    return flat.view(target.shape)
