"""Megatron's getters of the training globals (args, timers, tokenizer, writers, micro-batch
calculator, ...): views onto the current :class:`~megatron.training.run.Run`.

The trainer passes its Run explicitly; Megatron users, pretrain scripts and library callers reach
the same objects through ``get_args()`` and friends. ``megatron.core`` never does. The setters
fill the current Run (tests and tools set up the pieces they need without a full start-up).
"""

from typing import Any, Optional

# megatron.core (and so torch) is imported inside the functions that need it: the flags package
# reaches this module and must import without torch (flag_policy.py).
from .frozen_args import train_state_of
from .run import Run
from .train_state import TrainState

_CURRENT: Optional[Run] = None


def get_run() -> Run:
    """The current run (an empty one until start-up or a setter fills it)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Run()
    return _CURRENT


def _get(name: str, field: str, required: bool = True):
    value = getattr(get_run(), field)
    if required and value is None:
        raise RuntimeError(
            f"{name} is not initialized; call initialize_megatron() or pretrain() first"
        )
    return value


def _set(field: str, value: Any):
    setattr(get_run(), field, value)


def get_args():
    return _get("args", "args")


def set_args(args):
    """Make ``args`` the run's flags. Frozen args bring the TrainState they read from; plain
    ones (tests, tools) start a TrainState from the run-state names they hold."""
    run = get_run()
    run.args = args
    state = train_state_of(args)
    run.state = (
        state
        if state is not None
        else (TrainState.from_args(args) if args is not None else TrainState())
    )


def get_timers():
    return _get("timers", "timers")


def set_timers(timers):
    _set("timers", timers)


def get_tokenizer():
    return _get("tokenizer", "tokenizer")


def set_tokenizer(tokenizer):
    _set("tokenizer", tokenizer)


def get_tensorboard_writer():
    return _get("tensorboard_writer", "tensorboard", required=False)


def set_tensorboard_writer(writer):
    _set("tensorboard", writer)


def get_wandb_writer():
    return _get("wandb_writer", "wandb", required=False)


def set_wandb_writer(writer):
    _set("wandb", writer)


def get_num_microbatches_calculator():
    return _get("num_microbatches_calculator", "num_microbatches_calculator")


def set_num_microbatches_calculator(calculator):
    _set("num_microbatches_calculator", calculator)


def get_num_microbatches() -> int:
    return get_num_microbatches_calculator().get()


def get_current_global_batch_size() -> int:
    return get_num_microbatches_calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    get_num_microbatches_calculator().update(consumed_samples, consistency_check)


def get_parallel_state():
    """The current :class:`~megatron.core.parallel_state.ParallelState`: the one that
    ``megatron.core.parallel_state.initialize_model_parallel`` made current (its module-level
    getters read the same object)."""
    from megatron.core import parallel_state

    state = parallel_state.current_parallel_state()
    if state is None:
        raise RuntimeError(
            "parallel_state is not initialized; call initialize_megatron() or pretrain() first"
        )
    return state


def get_rng_tracker():
    """The current RNG tracker (``megatron.core.tensor_parallel.get_cuda_rng_tracker()``'s), or
    None before seeding."""
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    return tensor_parallel_random.current_rng_tracker()


def set_rng_tracker(tracker):
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    tensor_parallel_random.set_current_rng_tracker(tracker)


def get_signal_handler() -> Optional[Any]:
    return _get("signal_handler", "signal_handler", required=False)


def set_signal_handler(handler):
    _set("signal_handler", handler)


def get_model_family():
    """The ModelFamily of the run (``pretrain(..., model_family=...)``); GPT's when none was set,
    as Megatron's formulas are GPT's."""
    return get_run().model_family


def set_model_family(family):
    _set("family", family)


def reset_globals():
    """Forget the current run (tests run several trainings in one process), the current
    parallel state and RNG tracker included (their groups are not destroyed here)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    global _CURRENT
    _CURRENT = None
    parallel_state.forget_model_parallel()
    tensor_parallel_random.set_current_rng_tracker(None)


def get_rerun_state_machine():
    """The run's :class:`~megatron.core.rerun_state_machine.RerunStateMachine` (None before
    ``pretrain()`` builds it); loss functions validate their results through it."""
    return _get("rerun_state_machine", "rerun", required=False)


def set_rerun_state_machine(machine):
    _set("rerun", machine)
