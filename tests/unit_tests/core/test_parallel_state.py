"""Rank-grid arithmetic (no processes) and group creation in a real gloo world."""

import re

import pytest

from megatron.core.parallel_layout import ParallelLayout, RankGenerator, hierarchical_cp_ranks
from tests.unit_tests.dist_utils import run_distributed


def test_world16_tp2_cp2_pp2_dp2_exact_groups():
    # rank = tp + 2*cp + 4*dp + 8*pp with the default order tp-cp-ep-dp-pp.
    groups = ParallelLayout(
        world_size=16,
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        pipeline_model_parallel_size=2,
    ).all_group_ranks()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert groups["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert groups["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert groups["mp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert groups["tp-dp-cp"] == [list(range(8)), list(range(8, 16))]
    assert groups["embedding"] == [
        [0, 8],
        [1, 9],
        [2, 10],
        [3, 11],
        [4, 12],
        [5, 13],
        [6, 14],
        [7, 15],
    ]
    assert groups["position-embedding"] == [[r] for r in range(8)]
    # Dense model: expert grid with EP=1, ETP=TP -> expert-dp spans cp and dp of the dense grid.
    assert groups["ep"] == [[r] for r in range(16)]
    assert groups["etp"] == groups["tp"]
    assert groups["expert-dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_tp_pp_dp_mapping_puts_pp_before_dp():
    # order tp-cp-ep-pp-dp: rank = tp + 2*pp + 4*dp for TP2 PP2 DP2.
    groups = ParallelLayout(
        world_size=8,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        use_tp_pp_dp_mapping=True,
    ).all_group_ranks()
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_expert_grid_with_ep():
    # World 8, TP1, EP4: expert grid rank = etp + ep*1 + edp*4 (pp=1).
    groups = ParallelLayout(world_size=8, expert_model_parallel_size=4).all_group_ranks()
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["expert-dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["dp"] == [list(range(8))]


def test_every_rank_in_exactly_one_group_of_each_type():
    groups = ParallelLayout(
        world_size=24,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        context_parallel_size=2,
    ).all_group_ranks()
    for name, rank_lists in groups.items():
        flat = sorted(r for ranks in rank_lists for r in ranks)
        if name in ("embedding", "position-embedding"):
            continue
        assert flat == list(range(24)), name


def test_coordinates_invert_rank_formula():
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for rank in range(24):
        c = gen.coordinates(rank)
        assert c["tp"] + 2 * c["cp"] + 4 * c["dp"] + 12 * c["pp"] == rank


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (
            dict(world_size=6, tensor_model_parallel_size=4),
            ["world size (6)", "tensor-model-parallel size (4)"],
        ),
        (dict(world_size=8, pipeline_model_parallel_size=3), ["pipeline-model-parallel size (3)"]),
        (dict(world_size=4, expert_model_parallel_size=3), ["expert-model-parallel size (3)"]),
    ],
)
def test_bad_layouts_name_the_sizes(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words[0])) as err:
        ParallelLayout(**kwargs)
    for w in words:
        assert w in str(err.value)


def _check_groups(rank, world_size):
    import torch
    import torch.distributed as dist

    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    assert state.get_tensor_model_parallel_world_size() == 2
    assert state.get_data_parallel_world_size() == 2
    assert state.get_tensor_model_parallel_rank() == rank % 2
    assert state.get_data_parallel_rank() == rank // 2
    # A collective over the TP group sums exactly its two members.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=state.get_tensor_model_parallel_group())
    expected = sum(state.ranks["tp"])
    assert t.item() == expected
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=state.get_data_parallel_group())
    assert t.item() == sum(state.ranks["dp"])


def test_groups_in_gloo_world():
    run_distributed(_check_groups, world_size=4)


def test_hierarchical_context_parallel_groups_are_megatrons():
    """Megatron's create_hierarchical_groups: level 0 (the a2a level of a2a+p2p) groups
    consecutive members of the CP group, level 1 (p2p) members a level-0 size apart."""
    cp_ranks = [1, 3, 5, 7, 9, 11, 13, 15]  # a CP group of 8 at TP 2
    a2a, p2p = hierarchical_cp_ranks(cp_ranks, [2, 4])
    assert a2a == [[1, 3], [5, 7], [9, 11], [13, 15]]
    assert p2p == [[1, 5, 9, 13], [3, 7, 11, 15]]
    levels = hierarchical_cp_ranks(list(range(8)), [2, 2, 2])
    assert levels == [
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ]
    with pytest.raises(
        ValueError, match=r"\[2, 2\] multiply to 4, not the context-parallel size 8"
    ):
        hierarchical_cp_ranks(list(range(8)), [2, 2])


def test_distributed_optimizer_instances_split_dp_into_contiguous_blocks():
    # Megatron's partial distributed optimizer: each DP x CP group cut into N contiguous blocks
    # (the shards of one instance); the ranks at the same place of each block exchange the
    # reduced slices; an instance of the whole grid holds every rank with its DP index in a block.
    groups = ParallelLayout(
        world_size=8, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2
    ).all_group_ranks()
    assert groups["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["intra-dp-cp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["inter-dist-opt"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert groups["intra-dist-opt"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # With experts over EP=2 the dense and the expert inter-instance groups are the same ranks
    # (Megatron builds one group for both).
    groups = ParallelLayout(
        world_size=8, expert_model_parallel_size=2, num_distributed_optimizer_instances=2
    ).all_group_ranks()
    assert groups["intra-dp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["intra-expert-dp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert sorted(groups["inter-dist-opt"]) == sorted(groups["inter-expert-dp"])
    assert "intra-dp-cp" not in ParallelLayout(world_size=8).all_group_ranks()
    with pytest.raises(ValueError, match=re.escape("expert-data-parallel size (2) is not")):
        ParallelLayout(
            world_size=4,
            expert_model_parallel_size=2,
            num_distributed_optimizer_instances=4,
        )
