"""The training side's globals: args, timers, tokenizer, writers, micro-batch calculator.

Megatron users reach these through ``get_args()`` and friends; ``megatron.core`` never does.
"""

from typing import Any, Optional

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tensor_parallel_random

_GLOBALS = {}


def _get(name: str, required: bool = True):
    value = _GLOBALS.get(name)
    if required and value is None:
        raise RuntimeError(
            f"{name} is not initialized; call initialize_megatron() or pretrain() first"
        )
    return value


def _set(name: str, value: Any, allow_reset: bool = True):
    if not allow_reset and _GLOBALS.get(name) is not None:
        raise RuntimeError(f"{name} is already initialized")
    _GLOBALS[name] = value


def get_args():
    return _get("args")


def set_args(args):
    _set("args", args)


def get_timers():
    return _get("timers")


def set_timers(timers):
    _set("timers", timers)


def get_tokenizer():
    return _get("tokenizer")


def set_tokenizer(tokenizer):
    _set("tokenizer", tokenizer)


def get_tensorboard_writer():
    return _get("tensorboard_writer", required=False)


def set_tensorboard_writer(writer):
    _set("tensorboard_writer", writer)


def get_wandb_writer():
    return _get("wandb_writer", required=False)


def set_wandb_writer(writer):
    _set("wandb_writer", writer)


def get_num_microbatches_calculator():
    return _get("num_microbatches_calculator")


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
    state = parallel_state.current_parallel_state()
    if state is None:
        raise RuntimeError(
            "parallel_state is not initialized; call initialize_megatron() or pretrain() first"
        )
    return state


def get_rng_tracker():
    """The current RNG tracker (``megatron.core.tensor_parallel.get_cuda_rng_tracker()``'s), or
    None before seeding."""
    return tensor_parallel_random.current_rng_tracker()


def set_rng_tracker(tracker):
    tensor_parallel_random.set_current_rng_tracker(tracker)


def get_signal_handler() -> Optional[Any]:
    return _get("signal_handler", required=False)


def set_signal_handler(handler):
    _set("signal_handler", handler)


def get_model_family():
    """The ModelFamily of the run (``pretrain(..., model_family=...)``); GPT's when none was set,
    as Megatron's formulas are GPT's."""
    family = _get("model_family", required=False)
    if family is None:
        from megatron.training.model_families import get_model_family as family_named

        family = family_named("gpt")
    return family


def set_model_family(family):
    _set("model_family", family)


def reset_globals():
    """Forget every global (tests run several trainings in one process), the current parallel
    state and RNG tracker included (their groups are not destroyed here)."""
    _GLOBALS.clear()
    parallel_state.forget_model_parallel()
    tensor_parallel_random.set_current_rng_tracker(None)


def get_rerun_state_machine():
    """The run's :class:`~megatron.core.rerun_state_machine.RerunStateMachine` (None before
    ``pretrain()`` builds it); loss functions validate their results through it."""
    return _get("rerun_state_machine", required=False)


def set_rerun_state_machine(machine):
    _set("rerun_state_machine", machine)
