"""The layers of each pipeline stage and virtual stage, computed in core from the config
(get_num_layers_to_build / get_transformer_layer_offset), against splits written out by hand."""

import pytest
import torch

from megatron.core.pipeline_parallel.layer_split import (
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(num_layers, pp, vp=None, **split):
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        **split,
    )


# (config, {(pp_rank, vp_stage): (layers, offset)}), written from the split rules.
CASES = {
    "one stage": (_config(5, 1), {(None, None): (5, 0)}),
    "even": (_config(8, 4), {(0, None): (2, 0), (1, None): (2, 2), (3, None): (2, 6)}),
    # Virtual stage v = chunk * PP + rank: rank 0 holds layers 0-1 and 4-5, rank 1 2-3 and 6-7.
    "interleaved": (
        _config(8, 2, 2),
        {(0, 0): (2, 0), (1, 0): (2, 2), (0, 1): (2, 4), (1, 1): (2, 6)},
    ),
    "uneven first and last": (
        _config(8, 4, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1),
        {(0, None): (1, 0), (1, None): (3, 1), (2, None): (3, 4), (3, None): (1, 7)},
    ),
    "uneven first only, interleaved": (
        _config(12, 2, 2, num_layers_in_first_pipeline_stage=4),
        {(0, 0): (2, 0), (1, 0): (4, 2), (0, 1): (2, 6), (1, 1): (4, 8)},
    ),
    # 7 layers + the embedding's place = 8 over 2 ranks: the first stage builds 3.
    "embedding accounted": (
        _config(7, 2, account_for_embedding_in_pipeline_split=True),
        {(0, None): (3, 0), (1, None): (4, 3)},
    ),
    "embedding and loss accounted, interleaved": (
        _config(6, 2, 2, account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True),
        {(0, 0): (1, 0), (1, 0): (2, 1), (0, 1): (2, 3), (1, 1): (1, 5)},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_layers_and_offsets_of_every_stage(name):
    config, expected = CASES[name]
    for (pp_rank, vp_stage), (layers, offset) in expected.items():
        assert get_num_layers_to_build(config, vp_stage, pp_rank) == layers, (pp_rank, vp_stage)
        assert get_transformer_layer_offset(config, vp_stage, pp_rank) == offset, (
            pp_rank,
            vp_stage,
        )


def test_stages_tile_the_model_in_virtual_stage_order():
    config = _config(12, 2, 2, num_layers_in_first_pipeline_stage=4)
    seen = []
    for vp_stage in range(2):
        for pp_rank in range(2):
            start = get_transformer_layer_offset(config, vp_stage, pp_rank)
            seen.extend(range(start, start + get_num_layers_to_build(config, vp_stage, pp_rank)))
    assert seen == list(range(12))


def test_missing_stage_coordinates_are_errors():
    with pytest.raises(ValueError, match="the pipeline rank of the model chunk is needed"):
        get_num_layers_to_build(_config(8, 2))
    with pytest.raises(ValueError, match="the model chunk's vp_stage is needed"):
        get_transformer_layer_offset(_config(8, 2, 2), pp_rank=0)
    with pytest.raises(ValueError, match="out of range"):
        get_num_layers_to_build(_config(8, 2), pp_rank=2)
    with pytest.raises(ValueError, match="--decoder-first-pipeline-num-layers"):
        get_num_layers_to_build(_config(8, 4, num_layers_in_first_pipeline_stage=9), pp_rank=0)
    # A block of a pipelined config needs the pipeline group unless built by hand.
    with pytest.raises(ValueError, match="pipeline rank of the model chunk is needed"):
        TransformerBlock(_config(8, 2))
    block = TransformerBlock(_config(8, 2), num_layers=3)
    assert [layer.layer_number for layer in block.layers] == [1, 2, 3]


def _worker(rank, world_size, _args, _results):
    """PP=2, 2 virtual stages: every rank builds its chunks from the config and its pipeline
    group alone, and the chunks' global layer numbers are the hand-written split's."""
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    config = _config(8, 2, 2, params_dtype=torch.float32)
    numbers = [
        [layer.layer_number for layer in TransformerBlock(config, pg_collection=state,
                                                          vp_stage=vp).layers]
        for vp in range(2)
    ]  # fmt: skip
    assert numbers == ([[1, 2], [5, 6]] if rank == 0 else [[3, 4], [7, 8]]), numbers


def test_blocks_find_their_layers_from_the_pipeline_group():
    from tests.unit_tests.dist_utils import run_distributed

    run_distributed(_worker, 2, None, None)
