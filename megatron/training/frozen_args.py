"""``args`` once the run has started: read-only, with the run's progress read from its TrainState.

initialize_megatron() validates the flags, derives what Megatron derives at start-up (the
backend, the training iterations of a sample-based run, the padded vocabulary), prints them, then
freezes them: from there on a write such as ``get_args().lr = 1`` raises
:class:`ArgsFrozenError`. Megatron's run-state names on ``args`` (``iteration``,
``consumed_train_samples``, ``num_floating_point_operations_so_far``, ``last_saved_iteration``,
``do_train``, ...) are answered live from the run's
:class:`~megatron.training.train_state.TrainState`, so that Megatron code reading
``get_args().iteration`` keeps working.

A plain copy made with ``argparse.Namespace(**vars(frozen))`` holds the flags but not the
run-state names (they are not in ``vars``); the one such copy in the trainer (flag_policy's
``given`` namespace) is made during validation, before the freeze.
"""

from __future__ import annotations

import argparse

from .train_state import ARGS_NAMES, TrainState


class ArgsFrozenError(AttributeError):
    """A write into the args after start-up (an AttributeError, as a write into a frozen
    dataclass is)."""


def _refusal(name: str) -> ArgsFrozenError:
    if name in ARGS_NAMES:
        return ArgsFrozenError(
            f"args.{name} is read-only once the run starts: it is run state, kept in the run's "
            f"TrainState (megatron/training/train_state.py: run.state.{ARGS_NAMES[name]})"
        )
    return ArgsFrozenError(
        f"args.{name} is read-only once the run starts (initialize_megatron() validated and "
        "froze the flags); run state lives in TrainState (megatron/training/train_state.py)"
    )


class FrozenArgs(argparse.Namespace):
    """The validated flags, read-only; Megatron's run-state names read from ``state``.
    ``dest_order``: the order of the dests as validation left them (default ``args``' own)."""

    __slots__ = ("_state", "_dest_order")  # outside __dict__: vars(args) holds the flags only

    def __init__(self, args: argparse.Namespace, state: TrainState, dest_order=None):
        values = vars(args)
        object.__setattr__(self, "_state", state)
        # Run-state names included: a checkpoint's saved args keep Megatron's order
        # (saved_args.checkpoint_args).
        object.__setattr__(self, "_dest_order", tuple(values if dest_order is None else dest_order))
        own = self.__dict__
        for name, value in values.items():
            if name not in ARGS_NAMES:
                own[name] = value

    def __getattr__(self, name):  # only called for names that are not flags
        field = ARGS_NAMES.get(name)
        if field is None:
            raise AttributeError(f"'Namespace' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, "_state"), field)

    def __setattr__(self, name, value):
        raise _refusal(name)

    def __delattr__(self, name):
        raise _refusal(name)

    def __contains__(self, key) -> bool:
        return key in self.__dict__ or key in ARGS_NAMES

    def __reduce__(self):
        return (_rebuild, (dict(self.__dict__), self._dest_order, self._state))

    def dest_order(self) -> tuple:
        """The dests in the order validation left them, the run-state names included."""
        return self._dest_order


def _rebuild(values: dict, dest_order: tuple, state: TrainState) -> FrozenArgs:
    return FrozenArgs(argparse.Namespace(**values), state, dest_order)


def freeze_args(args: argparse.Namespace, state: TrainState | None = None) -> FrozenArgs:
    """``args`` read-only, Megatron's run-state names answered from ``state`` (by default a
    TrainState holding the values ``args`` has under those names). Frozen args are returned as
    they are."""
    if isinstance(args, FrozenArgs):
        return args
    return FrozenArgs(args, state if state is not None else TrainState.from_args(args))


def replace_args(args, **changes):
    """A copy of ``args`` with ``changes``; ``args`` itself is not written. A frozen copy keeps
    the dest order (new names last) and reads the same TrainState."""
    values = dict(vars(args), **changes)
    if not isinstance(args, FrozenArgs):
        return argparse.Namespace(**values)
    order = args._dest_order + tuple(name for name in changes if name not in args._dest_order)
    return FrozenArgs(argparse.Namespace(**values), args._state, order)


def train_state_of(args) -> TrainState | None:
    """The TrainState a frozen ``args`` reads its run-state names from (None for plain args)."""
    if isinstance(args, FrozenArgs):
        return args._state
    return None
