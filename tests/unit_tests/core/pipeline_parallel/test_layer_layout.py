"""--pipeline-model-parallel-layout: megatron-core's grammar and the layer split it gives
(the runs it places are in tests/functional_tests/test_mtp_e2e.py; the messages of bad layouts
in tests/unit_tests/training/flags/test_validation.py)."""

import pytest

from megatron.core.pipeline_parallel.layer_layout import (
    PipelineParallelLayerLayout,
    parse_layout_string,
)
from megatron.core.pipeline_parallel.layer_split import compute_layer_split


def test_megatron_example_unrolls_as_documented():
    # megatron-core's docstring: "Ettt|(tt|)*29,m|L" is [E t t t] + [t t] * 29 + [m] + [L].
    stages = parse_layout_string("Ettt|(tt|)*29,m|L")
    assert stages == (
        [["embedding"] + ["decoder"] * 3] + [["decoder"] * 2] * 29 + [["mtp"], ["loss"]]
    )
    # The fine_grained_offloading configuration's: the last of its 8 stages holds m and L only.
    assert parse_layout_string("Et*3|(tt|)*6mL") == (
        [["embedding"] + ["decoder"] * 3] + [["decoder"] * 2] * 6 + [["mtp", "loss"]]
    )


def test_stages_go_round_robin_over_the_ranks():
    # 8 stages at PP 2: rank r holds stages r, r + 2, r + 4, r + 6 as its 4 model chunks.
    layout = PipelineParallelLayerLayout("Et*3|(tt|)*6mL", 2)
    assert layout.virtual_pipeline_model_parallel_size == 4
    assert layout.decoder_counts() == ((3, 2, 2, 2), (2, 2, 2, 0))
    assert layout.validate_layer_layout(15, 1) is False  # MTP on the last rank
    split = compute_layer_split(15, 2, 4, pipeline_model_parallel_layout="Et*3|(tt|)*6mL")
    assert split.counts == ((3, 2, 2, 2), (2, 2, 2, 0))
    # Layer offsets follow model order: chunk 1 of rank 0 starts after stages 0 and 1.
    assert [split.offset_for(r, c) for c in range(4) for r in range(2)] == [
        0, 3, 5, 7, 9, 11, 13, 15
    ]  # fmt: skip


def test_split_refuses_a_layout_that_disagrees_with_the_configuration():
    with pytest.raises(ValueError, match=r"describes 2 virtual stages per pipeline rank"):
        compute_layer_split(4, 2, None, pipeline_model_parallel_layout="Et|t|t|tL")
    with pytest.raises(ValueError, match=r"cannot be combined with --decoder-first"):
        compute_layer_split(4, 2, None, 2, pipeline_model_parallel_layout="Ett|ttL")
