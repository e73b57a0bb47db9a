"""Token dispatchers: bring each token to the ranks holding its experts and the experts'
outputs back, weighted by the routing probabilities.

Both work over the ``tp_ep`` group (expert-tensor x expert-parallel ranks; member g has ETP rank
g % ETP and EP rank g // ETP). Every rank of it holds different tokens (sequence parallelism
is required with TP > 1), so exchanging tokens never duplicates work:

* ``allgather``: every rank gathers all tokens of the group with their routing, runs the ones
  routed to its experts and scatter-adds the weighted outputs into a buffer of all the group's
  tokens; a reduce-scatter returns each rank its tokens' sums (over experts and ETP shards).
* ``alltoall``: each token goes only where it is needed: to every ETP rank of the EP rank holding
  its expert (uneven all-to-all), sorted by expert there; outputs come back the same way and are
  weighted and summed on the token's own rank.

The two compute the same function; ``alltoall`` moves k * T rows instead of all of them.
"""

from typing import List, Tuple

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _sorted_by_expert(routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """For a [T, n] map: (token index, expert index) of every routed pair sorted by expert then
    token, and the count per expert."""
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
    counts = routing_map.sum(dim=0).tolist()
    return token_idx, expert_idx, [int(c) for c in counts]


class MoEAllGatherTokenDispatcher:
    """See the module docstring."""

    def __init__(self, num_local_experts: int, ep_rank: int, tp_ep_group=None):
        self.num_local_experts = num_local_experts
        self.first_expert = ep_rank * num_local_experts
        self.group = tp_ep_group

    def run(self, tokens, probs, routing_map, experts) -> torch.Tensor:
        """tokens [T, h], probs / routing_map [T, E] -> [T, h]."""
        all_tokens = gather_from_sequence_parallel_region(tokens, self.group)
        all_probs = gather_from_sequence_parallel_region(probs, self.group)
        all_map = C.all_gather_along_first_dim(routing_map.contiguous(), self.group)
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        token_idx, expert_idx, counts = _sorted_by_expert(all_map[:, local])
        outputs = experts(all_tokens[token_idx], counts)
        weights = all_probs[:, local][token_idx, expert_idx].unsqueeze(-1)
        combined = torch.zeros_like(all_tokens).index_add(0, token_idx, outputs * weights)
        return reduce_scatter_to_sequence_parallel_region(combined, self.group)


class MoEAlltoAllTokenDispatcher:
    """See the module docstring."""

    def __init__(self, num_local_experts: int, ep_size: int, etp_size: int, tp_ep_group=None):
        self.num_local_experts = num_local_experts
        self.ep_size, self.etp_size = ep_size, etp_size
        self.group = tp_ep_group

    def run(self, tokens, probs, routing_map, experts) -> torch.Tensor:
        n = self.num_local_experts
        token_idx, expert_idx, counts = _sorted_by_expert(routing_map)
        # Rows for EP rank e are the pairs of its experts, consecutive since sorted by expert.
        per_ep = [sum(counts[e * n : (e + 1) * n]) for e in range(self.ep_size)]
        starts = [sum(per_ep[:e]) for e in range(self.ep_size)]
        send_rows, input_splits, send_counts = [], [], []
        for member in range(self.ep_size * self.etp_size):
            e = member // self.etp_size
            send_rows.append(
                torch.arange(starts[e], starts[e] + per_ep[e], device=token_idx.device)
            )
            input_splits.append(per_ep[e])
            send_counts.append(counts[e * n : (e + 1) * n])
        order = torch.cat(send_rows)
        # How many rows of each local expert every member sends here.
        count_matrix = torch.tensor(send_counts, dtype=torch.long, device=tokens.device)
        received = C.all_to_all_uneven(
            count_matrix, self.group, [1] * len(send_counts), [1] * len(send_counts)
        )
        # One read of the counts on the host: the collectives and the experts take split sizes.
        received_counts = received.tolist()
        output_splits = [sum(row) for row in received_counts]
        arrived = all_to_all(tokens[token_idx[order]], self.group, output_splits, input_splits)
        # Arrived rows are grouped by sender, then expert; the experts need them by expert.
        by_expert = self._by_expert_permutation(received, sum(output_splits))
        outputs = experts(arrived[by_expert], [sum(col) for col in zip(*received_counts)])
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        returned = all_to_all(outputs[back], self.group, input_splits, output_splits)
        pair = order  # row r of `returned` is sorted pair order[r]
        weights = probs[token_idx[pair], expert_idx[pair]].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_idx[pair], returned * weights)

    @staticmethod
    def _by_expert_permutation(received: torch.Tensor, total: int) -> torch.Tensor:
        """received [members, experts] counts (``total`` rows in all) -> row order that lists
        expert 0's rows of every member, then expert 1's, ... Computed on the counts' device:
        each row gets the key expert * members + member, and a stable sort orders the keys."""
        members, experts = received.shape
        member = torch.arange(members, device=received.device).unsqueeze(1)
        expert = torch.arange(experts, device=received.device).unsqueeze(0)
        keys = (expert * members + member).flatten()
        row_keys = torch.repeat_interleave(keys, received.flatten(), output_size=total)
        return torch.argsort(row_keys, stable=True)
