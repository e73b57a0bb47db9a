"""The flags this code base does not honour: one row per dest, with its class and reason; see
megatron/training/flag_policy.py for the classes and what each does at start-up.

Every other flag is honoured, and its field (megatron/training/flags/*.py) says where
(``honoured_at``); ``policy_of`` joins the two into the policy of every dest.

Rows are grouped by family and share their reason (the dests of a family are listed in a
whitespace-separated block). A row with ``given=`` applies to some values only (the other values
are honoured). A feature's own issue deletes its rows and gives its fields an ``honoured_at``.
The order of the rows is the order in which a refusal or the start-up note lists the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

HONOURED = "honoured"
NO_EFFECT = "no effect here"
REFUSED = "refused"
KINDS = (HONOURED, NO_EFFECT, REFUSED)

# (value, the user's args) -> whether the flag counts as given for its rule.
Given = Callable[[Any, argparse.Namespace], bool]


@dataclass(frozen=True)
class Rule:
    """The policy of one flag (one argparse dest)."""

    dest: str
    """The argparse dest the rule is about."""

    kind: str
    """HONOURED, NO_EFFECT or REFUSED."""

    reason: str
    """Why: printed in the start-up note, the refusal line and --help."""

    given: Optional[Given] = None
    """When the flag triggers its rule; None: when its value differs from the parser default.
    A REFUSED or NO_EFFECT rule with a predicate applies to those values only; the flag's other
    values are honoured."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.dest}: unknown policy kind {self.kind!r}")
        if not self.reason:
            raise ValueError(f"{self.dest}: a policy rule needs its reason")


ROWS: Dict[str, Rule] = {}
"""dest -> its NO_EFFECT or REFUSED rule, in table order."""


def _rows(kind, reason, *names, given=None):
    # Each argument holds one dest or several, separated by whitespace.
    for dest in (dest for group in names for dest in group.split()):
        if dest in ROWS:
            raise ValueError(f"{dest} has two rows in the flag policy table")
        ROWS[dest] = Rule(dest, kind, reason, given)


def no_effect(reason, *dests, given=None):
    _rows(NO_EFFECT, reason, *dests, given=given)


def refused(reason, *dests, given=None):
    _rows(REFUSED, reason, *dests, given=given)


_NYI = "not implemented yet"

# --------------------------------------------------------------- no effect here, speed only
_TE = "Transformer Engine is not used; the local PyTorch implementation computes the same layers"
_FUSED = "selects a fused kernel; the unfused PyTorch code here computes the same result"
_CUDA_GRAPHS = "CUDA graphs are not captured here; the same computation runs without them"
_TP_OVERLAP = (
    "userbuffer overlap of tensor-parallel communication with GEMMs is not built here; the "
    "collectives run unoverlapped with the same result"
)
_NCCL = (
    "tunes how NCCL runs the collectives (user buffers, SHARP, symmetric memory, streams, "
    "communicator settings); the collectives compute the same result"
)
_SCHEDULING = "only changes when communication is issued; the result is the same"
_CKPT_IO = "only changes how checkpoint files are written or read, not what they hold"

