"""Gradient reductions after backward, checked against sums written out by hand:

* DDP with expert parameters (``allreduce = False``): their own buffers, reduced over the expert
  data-parallel group with the dense 1/DP scaling (Megatron's);
* finalize_model_grads: the sequence-parallel norm gradients summed over TP, the per-token
  scaling by DP x CP / total tokens;
* the distributed optimizer over dense and expert buffers, and the MoE global_aux_loss token
  counts over TP x DP x CP.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.tensor_parallel import ProcessGroupCollection
from tests.unit_tests.dist_utils import run_distributed


class _FakeMoE(torch.nn.Module):
    """A dense weight and an expert weight; loss = dense . x[:4] + expert . x[4:], so the
    gradients are the slices of ``x``."""

    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.expert = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.expert.allreduce = False

    def forward(self, x):
        return (self.dense * x[:4]).sum() + (self.expert * x[4:]).sum()


def _inputs(rank):
    return torch.arange(1, 8, dtype=torch.float64) * (rank + 1) ** 2


def _check_reduction(rank, state, average_in_collective):
    model = _FakeMoE()
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(average_in_collective=average_in_collective),
        model,
        pg_collection=ProcessGroupCollection.from_parallel_state(state),
    )
    assert [p for b in ddp.buffers for p in b.params] == [model.dense]
    assert [p for b in ddp.expert_parallel_buffers for p in b.params] == [model.expert]
    ddp.zero_grad_buffer()
    ddp(_inputs(rank)).backward()
    ddp.finish_grad_sync()

    dp_ranks = state.ranks["dp-cp"]
    expert_dp_ranks = state.ranks["expert-dp"]
    dense = sum(_inputs(r)[:4] for r in dp_ranks) / len(dp_ranks)
    expert = sum(_inputs(r)[4:] for r in expert_dp_ranks) / len(dp_ranks)
    torch.testing.assert_close(model.dense.main_grad, dense, rtol=1e-15, atol=0)
    torch.testing.assert_close(model.expert.main_grad, expert, rtol=1e-15, atol=0)

    ddp.scale_gradients(0.5)
    torch.testing.assert_close(model.expert.main_grad, expert / 2, rtol=1e-15, atol=0)
    return len(dp_ranks), len(expert_dp_ranks)


def _check_distributed_optimizer(rank, state):
    """The distributed optimizer shards the dense weight over DP and the expert weight over
    expert DP: after one SGD step (lr 1, no momentum) every rank holds -(reduced gradient) again,
    and the grad norm counts the dense gradient once and each EP rank's expert once."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    model = _FakeMoE().float()
    model.expert.allreduce = False
    ddp = DistributedDataParallel(
        None,
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        model,
        pg_collection=ProcessGroupCollection.from_parallel_state(state),
    )
    config = OptimizerConfig(
        lr=1.0,
        optimizer="sgd",
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=1e9,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    optimizer.expert_parallel_group = state.group("tp-ep-pp")
    ddp.zero_grad_buffer()
    ddp(_inputs(rank).float()).backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()

    dp_ranks = state.ranks["dp-cp"]
    dense = sum(_inputs(r)[:4] for r in dp_ranks) / len(dp_ranks)

    def expert_of(member):  # the expert gradient of the expert-DP group holding ``member``
        group = next(g for g in state.layout.all_group_ranks()["expert-dp"] if member in g)
        return sum(_inputs(r)[4:] for r in group) / len(dp_ranks)

    assert ok
    torch.testing.assert_close(model.dense.detach().double(), -dense, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.expert.detach().double(), -expert_of(rank), rtol=1e-6, atol=0)
    experts = [expert_of(member) for member in state.ranks["tp-ep-pp"]]
    expected = torch.sqrt(dense.square().sum() + sum(e.square().sum() for e in experts))
    assert grad_norm == pytest.approx(expected.item(), rel=1e-6)
    # distrib_optim.pt of a model with experts: [dense state, expert state] (Megatron's chained
    # optimizers), each on rank 0 of the group that shards it.
    saved = optimizer.parameter_state_for_file()
    dense_root = state.ranks["dp-cp"][0] == rank
    expert_root = state.ranks["expert-dp"][0] == rank
    if not (dense_root or expert_root):
        assert saved is None
    else:
        assert [part is not None for part in saved] == [dense_root, expert_root]
        if expert_root:
            flat = saved[1][0][(torch.float32, torch.float32)]["param"][0]
            torch.testing.assert_close(flat.double(), -expert_of(rank), rtol=1e-6, atol=0)


def _check_global_aux_loss(rank, state):
    """global_aux_loss counts the tokens of every rank of TP x DP x CP (here TP=2 with
    sequence parallelism, DP=2: four ranks holding different tokens)."""
    from megatron.core.transformer.moe import moe_utils as U
    from megatron.core.transformer.moe.router import TopKRouter
    from tests.unit_tests.core.transformer.test_moe_router import _global_aux_loss_loops, moe_config

    coeff, tokens = 0.1, 5
    config = moe_config(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    router = TopKRouter(config, state.group("tp-cp"), state.group("tp-dp-cp")).train()
    generator = torch.Generator().manual_seed(7)
    logits = [torch.randn(tokens, 4, dtype=torch.float64, generator=generator) for _ in range(4)]
    maps = [U.route_topk(x, 2)[1] for x in logits]
    probs = torch.zeros_like(logits[rank], requires_grad=True)
    with torch.enable_grad():
        router._attach_losses(logits[rank], probs, maps[rank], tokens)
    members = state.ranks["tp-dp-cp"]
    counts = sum(maps[r].sum(0).double() for r in members)
    scores = torch.softmax(logits[rank], dim=-1)
    expected = _global_aux_loss_loops(scores, counts, tokens * len(members), 2, coeff)
    got = router.tracked["global_load_balancing_loss"].item() * coeff
    assert len(members) == 4 and got == pytest.approx(expected, rel=1e-6)


class _Chunk(torch.nn.Module):
    """A model chunk after backward: a norm weight (replicated over TP, sequence-parallel input)
    and a TP-sharded weight, with rank-dependent gradients."""

    def __init__(self, rank):
        super().__init__()
        self.config = SimpleNamespace(sequence_parallel=True, barrier_with_L1_time=False)
        self.norm = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.norm.sequence_parallel = True
        self.sharded = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.norm.grad = torch.full((3,), float(rank + 1), dtype=torch.float64)
        self.sharded.grad = torch.full((2,), float(rank + 1), dtype=torch.float64)
        self.scales = []

    def finish_grad_sync(self):
        pass

    def scale_gradients(self, scale):
        self.scales.append(scale)


def _check_finalize(rank, state):
    chunk = _Chunk(rank)
    tokens = torch.tensor(10 * (rank + 1))
    finalize_model_grads([chunk], num_tokens=tokens, pg_collection=state)
    tp_ranks, dp_ranks = state.ranks["tp"], state.ranks["dp-cp"]
    torch.testing.assert_close(
        chunk.norm.grad, torch.full((3,), float(sum(r + 1 for r in tp_ranks)), dtype=torch.float64)
    )
    torch.testing.assert_close(
        chunk.sharded.grad, torch.full((2,), float(rank + 1), dtype=torch.float64)
    )
    assert chunk.scales == [len(dp_ranks) / sum(10 * (r + 1) for r in dp_ranks)]


def _worker(rank, world_size, _args, _results):
    import torch.distributed as dist

    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    # TP=1: dense DP over all 4 ranks; EP=2 -> expert DP pairs {0, 2} and {1, 3}.
    state = initialize_model_parallel(expert_model_parallel_size=2)
    try:
        for average_in_collective in (False, True):
            assert _check_reduction(rank, state, average_in_collective) == (4, 2)
        _check_distributed_optimizer(rank, state)
    finally:
        destroy_model_parallel()
    # TP=2, DP=2, EP=2 (expert TP = TP): every expert lives on one rank (expert DP = 1), its
    # gradient is only scaled by 1/DP.
    state = initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    try:
        assert _check_reduction(rank, state, False) == (2, 1)
        _check_finalize(rank, state)
        _check_global_aux_loss(rank, state)
    finally:
        destroy_model_parallel()

    with pytest.raises(ValueError, match="pass expert_data_parallel_group"):
        DistributedDataParallel(
            None,
            DistributedDataParallelConfig(),
            _FakeMoE(),
            pg_collection=ProcessGroupCollection(dp_cp=dist.group.WORLD),
        )


def test_expert_gradients_are_reduced_over_expert_data_parallel_ranks():
    run_distributed(_worker, 4, None, None)
