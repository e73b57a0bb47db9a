"""megatron-core 0.16's ``TransformerConfig`` fields for features this code base does not have.

Code written against megatron-core may name any of its config fields; each one exists here with
megatron-core's default. Two kinds:

* settings of a feature that is absent or off (fp8 recipes, Mamba sizes, communication overlap
  of Transformer Engine, CUDA graph details, ...): accepted at any value and without effect,
  because the feature they tune never runs here (:data:`INERT_FIELDS`);
* switches of a feature this code base does not implement (fp8/fp4, multi-latent attention,
  sliding-window attention, CPU offloading, CUDA graphs other than
  ``cuda_graph_impl='local'``, ...): any value
  but megatron-core's default is refused by :func:`refuse_unsupported_features`, naming the field,
  so a run never silently trains another model than the one asked for.

``transformer_impl`` is accepted as ``"local"`` and as megatron-core's default
``"transformer_engine"`` (without Transformer Engine both build the local modules here).
"""

from dataclasses import dataclass
from typing import Any

# Fields of features implemented here, whose values TransformerConfig checks itself (gated delta
# net attention and the attention output gate).
CHECKED_ELSEWHERE = frozenset(
    {
        "experimental_attention_variant",
        "linear_attention_freq",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "attention_output_gate",
        # Parsed and checked by the pipeline layer split (pipeline_parallel/layer_layout.py).
        "pipeline_model_parallel_layout",
    }
)

# Fields whose value has no effect here (see the module docstring).
INERT_FIELDS = frozenset(
    {
        # Megatron-core picks deterministic Transformer Engine kernels by it; the layers here
        # choose no kernel by it. The command line's --deterministic-mode switches the process
        # to torch's deterministic algorithms (training/flags/rules/layer.py).
        "deterministic_mode",
        # Overlap of one micro-batch's expert all-to-all with another's computation (speed only:
        # the command line names them in its start-up note and checks Megatron's rules).
        "overlap_moe_expert_parallel_comm",
        "delay_wgrad_compute",
        "max_seqlen_per_dp_cp_rank",
        # The local kernels have no non-deterministic variant to turn off; --deterministic-mode
        # also calls torch.use_deterministic_algorithms (megatron/training/flags/rules/layer.py).
        "deterministic_mode",
        "async_tensor_model_parallel_allreduce",
        "tp_comm_bulk_wgrad",
        "tp_comm_bulk_dgrad",
        "tp_comm_overlap_ag",
        "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad",
        "tp_comm_split_ag",
        "tp_comm_atomic_ag",
        "tp_comm_split_rs",
        "tp_comm_atomic_rs",
        "tp_comm_overlap_disable_qkv",
        "tp_comm_overlap_disable_fc1",
        "tp_comm_bootstrap_backend",
        "batch_p2p_sync",
        "use_ring_exchange_p2p",
        "overlap_p2p_comm_warmup_flush",
        "cpu_offloading_num_layers",
        "_cpu_offloading_context",
        "cpu_offloading_activations",
        "cpu_offloading_weights",
        "cpu_offloading_double_buffering",
        "qk_clip_alpha",
        "qk_clip_threshold",
        "dsa_indexer_n_heads",
        "dsa_indexer_head_dim",
        "dsa_indexer_topk",
        "dsa_indexer_loss_coeff",
        "dsa_indexer_use_sparse_loss",
        "fp8_recipe",
        "fp8_quantizer_factory",
        "fp8_margin",
        "fp8_interval",
        "fp8_amax_history_len",
        "fp8_amax_compute_algo",
        "fp8_wgrad",
        "tp_only_amax_red",
        "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16",
        "kitchen_attention_backend",
        "fp4_recipe",
        "fp4_quantizer_factory",
        "moe_flex_dispatcher_backend",
        "moe_permute_fusion",
        "moe_router_fusion",
        "moe_deepep_num_sms",
        "moe_hybridep_num_sms",
        "cuda_graph_use_single_mempool",
        "cuda_graph_retain_backward_graph",
        "cuda_graph_scope",
        "clone_scatter_output_in_embedding",
        "disable_parameter_transpose_cache",
        "inference_sampling_seed",
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
        "use_mamba_mem_eff_path",
        "mlp_chunks_for_prefill",
        "transformer_impl",
        "fine_grained_activation_offloading",
        "offload_modules",
        "min_offloaded_tensor_size",
    }
)

_TRANSFORMER_IMPLS = ("local", "transformer_engine")
# 'local': per-layer graphs of the training step (megatron/core/transformer/cuda_graphs.py).
_CUDA_GRAPH_IMPLS = ("none", "local")
_CUDA_GRAPH_FIELDS = ("cuda_graph_impl", "enable_cuda_graph", "cuda_graph_warmup_steps")