no_effect(_TE, "transformer_impl", given=lambda value, args: value != "local")
no_effect(_TE, "use_te_activation_func", "use_transformer_engine_op_fuser")
no_effect(
    _FUSED,
    """
    masked_softmax_fusion apply_rope_fusion no_persist_layer_norm
    use_fused_weighted_squared_relu fused_residual_rmsnorm
    disable_jit_fuser mla_down_proj_fusion
    """,
)
no_effect(_FUSED, "cross_entropy_fusion_impl", given=lambda value, args: value == "te")
# On: the torch.compile'd bias-dropout-add of CUDA runs (TransformerConfig.bias_dropout_fusion);
# off: the unfused ops, which CPU runs either way.
no_effect(_FUSED, "bias_dropout_fusion", given=lambda value, args: not value)
no_effect(
    "selects a FlashAttention release; attention here runs torch's kernels",
    "flash_attention_version",
)
no_effect(
    "selects a Triton SYRK kernel for Muon's Newton-Schulz steps, which run as plain matmuls "
    "here (the same arithmetic)",
    "muon_use_syrk",
)
no_effect(
    _CUDA_GRAPHS,
    """
    external_cuda_graph optimizer_cuda_graph cuda_graph_modules cuda_graph_scope_deprecated
    """,
)
no_effect(
    _CUDA_GRAPHS,
    "cuda_graph_impl",
    given=lambda value, args: value not in ("none", "local"),
)
no_effect(
    _TP_OVERLAP,
    """
    tp_comm_overlap tp_comm_overlap_cfg tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag
    tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs
    tp_comm_bootstrap_backend
    """,
)
no_effect(
    _NCCL,
    """
    nccl_ub use_sharp sharp_enabled_group disable_symmetric_registration
    fsdp_manual_registration create_all_gather_group high_priority_stream_groups
    nccl_communicator_config_path ddp_pad_buckets_for_high_nccl_busbw
    pipeline_model_parallel_comm_backend
    """,
)
no_effect(
    _SCHEDULING,
    """
    overlap_p2p_comm overlap_p2p_comm_warmup_flush use_ring_exchange_p2p align_grad_reduce
    align_param_gather overlap_param_gather_with_optimizer_step defer_embedding_wgrad_compute
    wgrad_deferral_limit gradient_reduce_div_fusion train_sync_interval
    """,
)
no_effect(
    "overlaps one micro-batch's expert-parallel all-to-all with another's computation (and "
    "defers the expert weight-gradient GEMMs to fill the gaps); the same arithmetic runs "
    "unoverlapped here",
    "overlap_moe_expert_parallel_comm delay_wgrad_compute",
)
no_effect(
    "context parallelism here always exchanges keys and values in a p2p ring; the other "
    "exchanges compute the same attention",
    "cp_comm_type",
    given=lambda value, args: list(value or ["p2p"]) != ["p2p"],
)
no_effect(
    "Megatron-FSDP is mapped onto this code base's own ZeRO machinery (README: Memory "
    "options); its buffer and kernel settings change speed only",
    """
    megatron_fsdp_version use_layer_wise_param_layout fsdp_double_buffer
    suggested_communication_unit_size megatron_fsdp_enable_fine_grained_param_gather
    megatron_fsdp_max_pool_double_buffer fsdp_db_use_persist_buf_on_alloc_fail
    keep_fp8_transpose_cache
    """,
)


def _runs_fsdp2(args) -> bool:
    # model_setup.uses_torch_fsdp2, read from the user's args (flags do not import training).
    return bool(getattr(args, "use_torch_fsdp2", False)) or (
        bool(getattr(args, "use_megatron_fsdp", False))
        and getattr(args, "data_parallel_sharding_strategy", None) == "optim_grads_params"
    )


no_effect(
    "FSDP2 (--use-torch-fsdp2, or --use-megatron-fsdp with optim_grads_params) has no DDP "
    "buckets: it always reduce-scatters each FSDP unit's gradients during backward and "
    "prefetches the next unit's parameters",
    "overlap_grad_reduce overlap_param_gather ddp_bucket_size ddp_num_buckets",
    given=lambda value, args: value not in (None, False) and _runs_fsdp2(args),
)
no_effect(
    _CKPT_IO,
    """
    use_persistent_ckpt_worker async_strategy async_ckpt_cpu_priority async_ckpt_io_priority
    async_ckpt_use_cpu_shm ckpt_fully_parallel_load ckpt_fully_parallel_load_exchange_algo
    ckpt_fully_parallel_load_per_rank_objects ckpt_fully_parallel_save_process_group
    ckpt_fully_parallel_load_process_group ckpt_assume_constant_structure
    ckpt_load_validate_sharding_integrity distrib_optim_fully_reshardable_mem_efficient
    dist_ckpt_workers dataloader_defer_npy_index_mmap
    """,
)
no_effect(
    "memory housekeeping of the CUDA caching allocator or of Python objects; results are the same",
    """
    empty_unused_memory_level clone_scatter_output_in_embedding mlp_chunks_for_training
    """,
)
no_effect(
    "marks the range an external profiler (nsys, NVTX) captures; nothing is profiled here and "
    "the run is the same",
    """
    nvtx_ranges profile profile_step_start profile_step_end profile_ranks
    """,
)

# ----------------------------------------------------------------------------- refused
_MOE = f"mixture of experts is {_NYI}"
_HYBRID = (
    "linear attention other than gated_delta_net (gated delta products, gdn/gdn2) and DSA "
    f"models are {_NYI}"
)
_FP8 = "fp8/fp4 training needs Transformer Engine, which this code base does not use"
_BERT_T5 = f"T5 relative position buckets and BERT embedders are {_NYI}"
_VISION = f"vision models are {_NYI}"
_TEXT_GEN = (
    f"the dynamic-batching inference engine and its kernels are {_NYI} (the static text "
    "generation server is built: tools/run_text_generation_server.py)"
)
_FT = f"fault tolerance (in-process restart, fault injection, autoresume) is {_NYI}"
_RL = f"reinforcement learning and distillation are {_NYI}"
_PROFILER = f"the PyTorch profiler and CUDA memory-history dumps are {_NYI}"

