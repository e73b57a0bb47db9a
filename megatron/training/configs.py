"""The one place where the global args become the config dataclasses of megatron.core."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.utils import openai_gelu, squared_relu

from . import global_vars


def _from_args(cls, args, **overrides):
    """Fill every field of ``cls`` that has an arg of the same name, then apply ``overrides``."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
    return cls(**kwargs)


def _attention_backend_name(value) -> str:
    """Megatron's --attention-backend is an AttnBackend member; the config takes its name (a
    checkpoint's args may hold the name already)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return AttnBackend(value).name
    return getattr(value, "name", value)


def core_transformer_config_from_args(args, config_class=TransformerConfig) -> TransformerConfig:
    """TransformerConfig for the model, with the flag names that differ from field names mapped."""
    overrides = {
        "attention_backend": _attention_backend_name(args.attention_backend),
        "gated_linear_unit": bool(args.swiglu),
        "num_moe_experts": getattr(args, "num_experts", None),
        "num_layers_in_first_pipeline_stage": getattr(
            args, "decoder_first_pipeline_num_layers", None
        ),
        "num_layers_in_last_pipeline_stage": getattr(
            args, "decoder_last_pipeline_num_layers", None
        ),
        "deallocate_pipeline_outputs": True,
        "pipeline_dtype": args.params_dtype,
        # Layout-independent init: every TP/PP/CP layout builds the one-process model's weights.
        "init_seed": args.seed,
        "params_dtype": args.params_dtype,
        "bias_activation_fusion": bool(
            args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
        ),
        # The run's dropout streams (set by initialize_megatron; None without it), in the config
        # itself so that every copy a model makes of it (T5's encoder and decoder) has them too.
        "rng_tracker": global_vars.get_rng_tracker(),
    }
    if args.swiglu:
        overrides["activation_func"] = F.silu
    elif args.squared_relu:
        overrides["activation_func"] = squared_relu
    elif args.openai_gelu:
        overrides["activation_func"] = openai_gelu
    else:
        overrides["activation_func"] = F.gelu
    if args.init_method_xavier_uniform:
        overrides["init_method"] = torch.nn.init.xavier_uniform_
    if getattr(args, "multi_latent_attention", False) and config_class is TransformerConfig:
        config_class = MLATransformerConfig
        overrides.update(_mla_overrides(args))
    names = {f.name for f in dataclasses.fields(config_class)}
    overrides = {k: v for k, v in overrides.items() if k in names}
    return _from_args(config_class, args, **overrides)


def _mla_overrides(args) -> dict:
    """MLATransformerConfig's fields whose flags are named differently; an unset flag leaves the
    config's default (Megatron-LM: --rope-type defaults to yarn under MLA)."""
    pairs = {
        "rope_type": "rope_type",
        "original_max_position_embeddings": "yarn_original_max_position_embeddings",
        "beta_fast": "yarn_beta_fast",
        "beta_slow": "yarn_beta_slow",
        "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
    }
    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    out = {}
    for field, flag in pairs.items():
        value = getattr(args, flag, None)
        out[field] = defaults[field] if value is None else value
    return out


def optimizer_config_from_args(args, timers=None) -> OptimizerConfig:
    """OptimizerConfig from the flags. ``mup_width_mult`` is left None: it is the model's
    (TransformerConfig derives it), and the training loop copies it from there."""
    return _from_args(
        OptimizerConfig,
        args,
        timers=timers,
        min_lr=args.min_lr if args.min_lr is not None else 0.0,
        mup_width_mult=None,
    )


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
        average_in_collective=bool(getattr(args, "ddp_average_in_collective", False)),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False))
        and bool(args.use_distributed_optimizer),
        bucket_size=getattr(args, "ddp_bucket_size", None),
        check_for_nan_in_grad=bool(getattr(args, "check_for_nan_in_loss_and_grad", False))
        and not args.fp16,
        check_for_large_grads=bool(getattr(args, "check_for_large_grads", False)),
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy
        if getattr(args, "use_megatron_fsdp", False) and args.use_distributed_optimizer
        else "no_shard",
        num_distributed_optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1)
        if args.use_distributed_optimizer
        else 1,
    )
