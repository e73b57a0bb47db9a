"""One training run's context: what start-up builds once and the trainer passes explicitly.

``pretrain()`` hands the :class:`Run` down to the loop, evaluation, logging and checkpoints.
Megatron's getters (``get_args()``, ``get_timers()``, ``get_tokenizer()``, ...) stay, as views
onto the current run (global_vars.py), for Megatron code and library callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .train_state import TrainState


@dataclass
class Run:
    """The run's flags (read-only once it starts), its progress, and what start-up built for it.

    * ``args``: the validated flags (:class:`~megatron.training.frozen_args.FrozenArgs` after
      initialize_megatron);
    * ``state``: the progress (:class:`~megatron.training.train_state.TrainState`), the one
      object a checkpoint saves and restores (as Megatron's entries);
    * ``parallel_state``: the process groups and ``rng_tracker`` (the model-parallel RNG
      streams): megatron.core's current ones (one per process, which Megatron Core's
      module-level API reads too), not copies; ``timers``; ``tokenizer``;
      ``num_microbatches_calculator``;
    * ``tensorboard`` / ``wandb``: the writers (None when not asked for);
    * ``rerun``: the rerun state machine; ``family``: the ModelFamily given to pretrain()
      (:attr:`model_family` answers GPT's when none was given);
      ``signal_handler`` (--exit-signal-handler); ``step_context``: what the schedules take
      from the trainer (model_setup.build_step_context);
    * ``start_time``: time.time() at the earliest rank's start of the job (throughput in the
      progress log, --exit-duration-in-mins);
    * ``async_saver``: the --async-save checkpoint being written in the background and its
      process group (checkpointing_dist.AsyncSaver, made at the first asynchronous save).
    """

    args: Any = None
    state: TrainState = field(default_factory=TrainState)
    timers: Any = None
    tokenizer: Any = None
    num_microbatches_calculator: Any = None
    tensorboard: Any = None
    wandb: Any = None
    rerun: Any = None
    family: Any = None
    signal_handler: Any = None
    step_context: Any = None
    start_time: Optional[float] = None
    async_saver: Any = None

    @property
    def parallel_state(self):
        """megatron.core.parallel_state's current state (None before initialize)."""
        from megatron.core import parallel_state

        return parallel_state.current_parallel_state()

    @property
    def rng_tracker(self):
        """megatron.core.tensor_parallel's current RNG tracker (None before seeding)."""
        from megatron.core.tensor_parallel import random

        return random.current_rng_tracker()

    @property
    def model_family(self):
        """The run's ModelFamily; GPT's when none was given, as Megatron's formulas are GPT's."""
        if self.family is not None:
            return self.family
        from .model_families import get_model_family

        return get_model_family("gpt")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches in this iteration's global batch (changes during a batch-size ramp-up)."""
        return self.num_microbatches_calculator.get()
