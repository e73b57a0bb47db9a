import pytest

from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
    simulate_rampup_train_iters,
)


def test_constant():
    c = build_num_microbatches_calculator(
        0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4
    )
    assert isinstance(c, ConstantNumMicroBatchesCalculator)
    assert c.get() == 4
    assert c.get_current_global_batch_size() == 32
    assert c.get_micro_batch_size() == 2
    c.update(10_000, consistency_check=True)
    assert c.get() == 4


def test_constant_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"global batch size \(30\) is not divisible by micro batch size \(2\) "
        r"times data parallel size \(4\)",
    ):
        ConstantNumMicroBatchesCalculator(30, 2, 4)


def test_constant_decrease_if_needed():
    c = ConstantNumMicroBatchesCalculator(30, 2, 4, decrease_batch_size_if_needed=True)
    assert c.get() == 3
    assert c.get_current_running_global_batch_size() == 24
    assert c.get_current_global_batch_size() == 30


def test_rampup_sequence():
    # 8 -> 32 in steps of 8 over 96 samples: one increment every 96 / 3 = 32 samples.
    c = build_num_microbatches_calculator(0, ["8", "8", "96"], 32, 2, 2)
    assert isinstance(c, RampupBatchsizeNumMicroBatchesCalculator)
    expected = {0: 8, 8: 8, 31: 8, 32: 16, 63: 16, 64: 24, 95: 24, 96: 32, 97: 32, 10_000: 32}
    for consumed, gbs in expected.items():
        c.update(consumed, consistency_check=True)
        assert c.get_current_global_batch_size() == gbs, consumed
        assert c.get() == gbs // 4, consumed
    # A training run: consumed samples advance by the current batch size.
    consumed, seen = 0, []
    for _ in range(10):
        c.update(consumed)
        seen.append(c.get_current_global_batch_size())
        consumed += c.get_current_global_batch_size()
    assert seen == [8, 8, 8, 8, 16, 16, 24, 24, 32, 32]


def test_rampup_consistency_check_hits_odd_size():
    c = RampupBatchsizeNumMicroBatchesCalculator(16, 4, 1, [4, 2, 60])  # increment every 10 samples
    c.update(15, consistency_check=False)
    assert c.get_current_global_batch_size() == 6
    with pytest.raises(ValueError, match=r"current global batch size \(6\) is not divisible"):
        c.update(15, consistency_check=True)
    d = RampupBatchsizeNumMicroBatchesCalculator(
        16, 4, 1, [4, 2, 60], decrease_batch_size_if_needed=True
    )
    d.update(15, consistency_check=True)
    assert d.get() == 1 and d.get_current_running_global_batch_size() == 4


@pytest.mark.parametrize(
    "rampup, needle",
    [
        ([40, 8, 96], "must be >= the --rampup-batch-size start"),
        ([8, 5, 96], "divisible by the batch size increment"),
        ([8, 8], "expects 3 values"),
        (["a", "8", "96"], "must be integers"),
    ],
)
def test_rampup_bad_arguments(rampup, needle):
    with pytest.raises(ValueError, match=needle):
        RampupBatchsizeNumMicroBatchesCalculator(32, 2, 2, rampup)


def test_rampup_without_increments():
    c = RampupBatchsizeNumMicroBatchesCalculator(32, 2, 2, [32, 8, 96])
    assert c.get_current_global_batch_size() == 32 and c.get() == 8


def test_simulate_train_iters():
    assert simulate_rampup_train_iters(1000, 32) == 31
    # Ramp (see test_rampup_sequence): 8,8,8,8,16,16,24,24 -> 112 samples in 8 iterations
    # (the loop stops once consumed > 96); then (200 - 112) // 32 = 2 full batches.
    assert simulate_rampup_train_iters(200, 32, [8, 8, 96], 2, 2) == 10
    # Training shorter than the ramp: stop when consumed > train_samples.
    assert simulate_rampup_train_iters(20, 32, [8, 8, 96], 2, 2) == 3