@dataclass
class UnsupportedFeatureFields:
    """megatron-core's fields (and defaults) that this code base has no feature behind."""

    pipeline_model_parallel_comm_backend: Any = None
    """Backend of the pipeline's point-to-point transfers (None: the group's)."""
    max_seqlen_per_dp_cp_rank: Any = None
    """Longest sequence a rank holds under hybrid context parallelism."""
    hybrid_context_parallel: Any = False
    """Hybrid (per-sample) context parallelism."""
    moe_extended_tp: Any = False
    """Expert tensor parallelism over the extended TP x EP group."""
    deterministic_mode: Any = False
    """Deterministic kernels only."""
    async_tensor_model_parallel_allreduce: Any = True
    """Overlap the input-gradient all-reduce with its GEMM."""
    tp_comm_bulk_wgrad: Any = True
    """Transformer Engine: bulk overlap of the weight-gradient communication."""
    tp_comm_bulk_dgrad: Any = True
    """Transformer Engine: bulk overlap of the data-gradient communication."""
    tp_comm_overlap_ag: Any = True
    """Transformer Engine: overlap the all-gather with its GEMM."""
    tp_comm_overlap_rs: Any = True
    """Transformer Engine: overlap the reduce-scatter with its GEMM."""
    tp_comm_overlap_rs_dgrad: Any = False
    """Transformer Engine: overlap the data-gradient reduce-scatter."""
    tp_comm_split_ag: Any = True
    """Transformer Engine: split-pipelined all-gather overlap."""
    tp_comm_atomic_ag: Any = False
    """Transformer Engine: atomic all-gather overlap."""
    tp_comm_split_rs: Any = True
    """Transformer Engine: split-pipelined reduce-scatter overlap."""
    tp_comm_atomic_rs: Any = False
    """Transformer Engine: atomic reduce-scatter overlap."""
    tp_comm_overlap_disable_qkv: Any = False
    """Transformer Engine: no communication overlap for the QKV projection."""
    tp_comm_overlap_disable_fc1: Any = False
    """Transformer Engine: no communication overlap for fc1."""
    tp_comm_bootstrap_backend: Any = "nccl"
    """Transformer Engine: backend that sets up the overlap buffers."""
    overlap_moe_expert_parallel_comm: Any = False
    """Overlap the expert-parallel all-to-all with computation."""
    delay_wgrad_compute: Any = False
    """Compute weight gradients later than the data gradients."""
    ep_overlap_early_attn_memory_release: Any = False
    """Release attention memory early under expert-parallel overlap."""
    batch_p2p_sync: Any = True
    """Synchronize after batched pipeline sends and receives."""
    use_ring_exchange_p2p: Any = False
    """Pipeline transfers through ring exchange kernels."""
    overlap_p2p_comm_warmup_flush: Any = False
    """Overlap the pipeline transfers of warm-up and flush."""
    mtp_standalone: Any = False
    """Multi-token prediction layers on a pipeline stage of their own."""
    cpu_offloading: Any = False
    """Offload activations / weights to the CPU."""
    cpu_offloading_num_layers: Any = 0
    """Layers whose activations are offloaded."""
    _cpu_offloading_context: Any = None
    """The offloading context (internal to megatron-core)."""
    cpu_offloading_activations: Any = True
    """Offload activations (with cpu_offloading)."""
    cpu_offloading_weights: Any = False
    """Offload weights (with cpu_offloading)."""
    cpu_offloading_double_buffering: Any = False
    """Double-buffer the offloaded tensors."""
    pipeline_model_parallel_layout: Any = None
    """An explicit layer layout over the pipeline stages."""
    softmax_type: Any = "vanilla"
    """Attention softmax variant ('vanilla': the usual softmax)."""
    activation_func_fp8_input_store: Any = False
    """Keep the activation's input in fp8 for backward."""
    glu_linear_offset: Any = 0.0
    """Offset added to the linear half of a gated linear unit."""
    activation_func_clamp_value: Any = None
    """Clamp of the activation's input (None: none)."""
    window_size: Any = None
    """Sliding-window attention's (left, right) window (None: full attention)."""
    window_attn_skip_freq: Any = None
    """Every how many layers sliding-window attention is skipped."""
    qk_l2_norm: Any = False
    """L2-normalize queries and keys."""
    qk_clip: Any = False
    """QK-clip of the attention logits (Muon)."""
    qk_clip_alpha: Any = 0.5
    """QK-clip's balance between queries and keys."""
    qk_clip_threshold: Any = 100
    """QK-clip's logit threshold."""
    log_max_attention_logit: Any = False
    """Track the largest attention logit."""
    attention_output_gate: Any = False
    """A gate on the attention output."""
    multi_latent_attention: Any = False
    """Multi-latent attention (MLATransformerConfig)."""
    no_rope_freq: Any = None
    """Layers that skip rotary embeddings."""
    experimental_attention_variant: Any = None
    """An experimental attention variant (e.g. DeepSeek sparse attention)."""
    dsa_indexer_n_heads: Any = None
    """DeepSeek sparse attention: indexer heads."""
    dsa_indexer_head_dim: Any = None
    """DeepSeek sparse attention: indexer head size."""
    dsa_indexer_topk: Any = None
    """DeepSeek sparse attention: tokens each query keeps."""
    dsa_indexer_loss_coeff: Any = None
    """DeepSeek sparse attention: indexer loss weight."""
    dsa_indexer_use_sparse_loss: Any = False
    """DeepSeek sparse attention: sparse indexer loss."""
    linear_attention_freq: Any = None
    """Every how many layers attention is linear attention."""
    linear_conv_kernel_dim: Any = 4
    """Linear attention: convolution kernel size."""
    linear_key_head_dim: Any = 128
    """Linear attention: key head size."""
    linear_value_head_dim: Any = 128
    """Linear attention: value head size."""
    linear_num_key_heads: Any = 16
    """Linear attention: key heads."""
    linear_num_value_heads: Any = 32
    """Linear attention: value heads."""
    disable_bf16_reduced_precision_matmul: Any = False
    """No reduced-precision reductions in bf16 GEMMs."""
    use_fused_weighted_squared_relu: Any = False
    """Fused weighted squared-ReLU kernel."""
    fused_single_qkv_rope: Any = False
    """Fused QKV split and RoPE kernel."""
    fp8: Any = None
    """fp8 training recipe format (None: no fp8)."""
    fp8_recipe: Any = "delayed"
    """fp8 scaling recipe."""
    fp8_param: Any = False
    """Keep parameters in fp8."""
    fp8_quantizer_factory: Any = None
    """Factory of custom fp8 quantizers."""
    fp8_margin: Any = 0
    """fp8 scaling margin."""
    fp8_interval: Any = 1
    """fp8 scaling update interval."""
    fp8_amax_history_len: Any = 1
    """fp8 amax history length."""
    fp8_amax_compute_algo: Any = "most_recent"
    """fp8 amax algorithm."""
    fp8_wgrad: Any = True
    """fp8 weight gradients."""
    fp8_dot_product_attention: Any = False
    """fp8 attention."""
    fp8_multi_head_attention: Any = False
    """fp8 multi-head attention."""
    tp_only_amax_red: Any = False
    """Reduce fp8 amax over TP only."""
    first_last_layers_bf16: Any = False
    """Keep the first and last layers in bf16 under fp8/fp4."""
    num_layers_at_start_in_bf16: Any = 1
    """bf16 layers at the start (with first_last_layers_bf16)."""
    num_layers_at_end_in_bf16: Any = 1
    """bf16 layers at the end (with first_last_layers_bf16)."""
    use_kitchen: Any = False
    """NVIDIA Kitchen quantized modules."""
    use_kitchen_attention: Any = False
    """NVIDIA Kitchen attention."""
    kitchen_attention_backend: Any = "sdpa"
    """NVIDIA Kitchen attention backend."""
    fp4: Any = None
    """fp4 training recipe format (None: no fp4)."""
    fp4_recipe: Any = "nvfp4"
    """fp4 scaling recipe."""
    fp4_param: Any = False
    """Keep parameters in fp4."""
    fp4_quantizer_factory: Any = None
    """Factory of custom fp4 quantizers."""
    moe_enable_routing_replay: Any = False
    """Replay recorded MoE routing decisions."""
    moe_router_topk_limited_devices: Any = None
    """Devices a token's experts may span (None: any)."""
    moe_router_padding_for_quantization: Any = False
    """Pad the routing map for quantized GEMMs."""
    moe_router_padding_for_fp8: Any = False
    """Pad the routing map for fp8 GEMMs."""
    moe_router_force_load_balancing: Any = False
    """Force a uniform routing (benchmarking)."""
    moe_use_legacy_grouped_gemm: Any = False
    """The legacy GroupedMLP experts."""
    moe_token_dropping: Any = False
    """Drop tokens over the expert capacity (legacy switch)."""
    moe_enable_deepep: Any = False
    """DeepEP token dispatch."""
    moe_flex_dispatcher_backend: Any = "deepep"
    """Backend of the flex token dispatcher."""
    moe_permute_fusion: Any = False
    """Fused token permutation kernels."""
    moe_router_fusion: Any = False
    """Fused router kernels."""
    moe_apply_probs_on_input: Any = False
    """Apply the routing probabilities to the experts' input."""
    moe_latent_size: Any = None
    """Latent size of latent MoE (None: none)."""
    moe_deepep_num_sms: Any = 20
    """SMs DeepEP uses."""
    moe_hybridep_num_sms: Any = 16
    """SMs HybridEP uses."""
    enable_cuda_graph: Any = False
    """Capture the layers in CUDA graphs."""
    cuda_graph_use_single_mempool: Any = False
    """One memory pool for every CUDA graph."""
    cuda_graph_retain_backward_graph: Any = False
    """Keep the backward CUDA graph."""
    cuda_graph_warmup_steps: Any = 3
    """Steps before CUDA graph capture."""
    external_cuda_graph: Any = False
    """CUDA graphs captured outside the model."""
    cuda_graph_impl: Any = "none"
    """CUDA graph implementation ('none': no graphs)."""
    cuda_graph_scope: Any = "full"
    """What CUDA graphs capture."""
    clone_scatter_output_in_embedding: Any = True
    """Clone the embedding's sequence-parallel scatter output."""
    disable_parameter_transpose_cache: Any = False
    """Transformer Engine: no cached weight transposes."""
    config_logger_dir: Any = ""
    """Directory megatron-core logs configs and tensors to ('': none)."""
    flash_decode: Any = False
    """Flash decoding at inference."""
    batch_invariant_mode: Any = False
    """Batch-invariant kernels."""
    use_te_activation_func: Any = False
    """Transformer Engine's activation functions."""
    inference_rng_tracker: Any = False
    """A separate RNG tracker for inference."""
    inference_sampling_seed: Any = 42
    """Seed of inference sampling."""
    symmetric_ar_type: Any = None
    """Symmetric-memory all-reduce type (None: none)."""
    use_inference_optimized_layers: Any = False
    """Inference-optimized layers."""
    inference_fuse_tp_communication: Any = False
    """Fused TP communication at inference."""
    mrope_section: Any = None
    """Multimodal RoPE's sections (None: no mRoPE)."""
    mamba_state_dim: Any = 128
    """Mamba state size."""
    mamba_head_dim: Any = 64
    """Mamba head size."""
    mamba_num_groups: Any = 8
    """Mamba groups."""
    mamba_num_heads: Any = None
    """Mamba heads."""
    use_mamba_mem_eff_path: Any = True
    """Mamba's memory-efficient kernel."""
    mlp_chunks_for_prefill: Any = 1
    """MLP chunks during inference prefill."""
    heterogeneous_block_specs: Any = False
    """Layers of differing configurations."""
    hetereogenous_dist_checkpoint: Any = False
    """Checkpoints of heterogeneous layers (megatron-core's spelling)."""
    quant_recipe: Any = None
    """A quantization recipe (None: none)."""
    transformer_impl: Any = "transformer_engine"
    """Layer implementation ('transformer_engine' or 'local': the local layers here)."""
    fine_grained_activation_offloading: Any = False
    """Offload chosen activations to the CPU."""
    offload_modules: Any = "<factory []>"
    """Modules whose activations are offloaded."""
    min_offloaded_tensor_size: Any = 1048576
    """Smallest tensor offloaded (bytes)."""


