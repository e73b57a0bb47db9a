"""The run's progress lives in a TrainState, not in ``args``: the args are read-only once
initialize_megatron() has finished (a write raises), and Megatron's run-state names on them
(``get_args().iteration``, ...) are read from the run's TrainState. The checkpoints keep
Megatron's entries (test_checkpointing.py / test_dist_checkpointing.py check them key for key)."""

import argparse
import copy
import pickle

import pytest
import torch

from megatron.checkpointing.saved_args import checkpoint_args
from megatron.training import global_vars
from megatron.training.frozen_args import ArgsFrozenError, freeze_args, replace_args
from megatron.training.train_state import TrainState
from tests.unit_tests.tiny_configs import tiny_args, tiny_argv


def test_advance_counts_iterations_samples_flops_and_skipped_samples():
    state = TrainState()
    state.start(iteration=3, flops=10.0)
    state.advance(samples=8, flops=2.5, skipped=False)
    state.advance(samples=8, flops=2.5, skipped=True)
    assert (state.iteration, state.consumed_train_samples) == (5, 16)
    assert state.skipped_train_samples == 8
    assert state.num_floating_point_operations_so_far == 15.0
    assert state.num_floating_point_operations_at_start == 10.0  # the job's start
    assert state.last_saved_iteration == 3  # the loaded checkpoint


def test_args_entries_are_the_names_megatrons_args_hold_at_each_point_of_the_run():
    state = TrainState(consumed_train_samples=16, consumed_valid_samples=8)
    counts = {"consumed_train_samples": 16, "skipped_train_samples": 0, "consumed_valid_samples": 8}
    assert state.args_entries() == counts  # validation sets only the sample counts
    state.start(iteration=0, flops=0.0)
    started = {"iteration": 0, "num_floating_point_operations_so_far": 0.0}
    started["last_saved_iteration"] = None
    assert state.args_entries() == {**counts, **started}
    state.do_train, state.do_valid, state.do_test = True, False, True
    data = {"do_train": True, "do_valid": False, "do_test": True}
    assert list(state.args_entries().items()) == list({**counts, **started, **data}.items())


def test_restore_sample_counts_reads_a_checkpoints_args_and_zero_where_absent():
    state = TrainState(consumed_valid_samples=5)
    state.restore_sample_counts(argparse.Namespace(consumed_train_samples=40))
    assert (state.consumed_train_samples, state.skipped_train_samples) == (40, 0)
    assert state.consumed_valid_samples == 0


def test_frozen_args_refuse_writes_and_read_the_run_state_live():
    args = tiny_args()
    state = TrainState.from_args(args)
    frozen = freeze_args(args, state)
    with pytest.raises(ArgsFrozenError, match=r"^args\.lr is read-only once the run starts"):
        frozen.lr = 1.0
    with pytest.raises(ArgsFrozenError, match=r"run state, kept in the run's TrainState"):
        frozen.consumed_train_samples = 8
    with pytest.raises(ArgsFrozenError, match="read-only"):
        del frozen.seed
    with pytest.raises(AttributeError, match="read-only"):  # what a frozen dataclass raises
        setattr(frozen, "new_flag", 1)
    assert frozen.lr == args.lr and frozen.seed == args.seed

    state.start(iteration=7, flops=3.0)
    state.advance(samples=8, flops=1.0, skipped=False)
    assert (frozen.iteration, frozen.consumed_train_samples) == (8, 8)
    # Megatron's args hold the FLOPs at the job's start (its loop keeps the total elsewhere).
    assert frozen.num_floating_point_operations_so_far == 3.0
    assert getattr(frozen, "skipped_train_samples", None) == 0
    assert "iteration" in frozen and "lr" in frozen and "no_such_flag" not in frozen
    assert "iteration" not in vars(frozen)  # vars() holds the flags
    with pytest.raises(AttributeError, match="no_such_flag"):
        frozen.no_such_flag  # noqa: B018


def test_frozen_args_pickle_and_copy_with_their_state():
    state = TrainState()
    frozen = freeze_args(tiny_args(), state)
    state.start(iteration=2, flops=0.0)
    back = pickle.loads(pickle.dumps(frozen))
    assert vars(back) == vars(frozen) and back.iteration == 2
    with pytest.raises(ArgsFrozenError, match="read-only"):
        back.lr = 1.0
    shallow = copy.copy(frozen)
    state.advance(samples=8, flops=1.0, skipped=False)
    assert shallow.iteration == 3  # the same run


def test_replace_args_copies_without_writing_and_keeps_the_saved_order():
    args = tiny_args()
    state = TrainState.from_args(args)
    frozen = freeze_args(args, state)
    state.start(iteration=4, flops=0.0)
    other = replace_args(frozen, ckpt_format="torch", save="/elsewhere")
    assert (other.ckpt_format, other.save, other.iteration) == ("torch", "/elsewhere", 4)
    assert (frozen.ckpt_format, frozen.save) == (args.ckpt_format, args.save)
    saved = list(vars(checkpoint_args(other, state)))
    assert saved == list(vars(checkpoint_args(frozen, state)))
    # The validated dests in their order, the sample counts where validation put them.
    assert saved[: len(vars(args))] == list(vars(args))
    assert saved[len(vars(args)) :] == [
        "iteration",
        "num_floating_point_operations_so_far",
        "last_saved_iteration",
    ]


def test_initialize_megatron_freezes_the_args(single_process_env, fresh_globals):
    from megatron.training.initialize import initialize_megatron

    args = initialize_megatron(argv=tiny_argv("--train-samples", "64", drop=("--train-iters",)))
    assert args is global_vars.get_args()
    # The values start-up derives are in: the iterations of a sample-based run, the backend,
    # the padded vocabulary.
    assert args.train_iters == 64 // args.global_batch_size
    assert args.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")
    assert args.padded_vocab_size % args.make_vocab_size_divisible_by == 0
    with pytest.raises(ArgsFrozenError, match="read-only"):
        global_vars.get_args().lr = 1.0
    run = global_vars.get_run()
    run.state.start(iteration=5, flops=0.0)
    assert global_vars.get_args().iteration == 5 == run.state.iteration
