"""The weight-hash check across data-parallel replicas with expert parameters: experts differ
across expert-parallel ranks by design and are compared only over the ranks that hold the same
experts (the expert-data-parallel group); the other parameters over the data-parallel group."""

import torch
import torch.distributed as dist

from megatron.core.distributed.param_hashes import check_param_hashes_across_dp_replicas
from tests.unit_tests.dist_utils import run_distributed


def _model(rank: int, expert_value: float, dense_value: float = 1.0) -> torch.nn.Module:
    model = torch.nn.Module()
    model.dense = torch.nn.Parameter(torch.full((3,), dense_value))
    model.expert = torch.nn.Parameter(torch.full((2,), expert_value))
    model.expert.allreduce = False  # an expert parameter, as moe.experts marks them
    return model


def _checks(rank, world_size):
    world = dist.group.WORLD
    # Expert parallelism 2 over 2 ranks: each rank's experts are its own (expert-DP of one).
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    ep_model = _model(rank, expert_value=float(rank))
    assert check_param_hashes_across_dp_replicas([ep_model], world, alone) == []
    # Without the expert group everything is compared over DP: the experts differ.
    mismatches = check_param_hashes_across_dp_replicas([ep_model], world)
    assert [(m.rank, m.reference_rank, m.first_parameter) for m in mismatches] == [(1, 0, "expert")]
    # Expert-DP of two (the same experts on both ranks) that differ are found ...
    mismatches = check_param_hashes_across_dp_replicas([ep_model], world, world)
    assert [(m.rank, m.first_parameter) for m in mismatches] == [(1, "expert")]
    # ... and a dense parameter that differs is found under expert parallelism too.
    dense_off = _model(rank, expert_value=float(rank), dense_value=1.0 + rank)
    mismatches = check_param_hashes_across_dp_replicas([dense_off], world, alone)
    assert [(m.rank, m.first_parameter) for m in mismatches] == [(1, "dense")]


def test_expert_parameters_are_compared_over_the_expert_data_parallel_group():
    run_distributed(_checks, 2)
