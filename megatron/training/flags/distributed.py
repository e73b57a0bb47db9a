"""Parallel layout and communication flags: the TP/PP/CP sizes, the pipeline split,
data-parallel gradients, the distributed optimizer and FSDP, process groups, NCCL's flight
recorder and the userbuffer overlap of tensor-parallel communication."""

from typing import List, Optional

from megatron.training.flags.spec import FromEnv, flag, flag_group, off_switch, switch


@flag_group(
    "distributed",
    removed={
        "--no-scatter-gather-tensors-in-pipeline": "pipeline tensors are sent whole; drop the flag"
    },
)
class DistributedFlags:
    tensor_model_parallel_size: int = flag(
        1,
        "Degree of tensor model parallelism.",
        honoured_at="TransformerConfig.tensor_model_parallel_size; "
        "initialize.initialize_megatron; tokenizer._vocab_size_with_padding",
    )
    tensor_parallel_num_weight_shards: Optional[int] = flag(
        None, "Shards of each weight across the tensor-parallel group."
    )
    pipeline_model_parallel_size: int = flag(
        1,
        "Degree of pipeline model parallelism.",
        honoured_at="TransformerConfig.pipeline_model_parallel_size; "
        "pretrain_t5.model_provider; initialize.initialize_megatron",
    )
    pipeline_model_parallel_comm_backend: Optional[str] = flag(
        None, "Backend of the pipeline p2p communication.", choices=["nccl", "ucc"]
    )
    decoder_first_pipeline_num_layers: Optional[int] = flag(
        None,
        "Layers on the first pipeline stage (uneven split).",
        honoured_at="TransformerConfig.num_layers_in_first_pipeline_stage",
    )
    decoder_last_pipeline_num_layers: Optional[int] = flag(
        None,
        "Layers on the last pipeline stage (uneven split).",
        honoured_at="TransformerConfig.num_layers_in_last_pipeline_stage",
    )
    pipeline_model_parallel_layout: Optional[str] = flag(
        None,
        'Layers of each pipeline (and virtual) stage, e.g. "Et|(tt|)*3,m|L": E embedding, '
        "t transformer layer, m MTP layer, L loss; sets the virtual pipeline size.",
        honoured_at="TransformerConfig.pipeline_model_parallel_layout (layer_split.py)",
    )
    model_parallel_size: Optional[int] = flag(
        None,
        "Removed: use --tensor-model-parallel-size.",
        honoured_at="rules/deprecated.py: ends with Megatron's hint",
    )
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        None,
        "Layers per virtual pipeline stage.",
        honoured_at="rules/pipeline.py -> virtual_pipeline_model_parallel_size",
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        None,
        "Virtual pipeline stages per rank.",
        honoured_at="rules/pipeline.py -> virtual_pipeline_model_parallel_size",
    )
    microbatch_group_size_per_vp_stage: Optional[int] = flag(
        None,
        "Consecutive micro-batches per virtual stage (default: pipeline size).",
        options="--microbatch-group-size-per-virtual-pipeline-stage",
        honoured_at="TransformerConfig.microbatch_group_size_per_vp_stage; "
        "model_setup.setup_model_and_optimizer; "
        "core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
    )
    overlap_p2p_comm: bool = off_switch(
        "Do not overlap pipeline communication with compute.",
        options="--no-overlap-p2p-communication",
    )
    overlap_p2p_comm_warmup_flush: bool = switch(
        "Also overlap pipeline communication in warm-up and flush.",
        options="--overlap-p2p-communication-warmup-flush",
    )
    distributed_backend: str = flag(
        "nccl",
        "torch.distributed backend.",
        choices=["nccl", "gloo"],
        honoured_at="initialize._initialize_distributed",
    )
    distributed_timeout_minutes: int = flag(
        10,
        "Timeout of torch.distributed operations.",
        honoured_at="initialize._initialize_distributed",
    )
    overlap_grad_reduce: bool = switch(
        "Overlap the gradient reduction with backward.",
        honoured_at="DistributedDataParallelConfig.overlap_grad_reduce",
    )
    defer_embedding_wgrad_compute: bool = switch(
        "Defer the output-layer weight gradient to the pipeline flush."
    )
    align_grad_reduce: bool = off_switch(
        "Let each pipeline stage launch its gradient reduction independently."
    )
    wgrad_deferral_limit: int = flag(0, "Micro-batches whose embedding wgrad may be deferred.")
    ddp_num_buckets: Optional[int] = flag(
        None, "Number of data-parallel gradient buckets.", honoured_at="model_setup.get_model"
    )
    ddp_bucket_size: Optional[int] = flag(
        None,
        "Data-parallel gradient bucket size (elements).",
        honoured_at="DistributedDataParallelConfig.bucket_size",
    )
    ddp_pad_buckets_for_high_nccl_busbw: bool = switch("Pad buckets to a large power of 2.")
    ddp_reduce_scatter_with_fp32_accumulation: bool = switch(
        "Accumulate the gradient reduce-scatter in fp32."
    )
    gtp_remat_reduce_scatter_with_fp32_accumulation: bool = switch(
        "Accumulate the rematerialized reduce-scatter in fp32."
    )
    ddp_param_name_patterns_for_fp32_local_accumulation: List[str] = flag(
        [],
        "Parameters (name patterns) whose gradients accumulate locally in fp32.",
        type=None,
        nargs="+",
    )
    ddp_average_in_collective: bool = switch(
        "Average inside the collective instead of pre-scaling by 1/DP.",
        honoured_at="DistributedDataParallelConfig.average_in_collective",
    )
    overlap_param_gather: bool = switch(
        "Overlap the parameter all-gather with forward (distributed optimizer).",
        honoured_at="DistributedDataParallelConfig.overlap_param_gather",
    )
    overlap_param_gather_with_optimizer_step: bool = switch(
        "Overlap the first all-gather with the optimizer step."
    )
    align_param_gather: bool = off_switch(
        "Let each pipeline stage launch its parameter all-gather independently.",
        options="--no-align-param-gather",
    )
    use_ring_exchange_p2p: bool = switch("Use the ring-exchange kernel for pipeline p2p.")
    # torch.distributed.launch and older torchrun releases pass the underscore spelling.
    local_rank: int = flag(
        FromEnv("LOCAL_RANK", 0),
        "Local rank passed by the launcher (default: $LOCAL_RANK).",
        aliases=("--local_rank",),
        honoured_at="initialize._initialize_distributed",
    )
    lazy_mpu_init: bool = switch(
        "Skip the DDP setup in initialize_megatron and return a function that completes it."
    )
    account_for_embedding_in_pipeline_split: bool = switch(
        "Count the input embedding as a layer when splitting layers over pipeline stages.",
        honoured_at="TransformerConfig.account_for_embedding_in_pipeline_split",
    )
    account_for_loss_in_pipeline_split: bool = switch(
        "Count the loss as a layer when splitting layers over pipeline stages.",
        honoured_at="TransformerConfig.account_for_loss_in_pipeline_split",
    )
    use_distributed_optimizer: bool = switch(
        "Shard the optimizer state over data-parallel ranks (ZeRO-1).",
        honoured_at="OptimizerConfig.use_distributed_optimizer; "
        "DistributedDataParallelConfig.use_distributed_optimizer; "
        "model_setup.setup_model_and_optimizer",
    )
    num_distributed_optimizer_instances: int = flag(
        1,
        "Distributed optimizer copies across the data-parallel domain.",
        honoured_at="parallel_state.ParallelLayout.num_distributed_optimizer_instances; "
        "DistributedDataParallelConfig.num_distributed_optimizer_instances",
    )
    nccl_ub: bool = switch(
        "Register NCCL user buffers for DP communication.", options="--use-nccl-ub"
    )
    disable_symmetric_registration: bool = switch("Do not register NCCL symmetric memory.")
    gtp_remat_nccl_ub: bool = switch("NCCL user buffers for the rematerialized communication.")
    gtp_expert_remat_nccl_ub: bool = switch("The same for expert layers.")
    gtp_remat_opt_in_modules: List[str] = flag(
        [], "Modules whose communication is rematerialized.", nargs="+"
    )
    fsdp_manual_registration: bool = switch("Register the FSDP buffers manually.")
    create_all_gather_group: bool = switch("Create a separate group for parameter all-gathers.")
    use_sharp: bool = switch("Enable SHARP collectives.")
    sharp_enabled_group: Optional[str] = flag(
        None, "Group that uses SHARP.", choices=["dp", "dp_replica"]
    )
    high_priority_stream_groups: List[str] = flag(
        [], "Groups whose collectives run at high priority.", nargs="+"
    )
    use_megatron_fsdp: bool = switch(
        "Use Megatron-FSDP.", honoured_at="model_setup.uses_torch_fsdp2"
    )
    megatron_fsdp_version: int = flag(1, "Megatron-FSDP implementation version.", choices=[1, 2])
    use_layer_wise_param_layout: bool = off_switch(
        "Megatron-FSDP: do not lay the parameter buffers out layer by layer.",
        options="--no-use-layer-wise-param-layout",
    )
    outer_dp_sharding_strategy: str = flag(
        "no_shard",
        "Sharding across the outer data-parallel group (hybrid FSDP).",
        choices=["no_shard", "optim"],
    )
    gradient_reduce_div_fusion: bool = off_switch(
        "Divide the gradients separately from their reduction.",
        options="--no-gradient-reduce-div-fusion",
    )
    fsdp_double_buffer: bool = switch("Megatron-FSDP: double-buffer the parameter gathers.")
    suggested_communication_unit_size: Optional[int] = flag(
        None, "Megatron-FSDP: elements per communication unit."
    )
    keep_fp8_transpose_cache: bool = switch("Keep the fp8 transpose cache between steps.")
    enable_full_sharding_in_hsdp: bool = switch("Shard fully inside each hybrid-FSDP replica.")
    init_model_with_meta_device: bool = switch("Create the model on the meta device.")
    data_parallel_sharding_strategy: str = flag(
        "optim_grads_params",
        "Megatron-FSDP sharding.",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        honoured_at="model_setup.uses_torch_fsdp2",
    )
    use_torch_fsdp2: bool = switch(
        "Use torch FSDP2 (fully_shard).", honoured_at="model_setup.uses_torch_fsdp2"
    )
    torch_fsdp2_reshard_after_forward: bool = off_switch(
        "Keep parameters gathered after forward (FSDP2 ZeRO-2).",
        options="--torch-fsdp2-no-reshard-after-forward",
        honoured_at="model_setup.get_model",
    )
    context_parallel_size: int = flag(
        1,
        "Degree of context parallelism.",
        honoured_at="TransformerConfig.context_parallel_size; initialize.initialize_megatron; "
        "core.pipeline_parallel.p2p_communication.get_tensor_shape",
    )
    cp_comm_type: List[str] = flag(
        ["p2p"],
        "Context-parallel communication: p2p, a2a, allgather or a2a+p2p (one value, or one per "
        "layer).",
        nargs="+",
        honoured_at="TransformerConfig.cp_comm_type; "
        "core.transformer.dot_product_attention.DotProductAttention",
    )
    max_seqlen_per_dp_cp_rank: Optional[int] = flag(
        None, "Largest sequence length one DP x CP rank holds (hybrid context parallelism)."
    )
    hybrid_context_parallel: bool = switch(
        "Balance variable-length sequences over data- and context-parallel ranks."
    )
    hierarchical_context_parallel_sizes: Optional[List[int]] = flag(
        None,
        "Sizes of the hierarchical context-parallel levels (product = context-parallel size).",
        nargs="+",
        honoured_at="rules/parallel.py (validation, the exchange named at start-up); "
        "initialize.initialize_megatron: parallel_state.get_hierarchical_context_parallel_groups",
    )
    nccl_communicator_config_path: Optional[str] = flag(
        None, "YAML file with NCCL communicator settings."
    )
    use_tp_pp_dp_mapping: bool = switch(
        "Rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.",
        honoured_at="initialize.initialize_megatron",
    )
    use_gloo_process_groups: bool = off_switch(
        "Do not create gloo copies of the process groups.",
        options="--disable-gloo-process-groups",
        honoured_at="this code base creates no gloo copies of its process groups",
    )
    fake_process_group: bool = switch("Use a fake process group (no communication; testing aid).")
    distributed_timeout_seconds_after_init: Optional[int] = flag(
        None,
        "Timeout of collectives once initialization is over (seconds).",
        honoured_at="training.train",
    )
    disable_jit_fuser: bool = switch("Do not use the TorchScript/nvFuser JIT fusions.")
    flight_recorder_dump_path: Optional[str] = flag(
        None,
        "Where NCCL's flight recorder dumps its trace.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    flight_recorder_trace_buffer_size: int = flag(
        2000,
        "Entries kept by the flight recorder.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    flight_recorder_dump_on_timeout: bool = off_switch(
        "Do not dump the flight recorder on a timeout.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    flight_recorder_include_stack_trace: bool = switch(
        "Record stack traces in the flight recorder.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    flight_recorder_include_only_active: bool = off_switch(
        "Dump finished collectives too.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    flight_recorder_extra_dump_on_exec: bool = off_switch(
        "No extra dump when an exception is raised.",
        honoured_at="nccl_flight_recorder.flight_recorder_settings",
    )
    tp_comm_overlap: bool = switch("Overlap tensor-parallel communication with GEMMs.")
    tp_comm_bulk_wgrad: bool = off_switch("No bulk overlap of the wgrad GEMM with communication.")
    tp_comm_bulk_dgrad: bool = off_switch("No bulk overlap of the dgrad GEMM with communication.")
    tp_comm_overlap_ag: bool = off_switch("No overlap of the all-gather with GEMMs.")
    tp_comm_overlap_rs: bool = off_switch("No overlap of the reduce-scatter with GEMMs.")
    tp_comm_overlap_rs_dgrad: bool = switch("Overlap the reduce-scatter with the dgrad GEMM.")
    tp_comm_split_ag: bool = off_switch("Do not split the overlapped all-gather into chunks.")
    tp_comm_split_rs: bool = off_switch("Do not split the overlapped reduce-scatter into chunks.")
    tp_comm_bootstrap_backend: str = flag(
        "nccl", "Backend that bootstraps the overlap buffers.", choices=["nccl", "mpi", "gloo"]
    )
