"""Megatron optimizer: param groups, mixed-precision wrappers, loss scaling, clipping."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron.core import parallel_state

from .clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from .distrib_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .layer_wise_optimizer import LayerWiseDistributedOptimizer
from .muon import Muon, uses_muon
from .optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from .optimizer_config import OptimizerConfig

__all__ = [
    "OptimizerConfig",
    "MegatronOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "DistributedOptimizer",
    "LayerWiseDistributedOptimizer",
    "Muon",
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


def _mup_scales(name: str, param: torch.Tensor, config: OptimizerConfig, optimizer: str):
    """(learning-rate factor, Adam epsilon factor) of one param under muP (Megatron's rules):
    with Adam the hidden matrices (2-D, not of the embedding class: embeddings and the output
    layer, whose logits muP scales instead) take lr / width and eps / width; with SGD the
    vector-like params (1-D and embedding class) take lr * width; matrices that Muon updates keep
    theirs. Params with a --decoupled-lr keep it."""
    width = config.mup_width_mult
    if width is None or width == 1.0:
        return 1.0, 1.0
    if config.decoupled_lr is not None and _is_embedding_or_output(name, param):
        return 1.0, 1.0
    embedding_class = getattr(param, "shared_embedding", False) or getattr(
        param, "is_embedding_parameter", "embedding" in _strip_wrappers(name)
    )
    vector_like = embedding_class or param.dim() <= 1
    if config.optimizer == "sgd":
        return (width, 1.0) if vector_like else (1.0, 1.0)
    if vector_like or optimizer == "muon":
        return 1.0, 1.0
    return 1.0 / width, (1.0 / width if optimizer == "adam" else 1.0)


def _inner_optimizer_of(param: torch.Tensor, config: OptimizerConfig) -> str:
    if config.optimizer == "muon":
        return "muon" if uses_muon(param) else config.muon_scalar_optimizer
    return config.optimizer


def _megatron_core_group_rank(key: Tuple) -> Tuple:
    """megatron-core's order of param groups (torch-format checkpoints pair state with them by
    position): the groups without overrides of the defaults first, then by the sorted names of
    what they override (max/min LR of --decoupled-lr before lr_mult before wd_mult 0); groups
    that tie keep the order of their first parameter."""
    wd_mult, group_lr_mult, _is_expert, is_decoupled, _mup_eps, _inner = key
    overrides = (["max_lr", "min_lr"] if is_decoupled else []) + (
        ["lr_mult"] if group_lr_mult != 1.0 else []
    )
    overrides += ["wd_mult"] if wd_mult != 1.0 else []
    return (bool(overrides), tuple(sorted(overrides)))


def get_param_groups(
    model_chunks: Sequence[torch.nn.Module],
    config: OptimizerConfig,
    no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    lr_mult: float = 1.0,
) -> List[Dict]:
    """Group trainable params by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr, muP
    factors, inner optimizer).

    Biases and 1-D params (norm weights) get no weight decay. With config.decoupled_lr set, the
    input embedding and output layer params get their own max/min LR. With
    config.mup_width_mult, 'lr_mult' (and Adam's 'eps') follow muP (:func:`_mup_scales`). With
    --optimizer muon each group names its 'optimizer' (muon, adam or lion). Each group carries
    'wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr', 'max_lr', 'min_lr'.
    """
    min_lr = 0.0 if config.min_lr is None else float(config.min_lr)
    use_decoupled = config.decoupled_lr is not None
    decoupled_min_lr = min_lr if config.decoupled_min_lr is None else float(config.decoupled_min_lr)

    grouped: Dict[Tuple, List[torch.Tensor]] = {}
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
            inner = _inner_optimizer_of(param, config)
            mup_lr, mup_eps = _mup_scales(name, param, config, inner)
            # muP's factor scales the whole schedule (max and min LR), as lr_mult does; keeping it
            # there also keeps the muP classes apart in the groups' checkpoint signature.
            group_lr_mult = (float(lr_mult) if scale_lr else 1.0) * mup_lr
            is_expert_parallel = not getattr(param, "allreduce", True)
            is_decoupled = use_decoupled and _is_embedding_or_output(name, param)
            key = (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled, mup_eps, inner)
            grouped.setdefault(key, []).append(param)

    groups = []
    for key, params in sorted(grouped.items(), key=lambda item: _megatron_core_group_rank(item[0])):
        wd_mult, group_lr_mult, is_expert_parallel, is_decoupled, mup_eps, inner = key
        max_lr = float(config.decoupled_lr) if is_decoupled else float(config.lr)
        group_min_lr = decoupled_min_lr if is_decoupled else min_lr
        group = {
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
        if mup_eps != 1.0:
            group["eps"] = config.adam_eps * mup_eps
        if config.optimizer == "muon":
            group["optimizer"] = inner
        groups.append(group)
    return groups


def _validate(config: OptimizerConfig) -> None:
    if config.lr is None:
        raise ValueError("the learning rate (--lr) must be set to build an optimizer")
    if config.optimizer not in ("adam", "sgd", "muon"):
        raise ValueError(f"--optimizer must be adam, sgd or muon, got {config.optimizer!r}")
    if config.optimizer == "muon":
        if config.fp16:
            raise ValueError("--optimizer muon does not support --fp16 (use --bf16 or fp32)")
        if config.use_distributed_optimizer:
            raise ValueError(
                "--optimizer muon shards whole parameters over data parallelism "
                "(use_layer_wise_distributed_optimizer), not the flat buffers of "
                "--use-distributed-optimizer"
            )
        if config.muon_scalar_optimizer not in ("adam", "lion"):
            raise ValueError(
                "--muon-scalar-optimizer must be adam or lion, got "
                f"{config.muon_scalar_optimizer!r}"
            )
    elif config.use_layer_wise_distributed_optimizer:
        raise ValueError("the layer-wise distributed optimizer is used with --optimizer muon only")
    if config.optimizer_step_impl not in _STEP_IMPLS:
        raise ValueError(
            f"optimizer_step_impl must be one of {', '.join(_STEP_IMPLS)}, got "
            f"{config.optimizer_step_impl!r}"
        )
    if config.fp16 and config.bf16:
        raise ValueError("--fp16 and --bf16 cannot both be set")
    if config.clip_grad < 0.0:
        raise ValueError(f"--clip-grad must be >= 0, got {config.clip_grad}")
    if config.loss_scale is not None and not config.loss_scale > 0.0:
        raise ValueError(f"--loss-scale must be positive, got {config.loss_scale}")


_STEP_IMPLS = ("auto", "fused", "foreach", "for_loop")


def _step_impl_kwargs(config: OptimizerConfig, device: torch.device) -> Dict[str, bool]:
    """torch.optim's switches for config.optimizer_step_impl, the params being on ``device``:
    'auto' takes the fused kernel on CUDA (what Megatron runs there: Transformer Engine's or
    apex's FusedAdam) and leaves torch's default elsewhere (on the CPU: one param at a time)."""
    impl = config.optimizer_step_impl
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else None
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for_loop":
        return {"foreach": False}
    return {}


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


def _qkv_split(model_chunks) -> Optional[Tuple[int, int, int]]:
    """Rows of (query, key, value) in one query group of the fused QKV weight, from the model's
    TransformerConfig (found on any module of the chunks; DDP wrappers carry another config)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if hasattr(config, "kv_channels") and hasattr(config, "num_query_groups"):
                if getattr(config, "attention_output_gate", False):
                    # The fused weight holds the gates too; which block they join is unknown.
                    raise ValueError(
                        "Muon's per-part QKV orthogonalization does not support "
                        "--attention-output-gate here; add --muon-no-split-qkv"
                    )
                heads_per_group = config.num_attention_heads // config.num_query_groups
                d = config.kv_channels
                return (heads_per_group * d, d, d)
    return None


def _muon(config: OptimizerConfig, param_groups, model_chunks, tp_group) -> Muon:
    return Muon(
        param_groups,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        coefficient_type=config.muon_coefficient_type,
        num_ns_steps=config.muon_num_ns_steps,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        matmul_precision=config.muon_fp32_matmul_prec,
        tp_mode=config.muon_tp_mode,
        tp_group=tp_group,
        qkv_split=_qkv_split(model_chunks) if config.muon_split_qkv else None,
        adam_betas=(config.adam_beta1, config.adam_beta2),
        adam_eps=config.adam_eps,
        lion_betas=(config.lion_beta1, config.lion_beta2),
    )


FROM_PARALLEL_STATE = object()
"""Default of get_megatron_optimizer's group arguments: read from the current parallel_state."""


def _groups_from_parallel_state(model_parallel_group, tp_rank, tp_group, data_parallel_group):
    state = parallel_state.current_parallel_state()

    def pick(given, from_state, without_state):
        if given is not FROM_PARALLEL_STATE:
            return given
        return from_state() if state is not None else without_state

    return (
        pick(
            model_parallel_group,
            lambda: state.get_model_parallel_group() if state.size("mp") > 1 else None,
            None,
        ),
        pick(tp_rank, lambda: state.get_tensor_model_parallel_rank(), 0),
        pick(tp_group, lambda: state.get_tensor_model_parallel_group(), None),
        pick(
            data_parallel_group,
            lambda: state.get_data_parallel_group(with_context_parallel=True),
            None,
        ),
    )


def _expert_data_parallel_group(chunk):
    """The group over which ``chunk``'s expert parameters are replicated: its DDP wrapper's, else
    the current parallel_state's (None: one rank)."""
    if hasattr(chunk, "expert_data_parallel_group"):
        return chunk.expert_data_parallel_group
    state = parallel_state.current_parallel_state()
    return state.get_expert_data_parallel_group() if state is not None else None


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    model_parallel_group=FROM_PARALLEL_STATE,
    tp_rank=FROM_PARALLEL_STATE,
    no_weight_decay_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    scale_lr_cond: Optional[Callable[[str, torch.Tensor], bool]] = None,
    lr_mult: float = 1.0,
    tp_group=FROM_PARALLEL_STATE,
    data_parallel_group=FROM_PARALLEL_STATE,
) -> MegatronOptimizer:
    """Build the optimizer for the (possibly several) model chunks of this rank.

    model_parallel_group: the group over which grad norms, zero counts and the inf/NaN flag are
    reduced (TP x PP ranks holding different parts of the model); None in a single process.
    tp_rank: this rank's tensor-parallel rank (non-TP params are counted in norms on rank 0 only).
    With config.use_distributed_optimizer, ``model_chunks`` must be the DistributedDataParallel
    chunks (built with use_distributed_optimizer=True): the optimizer shards over their DP group.
    tp_group: the tensor-parallel group (Muon orthogonalizes split weights over it).
    data_parallel_group: with config.use_layer_wise_distributed_optimizer (Muon), the group whose
    ranks each update a share of the (whole) params; ``model_parallel_group`` must then span
    every rank that holds a different part of the model or state (the world).
    Megatron-core's form ``get_megatron_optimizer(config, model_chunks)``: each group or rank not
    given comes from the current ``parallel_state`` (the model-parallel group when it has more
    than one rank, the TP rank and group, the DP x CP group), or is None / 0 without one.
    """
    model_parallel_group, tp_rank, tp_group, data_parallel_group = _groups_from_parallel_state(
        model_parallel_group, tp_rank, tp_group, data_parallel_group
    )
    _validate(config)
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    param_groups = get_param_groups(
        model_chunks, config, no_weight_decay_cond, scale_lr_cond, lr_mult
    )
    if not param_groups:
        raise ValueError("the model has no trainable parameters to optimize")

    if config.optimizer == "muon":
        if config.use_layer_wise_distributed_optimizer:
            return LayerWiseDistributedOptimizer(
                lambda groups: _muon(config, groups, model_chunks, tp_group),
                param_groups,
                config,
                data_parallel_group,
                model_parallel_group,
                tp_rank,
                _expert_data_parallel_group(model_chunks[0]),
            )
        inner = _muon(config, param_groups, model_chunks, tp_group)
        if config.bf16:
            device = param_groups[0]["params"][0].device
            return Float16OptimizerWithFloat16Params(
                inner, config, _grad_scaler(config, device), model_parallel_group, tp_rank
            )
        return FP32Optimizer(inner, config, model_parallel_group, tp_rank)

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
    device = param_groups[0]["params"][0].device
    optimizer_kwargs.update(_step_impl_kwargs(config, device))
    if config.use_distributed_optimizer:
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
