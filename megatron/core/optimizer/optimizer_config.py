"""Configuration of the Megatron optimizer (field names follow Megatron's OptimizerConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class OptimizerConfig:
    """Everything get_megatron_optimizer needs; the training side fills it from the flags."""

    optimizer: str = "adam"
    """Inner optimizer: 'adam' (torch AdamW, decoupled weight decay) or 'sgd' (--optimizer)."""

    lr: Optional[float] = None
    """Peak learning rate (--lr). Must be set before building an optimizer."""

    min_lr: Optional[float] = None
    """Minimum learning rate the scheduler decays to (--min-lr); None means 0.0."""

    decoupled_lr: Optional[float] = None
    """Separate peak LR for the input embedding and output layer (--decoupled-lr); None = off."""

    decoupled_min_lr: Optional[float] = None
    """Minimum LR for the decoupled params (--decoupled-min-lr); None means min_lr."""

    weight_decay: float = 0.01
    """Weight decay coefficient for L2 regularization (--weight-decay)."""

    fp16: bool = False
    """Model params are fp16: keep fp32 master params and scale the loss (--fp16)."""

    bf16: bool = False
    """Model params are bf16: keep fp32 master params, no loss scaling by default (--bf16)."""

    params_dtype: torch.dtype = torch.float32
    """dtype the model params were created in (fp16/bf16/fp32)."""

    loss_scale: Optional[float] = None
    """Static loss scale (--loss-scale); None means dynamic loss scaling (fp16 only)."""

    initial_loss_scale: float = 2**32
    """Initial dynamic loss scale (--initial-loss-scale)."""

    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale (--min-loss-scale)."""

    loss_scale_window: float = 1000
    """Clean steps before the dynamic loss scale is doubled (--loss-scale-window)."""

    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic loss scale is halved (--hysteresis)."""

    adam_beta1: float = 0.9
    """First moment coefficient of Adam (--adam-beta1)."""

    adam_beta2: float = 0.999
    """Second moment coefficient of Adam (--adam-beta2)."""

    adam_eps: float = 1e-08
    """Term added to Adam's denominator for numerical stability (--adam-eps)."""

    sgd_momentum: float = 0.9
    """Momentum of SGD (--sgd-momentum)."""

    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state over the data-parallel group
    (--use-distributed-optimizer); the model chunks must be DDP-wrapped with the same option."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (--clip-grad); 0 disables clipping (and grad norm)."""

    log_num_zeros_in_grad: bool = False
    """Count zero entries of the gradient at every step (--log-num-zeros-in-grad)."""

    barrier_with_L1_time: bool = False
    """Barrier before starting/stopping the level-1 optimizer timers (--barrier-with-L1-time)."""

    timers: Optional[Any] = None
    """Optional megatron.core.timers.Timers object used to time the optimizer phases."""
