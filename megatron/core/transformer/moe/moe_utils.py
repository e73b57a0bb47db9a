"""Pure functions of MoE routing: scores, top-k selection, capacity, the load-balancing and
z losses, Sinkhorn, and the autograd hook that adds an auxiliary loss to backward.

Formulas (T tokens, E experts, k = top-k, p = router probabilities over all experts [T, E],
c_i = tokens routed to expert i):

* aux_loss (Switch / GShard): coeff * E / (k * T^2) * sum_i c_i * sum_t p[t, i];
* seq_aux_loss: the same per sequence (T = its length), averaged over the sequences;
* global_aux_loss: the same with c_i counted over the global batch (every rank of TP x DP x CP)
  and averaged over the micro-batches of the step so far, T the tokens of one micro-batch on all
  those ranks;
* z-loss (ST-MoE): coeff * mean_t logsumexp(logits[t])^2.

When a rank holds only part of the tokens (sequence or context parallelism) the counts c_i and
T are those of all parts, the probabilities this rank's: the parts' losses add up to the loss
of the whole.
"""

import math
from typing import Optional, Tuple

import torch


def topk_with_groups(
    scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int]
) -> torch.Tensor:
    """Indices [T, k] of the k largest scores per row; with groups, only among the experts of
    the ``group_topk`` groups whose best ``topk // group_topk`` scores sum highest (DeepSeek's
    group-limited routing)."""
    if not num_groups:
        return torch.topk(scores, k=topk, dim=-1).indices
    tokens, experts = scores.shape
    per_group = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, chosen_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, k=topk, dim=-1).indices


def route_topk(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] with the routing weights at the selected experts and 0 elsewhere,
    routing_map [T, E] bool).

    softmax: the softmax of the k selected logits (``pre_softmax``: of all logits, then the k
    largest probabilities); sigmoid: sigmoid of the logits, the k selected normalized to sum 1
    when k > 1; sqrtsoftplus: the same with sqrt(softplus(logit)) for the sigmoid.
    ``expert_bias`` [E] is added to the scores for the selection only.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = logits
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = _bounded_scores(logits, score_function)
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    indices = topk_with_groups(selection, topk, num_groups, group_topk)
    weights = torch.gather(scores, 1, indices)
    if score_function == "softmax" and not pre_softmax:
        weights = torch.softmax(weights, dim=-1)
    elif score_function != "softmax" and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, indices, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def _bounded_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-expert scores of the non-softmax functions: sigmoid(x) or sqrt(softplus(x))."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    return torch.sqrt(torch.nn.functional.softplus(logits))


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The probabilities over all experts that the balancing losses weigh."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = _bounded_scores(logits, score_function)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_load_balancing_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """coeff * E / (k * T^2) * sum_i c_i * sum_t p[t, i] (module docstring)."""
    per_expert = probs.sum(dim=0)
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(per_expert * tokens_per_expert.to(probs.dtype)) * scale


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Balanced assignment weights by Sinkhorn iterations on exp(cost): rows and columns are
    rescaled in turn until the column scaling changes by less than ``tol`` (mean abs)."""
    cost = torch.exp(cost)
    rows = torch.ones(cost.size(0), dtype=cost.dtype, device=cost.device)
    cols = torch.ones(cost.size(1), dtype=cost.dtype, device=cost.device)
    eps = 1e-8
    change = float("inf")
    previous = cols
    while change > tol:
        rows = 1.0 / (rows.numel() * (torch.sum(cols * cost, dim=1) + eps))
        cols = 1.0 / (cols.numel() * (torch.sum(rows.unsqueeze(1) * cost, dim=0) + eps))
        change = torch.mean(torch.abs(previous - cols)).item()
        previous = cols
    return cols * cost * rows.unsqueeze(1)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """ceil(T * k / E * factor): the tokens an expert takes before it drops."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert: those with the largest weights ('probs') or
    the earliest ('position'). With ``pad_to_capacity`` every expert receives exactly
    min(capacity, T) tokens: the kept ones and, as filler, others with weight 0."""
    tokens = probs.shape[0]
    capacity = min(capacity, tokens)
    if drop_policy == "probs":
        key = probs.masked_fill(~routing_map, float("-inf"))
        kept_idx = torch.topk(key, k=capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept_idx, True) & routing_map
    elif drop_policy == "position":
        keep = routing_map & (torch.cumsum(routing_map.long(), dim=0) <= capacity)
    else:
        raise ValueError(f"unknown token drop policy {drop_policy!r}")
    probs = probs * keep
    if not pad_to_capacity:
        return probs, keep
    # Fillers: the first tokens not kept, up to `capacity` per expert.
    missing = capacity - keep.sum(dim=0, keepdim=True)
    filler = ~keep & (torch.cumsum((~keep).long(), dim=0) <= missing)
    return probs, keep | filler


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; in backward the auxiliary loss receives the gradient ``scale``
    (the factor the schedule applies to the main loss: a float or a one-element tensor), so it
    is trained as if added to it."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale
        if torch.is_tensor(scale):
            grad = torch.ones_like(aux_loss) * scale.to(aux_loss.dtype).reshape(())
        else:
            grad = torch.full_like(aux_loss, scale)
        return grad_output, grad, None
