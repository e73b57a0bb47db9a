"""Configuration of the Megatron optimizer (field names follow Megatron's OptimizerConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class OptimizerConfig:
    """Everything get_megatron_optimizer needs; the training side fills it from the flags."""

    optimizer: str = "adam"
    """Inner optimizer (--optimizer): 'adam' (torch AdamW, decoupled weight decay), 'sgd', or
    'muon' (Muon for the 2-D weight matrices, muon_scalar_optimizer for the rest; muon.py)."""

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

    muon_momentum: float = 0.9
    """Momentum (exponential average coefficient) of Muon (--muon-momentum)."""

    muon_split_qkv: bool = True
    """Orthogonalize the Q, K and V parts of the fused QKV weight apart (--muon-no-split-qkv
    turns it off)."""

    muon_nesterov: bool = False
    """Nesterov momentum in Muon (--muon-nesterov)."""

    muon_scale_mode: str = "spectral"
    """Scale of the orthogonalized update: 'spectral', 'unit_rms_norm' or 'shape_scaling'
    (--muon-scale-mode)."""

    muon_fp32_matmul_prec: str = "medium"
    """Precision of the Newton-Schulz matmuls (--muon-fp32-matmul-prec): 'medium' runs them in
    bf16, 'high' in fp32 (TF32 allowed on GPUs)."""

    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficient set: 'simple', 'quintic', 'polar_express', 'aol'
    (--muon-coefficient-type)."""

    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations per step (--muon-num-ns-steps)."""

    muon_tp_mode: str = "duplicated"
    """How Muon treats tensor-parallel weights: 'duplicated', 'distributed' or 'blockwise'
    (--muon-tp-mode; see muon.py)."""

    muon_extra_scale_factor: float = 1.0
    """Extra factor on every Muon update (--muon-extra-scale-factor)."""

    muon_scalar_optimizer: str = "adam"
    """Optimizer of the params Muon does not take (embedding, output layer, 1-D): 'adam' or
    'lion' (--muon-scalar-optimizer)."""

    lion_beta1: float = 0.95
    """Lion's interpolation coefficient of the update direction (--lion-beta1)."""

    lion_beta2: float = 0.98
    """Lion's momentum decay (--lion-beta2)."""

    use_layer_wise_distributed_optimizer: bool = False
    """Shard the optimizer over data parallelism by whole parameters: each DP rank updates its
    share and broadcasts it (Muon's distributed optimizer; set by --optimizer muon with
    --use-distributed-optimizer, or --optimizer dist_muon)."""

    mup_width_mult: Optional[float] = None
    """Width multiplier of a muP model (TransformerConfig.mup_width_mult with --use-mup): the
    hidden matrices' learning rate (and Adam epsilon) are divided by it. None: no muP scaling."""

    use_distributed_optimizer: bool = False
    """Shard fp32 main params and optimizer state over the data-parallel group
    (--use-distributed-optimizer); the model chunks must be DDP-wrapped with the same option."""

    optimizer_step_impl: str = "auto"
    """How the inner torch optimizer (adam, sgd) runs its step: 'fused' (one fused kernel per
    dtype and device: torch's fused=True), 'foreach' (multi-tensor kernels), 'for_loop' (one
    parameter at a time), or 'auto': fused where the params live on CUDA (as Megatron's
    Transformer Engine / apex FusedAdam), torch's own default elsewhere. Megatron-LM has no flag
    for this; 'for_loop' is the plain reference path."""

    foreach_grad_norm_and_copies: bool = True
    """Gradient norm, grad copies to the fp32 main grads and main-param copies back into the
    model params as multi-tensor (torch._foreach_*) operations rather than one per parameter.
    Every tensor's norm is still accumulated in float64 and the norms summed in float64: only
    the order of that sum changes. False: the per-parameter path."""

    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (--clip-grad); 0 disables clipping (and grad norm)."""

    log_num_zeros_in_grad: bool = False
    """Count zero entries of the gradient at every step (--log-num-zeros-in-grad)."""

    barrier_with_L1_time: bool = False
    """Barrier before starting/stopping the level-1 optimizer timers (--barrier-with-L1-time)."""

    timers: Optional[Any] = None
    """Optional megatron.core.timers.Timers object used to time the optimizer phases."""
