"""Experimental flags (layer specs, YAML configurations, optimizer-state and
Megatron-FSDP precisions) and the multi-storage client."""

from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, switch


@flag_group(
    "experimental",
    removed={
        (
            "--hybrid-attention-ratio",
            "--hybrid-mlp-ratio",
        ): "the layer mix of a hybrid model is given by --hybrid-layer-pattern"
    },
)
class ExperimentalFlags:
    enable_experimental: bool = switch("Enable experimental features.")
    spec: Optional[List[str]] = flag(
        None,
        'Custom layer spec: <module> <function> (or "local").',
        nargs="*",
        honoured_at="pretrain_*.model_provider",
    )
    hybrid_override_pattern: Optional[str] = flag(
        None,
        "Hybrid layer pattern (older name of --hybrid-layer-pattern).",
        honoured_at="pretrain_mamba.py (MambaModel)",
    )
    hybrid_layer_pattern: Optional[str] = flag(
        None,
        "Hybrid layer pattern: M mamba, * attention, - MLP, E MoE, | pipeline split.",
        honoured_at="pretrain_mamba.py (MambaModel)",
    )
    yaml_cfg: Optional[str] = flag(
        None, "Read the configuration from this YAML file instead of flags."
    )
    use_precision_aware_optimizer: bool = switch(
        "Keep main params / optimizer states in the dtypes below (Transformer Engine FusedAdam)."
    )
    main_grads_dtype: str = flag(
        "fp32", "Main gradient dtype.", type=None, choices=["fp32", "bf16"]
    )
    main_params_dtype: str = flag(
        "fp32", "Main parameter dtype.", type=None, choices=["fp32", "fp16"]
    )
    exp_avg_dtype: str = flag(
        "fp32", "Adam first-moment dtype.", type=None, choices=["fp32", "fp16", "bf16", "fp8"]
    )
    exp_avg_sq_dtype: str = flag(
        "fp32", "Adam second-moment dtype.", type=None, choices=["fp32", "fp16", "bf16", "fp8"]
    )
    megatron_fsdp_main_params_dtype: str = flag(
        "fp32",
        "Megatron-FSDP main params dtype.",
        type=None,
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    megatron_fsdp_main_grads_dtype: str = flag(
        "auto",
        "Megatron-FSDP main grads dtype.",
        type=None,
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    megatron_fsdp_grad_comm_dtype: str = flag(
        "auto",
        "Megatron-FSDP grad comm dtype.",
        type=None,
        choices=["fp32", "fp16", "bf16", "auto"],
    )
    megatron_fsdp_enable_fine_grained_param_gather: bool = switch(
        "Megatron-FSDP: gather parameters per module instead of per bucket."
    )
    megatron_fsdp_max_pool_double_buffer: bool = switch(
        "Megatron-FSDP: size the double buffer for the largest pool."
    )
    fsdp_db_use_persist_buf_on_alloc_fail: bool = switch(
        "Megatron-FSDP: fall back to a persistent buffer when the double buffer cannot be "
        "allocated."
    )


@flag_group("msc")
class MSCFlags:
    enable_msc: bool = switch(
        "Read and write checkpoints and data through the multi-storage client."
    )
    disable_msc_deprecated: bool = switch(
        "Deprecated: the multi-storage client is off by default.",
        options="--disable-msc",
        honoured_at="no effect, as in Megatron (the multi-storage client is off)",
    )
