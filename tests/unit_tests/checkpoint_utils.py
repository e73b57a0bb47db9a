"""A one-process training state for checkpoint unit tests (both formats)."""

import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed
from megatron.core.timers import Timers
from megatron.training import global_vars
from tests.unit_tests.tiny_configs import megatron_args


def checkpoint_args(tmp_path, ckpt_format: str, **overrides):
    """Arguments of a one-process run saving to and loading from ``tmp_path/ckpt``."""
    settings = dict(
        save=str(tmp_path / "ckpt"),
        load=str(tmp_path / "ckpt"),
        ckpt_format=ckpt_format,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        skipped_train_samples=0,
        num_layers=2,
        hidden_size=8,
        params_dtype=torch.float32,
        rank=0,
        world_size=1,
        some_callable=print,
    )
    return megatron_args(**{**settings, **overrides})


def set_training_globals(args) -> None:
    """Set the globals a save or load reads: args, groups, timers, RNG tracker."""
    global_vars.reset_globals()
    global_vars.set_args(args)
    initialize_model_parallel()
    global_vars.set_timers(Timers(0, "minmax"))
    tracker = RNGStatesTracker("cpu")
    model_parallel_manual_seed(tracker, 1234)
    global_vars.set_rng_tracker(tracker)


def make_scheduler(opt) -> OptimizerParamScheduler:
    """The LR scheduler the checkpoint tests save and load (warmup, then cosine decay)."""
    return OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )


def setup_training_state(args, make_model, bf16: bool = False):
    """Set the globals a save or load reads (:func:`set_training_globals`), then build
    ``make_model()``, its optimizer and its LR scheduler."""
    set_training_globals(args)
    model = make_model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=bf16), [model])
    return model, opt, make_scheduler(opt)
