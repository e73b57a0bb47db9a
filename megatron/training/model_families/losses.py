"""Loss functions shared by families: the masked per-token language-model loss."""

import torch

from megatron.training import get_args, get_parallel_state
from megatron.training.rerun import check_loss


def masked_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses, token count, and the [sum, count] pair reported as 'lm
    loss' (GPT's and T5's ``loss_func``)."""
    args = get_args()
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    local_tokens = loss_mask.sum().clone().detach().to(torch.int)
    num_tokens = local_tokens
    state = get_parallel_state()
    if state.get_context_parallel_world_size() > 1 and not args.calculate_per_token_loss:
        # Each CP rank holds part of every sequence: divide by the tokens of the whole sequence
        # (the schedule multiplies by CP size and DDP averages over DP x CP).
        num_tokens = local_tokens.clone()
        torch.distributed.all_reduce(num_tokens, group=state.get_context_parallel_group())
    check_loss(loss, args)
    reported = torch.cat([loss.clone().detach().view(1), local_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": reported}
