"""torch-format checkpoints: layout, weights-only loading, exact round trip, crash safety,
errors."""

import argparse

import pytest
import torch

from megatron.training import checkpointing, global_vars
from tests.unit_tests.checkpoint_utils import (
    check_saved_run_state,
    checkpoint_args,
    setup_training_state,
)


def _args(tmp_path, **kw):
    return checkpoint_args(tmp_path, "torch", **kw)


def _setup(tmp_path, seed=0, **kw):
    def make_model():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)
        )

    return setup_training_state(_args(tmp_path, **kw), make_model)


def _train(model, opt, sched, steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        loss = (
            torch.nn.functional.dropout(model(x), 0.5).pow(2).mean()
        )  # dropout draws from the global RNG
        loss.backward()
        opt.step()
        sched.step(4)
        losses.append(loss.item())
    return losses


def test_round_trip_resumes_exactly(tmp_path):
    model, opt, sched = _setup(tmp_path)
    _train(model, opt, sched, 3)
    checkpointing.save_checkpoint(3, model, opt, sched)
    straight = _train(model, opt, sched, 3, seed=8)

    root = tmp_path / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    path = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        sd = torch.load(path, weights_only=True)
    assert {
        "args",
        "checkpoint_version",
        "iteration",
        "model",
        "optimizer",
        "opt_param_scheduler",
        "rng_state",
    } <= set(sd)
    assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 3
    assert not hasattr(sd["args"], "some_callable"), (
        "non-plain args are dropped so weights_only loading works"
    )

    model2, opt2, sched2 = _setup(tmp_path, seed=99)  # different init, fresh optimizer
    torch.manual_seed(12345)  # scramble the RNG: the checkpoint must restore it
    iteration, _ = checkpointing.load_checkpoint(model2, opt2, sched2)
    assert iteration == 3
    resumed = _train(model2, opt2, sched2, 3, seed=8)
    assert resumed == straight
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_interrupted_save_keeps_previous_tracker(tmp_path, monkeypatch):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    real_save = torch.save

    def crash(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt, match="killed mid-save"):
        checkpointing.save_checkpoint(2, model, opt, sched)
    root = tmp_path / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").exists(), (
        "an interrupted file keeps its temporary name"
    )
    monkeypatch.setattr(torch, "save", real_save)
    model2, opt2, sched2 = _setup(tmp_path, seed=5)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 1


def test_wrong_model_gives_readable_mismatch(tmp_path):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    global_vars.set_args(_args(tmp_path))
    other = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)
    )
    with pytest.raises(checkpointing.CheckpointError, match="does not fit this model") as err:
        checkpointing.load_checkpoint(other, None, None)
    msg = str(err.value)
    assert (
        "does not fit this model" in msg and "0.weight: checkpoint (8, 8) vs model (16, 8)" in msg
    )


def test_missing_directory_starts_from_scratch(tmp_path):
    model, opt, sched = _setup(tmp_path, load=str(tmp_path / "nothing"))
    assert checkpointing.load_checkpoint(model, opt, sched) == (0, 0.0)


def test_finetune_and_no_save_optim(tmp_path):
    model, opt, sched = _setup(tmp_path, no_save_optim=True)
    checkpointing.save_checkpoint(4, model, opt, sched)
    model2, opt2, sched2 = _setup(tmp_path, seed=3)
    with pytest.raises(checkpointing.CheckpointError, match="no optimizer state"):
        checkpointing.load_checkpoint(model2, opt2, sched2)
    global_vars.get_args().finetune = True
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 0
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_megatron_lm_numpy_rng_state_loads_weights_only(tmp_path):
    # Megatron-LM stores numpy's RNG state as np.random.get_state() returns it (an ndarray),
    # which torch's weights-only loader refuses unless numpy's array globals are allowed.
    import numpy as np

    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    path = tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        sd = torch.load(path, weights_only=True)
    np.random.seed(5)
    sd["rng_state"][0]["np_rng_state"] = np.random.get_state()
    expected = np.random.rand(3)
    torch.save(sd, path)
    np.random.seed(6)
    model2, opt2, sched2 = _setup(tmp_path, seed=99)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 1
    assert np.array_equal(np.random.rand(3), expected)


def test_a_training_run_saves_megatrons_run_state_entries(tmp_path, capsys):
    # The saved args Namespace and the top-level entries, key for key and value for value.
    check_saved_run_state(tmp_path, "torch", capsys)
