"""Megatron optimizer: param groups, mixed-precision wrappers, loss scaling, clipping."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from .distrib_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from .optimizer_config import OptimizerConfig

__all__ = [
    "OptimizerConfig",
    "MegatronOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer",
    "MegatronGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "get_megatron_optimizer",
    "get_param_groups",
    "get_grad_norm_fp32",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
]

_DECOUPLED_LR_PREFIXES = ("embedding.word_embeddings", "output_layer")


def _strip_wrappers(name: str) -> str:
    # DDP and Float16Module wrap the model as `.module`; match names as the bare model sees them.
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _is_embedding_or_output(name: str, param: torch.Tensor) -> bool:
    if getattr(param, "is_embedding_or_output_parameter", False):
        return True
    return _strip_wrappers(name).startswith(_DECOUPLED_LR_PREFIXES)


def get_param_groups(
    model_chunks: Sequence[torch.nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    lr_mult: float = 1.0,
) -> List[Dict]:
    """Group trainable params by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).

    Biases and 1-D params (norm weights) get no weight decay. With config.decoupled_lr set, the
    input embedding and output layer params get their own max/min LR. Each group carries
    'wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr', 'max_lr', 'min_lr'.
    """
    min_lr = 0.0 if config.min_lr is None else float(config.min_lr)
    use_decoupled = config.decoupled_lr is not None
    decoupled_min_lr = min_lr if config.decoupled_min_lr is None else float(config.decoupled_min_lr)

    grouped: Dict[Tuple[float, float, bool, bool], List[torch.Tensor]] = {}
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if no_weight_decay_cond is not None:
                no_wd = bool(no_weight_decay_cond(name, param))
            else:
                no_wd = _strip_wrappers(name).endswith(".bias") or len(param.shape) == 1
            scale_lr = bool(scale_lr_cond(name, param)) if scale_lr_cond is not None else False
            wd_mult = 0.0 if no_wd else 1.0
            group_lr_mult = float(lr_mult) if scale_lr else 1.0
            is_expert_parallel = not getattr(param, "allreduce", True)
            is_decoupled = use_decoupled and _is_embedding_or_output(name, param)
            key = (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled)
            grouped.setdefault(key, []).append(param)

    groups = []
    for (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled), params in grouped.items():
        max_lr = float(config.decoupled_lr) if is_decoupled else float(config.lr)
        group_min_lr = decoupled_min_lr if is_decoupled else min_lr
        groups.append(
            {
                "params": params,
                "wd_mult": wd_mult,
                "lr_mult": group_lr_mult,
                "is_expert_parallel": is_expert_parallel,
                "is_decoupled_lr": is_decoupled,
                "max_lr": max_lr,
                "min_lr": group_min_lr,
                # Sensible values before the scheduler's first step overwrites them.
                "lr": max_lr * group_lr_mult,
                "weight_decay": config.weight_decay * wd_mult,
            }
        )
    return groups


def _validate(config: OptimizerConfig) -> None:
    if config.lr is None:
        raise ValueError("the learning rate (--lr) must be set to build an optimizer")
    if config.optimizer not in ("adam", "sgd"):
        raise ValueError(f"--optimizer must be 'adam' or 'sgd', got {config.optimizer!r}")
    if config.fp16 and config.bf16:
        raise ValueError("--fp16 and --bf16 cannot both be set")
    if config.clip_grad < 0.0:
        raise ValueError(f"--clip-grad must be >= 0, got {config.clip_grad}")
    if config.loss_scale is not None and not config.loss_scale > 0.0:
        raise ValueError(f"--loss-scale must be positive, got {config.loss_scale}")


def _grad_scaler(config: OptimizerConfig, device) -> Optional[MegatronGradScaler]:
    """Static scaler with --loss-scale, dynamic for fp16, none otherwise."""
    if config.loss_scale is not None and (config.fp16 or config.bf16):
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=config.loss_scale_window,
            hysteresis=config.hysteresis,
            device=device,
        )
    return None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    model_parallel_group=None,
    tp_rank: int = 0,
    no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    lr_mult: float = 1.0,
) -> MegatronOptimizer:
    """Build the optimizer for the (possibly several) model chunks of this rank.

    model_parallel_group: the group over which grad norms, zero counts and the inf/NaN flag are
    reduced (TP x PP ranks holding different parts of the model); None in a single process.
    tp_rank: this rank's tensor-parallel rank (non-TP params are counted in norms on rank 0 only).
    With config.use_distributed_optimizer, ``model_chunks`` must be the DistributedDataParallel
    chunks (built with use_distributed_optimizer=True): the optimizer shards over their DP group.
    """
    _validate(config)
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    param_groups = get_param_groups(
        model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult
    )
    if not param_groups:
        raise ValueError("the model has no trainable parameters to optimize")

    if config.optimizer == "adam":
        optimizer_cls = torch.optim.AdamW
        optimizer_kwargs = dict(
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
        )
    else:
        optimizer_cls = torch.optim.SGD
        optimizer_kwargs = dict(
            lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum
        )
    if config.use_distributed_optimizer:
        device = param_groups[0]["params"][0].device
        return DistributedOptimizer(
            optimizer_cls,
            optimizer_kwargs,
            param_groups,
            config,
            _grad_scaler(config, device),
            model_chunks,
            model_parallel_group,
            tp_rank,
        )
    inner = optimizer_cls(param_groups, **optimizer_kwargs)

    if config.fp16 or config.bf16:
        device = param_groups[0]["params"][0].device
        grad_scaler = _grad_scaler(config, device)
        return Float16OptimizerWithFloat16Params(
            inner, config, grad_scaler, model_parallel_group, tp_rank
        )
    return FP32Optimizer(inner, config, model_parallel_group, tp_rank)
