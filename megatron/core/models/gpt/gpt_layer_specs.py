"""Layer specs of GPT models (Megatron Core's ``gpt_layer_specs``, megatron-core 0.16's
signatures).

The local spec is this code base's plain PyTorch layer; its module names are Megatron Core's,
so checkpoints keep their names: ``input_layernorm``, ``self_attention.{linear_qkv,
q_layernorm, k_layernorm, core_attention, linear_proj}``, ``pre_mlp_layernorm``,
``mlp.{linear_fc1, linear_fc2}``.

The modules read most choices from the ``TransformerConfig`` they are built with: the norm type
(as megatron-core's torch-norm fallback does), biases, activation, grouped-query attention,
QK-norm and grouped expert GEMMs. The specs' arguments of the same name must therefore agree with
the config (Megatron-LM derives both from the same flags); arguments naming a feature this code
base does not have (QK L2 norm, Kitchen, Transformer Engine's op fuser) are refused with an
error naming them. ``multi_latent_attention=True`` builds ``MLASelfAttention`` (its modules:
``linear_q_proj`` or ``linear_q_down_proj``/``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``, ``q_layernorm``/``kv_layernorm``, ``linear_proj``).
"""

from typing import Optional

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_config import is_moe_layer
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

_NORMALIZATIONS = (None, "LayerNorm", "RMSNorm")


def _refuse_unsupported(spec_name: str, **requested) -> None:
    wanted = sorted(name for name, value in requested.items() if value)
    if wanted:
        raise ValueError(f"{spec_name}: {', '.join(wanted)} not supported here")


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """A decoder layer: norm, causal self-attention, norm, MLP (a mixture of ``num_experts``
    experts when given). ``fp8`` is ignored (deprecated in megatron-core too);
    ``moe_grouped_gemm`` and ``normalization`` follow the config (see the module docstring);
    ``qk_layernorm=True`` requires ``config.qk_layernorm``."""
    del fp8, moe_grouped_gemm, kitchen_attention_backend
    _refuse_unsupported(
        "get_gpt_layer_local_spec",
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
    )
    if normalization not in _NORMALIZATIONS:
        raise ValueError(
            f"get_gpt_layer_local_spec: normalization {normalization!r} is not one of "
            f"{_NORMALIZATIONS}"
        )
    attention_params = {"attn_mask_type": AttnMaskType.causal}
    if multi_latent_attention:
        # The q/kv latent norms follow config.qk_layernorm, as in megatron-core's local spec.
        attention = ModuleSpec(module=MLASelfAttention, params=attention_params)
    else:
        if qk_layernorm:
            attention_params["qk_layernorm"] = True
        attention = ModuleSpec(module=SelfAttention, params=attention_params)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=attention,
            pre_mlp_layernorm=build_norm,
            mlp=MoELayer if num_experts else MLP,
        ),
    )


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """The local spec: there is no Transformer Engine here, and the local modules hold the same
    parameters under the names megatron-core's local spec uses."""
    _refuse_unsupported(
        "get_gpt_layer_with_transformer_engine_spec",
        use_te_op_fuser=use_te_op_fuser,
        use_te_activation_func=use_te_activation_func,
    )
    return get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        fp8=fp8,
        moe_use_legacy_grouped_gemm=moe_use_legacy_grouped_gemm,
        qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
        kitchen_attention_backend=kitchen_attention_backend,
    )


def get_gpt_decoder_block_spec(
    config,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """One spec per layer of the whole model and the final norm: where layers differ (an MoE
    layer every few layers, ``--moe-layer-freq``) they differ here. ``use_transformer_engine``
    changes nothing (the local modules either way); ``vp_stage``/``pp_rank`` are accepted and
    unused: the TransformerBlock takes its stage's layers from the whole model's list."""
    del use_transformer_engine, vp_stage, pp_rank
    return TransformerBlockSubmodules(
        layer_specs=[
            get_gpt_layer_local_spec(
                num_experts=config.num_moe_experts if is_moe_layer(config, i) else None,
                multi_latent_attention=config.multi_latent_attention,
                normalization=normalization,
                qk_l2_norm=qk_l2_norm,
            )
            for i in range(config.num_layers)
        ],
        layer_norm=build_norm,
    )
