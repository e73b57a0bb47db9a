"""torch-format checkpoints: layout, weights-only loading, exact round trip, crash safety, errors."""
import argparse
import os

import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed
from megatron.core.timers import Timers
from tests.unit_tests.args_utils import megatron_args
from megatron.training import checkpointing, global_vars


def _args(tmp_path, **kw):
    settings = dict(save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"), ckpt_format="torch",
                    consumed_train_samples=0, consumed_valid_samples=0, skipped_train_samples=0,
                    num_layers=2, hidden_size=8, params_dtype=torch.float32, rank=0, world_size=1,
                    some_callable=print)
    return megatron_args(**{**settings, **kw})


def _setup(tmp_path, seed=0, **kw):
    global_vars.reset_globals()
    global_vars.set_args(_args(tmp_path, **kw))
    global_vars.set_parallel_state(initialize_model_parallel())
    global_vars.set_timers(Timers(0, "minmax"))
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, 1234)
    global_vars.set_rng_tracker(tracker)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1), [model])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                    lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=100, wd_incr_style="constant")
    return model, opt, sched


def _train(model, opt, sched, steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        loss = torch.nn.functional.dropout(model(x), 0.5).pow(2).mean()  # dropout draws from the global RNG
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
    assert {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
            "rng_state"} <= set(sd)
    assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 3
    assert not hasattr(sd["args"], "some_callable"), "non-plain args are dropped so weights_only loading works"

    model2, opt2, sched2 = _setup(tmp_path, seed=99)   # different init, fresh optimizer
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
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_checkpoint(2, model, opt, sched)
    root = tmp_path / "ckpt"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").exists(), \
        "an interrupted file keeps its temporary name"
    monkeypatch.setattr(torch, "save", real_save)
    model2, opt2, sched2 = _setup(tmp_path, seed=5)
    assert checkpointing.load_checkpoint(model2, opt2, sched2)[0] == 1


def test_wrong_model_gives_readable_mismatch(tmp_path):
    model, opt, sched = _setup(tmp_path)
    checkpointing.save_checkpoint(1, model, opt, sched)
    global_vars.set_args(_args(tmp_path))
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    with pytest.raises(checkpointing.CheckpointError) as err:
        checkpointing.load_checkpoint(other, None, None)
    msg = str(err.value)
    assert "does not fit this model" in msg and "0.weight: checkpoint (8, 8) vs model (16, 8)" in msg


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
