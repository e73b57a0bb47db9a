"""Mixture-of-experts flags: expert parallelism, the experts, the router, token dispatch."""

from typing import List, Optional, Union

from megatron.training.flags.spec import flag, flag_group, switch
from megatron.training.flags.types import moe_freq_type


@flag_group("moe")
class MoEFlags:
    expert_model_parallel_size: int = flag(
        1,
        "Degree of expert model parallelism.",
        honoured_at="TransformerConfig.expert_model_parallel_size; initialize.initialize_megatron",
    )
    expert_tensor_parallel_size: Optional[int] = flag(
        None,
        "Tensor parallelism inside experts. Default: --tensor-model-parallel-size.",
        honoured_at="TransformerConfig.expert_tensor_parallel_size; initialize.initialize_megatron",
    )
    expert_tensor_parallel_num_weight_shards: Optional[int] = flag(
        None, "Shards of each expert weight across the expert tensor-parallel group."
    )
    num_experts: Optional[int] = flag(
        None,
        "Number of experts per MoE layer (None or 0: dense model).",
        honoured_at="TransformerConfig.num_moe_experts",
    )
    moe_layer_freq: Union[int, List[int]] = flag(
        1,
        "MoE layer frequency: an int N (every Nth layer is MoE) or a list pattern such as "
        '"([1]*3+[0])*2".',
        type=moe_freq_type,
        honoured_at="TransformerConfig.moe_layer_freq",
    )
    moe_ffn_hidden_size: Optional[int] = flag(
        None,
        "Hidden size of each expert. Default: --ffn-hidden-size.",
        honoured_at="TransformerConfig.moe_ffn_hidden_size",
    )
    moe_latent_size: Optional[int] = flag(
        None, "Latent size the experts work in (None: hidden size)."
    )
    moe_shared_expert_intermediate_size: Optional[int] = flag(
        None,
        "Total hidden size of the shared experts (None: no shared expert).",
        honoured_at="TransformerConfig.moe_shared_expert_intermediate_size",
    )
    moe_shared_expert_gate: bool = switch(
        "Gate the shared expert output with a sigmoid.",
        honoured_at="TransformerConfig.moe_shared_expert_gate",
    )
    moe_shared_expert_glu_interleave_size: Optional[int] = flag(
        None, "Interleave size of the shared expert's gated linear unit weights."
    )
    moe_mlp_glu_interleave_size: Optional[int] = flag(
        None, "Interleave size of the experts' gated linear unit weights."
    )
    moe_grouped_gemm: bool = switch(
        "Run the local experts with one grouped GEMM.",
        honoured_at="TransformerConfig.moe_grouped_gemm",
    )
    use_grouped_gemm_for_shared_expert: bool = switch("Run the shared expert with a grouped GEMM.")
    use_grouped_gemm_for_dense_mlp: bool = switch("Run dense MLPs with a grouped GEMM.")
    moe_use_grouped_tensor: bool = switch("Keep the expert weights in one grouped tensor.")
    moe_single_grouped_weight: bool = switch(
        "Store all expert weights of a layer as one parameter."
    )
    moe_single_grouped_bias: bool = switch("Store all expert biases of a layer as one parameter.")
    moe_layer_recompute: bool = switch(
        "Recompute MoE layers in backward (deprecated: --recompute-modules moe).",
        honoured_at="TransformerConfig.moe_layer_recompute",
    )
    moe_use_upcycling: bool = switch("Convert a dense checkpoint into an MoE model.")
    moe_upcycling_granularity: int = flag(
        1, "Experts made from each dense MLP when upcycling (fine-grained upcycling)."
    )
    moe_apply_probs_on_input: bool = switch("Multiply the router probabilities into the inputs.")
    moe_per_layer_logging: bool = switch(
        "Log auxiliary losses per MoE layer.",
        honoured_at="TransformerConfig.moe_per_layer_logging; training.train_step",
    )
    moe_router_load_balancing_type: List[str] = flag(
        "aux_loss",
        "Router load-balancing method (one per MoE layer group, or one for all).",
        nargs="+",
        choices=[
            "aux_loss",
            "seq_aux_loss",
            "global_aux_loss",
            "sinkhorn",
            "quantile_balancing",
            "none",
        ],
        honoured_at="TransformerConfig.moe_router_load_balancing_type",
    )
    moe_router_dtype: Optional[str] = flag(
        None,
        "Dtype of the routing computation.",
        choices=["fp32", "fp64"],
        honoured_at="TransformerConfig.moe_router_dtype",
    )
    moe_router_score_function: str = flag(
        "softmax",
        "Router score function.",
        choices=["softmax", "sigmoid", "sqrtsoftplus"],
        honoured_at="TransformerConfig.moe_router_score_function",
    )
    moe_router_topk: int = flag(
        2,
        "Number of experts each token is routed to.",
        honoured_at="TransformerConfig.moe_router_topk",
    )
    moe_router_pre_softmax: bool = switch(
        "Apply the softmax before the top-k selection.",
        honoured_at="TransformerConfig.moe_router_pre_softmax",
    )
    moe_router_num_groups: Optional[int] = flag(
        None,
        "Expert groups for group-limited routing.",
        honoured_at="TransformerConfig.moe_router_num_groups",
    )
    moe_router_group_topk: Optional[int] = flag(
        None,
        "Selected groups for group-limited routing.",
        honoured_at="TransformerConfig.moe_router_group_topk",
    )
    moe_router_topk_scaling_factor: Optional[float] = flag(
        None,
        "Scaling factor of the top-k scores.",
        honoured_at="TransformerConfig.moe_router_topk_scaling_factor",
    )
    moe_router_enable_expert_bias: bool = switch(
        "Aux-loss-free balancing with a learned expert bias.",
        honoured_at="TransformerConfig.moe_router_enable_expert_bias",
    )
    moe_router_bias_update_rate: float = flag(
        0.001,
        "Update rate of the expert bias.",
        honoured_at="TransformerConfig.moe_router_bias_update_rate",
    )
    moe_router_quantile_balancing_ema: float = flag(0.0, "EMA factor of quantile load balancing.")
    moe_router_force_load_balancing: bool = switch("Route tokens uniformly (benchmarking aid).")
    moe_router_force_biased: Optional[float] = flag(
        None, "Skew the forced routing towards some experts (benchmarking aid)."
    )
    moe_router_padding_for_quantization: bool = switch("Pad routing maps for quantized experts.")
    moe_router_padding_for_fp8: bool = switch("Pad routing maps for fp8 experts (deprecated name).")
    moe_router_fusion: bool = switch("Fuse the router's top-k and score computation.")
    moe_enable_routing_replay: bool = switch("Record and replay routing decisions.")
    moe_aux_loss_coeff: List[float] = flag(
        0.0,
        "Auxiliary load-balancing loss coefficient(s).",
        nargs="+",
        honoured_at="TransformerConfig.moe_aux_loss_coeff",
    )
    moe_z_loss_coeff: Optional[float] = flag(
        None, "Router z-loss coefficient.", honoured_at="TransformerConfig.moe_z_loss_coeff"
    )
    moe_input_jitter_eps: Optional[float] = flag(
        None,
        "Multiplicative jitter applied to router inputs.",
        honoured_at="TransformerConfig.moe_input_jitter_eps",
    )
    moe_token_dispatcher_type: str = flag(
        "allgather",
        "Token dispatcher.",
        choices=["allgather", "alltoall", "flex"],
        honoured_at="TransformerConfig.moe_token_dispatcher_type",
    )
    moe_enable_deepep: bool = switch("Dispatch tokens with DeepEP (deprecated: flex dispatcher).")
    moe_flex_dispatcher_backend: str = flag(
        "deepep", "Backend of the flex token dispatcher.", choices=["deepep", "hybridep", "ncclep"]
    )
    moe_flex_dispatcher_num_sms: Optional[int] = flag(None, "SMs the flex dispatcher may use.")
    moe_deepep_num_sms: Optional[int] = flag(None, "SMs DeepEP may use.")
    moe_hybridep_num_sms: Optional[int] = flag(None, "SMs HybridEP may use.")
    moe_hybridep_num_blocks_permute: Optional[int] = flag(
        None, "Thread blocks of HybridEP's permute."
    )
    moe_hybridep_num_blocks_unpermute: Optional[int] = flag(
        None, "Thread blocks of HybridEP's unpermute."
    )
    moe_hybridep_num_sms_preprocessing: int = flag(108, "SMs of HybridEP's preprocessing.")
    moe_hybridep_pad_uneven_dispatch_inputs: bool = switch("Pad uneven HybridEP dispatch inputs.")
    moe_permute_fusion_into_hybridep: bool = switch("Fuse the permutation into HybridEP.")
    moe_ncclep_zero_copy: bool = switch("Zero-copy buffers for the NCCL EP dispatcher.")
    moe_dispatch_fwd_dtype: str = flag(
        "bf16", "Dtype of the tokens sent in the forward dispatch.", choices=["bf16", "mxfp8"]
    )
    moe_combine_bwd_dtype: str = flag(
        "bf16", "Dtype of the gradients sent in the backward combine.", choices=["bf16", "mxfp8"]
    )
    moe_permute_fusion: bool = switch("Fuse the token permutation kernels.")
    moe_expert_capacity_factor: Optional[float] = flag(
        None,
        "Expert capacity factor (None: no dropping).",
        honoured_at="TransformerConfig.moe_expert_capacity_factor",
    )
    moe_expert_rank_capacity_factor: Optional[float] = flag(
        None, "Capacity factor per expert-parallel rank (None: no dropping)."
    )
    moe_pad_expert_input_to_capacity: bool = switch(
        "Pad each expert input to its capacity.",
        honoured_at="TransformerConfig.moe_pad_expert_input_to_capacity",
    )
    moe_token_drop_policy: str = flag(
        "probs",
        "Which tokens are dropped beyond capacity.",
        choices=["probs", "position"],
        honoured_at="TransformerConfig.moe_token_drop_policy",
    )
    moe_pad_experts_for_cuda_graph_inference: bool = switch(
        "Pad the experts to fixed sizes for CUDA-graph inference."
    )
    moe_shared_expert_overlap: bool = switch("Overlap shared experts with token dispatch.")
    overlap_moe_expert_parallel_comm: bool = switch(
        "Overlap expert-parallel communication with computation across micro-batches."
    )
    delay_wgrad_compute: bool = switch("Delay the expert weight-gradient GEMMs to overlap them.")
    overlap_dispatch_backward_with_experts_wgrad: bool = switch(
        "Overlap the backward dispatch with the experts' weight gradients."
    )
    ep_overlap_early_attn_memory_release: bool = switch(
        "Release attention memory early when overlapping expert-parallel communication."
    )
    high_priority_a2a_comm_stream: bool = switch("Run the all-to-all on a high-priority stream.")
    moe_paged_stash: bool = switch("Stash expert activations in paged buffers.")
    moe_paged_stash_page_size: int = flag(64, "Page size (tokens) of the paged stash.")
    moe_paged_stash_buffer_size_factor_cuda: float = flag(
        1.1, "GPU paged-stash buffer size as a multiple of the expected size."
    )
    moe_paged_stash_buffer_size_factor_cpu: float = flag(
        0.0, "CPU paged-stash buffer size as a multiple of the expected size."
    )
    moe_routing_trace_path: Optional[str] = flag(
        None, "Write the routing decisions to this directory."
    )
    moe_routing_trace_max_training_iters: Optional[int] = flag(
        None, "Iterations whose routing is traced (None: all)."
    )
    moe_routing_trace_capture_logits: bool = switch("Also trace the router logits.")
    moe_routing_trace_capture_hidden_states: bool = switch("Also trace the router inputs.")
    moe_routing_trace_dump_weights: bool = switch("Also dump the router weights.")
