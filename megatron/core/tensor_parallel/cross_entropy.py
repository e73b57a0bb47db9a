"""Cross entropy over logits split along the vocabulary across tensor-parallel ranks.

Each rank holds logits [..., V/TP] for its vocab range. The full softmax is never materialized:
the per-token max, the target logit (owned by one rank) and the sum of exponentials are
all-reduced, so each rank exchanges three numbers per token. The result equals
``F.cross_entropy`` over the full (padded) vocabulary; pad columns are real logits, as in
Megatron (their rows are trained parameters).

Label smoothing follows Megatron: ``label_smoothing`` = e spreads e over the V - 1 non-target
classes, which equals torch's ``label_smoothing = e * V / (V - 1)`` (spread over all V classes).
Megatron's smoothing term averages the log-probabilities over the rank's vocabulary shard; here it
averages them over the full vocabulary (all-reduced), so the loss does not depend on the TP size.
"""

import torch

from megatron.core.tensor_parallel import collectives as C


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, label_smoothing: float, group):
        # logits [N, Vp] (a fresh tensor is made below; the input is not modified), target [N]
        size, rank = C.group_size(group), C.group_rank(group)
        partition = logits.shape[-1]
        vocab = partition * size
        logits_max = logits.max(dim=-1).values
        C.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        start = rank * partition
        outside = (target < start) | (target >= start + partition)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = (
            shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        )

        if label_smoothing > 0.0:
            shifted_sum = shifted.sum(dim=-1)
        # One all-reduce carries the target logit, the sum of exponentials (and the smoothing sum).
        exp = shifted.exp_()
        stats = [target_logit, exp.sum(dim=-1)] + ([shifted_sum] if label_smoothing > 0.0 else [])
        stats = C.all_reduce(torch.stack(stats), group)
        target_logit, sum_exp = stats[0], stats[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit
        smoothing = 0.0
        if label_smoothing > 0.0:
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_prob = stats[2] / vocab - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.smoothing = smoothing
        ctx.vocab = vocab
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logit_j = p_j - (1 - s) [j == target] - s / V; computed in place on the
        # saved softmax (a second backward fails autograd's version check instead of being wrong).
        grad = softmax
        own = (~outside).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -own.unsqueeze(-1))
        if ctx.smoothing > 0.0:
            grad.sub_(ctx.smoothing / ctx.vocab)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group=None,
) -> torch.Tensor:
    """Per-token loss [...] from this rank's logits [..., V/TP] and the global target ids [...].

    ``tp_group`` None: the logits hold the whole vocabulary. The loss has the logits' dtype.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target of shape {tuple(target.shape)} does not match logits of shape "
            f"{tuple(vocab_parallel_logits.shape)}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    partition = vocab_parallel_logits.shape[-1]
    flat = _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits.reshape(-1, partition),
        target.reshape(-1),
        float(label_smoothing),
        tp_group,
    )
    return flat.view(target.shape)
