"""What the trainer hands the forward/backward schedules for an iteration.

Megatron Core's trainer sets these on the model config (``config.grad_scale_func = ...``) and
its schedules read them back from there. Here the trainer builds one :class:`StepContext` and
passes it to the schedule (``step_context=``), so the model config holds only the model's
settings. A caller written against Megatron Core that sets the config its way still works: a
schedule given no context reads one from the config (:meth:`StepContext.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from megatron.core.device import compute_device


@dataclass(frozen=True)
class StepContext:
    """The loss scaler, the gradient finalization, the timers and the schedule options of a
    training (or evaluation) step."""

    grad_scale_func: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """Scales the loss before backward (the fp16 loss scale); None: no scaling."""

    finalize_model_grads_func: Optional[Callable[..., None]] = None
    """Called after the last backward with the model chunks and, with
    ``calculate_per_token_loss``, the iteration's token count (``num_tokens=``): the gradient
    reductions."""

    timers: Optional[Callable] = None
    """megatron.core.timers.Timers for the level-2 compute and p2p timers; None: untimed."""

    calculate_per_token_loss: bool = False
    """The loss function's sum is not divided by its token count and the micro-batches: the
    finalization divides the gradients by the iteration's token count instead."""

    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Micro-batches run on one virtual stage before the next (interleaved schedule); None
    means the pipeline size."""

    grad_sync_func: Optional[Callable] = None
    """Called with a chunk's parameters after its last backward (overlapped reductions)."""

    pipeline_event_callback: Optional[Callable] = None
    """Called with a ``PipelineEvent`` after every forward and backward compute of the pipeline
    schedules (tests and tracing)."""

    @classmethod
    def from_config(cls, config) -> "StepContext":
        """The context a Megatron Core caller gives through the model config's attributes (any
        object: those it lacks take their defaults)."""
        return cls(
            grad_scale_func=getattr(config, "grad_scale_func", None),
            finalize_model_grads_func=getattr(config, "finalize_model_grads_func", None),
            timers=getattr(config, "timers", None),
            calculate_per_token_loss=getattr(config, "calculate_per_token_loss", False),
            microbatch_group_size_per_vp_stage=getattr(
                config, "microbatch_group_size_per_vp_stage", None
            ),
            grad_sync_func=getattr(config, "grad_sync_func", None),
        )

    def timer(self, name: str):
        """The level-2 timer ``name``, or None without timers."""
        return self.timers(name, log_level=2) if self.timers is not None else None

    def mtp_loss_scale(self, num_microbatches: int, cp_size: int) -> Union[float, torch.Tensor]:
        """The factor the multi-token-prediction losses take in backward: the main loss's (its
        loss scale; with per-token loss nothing more, the trainer divides by the token count;
        else cp_size / num_microbatches, as the schedule's forward step gives the main loss)."""
        factor = 1.0 if self.calculate_per_token_loss else cp_size / num_microbatches
        if self.grad_scale_func is None:
            return factor
        one = torch.ones(1, device=compute_device())
        return self.grad_scale_func(one).double() * factor

    def moe_aux_loss_scale(
        self, num_microbatches: int, cp_size: int, per_token_loss: bool = False
    ) -> Union[float, torch.Tensor]:
        """The factor the routers' auxiliary losses take in backward: the one a micro-batch's
        loss gets in the schedule's forward step (and the fp16 loss scale its backward step
        applies), as if added to it. With a loss scaler a device tensor (in float64, the
        arithmetic of a Python float): reading the loss scale on the host would wait for the
        device at every micro-batch.

        ``per_token_loss``: the model config's ``calculate_per_token_loss``, which the routers
        read too (Megatron's schedule and routers both read the model's). Then the main loss is
        not divided (the finalization divides every gradient by the iteration's token count),
        so only the loss scale is left: the routers multiply their losses by the micro-batch's
        token count instead (Megatron's scaling, see TopKRouter)."""
        factor = 1.0 if per_token_loss else cp_size / num_microbatches
        if self.grad_scale_func is None:
            return factor
        one = torch.ones(1, device=compute_device())
        return self.grad_scale_func(one).double() * factor
