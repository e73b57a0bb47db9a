"""Model-shape flags: network size, multi-latent attention, Transformer Engine (fp8/fp4).

MoE flags are in moe.py; hybrid models and attention variants in variants.py; the legacy
vision and biencoder groups in legacy.py.
"""

from typing import List, Optional, Tuple, Union

from megatron.core.transformer.enums import AttnBackend
from megatron.training.flags.spec import flag, flag_group, off_switch, switch
from megatron.training.flags.types import enum_type, moe_freq_type, no_rope_freq_type, tuple_type


@flag_group("network size")
class NetworkSizeFlags:
    num_layers: Optional[int] = flag(
        None,
        "Number of transformer layers.",
        honoured_at="TransformerConfig.num_layers (T5: the encoder's)",
    )
    encoder_num_layers: Optional[int] = flag(
        None,
        "Number of encoder transformer layers (T5); alternative spelling of --num-layers.",
        honoured_at="pretrain_t5.model_provider",
    )
    decoder_num_layers: Optional[int] = flag(
        None,
        "Number of decoder transformer layers (T5).",
        honoured_at="pretrain_t5.model_provider; model_families.t5.cost._decoder_layers",
    )
    hidden_size: Optional[int] = flag(
        None, "Transformer hidden size.", honoured_at="TransformerConfig.hidden_size"
    )
    ffn_hidden_size: Optional[int] = flag(
        None,
        "Hidden size of the MLP. Default: 4 * hidden-size, or int(4 * hidden-size * 2/3 / 64) * "
        "64 with --swiglu.",
        honoured_at="TransformerConfig.ffn_hidden_size",
    )
    num_attention_heads: Optional[int] = flag(
        None, "Number of attention heads.", honoured_at="TransformerConfig.num_attention_heads"
    )
    attention_backend: AttnBackend = flag(
        AttnBackend.auto,
        "Attention kernel: flash/fused run torch scaled_dot_product_attention; unfused/local "
        "materialise the scores where they can (no mask tensor, fp32); auto takes unfused on "
        "CPU up to seq 1024 and SDPA otherwise.",
        type=enum_type(AttnBackend),
        choices=list(AttnBackend),
        metavar="{flash,fused,unfused,local,auto}",
        honoured_at="TransformerConfig.attention_backend",
    )
    flash_attention_version: Optional[int] = flag(
        None, "FlashAttention major version to use.", choices=[2, 3, 4]
    )
    softmax_type: str = flag(
        "vanilla",
        "Attention softmax: vanilla, off-by-one (an extra zero logit) or learnable (a learned "
        "sink logit per head).",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    kv_channels: Optional[int] = flag(
        None,
        "Per-head projection size. Default: hidden-size // num-attention-heads.",
        honoured_at="TransformerConfig.kv_channels; core.optimizer._qkv_split (Muon)",
    )
    group_query_attention: bool = switch(
        "Use grouped-query attention (see --num-query-groups).",
        honoured_at="rules/shape.py -> TransformerConfig.num_query_groups",
    )
    num_query_groups: int = flag(
        1,
        "Number of key/value head groups; only read with --group-query-attention.",
        honoured_at="TransformerConfig.num_query_groups; core.optimizer._qkv_split (Muon)",
    )
    window_size: Optional[Tuple[int, int]] = flag(
        None, 'Sliding-window attention (left, right), e.g. "(128, 0)".', type=tuple_type
    )
    window_attn_skip_freq: Optional[Union[int, List[int]]] = flag(
        None,
        "Layers that use full attention instead of the sliding window: an int N (every Nth "
        'layer) or a list pattern such as "([0]*3+[1])*2".',
        type=moe_freq_type,
    )
    max_position_embeddings: Optional[int] = flag(
        None,
        "Maximum sequence length the position embedding supports (size of the learned position "
        "table).",
        honoured_at="pretrain_*.model_provider; tools.run_text_generation_server._serve",
    )
    position_embedding_type: str = flag(
        "learned_absolute",
        "Position embedding type.",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
        honoured_at="pretrain_*.model_provider",
    )
    yarn_original_max_position_embeddings: Optional[int] = flag(
        None,
        "YaRN: the context length the model was trained with.",
        honoured_at="YarnRotaryEmbedding (multi-latent attention)",
    )
    yarn_beta_fast: Optional[float] = flag(
        None, "YaRN: fast rotation boundary.", honoured_at="YarnRotaryEmbedding"
    )
    yarn_beta_slow: Optional[float] = flag(
        None, "YaRN: slow rotation boundary.", honoured_at="YarnRotaryEmbedding"
    )
    yarn_correction_range_round_to_int: Optional[bool] = switch(
        "YaRN: round the correction range to integers.",
        default=None,
        honoured_at="YarnRotaryEmbedding",
        negation=(
            "--no-yarn-correction-range-round-to-int",
            "YaRN: keep the correction range fractional.",
        ),
    )
    relative_attention_num_buckets: int = flag(32, "Buckets for relative position embeddings.")
    relative_attention_max_distance: int = flag(
        128, "Maximum distance for relative position embeddings."
    )
    use_rotary_position_embeddings: bool = switch(
        "Deprecated: use --position-embedding-type rope.",
        honoured_at="rules/deprecated.py -> --position-embedding-type rope",
    )
    rotary_base: int = flag(
        10000,
        "Base (theta) of the rotary embedding frequencies.",
        honoured_at="pretrain_gpt.model_provider",
    )
    rotary_percent: float = flag(
        1.0,
        "Fraction of each head dimension that is rotated.",
        honoured_at="pretrain_gpt.model_provider",
    )
    rotary_interleaved: bool = switch(
        "Rotate interleaved (even/odd) pairs instead of halves.",
        honoured_at="TransformerConfig.rotary_interleaved",
    )
    rotary_seq_len_interpolation_factor: Optional[int] = flag(
        None, "Linear position interpolation factor for rotary embeddings."
    )
    use_rope_scaling: bool = switch(
        "Apply the llama3.x RoPE frequency scaling.", honoured_at="pretrain_gpt.model_provider"
    )
    rope_scaling_factor: float = flag(
        8.0,
        "RoPE scaling factor for --use-rope-scaling.",
        honoured_at="pretrain_gpt.model_provider",
    )
    no_rope_freq: Optional[Union[int, List[int]]] = flag(
        None,
        "Layers that skip RoPE: an int N (every Nth layer) or a list pattern such as "
        '"([0]*3+[1])*2".',
        type=no_rope_freq_type,
    )
    add_position_embedding: bool = off_switch(
        "Deprecated: use --position-embedding-type none.",
        options="--no-position-embedding",
        honoured_at="rules/deprecated.py -> --position-embedding-type none",
    )
    mrope_section: Optional[List[int]] = flag(
        None, "Channel sections for multimodal RoPE.", nargs="+"
    )
    make_vocab_size_divisible_by: int = flag(
        128,
        "Pad the vocabulary so that its size is divisible by this value times the "
        "tensor-parallel size.",
        honoured_at="tokenizer._vocab_size_with_padding",
    )
    normalization: str = flag(
        "LayerNorm",
        "Normalization layer.",
        choices=["LayerNorm", "RMSNorm"],
        honoured_at="TransformerConfig.normalization",
    )
    layernorm_epsilon: float = flag(
        1e-05,
        "Epsilon of LayerNorm / RMSNorm.",
        options="--norm-epsilon",
        honoured_at="TransformerConfig.layernorm_epsilon",
    )
    layernorm_zero_centered_gamma: bool = switch(
        "Zero-centred norm weights: the layer computes (1 + gamma).",
        options="--apply-layernorm-1p",
        honoured_at="TransformerConfig.layernorm_zero_centered_gamma",
    )
    apply_residual_connection_post_layernorm: bool = switch(
        "Take the residual after the layer norm (original BERT ordering).",
        honoured_at="TransformerConfig.apply_residual_connection_post_layernorm",
    )
    openai_gelu: bool = switch(
        "Use OpenAI's tanh GeLU approximation.", honoured_at="TransformerConfig.activation_func"
    )
    squared_relu: bool = switch(
        "Use squared ReLU instead of GeLU.", honoured_at="TransformerConfig.activation_func"
    )
    swiglu: bool = switch(
        "Use SwiGLU (gated SiLU) instead of GeLU.",
        honoured_at="TransformerConfig.gated_linear_unit, activation_func",
    )
    quick_geglu: bool = switch("Use the quick-GeLU gated linear unit (x * sigmoid(1.702 x)).")
    glu_linear_offset: float = flag(0.0, "Offset added to the linear half of a gated unit.")
    activation_func_clamp_value: Optional[float] = flag(
        None, "Clamp the activation input to [-value, value]."
    )
    onnx_safe: Optional[bool] = flag(
        None, "Use workarounds for the torch ONNX exporter.", type=bool
    )
    bert_binary_head: bool = off_switch(
        "Disable the BERT binary head.",
        options="--bert-no-binary-head",
        honoured_at="pretrain_bert.model_provider; pretrain_bert.forward_step; "
        "pretrain_bert.train_valid_test_datasets_provider",
    )
    untie_embeddings_and_output_weights: bool = switch(
        "Use a separate output layer instead of the transposed input embedding.",
        honoured_at="pretrain_*.model_provider; model_setup.get_model",
    )
    qk_layernorm: bool = switch(
        "Normalize queries and keys per head before attention.",
        honoured_at="TransformerConfig.qk_layernorm",
    )
    qk_l2_norm: bool = switch("L2-normalize queries and keys per head before attention.")
    qk_clip: bool = switch("Clip the query/key weights when attention logits grow (QK-clip).")
    qk_clip_alpha: float = flag(0.5, "Share of the QK-clip scaling applied to the queries.")
    qk_clip_threshold: float = flag(
        100, "Largest attention logit before QK-clip rescales the weights."
    )
    attention_output_gate: bool = switch(
        "Gate the attention output with a sigmoid.",
        honoured_at="SelfAttention (a gate per query head in linear_qkv)",
    )
    multi_latent_attention: bool = switch(
        "Use multi-latent attention (see the mla group).",
        honoured_at="configs.core_transformer_config_from_args; MLASelfAttention",
    )
    mtp_num_layers: Optional[int] = flag(
        None,
        "Number of multi-token-prediction layers.",
        honoured_at="TransformerConfig.mtp_num_layers; model_families.gpt.model.model_provider",
    )
    mtp_loss_scaling_factor: float = flag(
        0.1,
        "Weight of the multi-token-prediction loss.",
        honoured_at="TransformerConfig.mtp_loss_scaling_factor",
    )
    mtp_standalone: bool = switch("Place the multi-token-prediction layers on their own stage.")
    mtp_use_repeated_layer: bool = switch("Reuse one multi-token-prediction layer for every depth.")
    mtp_detach_heads: bool = switch("Detach the multi-token-prediction heads from the trunk.")
    mtp_hsm: bool = switch("Hidden-state mixing in the multi-token-prediction layers.")
    mtp_hybrid_override_pattern: Optional[str] = flag(
        None, "Hybrid layer pattern of the multi-token-prediction layers."
    )


@flag_group("mla")
class MLAFlags:
    q_lora_rank: Optional[int] = flag(
        None,
        "Rank of the low-rank query projection (None: full rank).",
        honoured_at="MLASelfAttention",
    )
    kv_lora_rank: int = flag(
        32, "Rank of the low-rank key/value projection.", honoured_at="MLASelfAttention"
    )
    qk_head_dim: int = flag(
        128,
        "Query/key head dimension without the positional part.",
        honoured_at="MLASelfAttention",
    )
    qk_pos_emb_head_dim: int = flag(
        64, "Query/key head dimension carrying RoPE.", honoured_at="MLASelfAttention"
    )
    v_head_dim: int = flag(128, "Value head dimension.", honoured_at="MLASelfAttention")
    rotary_scaling_factor: float = flag(
        1.0, "YaRN rotary scaling factor.", honoured_at="YarnRotaryEmbedding; MLASelfAttention"
    )
    mscale: float = flag(1.0, "YaRN mscale.", honoured_at="YarnRotaryEmbedding")
    mscale_all_dim: float = flag(
        0.0,
        "YaRN mscale applied to all dimensions.",
        honoured_at="YarnRotaryEmbedding; MLASelfAttention",
    )
    cache_mla_latents: bool = switch(
        "Cache the compressed latents instead of keys and values.",
        honoured_at="MLASelfAttention.forward",
    )
    mla_down_proj_fusion: bool = switch("Fuse the query and key/value down projections.")


@flag_group("Transformer-Engine")
class TransformerEngineFlags:
    fp8: Optional[str] = flag(
        None,
        "FP8 format (hybrid = E4M3 forward, E5M2 backward).",
        options="--fp8-format",
        choices=["e4m3", "hybrid"],
    )
    fp8_recipe: str = flag(
        "delayed",
        "FP8 scaling recipe.",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
    )
    fp8_margin: int = flag(0, "Scaling margin for fp8.")
    fp8_interval: int = flag(1, "Deprecated and ignored by Megatron.")
    fp8_amax_history_len: int = flag(1, "Steps of amax history kept per tensor.")
    fp8_amax_compute_algo: str = flag(
        "most_recent", "How amax is taken from the history.", choices=["most_recent", "max"]
    )
    fp8_quantizer_factory: Optional[str] = flag(
        None, "Python path of a custom fp8 quantizer factory."
    )
    fp8_wgrad: bool = off_switch("Compute weight gradients in higher precision.")
    fp8_output_proj: bool = switch("Run the attention output projection in fp8.")
    transformer_impl: str = flag(
        "transformer_engine",
        "Transformer implementation. This code base always runs its local PyTorch implementation.",
        choices=["local", "transformer_engine", "inference_optimized"],
        honoured_at="validate_args: always local (the layers of megatron/core/transformer)",
    )
    fp8_param_gather: bool = switch("Keep parameters in fp8 and all-gather them in fp8.")
    first_last_layers_bf16: bool = switch("Keep the first and last layers in bf16 under fp8.")
    num_layers_at_start_in_bf16: int = flag(1, "Layers kept in bf16 at the start.")
    num_layers_at_end_in_bf16: int = flag(1, "Layers kept in bf16 at the end.")
    fp4_param_gather: bool = switch("Keep parameters in fp4 and all-gather them in fp4.")
    fp4: Optional[str] = flag(None, "FP4 format.", options="--fp4-format", choices=["e2m1"])
    fp4_recipe: str = flag("nvfp4", "FP4 scaling recipe.", choices=["nvfp4", "custom"])
    fp4_quantizer_factory: Optional[str] = flag(
        None, "Python path of a custom fp4 quantizer factory."
    )
    te_precision_config_file: Optional[str] = flag(
        None, "Transformer Engine per-layer precision configuration file.", type=None
    )
    use_kitchen_attention: bool = switch("Use the Kitchen attention kernels.")
    kitchen_attention_backend: str = flag(
        "sdpa", "Kitchen attention backend.", choices=["sdpa", "fa"]
    )
    use_te_activation_func: bool = switch("Use Transformer Engine's activation kernels.")
    use_transformer_engine_op_fuser: bool = switch("Use Transformer Engine's operation fuser.")
