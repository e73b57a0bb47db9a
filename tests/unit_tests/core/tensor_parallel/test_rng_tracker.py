"""RNGStatesTracker and the model-parallel seeds (CPU generator)."""

import pytest
import torch

from megatron.core.tensor_parallel.random import (
    RNGStatesTracker,
    model_parallel_manual_seed,
    model_parallel_seed,
)


def test_fork_uses_named_stream_and_restores_caller_state():
    tracker = RNGStatesTracker("cpu")
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    expected_outside = torch.rand(4)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(4)
    # The caller's stream continues as if the fork never happened.
    torch.testing.assert_close(torch.rand(4), expected_outside, rtol=0, atol=0)
    expected_inside = torch.rand(4, generator=torch.Generator().manual_seed(123))
    torch.testing.assert_close(inside, expected_inside, rtol=0, atol=0)


def test_fork_advances_the_named_stream_and_restores_on_error():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 5)
    reference = torch.Generator().manual_seed(5)
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=reference))
    assert torch.equal(second, torch.rand(3, generator=reference))
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.fork("a"):
            torch.rand(2)
            raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), before)


def test_same_seed_same_stream_different_seeds_differ():
    t1, t2 = RNGStatesTracker("cpu"), RNGStatesTracker("cpu")
    t1.add("x", 42)
    t2.add("x", 42)
    t2.add("y", 43)
    with t1.fork("x"):
        a = torch.rand(5)
    with t2.fork("x"):
        b = torch.rand(5)
    with t2.fork("y"):
        c = torch.rand(5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_get_set_states_round_trip():
    tracker = RNGStatesTracker("cpu")
    tracker.add("s", 7)
    with tracker.fork("s"):
        torch.rand(3)
    saved = tracker.get_states()
    with tracker.fork("s"):
        expected = torch.rand(6)
    restored = RNGStatesTracker("cpu")
    restored.set_states(saved)
    with restored.fork("s"):
        assert torch.equal(torch.rand(6), expected)


def test_duplicates_unknown_names_and_reset():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="not added"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert not tracker.is_initialized()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="uint8"):
        tracker.set_states({"a": torch.zeros(3)})


def test_model_parallel_seeds():
    seeds = model_parallel_seed(1234, tp_rank=3, ep_rank=2, etp_rank=1)
    assert seeds.data_parallel == 1234
    assert seeds.tensor_model_parallel == 1234 + 2718 + 3
    assert seeds.expert_parallel == 1234 + 1024 + 200 + 1
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, 1234, tp_rank=1)
    assert set(tracker.get_states()) == {
        "data-parallel-rng",
        "model-parallel-rng",
        "expert-parallel-rng",
    }
    # The default generator was seeded with the data-parallel seed.
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    with tracker.fork("model-parallel-rng"):
        tp = torch.rand(3)
    assert torch.equal(tp, torch.rand(3, generator=torch.Generator().manual_seed(1234 + 2718 + 1)))
    # Calling again resets the streams instead of failing on duplicate names: the same draws.
    model_parallel_manual_seed(tracker, 1234, tp_rank=1)
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(3), tp)


def test_rejects_unknown_device():
    with pytest.raises(ValueError, match="cpu"):
        RNGStatesTracker("meta")


def test_dropout_on_split_activations_uses_per_tp_rank_streams():
    from types import SimpleNamespace

    import torch.nn.functional as F

    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed
    from megatron.core.transformer.utils import model_parallel_rng

    masks, replicated = [], []
    for tp_rank in (0, 1):
        torch.manual_seed(0)
        tracker = RNGStatesTracker("cpu")
        model_parallel_manual_seed(tracker, 1234, tp_rank=tp_rank)
        config = SimpleNamespace(rng_tracker=tracker, tensor_model_parallel_size=2)
        before = torch.get_rng_state()
        with model_parallel_rng(config, split_across_tp=True):
            masks.append(F.dropout(torch.ones(64), 0.5, training=True))
        assert torch.equal(torch.get_rng_state(), before), "the default stream is left untouched"
        with model_parallel_rng(config, split_across_tp=False):  # replicated activations
            replicated.append(F.dropout(torch.ones(64), 0.5, training=True))
        assert not torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(masks[0], masks[1]), "TP ranks draw different masks for their heads"
    assert torch.equal(replicated[0], replicated[1]), "replicated activations: one mask for all"


def test_layers_without_a_tracker_use_the_current_one_and_an_explicit_one_wins():
    """megatron-core's layers draw TP-split dropout and replay recompute from
    get_cuda_rng_tracker(): a config naming no tracker uses the current one that
    model_parallel_cuda_manual_seed made; a config's own tracker is used instead when set."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.utils import model_parallel_rng, rng_tracker_of

    previous, cpu_state = tp_random.current_rng_tracker(), torch.get_rng_state()
    try:
        tp_random.set_current_rng_tracker(None)
        bare = SimpleNamespace(rng_tracker=None, tensor_model_parallel_size=2)
        assert rng_tracker_of(bare) is None
        tp_random.model_parallel_cuda_manual_seed(1234, tp_rank=1)
        current = tp_random.current_rng_tracker()
        assert rng_tracker_of(bare) is current
        own = RNGStatesTracker("cpu")
        model_parallel_manual_seed(own, 99, tp_rank=0)
        assert rng_tracker_of(SimpleNamespace(rng_tracker=own)) is own

        stream = current.get_states()["model-parallel-rng"]
        before = torch.get_rng_state()
        with model_parallel_rng(bare, split_across_tp=True):
            drawn = F.dropout(torch.ones(64), 0.5, training=True)
        assert torch.equal(torch.get_rng_state(), before), "drawn from the tracker's stream"
        assert not torch.equal(current.get_states()["model-parallel-rng"], stream)
        torch.set_rng_state(stream)  # the same draw straight from the stream's saved state
        assert torch.equal(F.dropout(torch.ones(64), 0.5, training=True), drawn)
    finally:  # seeding reseeded this process's CPU generator: give back both
        tp_random.set_current_rng_tracker(previous)
        torch.set_rng_state(cpu_state)