refused(
    f"{_MOE.replace('mixture of experts', 'this load-balancing type')}",
    "moe_router_load_balancing_type",
    given=lambda value, args: any(
        v == "quantile_balancing" for v in (value if isinstance(value, (list, tuple)) else [value])
    ),
)
no_effect(
    "DeepEP / HybridEP kernels are not available here: the flex dispatcher exchanges tokens "
    "as the alltoall dispatcher does",
    "moe_token_dispatcher_type",
    given=lambda value, args: value == "flex",
)
no_effect(
    "fused MoE kernels and communication overlap of the GPU stack; the same result without",
    """
    moe_shared_expert_overlap moe_permute_fusion moe_router_fusion moe_enable_deepep
    moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_deepep_num_sms
    moe_hybridep_num_sms moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
    moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs
    moe_permute_fusion_into_hybridep moe_ncclep_zero_copy
    """,
)
refused(
    _MOE.replace("mixture of experts", "this MoE option"),
    """
    expert_tensor_parallel_num_weight_shards moe_latent_size
    moe_shared_expert_glu_interleave_size moe_mlp_glu_interleave_size
    use_grouped_gemm_for_shared_expert use_grouped_gemm_for_dense_mlp moe_use_grouped_tensor
    moe_single_grouped_weight moe_single_grouped_bias moe_use_upcycling
    moe_upcycling_granularity moe_apply_probs_on_input
    moe_router_quantile_balancing_ema moe_router_force_load_balancing moe_router_force_biased
    moe_router_padding_for_quantization moe_router_padding_for_fp8
    moe_enable_routing_replay moe_dispatch_fwd_dtype
    moe_combine_bwd_dtype moe_expert_rank_capacity_factor
    moe_pad_experts_for_cuda_graph_inference
    overlap_dispatch_backward_with_experts_wgrad ep_overlap_early_attn_memory_release
    high_priority_a2a_comm_stream moe_paged_stash moe_paged_stash_page_size
    moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu
    moe_routing_trace_path moe_routing_trace_max_training_iters moe_routing_trace_capture_logits
    moe_routing_trace_capture_hidden_states moe_routing_trace_dump_weights
    """,
)
no_effect(
    "selects mamba_ssm's fused kernel; the PyTorch SSD scan here computes the same layer",
    "use_mamba_mem_eff_path",
)
refused(
    "the SSM-state dtype of mamba_ssm's kernels: the PyTorch scan here keeps the states in the "
    "activations' dtype",
    "mamba_training_ssm_states_dtype",
)
refused(
    _HYBRID,
    """
    gdp_num_householder gdp_cutedsl_kernel gdp_num_chunk_states_to_recompute
    dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq
    dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
    dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation
    dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
    """,
)
refused(
    _HYBRID,
    "experimental_attention_variant",
    given=lambda value, args: value not in (None, "gated_delta_net"),
)
refused(
    f"this layer or attention variant is {_NYI}",
    """
    softmax_type window_size window_attn_skip_freq no_rope_freq
    rotary_seq_len_interpolation_factor mrope_section quick_geglu
    glu_linear_offset activation_func_clamp_value qk_l2_norm qk_clip qk_clip_alpha
    qk_clip_threshold enable_mhc_connections mhc_num_residual_streams
    mhc_sinkhorn_iterations mhc_init_gating_factor mhc_recompute_layer_num
    heterogeneous_layers_config_path heterogeneous_layers_config_encoded_json onnx_safe
    batch_invariant_mode batch_invariant_backend logit_dtype
    """,
)
refused(
    f"multi-token prediction is {_NYI}",
    """
    mtp_standalone mtp_use_repeated_layer
    mtp_detach_heads mtp_hsm mtp_hybrid_override_pattern
    """,
)
refused(
    "this position embedding is " + _NYI,
    "position_embedding_type",
    given=lambda value, args: value in ("yarn", "mrope", "relative"),
)
refused(
    f"YaRN outside multi-latent attention is {_NYI}",
    "rope_type",
    given=lambda value, args: value == "yarn" and not args.multi_latent_attention,
)
refused(
    f"YaRN outside multi-latent attention (--multi-latent-attention) is {_NYI}",
    """
    yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow
    yarn_correction_range_round_to_int
    """,
    given=lambda value, args: value is not None and not args.multi_latent_attention,
)
refused(
    _BERT_T5,
    """
    relative_attention_num_buckets relative_attention_max_distance output_bert_embeddings
    bert_embedder_type
    """,
)
refused(
    _FP8,
    """
    fp8 fp8_recipe fp8_margin fp8_interval fp8_amax_history_len fp8_amax_compute_algo
    fp8_quantizer_factory fp8_wgrad fp8_output_proj fp8_param_gather first_last_layers_bf16
    num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 fp4 fp4_recipe fp4_quantizer_factory
    fp4_param_gather te_precision_config_file te_rng_tracker use_kitchen_attention
    kitchen_attention_backend reuse_grad_buf_for_mxfp8_param_ag
    """,
)
refused(
    "only adam, sgd and muon (dist_muon) are implemented",
    "optimizer",
    given=lambda value, args: value not in ("adam", "sgd", "muon", "dist_muon"),
)
_STATE_PRECISION = f"this optimizer-state precision or offloading is {_NYI}"
refused(
    _STATE_PRECISION,
    """
    main_grads_dtype main_params_dtype exp_avg_dtype exp_avg_sq_dtype
    """,
    # validate_args turns these into torch dtypes: fp32 then reads "torch.float32".
    given=lambda value, args: str(value) not in ("fp32", "torch.float32"),
)
refused(
    _STATE_PRECISION,
    """
    use_precision_aware_optimizer megatron_fsdp_main_params_dtype megatron_fsdp_main_grads_dtype
    megatron_fsdp_grad_comm_dtype optimizer_cpu_offload optimizer_offload_fraction
    use_torch_optimizer_for_cpu_offload overlap_cpu_optimizer_d2h_h2d pin_cpu_grads
    pin_cpu_params ddp_reduce_scatter_with_fp32_accumulation
    ddp_param_name_patterns_for_fp32_local_accumulation apply_wd_to_qk_layernorm
    no_weight_decay_cond_type freeze_all_layers
    """,
)
refused(
    f"activation offloading is {_NYI}",
    """
    cpu_offloading_num_layers cpu_offloading_retain_pinned_cpu_buffers
    delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks
    activation_offload_fraction fine_grained_offloading_max_inflight_offloads
    """,
)
no_effect(
    "moves the saved activations of the chosen modules to host memory in forward and back in "
    "backward (GPU memory only); the same activations stay where they are here",
    "fine_grained_activation_offloading offload_modules min_offloaded_tensor_size",
)
refused(
    f"this parallel layout is {_NYI}",
    """
    max_seqlen_per_dp_cp_rank
    hybrid_context_parallel tensor_parallel_num_weight_shards outer_dp_sharding_strategy
    enable_full_sharding_in_hsdp gtp_remat_reduce_scatter_with_fp32_accumulation
    gtp_remat_nccl_ub gtp_expert_remat_nccl_ub gtp_remat_opt_in_modules fake_process_group
    lazy_mpu_init init_model_with_meta_device
    """,
)
refused(
    f"this checkpoint option is {_NYI}",
    """
    load_main_params_from_ckpt override_ckpt_iteration non_persistent_save_interval
    non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir
    non_persistent_local_ckpt_algo ckpt_convert_update_legacy_dist_opt_format
    ckpt_pg_tensors_cache_path ckpt_pg_tensors_cache_create strict_fsdp_dtensor_load
    dist_ckpt_save_pre_mcore_014 save_params_interval save_activations_interval
    save_tokens_per_expert_interval save_wgrads_interval save_dgrads_interval enable_msc
    """,
)
refused(
    "checkpoints are written and read in the torch, torch_dist or (with Megatron-FSDP) "
    "fsdp_dtensor format only",
    "ckpt_format",
    given=lambda value, args: (
        value not in ("torch", "torch_dist", "fsdp_dtensor")
        and bool(args.save or args.load or args.pretrained_checkpoint)
    ),
)
refused(
    "asynchronous saving needs --ckpt-format torch_dist",
    "async_save",
    given=lambda value, args: bool(value) and args.ckpt_format != "torch_dist",
)
refused(
    _FT,
    """
    enable_ft_package calc_ft_timeouts ft_num_warmup_iters
    gpu_sniff_test_interval adlr_autoresume adlr_autoresume_interval
    disable_straggler_on_startup straggler_ctrlr_port
    exit_signal_handler_for_dataloader replication replication_jump replication_factor
    inprocess_restart inprocess_max_iterations inprocess_monitor_thread_interval
    inprocess_monitor_process_interval inprocess_progress_watchdog_interval
    inprocess_heartbeat_interval inprocess_soft_timeout inprocess_hard_timeout
    inprocess_heartbeat_timeout inprocess_barrier_timeout inprocess_completion_timeout
    inprocess_last_call_wait inprocess_termination_grace_time inprocess_granularity
    inprocess_empty_cuda_cache fault_injector_ranks fault_injector_num_ranks
    fault_injector_fault_types fault_injector_fault_probabilities fault_injector_fault_delay
    fault_injector_delay_start_iteration fault_injector_mtti_seconds
    fault_injector_offset_seconds fault_injector_seed
    """,
)
# Its default is $WORLD_SIZE when the parser is built (tools may set args.world_size later).
refused(
    _FT,
    "inprocess_active_world_size",
    given=lambda value, args: (
        value not in (getattr(args, "world_size", value), int(os.getenv("WORLD_SIZE", "1")))
    ),
)
refused(
    f"this data option is {_NYI}",
    """
    phase_transition_iterations per_dataset_sequences_path dataloader_inter_document_masking
    object_storage_cache_path allow_ambiguous_pad_tokens dataloader_fast_cache_load
    step_batch_size_schedule iterations_to_skip full_validation multiple_validation_sets
    validation_set_names start_eval_at_iter
    """,
)
refused(
    "--dataloader-type external is " + _NYI + "; use single or cyclic",
    "dataloader_type",
    given=lambda value, args: value == "external",
)
refused(
    f"SFT training is {_NYI}",
    """
    sft sft_tokenizer_prompt_format chat_template
    """,
)
refused(
    f"this tokenizer option is {_NYI}",
    """
    metadata_path special_tokens tiktoken_pattern tiktoken_num_special_tokens
    tokenizer_sentencepiece_legacy tokenizer_sentencepiece_ignore_extra_whitespaces
    use_gigatoken
    """,
)
refused(
    "this tokenizer is " + _NYI,
    "tokenizer_type",
    given=lambda value, args: (
        value in ("TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")
    ),
)
refused(
    _PROFILER,
    """
    use_pytorch_profiler pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack
    pytorch_profiler_collect_chakra record_shapes record_memory_history memory_snapshot_path
    """,
)
refused(
    f"this logging option is {_NYI}",
    """
    log_memory_interval log_device_memory_used log_max_attention_logit log_energy
    config_logger_dir one_logger_project one_logger_run_name one_logger_async app_tag_run_name
    app_tag_run_version otel_enabled otel_service_name otel_span_groups
    run_workload_inspector_server
    """,
)
refused(
    "YAML configurations and experimental features are " + _NYI,
    """
    yaml_cfg enable_experimental
    """,
)
refused(
    _VISION,
    """
    vision_pretraining vision_pretraining_type vision_backbone_type swin_backbone_type
    num_classes img_h img_w num_channels patch_dim classes_fraction data_per_class_fraction
    head_lr_mult mask_type mask_factor iter_per_epoch sample_rate dino_local_img_size
    dino_local_crops_number dino_head_hidden_size dino_bottleneck_size dino_freeze_last_layer
    dino_norm_last_layer dino_warmup_teacher_temp dino_teacher_temp
    dino_warmup_teacher_temp_epochs ict_head_size biencoder_projection_dim
    biencoder_shared_query_context_model ict_load bert_load titles_data_path query_in_block_prob
    use_one_sent_docs evidence_data_path retriever_report_topk_accuracies
    retriever_score_scaling block_data_path embedding_path indexer_batch_size
    indexer_log_interval
    """,
)
refused(
    _TEXT_GEN,
    """
    flash_decode num_speculative_tokens inference_logging_step_interval
    inference_text_gen_server_logging
    inference_wandb_logging inference_coordinator_port inference_shards
    inference_use_synchronous_zmq_collectives inference_disable_ep_consensus
    mamba_inference_conv_states_dtype mamba_inference_ssm_states_dtype
    inference_dynamic_batching inference_dynamic_batching_buffer_size_gb
    inference_dynamic_batching_paused_buffer_size_gb
    inference_dynamic_batching_mamba_memory_ratio inference_dynamic_batching_block_size
    inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
    inference_dynamic_batching_num_cuda_graphs
    inference_dynamic_batching_track_paused_request_events
    inference_dynamic_batching_track_generated_token_events
    inference_dynamic_batching_unified_memory_level
    inference_dynamic_batching_enable_prefix_caching
    inference_dynamic_batching_prefix_caching_eviction_policy
    inference_dynamic_batching_prefix_caching_coordinator_policy
    inference_dynamic_batching_prefix_caching_routing_alpha
    inference_dynamic_batching_prefix_caching_mamba_gb
    inference_dynamic_batching_cuda_graph_mixed_prefill_count
    inference_dynamic_batching_cuda_graph_sizing_distribution
    inference_dynamic_batching_sampling_backend offset_sampling_seed_by_dp_rank
    inference_dynamic_batching_async_sched_mode inference_dynamic_batching_logprobs_mode
    enable_chunked_prefill inference_cuda_graph_scope decode_only_cuda_graphs
    inference_cuda_graph_all_prefills inference_cuda_graph_max_tokens symmetric_ar_type
    nccl_all_reduce_for_prefill inference_fuse_tp_communication
    inference_disable_triton_nvls_kernels inference_grouped_gemm_backend
    inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
    mlp_chunks_for_prefill inference_rng_tracker
    """,
)
no_effect(
    "splits large inference batches into micro-batches for pipelining; generation here runs "
    "each batch whole, with the same tokens",
    "inference_batch_times_seqlen_threshold",
)
no_effect(
    "selects Megatron's legacy static inference engine; the one engine here is a static one",
    "use_legacy_static_engine",
)
refused(
    _RL,
    """
    perform_rl_step rl_prompts_per_eval grpo_prompts_per_step grpo_group_size rl_generation_lag
    rl_max_inflight_requests rl_submission_granularity rl_consumption_granularity
    rl_durable_rollout_bank rl_rollout_bank_dir rl_rollout_bank_max_bytes langrl_env_config
    rl_default_temperature rl_default_top_p rl_default_top_k rl_partial_rollouts
    rl_use_sequence_packing rl_sequence_packing_max_sequences_per_bin rl_sequence_packing_algo
    rl_skip_bos_token rl_profile rl_profile_dir rl_inference_parsers grpo_iterations
    grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_kl_beta grpo_entropy_term_weight
    grpo_filter_groups_with_same_reward rl_inference_logprobs_is_correction
    rl_importance_sampling_truncation_coef rl_offload_optimizer_during_inference
    rl_kv_cache_management_mode rl_persist_cuda_graphs rl_training_cuda_graphs
    rl_inference_tensor_model_parallel_size rl_inference_pipeline_model_parallel_size
    rl_inference_expert_model_parallel_size rl_inference_expert_tensor_model_parallel_size
    rl_inference_model_unified_memory_level rl_offload_inference_model_weights_when_idle
    refit_method rl_verify_model_weights_swap logits_save_top_k logits_save_top_p
    logits_save_top_p_min_k logits_save_dir logits_save_dtype logits_load_dir
    logits_load_decode_threads logits_load_prefetch_factor logits_load_msc_prefetch_depth
    logits_load_kd_loss_alpha logits_load_ignore_errors dump_param_to_param_group_map
    """,
)


def policy_of(groups) -> Dict[str, Rule]:
    """dest -> Rule for every flag of ``groups``: the rows above, then HONOURED for every other
    dest, whose reason is where its field says it is honoured. Fails on a dest declared twice, a
    row without a flag and an honoured flag that does not say where."""
    honoured: Dict[str, Rule] = {}
    declared: Dict[str, str] = {}
    for group in groups:
        for field in dataclasses.fields(group):
            if field.name in declared:
                raise ValueError(
                    f"{field.name} is declared twice: in {declared[field.name]} and "
                    f"{group.__name__}"
                )
            declared[field.name] = group.__name__
            if field.name in ROWS:
                continue
            where = field.metadata["flag"].honoured_at
            if not where:
                raise ValueError(
                    f"{group.__name__}.{field.name}: an honoured flag says where (honoured_at=); "
                    "otherwise it needs a row in flags/policy.py"
                )
            honoured[field.name] = Rule(field.name, HONOURED, where)
    stale = sorted(set(ROWS) - set(declared))
    if stale:
        raise ValueError(f"policy rows without a flag: {', '.join(stale)}")
    return {**ROWS, **honoured}
