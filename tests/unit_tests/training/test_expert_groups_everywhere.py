"""A pipeline stage without MoE layers (DeepSeek's dense first layers: ``--moe-layer-freq
[0,1]`` at PP2) must still join the expert-group reductions of the grad norm, zero count and
inf flag: the stages with experts reduce over the expert-tensor x expert x pipeline group, which
includes it. Deciding "this model has experts" from the local chunks only left stage 0 out, and a
converted DeepSeek checkpoint hung at iteration 1 (TP1 PP2 EP2) in the grad-norm all-reduce."""

import torch

from megatron.training.model_setup import _has_expert_params
from tests.unit_tests.dist_utils import run_distributed


def _stage(rank, world_size, results):
    chunk = torch.nn.Linear(2, 2)
    if rank == 1:  # only the last stage holds an expert weight
        chunk.weight.allreduce = False
    results.put((rank, _has_expert_params([chunk])))


def test_every_rank_sees_the_experts_of_any_rank():
    import multiprocessing

    results = multiprocessing.get_context("spawn").Manager().Queue()
    run_distributed(_stage, 2, results, timeout_s=60)
    got = dict(results.get() for _ in range(2))
    assert got == {0: True, 1: True}


def test_without_torch_distributed_the_local_chunks_decide():
    dense, expert = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    expert.weight.allreduce = False
    assert _has_expert_params([dense]) is False
    assert _has_expert_params([dense, expert]) is True
