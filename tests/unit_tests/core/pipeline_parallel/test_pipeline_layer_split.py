"""Layer split over pipeline / virtual stages, schedule choice and micro-batch rules (no
processes)."""

import re

import pytest

from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.layer_split import (
    check_interleaved_microbatches,
    compute_layer_split,
    resolve_virtual_pipeline_size,
)
from megatron.core.pipeline_parallel.p2p_communication import get_tensor_shape
from megatron.core.transformer.transformer_config import TransformerConfig


def test_even_split_offsets_cover_all_layers():
    split = compute_layer_split(8, 4)
    assert [split.num_layers_for(r) for r in range(4)] == [2, 2, 2, 2]
    assert [split.offset_for(r) for r in range(4)] == [0, 2, 4, 6]
    assert split.chunk_args(0) == dict(
        pre_process=True, post_process=False, num_layers=2, layer_number_offset=0
    )
    assert split.chunk_args(3)["post_process"] and not split.chunk_args(3)["pre_process"]


def test_virtual_stages_interleave_layers():
    split = compute_layer_split(8, 2, 2)
    # virtual stage v = chunk * PP + rank holds layers [2v, 2v+2)
    assert [
        (split.offset_for(r, c), split.num_layers_for(r, c)) for c in range(2) for r in range(2)
    ] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert split.chunk_args(0, 0)["pre_process"] and not split.chunk_args(0, 1)["pre_process"]
    assert split.chunk_args(1, 1)["post_process"] and not split.chunk_args(1, 0)["post_process"]


def test_uneven_first_last():
    split = compute_layer_split(
        10, 4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3
    )
    assert [split.num_layers_for(r) for r in range(4)] == [1, 3, 3, 3]
    assert [split.offset_for(r) for r in range(4)] == [0, 1, 4, 7]
    only_first = compute_layer_split(7, 3, decoder_first_pipeline_num_layers=1)
    assert [only_first.num_layers_for(r) for r in range(3)] == [1, 3, 3]
    with_vp = compute_layer_split(12, 2, 2, decoder_first_pipeline_num_layers=4)
    assert with_vp.counts == ((2, 2), (4, 4))
    assert [with_vp.offset_for(r, c) for c in range(2) for r in range(2)] == [0, 2, 6, 8]


def test_account_for_embedding_and_loss():
    split = compute_layer_split(
        6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True
    )
    assert split.counts == ((1,), (2,), (2,), (1,))
    assert sum(sum(c) for c in split.counts) == 6
    split = compute_layer_split(7, 2, 2, account_for_embedding_in_pipeline_split=True)
    assert split.counts == ((1, 2), (2, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_layers=6, pipeline_model_parallel_size=4),
            "must be divisible by --pipeline-model-parallel-size",
        ),
        (
            dict(
                num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3
            ),
            "divisible by the number of virtual stages",
        ),
        (
            dict(
                num_layers=8, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2
            ),
            "need --pipeline-model-parallel-size > 1",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3),
            "remaining pipeline stages",
        ),
        (
            dict(
                num_layers=4,
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=3,
                decoder_last_pipeline_num_layers=3,
            ),
            "exceed --num-layers",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=3,
            ),
            "--decoder-first-pipeline-num-layers (3) must be divisible",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=4,
                account_for_loss_in_pipeline_split=True,
            ),
            "cannot be combined",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=4,
                account_for_embedding_in_pipeline_split=True,
            ),
            "--account-for-*-in-pipeline-split",
        ),
    ],
)
def test_bad_splits_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compute_layer_split(**kwargs)


def test_resolve_virtual_pipeline_size():
    assert resolve_virtual_pipeline_size(8, 2, num_layers_per_virtual_pipeline_stage=2) == 2
    assert resolve_virtual_pipeline_size(8, 2, num_layers_per_virtual_pipeline_stage=4) is None
    assert resolve_virtual_pipeline_size(8, 2, num_virtual_stages_per_pipeline_rank=4) == 4
    assert resolve_virtual_pipeline_size(8, 2) is None
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1"):
        resolve_virtual_pipeline_size(8, 1, num_layers_per_virtual_pipeline_stage=2)
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_virtual_pipeline_size(8, 2, 2, 2)
    with pytest.raises(
        ValueError, match="must be divisible by --num-layers-per-virtual-pipeline-stage"
    ):
        resolve_virtual_pipeline_size(8, 2, num_layers_per_virtual_pipeline_stage=3)


def test_interleaved_microbatch_rules():
    assert check_interleaved_microbatches(8, 4) == 4
    assert check_interleaved_microbatches(6, 2, 3) == 3
    assert check_interleaved_microbatches(7, 2, 5) == 5  # remainder 2 >= PP
    with pytest.raises(ValueError, match=r"must lie in \[PP=4, number of micro-batches=3\]"):
        check_interleaved_microbatches(3, 4)
    with pytest.raises(ValueError, match=r"must lie in \[PP=4"):
        check_interleaved_microbatches(8, 4, 2)
    with pytest.raises(ValueError, match="mod the micro-batch group size"):
        check_interleaved_microbatches(5, 4)


def test_schedule_table_groups():
    assert schedules.get_schedule_table(5, 2, 3) == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 0),
        (4, 0),
        (3, 1),
        (4, 1),
    ]


def test_get_forward_backward_func_choice():
    assert schedules.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert (
        schedules.get_forward_backward_func(2, None)
        is schedules.forward_backward_pipelining_without_interleaving
    )
    assert (
        schedules.get_forward_backward_func(2, 1)
        is schedules.forward_backward_pipelining_without_interleaving
    )
    assert (
        schedules.get_forward_backward_func(2, 2)
        is schedules.forward_backward_pipelining_with_interleaving
    )
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1"):
        schedules.get_forward_backward_func(1, 2)


class _StubCommunicator:
    """Stands in for a 4-stage pipeline: the micro-batch check must fire before any
    communication."""

    world_size, rank = 4, 0

    def exchange(self, **kwargs):
        raise AssertionError("communication started before the micro-batch check")


def test_interleaved_schedule_rejects_bad_microbatch_count_before_communicating():
    import torch

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    for c in chunks:
        c.config = config
    with pytest.raises(ValueError, match="mod the micro-batch group size"):
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None,
            data_iterator=[iter([]), iter([])],
            model=chunks,
            num_microbatches=6,
            seq_length=4,
            micro_batch_size=1,
            p2p_communicator=_StubCommunicator(),
        )
    with pytest.raises(ValueError, match="one entry per model chunk"):
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None,
            data_iterator=iter([]),
            model=chunks,
            num_microbatches=8,
            seq_length=4,
            micro_batch_size=1,
            p2p_communicator=_StubCommunicator(),
        )
    with pytest.raises(ValueError, match="pg_collection"):
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=None,
            data_iterator=iter([]),
            model=chunks[0],
            num_microbatches=2,
            seq_length=4,
            micro_batch_size=1,
        )


def test_tensor_shape_rules():
    config = TransformerConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        sequence_parallel=True,
    )
    assert get_tensor_shape(16, 3, config) == (4, 3, 8)
    config = TransformerConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, context_parallel_size=2
    )
    assert get_tensor_shape(16, 3, config) == (8, 3, 8)