_DEFAULTS = {
    name: value.default for name, value in UnsupportedFeatureFields.__dataclass_fields__.items()
}


def refuse_unsupported_features(config) -> None:
    """ValueError naming the first field of a missing feature set to another value than
    megatron-core's default."""
    for name, default in _DEFAULTS.items():
        if name in INERT_FIELDS or name in _CUDA_GRAPH_FIELDS or name in CHECKED_ELSEWHERE:
            continue
        value = getattr(config, name)
        if value == default:
            continue
        if name == "multi_latent_attention":
            if hasattr(config, "kv_lora_rank"):
                continue  # an MLATransformerConfig
            raise ValueError(
                "multi_latent_attention=True needs an MLATransformerConfig (its kv_lora_rank, "
                "qk_head_dim, ... fields)"
            )
        raise ValueError(
            f"TransformerConfig: {name}={value!r} is not supported here "
            f"(megatron-core's default: {default!r})"
        )
    if config.cuda_graph_impl not in _CUDA_GRAPH_IMPLS:
        raise ValueError(
            f"TransformerConfig: cuda_graph_impl={config.cuda_graph_impl!r} is not supported "
            f"here; use one of {_CUDA_GRAPH_IMPLS}"
        )
    if config.enable_cuda_graph and config.cuda_graph_impl != "local":
        raise ValueError(
            "TransformerConfig: enable_cuda_graph (deprecated) means cuda_graph_impl='local', "
            f"got cuda_graph_impl={config.cuda_graph_impl!r}"
        )
    if config.transformer_impl not in _TRANSFORMER_IMPLS:
        raise ValueError(
            f"TransformerConfig: transformer_impl={config.transformer_impl!r} is not supported "
            f"here; use one of {_TRANSFORMER_IMPLS}"
        )
