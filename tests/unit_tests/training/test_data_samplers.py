"""Samplers: the exact index order of Megatron and exact resumption from consumed samples."""

import pytest

from megatron.training.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
)


def test_single_sampler_slices_blocks_per_rank():
    batches = {r: list(MegatronPretrainingSampler(20, 0, 2, r, 2)) for r in range(2)}
    # Blocks of mbs*dp = 4 consecutive indices; rank r takes [2r, 2r+2) of each block; tail dropped.
    assert batches[0] == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert batches[1] == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]


def test_single_sampler_resumes_from_consumed():
    full = list(MegatronPretrainingSampler(40, 0, 2, 1, 2))
    resumed = list(MegatronPretrainingSampler(40, 12, 2, 1, 2))
    assert resumed == full[3:]


def test_single_sampler_rejects_exhausted_dataset():
    with pytest.raises(ValueError, match="exhausted"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)


def test_cyclic_sampler_covers_bucket_and_resumes():
    s = MegatronPretrainingRandomSampler(None, 16, 0, 2, 0, 2)
    it = iter(s)
    rank0 = [next(it) for _ in range(4)]
    flat = sorted(i for b in rank0 for i in b)
    assert flat == list(range(8)), "rank 0 owns the first bucket of an epoch"
    # Resume after 2 iterations (each consumes mbs*dp = 4 samples).
    resumed = MegatronPretrainingRandomSampler(None, 16, 8, 2, 0, 2)
    it2 = iter(resumed)
    assert [next(it2) for _ in range(2)] == rank0[2:]
