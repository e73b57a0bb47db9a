"""A one-process training state for checkpoint unit tests (both formats), and the run-state
entries a tiny training run leaves in its checkpoints."""

import os

import pytest
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


# Megatron's run-state names in a checkpoint's saved ``args``, after the validated dests in the
# order its trainer sets them (model set-up: iteration, FLOPs and last save; the data iterators:
# do_train/do_valid/do_test). The sample counts are validated dests (set to 0 by validation).
RUN_STATE_SET_BY_THE_TRAINER = (
    "iteration",
    "num_floating_point_operations_so_far",
    "last_saved_iteration",
    "do_train",
    "do_valid",
    "do_test",
)
SAMPLE_COUNTS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")


def _pretrain_gpt(argv) -> None:
    import sys

    from tests.harness import REPO

    sys.path.insert(0, str(REPO))
    import pretrain_gpt

    global_vars.reset_globals()
    try:
        pretrain_gpt.pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            pretrain_gpt.ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            argv=argv,
        )
    finally:
        global_vars.reset_globals()


def _saved_entries(directory, ckpt_format: str):
    """(the checkpoint's top-level entries but model/optimizer, its ``args`` as an ordered list
    of (name, value))."""
    import argparse

    from megatron.core.dist_checkpointing import load_common

    if ckpt_format == "torch":
        path = os.path.join(directory, "mp_rank_00", "model_optim_rng.pt")
        with torch.serialization.safe_globals([argparse.Namespace]):
            saved = torch.load(path, weights_only=True)
    else:
        saved = load_common(directory, safe_globals=[argparse.Namespace])
    top = {k: saved[k] for k in ("checkpoint_version", "iteration") if k in saved}
    top["flops"] = saved["num_floating_point_operations_so_far"]
    return top, list(vars(saved["args"]).items())


def check_saved_run_state(tmp_path, ckpt_format: str, capsys) -> None:
    """A 3-iteration tiny GPT run (evaluation every 2 iterations), saved at iterations 2 and 3,
    then resumed for a 4th: each checkpoint holds Megatron's top-level entries and its saved
    ``args`` Namespace exactly as Megatron's trainer leaves them (every validated dest in order,
    the run-state names after them; the FLOPs in ``args`` are those at the job's start, the
    top-level ones the running total). With torch_dist, the run is also converted to torch
    (--ckpt-convert-format), whose ``args`` hold no do_train/do_valid/do_test (the conversion
    happens before the data iterators are built)."""
    from megatron.checkpointing.saved_args import checkpoint_args as plain_args
    from tests.functional_tests.runner import TINY_MODEL
    from tests.unit_tests.tiny_configs import validated_args

    save = str(tmp_path / "ckpt")
    flags = ["--save", save, "--save-interval", "2", "--ckpt-format", ckpt_format]
    flags += ["--eval-iters", "1", "--eval-interval", "2"]
    first = TINY_MODEL + ["--train-iters", "3"] + flags
    resumed = TINY_MODEL + ["--train-iters", "4", "--override-opt-param-scheduler"]
    resumed += flags + ["--load", save]
    _pretrain_gpt(first)
    _pretrain_gpt(resumed)
    capsys.readouterr()

    # Values start-up derives (the backend without a GPU, the padded vocabulary) or that the
    # checkpoint stores as plain values.
    derived = {"distributed_backend": "gloo", "padded_vocab_size": 512}

    def expected_args(argv, state, trainer_names=RUN_STATE_SET_BY_THE_TRAINER):
        validated = vars(plain_args(validated_args(argv)))
        expected = [(k, state.get(k, v)) for k, v in {**validated, **derived}.items()]
        return expected + [(k, state[k]) for k in trainer_names]

    top2, args2 = _saved_entries(os.path.join(save, "iter_0000002"), ckpt_format)
    top3, args3 = _saved_entries(os.path.join(save, "iter_0000003"), ckpt_format)
    top4, args4 = _saved_entries(os.path.join(save, "iter_0000004"), ckpt_format)
    flops = top2["flops"]  # 2 iterations of 8 samples
    assert flops > 0
    assert top2 == {"checkpoint_version": 3.0, "iteration": 2, "flops": flops}
    assert top3 == {"checkpoint_version": 3.0, "iteration": 3, "flops": 1.5 * flops}
    assert top4 == {"checkpoint_version": 3.0, "iteration": 4, "flops": 2.0 * flops}
    run = dict(skipped_train_samples=0, do_train=True, do_valid=True, do_test=True)
    run.update(num_floating_point_operations_so_far=0.0, consumed_valid_samples=8)
    assert args2 == expected_args(
        first,
        dict(run, iteration=2, consumed_train_samples=16, last_saved_iteration=None),
    )
    assert args3 == expected_args(
        first, dict(run, iteration=3, consumed_train_samples=24, last_saved_iteration=2)
    )
    # The resumed job: FLOPs at its start (iteration 3's), a second evaluation at iteration 4.
    run.update(num_floating_point_operations_so_far=1.5 * flops, consumed_valid_samples=16)
    assert args4 == expected_args(
        resumed, dict(run, iteration=4, consumed_train_samples=32, last_saved_iteration=3)
    )
    if ckpt_format != "torch_dist":
        return

    converted = str(tmp_path / "converted")
    convert = TINY_MODEL + ["--train-iters", "4", "--override-opt-param-scheduler"]
    convert += flags + ["--load", save, "--ckpt-convert-format", "torch"]
    convert += ["--ckpt-convert-save", converted]
    with pytest.raises(SystemExit, match="^0$"):
        _pretrain_gpt(convert)
    capsys.readouterr()
    top, saved = _saved_entries(os.path.join(converted, "torch", "iter_0000004"), "torch")
    assert top == {"checkpoint_version": 3.0, "iteration": 4, "flops": 2.0 * flops}
    derived.update(ckpt_format="torch", save=os.path.join(converted, "torch"), async_save=False)
    derived["use_dist_ckpt"] = False
    assert saved == expected_args(
        convert,
        dict(
            iteration=4,
            consumed_train_samples=32,
            skipped_train_samples=0,
            consumed_valid_samples=16,
            num_floating_point_operations_so_far=2.0 * flops,
            last_saved_iteration=4,
        ),
        trainer_names=RUN_STATE_SET_BY_THE_TRAINER[:3],
    )
