"""Output layer and cross entropy in one autograd Function (``--cross-entropy-loss-fusion``).

The unfused path computes logits = hidden @ W^T, then log_softmax into a second [N, V] tensor
kept for backward. Here the logits are a private temporary: the forward turns them in place into
the softmax numerator exp(logit - max), keeps only that tensor and the per-row sums, and returns
the per-token loss; the backward turns the numerator in place into the logits' gradient
(softmax - onehot, scaled by the incoming gradient) and multiplies it into the gradients of the
hidden states and of the weight. One [N, V] tensor instead of two, one exp instead of two, and
no copy of the hidden states into [b, s, h] order. The values are those of
``F.cross_entropy(hidden @ W^T, target, reduction='none')`` up to rounding.

Tensor parallelism: ``weight`` may be this rank's vocabulary shard [V/TP, h] (rank t owns ids
[t V/TP, (t + 1) V/TP)); the row max, the target logit and the sum of exponentials are then
all-reduced over ``tp_group`` (three numbers per token), the three reductions of Megatron's
vocab-parallel cross entropy. The gradient returned for ``hidden`` is this rank's partial sum:
the caller passes the hidden states through ``copy_to_tensor_model_parallel_region`` (or the
sequence-parallel gather) first, whose backward all-reduces (reduce-scatters) it, exactly as for
the output layer.

No label smoothing (Megatron's fused cross entropy has none either). A second backward through
the same graph fails autograd's in-place version check instead of returning wrong gradients.
"""

import torch

from megatron.core.tensor_parallel import collectives as C


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
    ) -> torch.Tensor:
        # hidden [N, h], weight [Vp, h], target [N] (global ids)
        size = C.group_size(tp_group)
        partition = weight.shape[0]
        logits = torch.mm(hidden, weight.t())
        if fp32_softmax and logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if size > 1:
            start = C.group_rank(tp_group) * partition
            outside = (target < start) | (target >= start + partition)
            local_target = (target - start).masked_fill_(outside, 0)
        else:
            outside, local_target = None, target
        target_logit = logits.gather(1, local_target.unsqueeze(1)).squeeze(1)
        row_max = logits.amax(dim=1)
        if size > 1:
            target_logit.masked_fill_(outside, 0.0)
            C.all_reduce(row_max, tp_group, op=torch.distributed.ReduceOp.MAX)
        numer = logits.sub_(row_max.unsqueeze(1)).exp_()
        sum_exp = numer.sum(dim=1)
        if size > 1:
            stats = C.all_reduce(torch.stack([target_logit, sum_exp]), tp_group)
            target_logit, sum_exp = stats[0], stats[1]
        loss = sum_exp.log().add_(row_max).sub_(target_logit)
        ctx.save_for_backward(
            hidden,
            weight,
            local_target,
            numer,
            sum_exp,
            outside
            if outside is not None
            else torch.empty(0, dtype=torch.bool, device=loss.device),
        )
        ctx.tp_size = size
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, local_target, numer, sum_exp, outside = ctx.saved_tensors
        g = grad_loss.to(numer.dtype)
        grad = numer.mul_((g / sum_exp).unsqueeze(1))  # softmax * g
        minus_g = g.neg()
        if ctx.tp_size > 1:
            minus_g = minus_g.masked_fill_(outside, 0.0)
        grad.scatter_add_(1, local_target.unsqueeze(1), minus_g.unsqueeze(1))
        grad = grad.to(weight.dtype)
        grad_hidden = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t().mm(hidden) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    fp32_softmax: bool = True,
) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight^T`` against ``target``, without keeping logits.

    hidden [..., h]; weight [V, h] (or this rank's vocab shard [V/TP, h] with ``tp_group``);
    target [...] global token ids. Returns the losses [...]. With ``fp32_softmax`` half-precision
    logits are turned into fp32 for the softmax and the loss (float32 and float64 stay as they
    are); without it everything stays in the matmul's dtype (``fp16_lm_cross_entropy``).
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
    flat = LinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1),
        tp_group,
        bool(fp32_softmax),
    )
    return flat.view(target.shape)
