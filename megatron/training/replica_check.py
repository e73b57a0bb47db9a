"""``--check-weight-hash-across-dp-replicas-interval N``: before the first iteration and after
every N-th, check that all data-parallel replicas hold the same parameters; if they do not, the
run ends on every rank with the ranks named."""

from __future__ import annotations

from megatron.core.distributed.param_hashes import check_param_hashes_across_dp_replicas

from .run import Run
from .utils import print_rank_0


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas whose parameters differ; raised on every rank together."""


def check_weight_hashes_if_due(
    model, iteration: int, run: Run, before_training: bool = False
) -> None:
    """Run the check when the flag asks for it at `iteration` (a collective on every rank)."""
    interval = getattr(run.args, "check_weight_hash_across_dp_replicas_interval", None)
    if interval is None or not (before_training or iteration % interval == 0):
        return
    state = run.parallel_state
    # Context-parallel ranks hold the same parameters too: compare over DP x CP. Experts differ
    # across expert-parallel ranks: they are compared over the ranks holding the same experts.
    group = state.get_data_parallel_group(with_context_parallel=True)
    expert_group = state.get_expert_data_parallel_group() if run.args.num_experts else None
    mismatches = check_param_hashes_across_dp_replicas(model, group, expert_group)
    if mismatches:
        ranks = ", ".join(str(m.rank) for m in mismatches)
        first = mismatches[0]
        raise ReplicaMismatchError(
            f"--check-weight-hash-across-dp-replicas-interval: after {iteration} iterations the "
            f"parameters of rank(s) {ranks} differ from their first data-parallel replica "
            f"(rank {first.reference_rank}); first differing parameter on rank {first.rank}: "
            f"{first.first_parameter}"
        )
    print_rank_0(f">>> Weight hashes match after {iteration} iterations...")
