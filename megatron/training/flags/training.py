"""Training-loop flags (batch sizes, length of training, recompute, fusions, exit
conditions), evaluation and the rerun engine."""

import signal
from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch
from megatron.training.flags.types import enum_type


@flag_group(
    "training",
    removed={
        "--no-async-tensor-model-parallel-allreduce": (
            "the tensor-parallel all-reduce is always asynchronous; drop the flag"
        ),
        "--use-legacy-models": "legacy (non-core) models were removed; drop the flag",
        "--no-query-key-layer-scaling": (
            "query-key layer scaling is off by default; "
            "use --apply-query-key-layer-scaling to turn it on"
        ),
        "--DDP-impl": "the local/torch DDP choice was removed; drop the flag",
        (
            "--use-contiguous-buffers-in-local-ddp",
            "--no-contiguous-buffers-in-local-ddp",
        ): "contiguous gradient buffers are always used; drop the flag",
        "--distribute-checkpointed-activations": "use --distribute-saved-activations",
        "--activations-checkpoint-method": "use --recompute-method",
        "--activations-checkpoint-num-layers": "use --recompute-num-layers",
        "--standalone-embedding-stage": "use --account-for-embedding-in-pipeline-split",
    },
)
class TrainingFlags:
    micro_batch_size: Optional[int] = flag(
        None,
        "Samples per model instance per forward/backward pass.",
        honoured_at="initialize.initialize_megatron; initialize._update_train_iters; "
        "training.train_step",
    )
    batch_size: Optional[int] = flag(
        None,
        "Removed: use --micro-batch-size (and --global-batch-size).",
        honoured_at="rules/deprecated.py: ends with Megatron's hint",
    )
    global_batch_size: Optional[int] = flag(
        None,
        "Samples per optimizer step. Default: micro-batch-size * data-parallel size (one "
        "micro-batch per step).",
        honoured_at="initialize.initialize_megatron; initialize._update_train_iters; "
        "model_setup.get_optimizer_param_scheduler",
    )
    rampup_batch_size: Optional[List[int]] = flag(
        None,
        'Batch size ramp-up: <start> <increment> <ramp-up samples>, e.g. "16 8 300000" with '
        "--global-batch-size 1024. Needs --train-samples.",
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        honoured_at="initialize.initialize_megatron; initialize._update_train_iters",
    )
    step_batch_size_schedule: Optional[str] = flag(
        None,
        'Step batch-size schedule "TOKENS:BATCH ...", e.g. "0:16 2.4B:320" (K/M/B/T '
        "suffixes). Excludes --global-batch-size.",
    )
    decrease_batch_size_if_needed: bool = switch(
        "Lower the global batch size when micro-batch-size * data-parallel size does not divide "
        "it.",
        honoured_at="initialize.initialize_megatron",
    )
    recompute_activations: bool = switch(
        "Recompute activations in backward (= --recompute-granularity selective).",
        honoured_at="rules/deprecated.py -> --recompute-granularity selective",
    )
    recompute_granularity: Optional[str] = flag(
        None,
        "Activation recomputation granularity.",
        choices=["full", "selective"],
        honoured_at="TransformerConfig.recompute_granularity",
    )
    check_for_nan_in_loss_and_grad: bool = off_switch(
        "Do not check the loss and gradients for NaN/Inf.",
        options="--no-check-for-nan-in-loss-and-grad",
        honoured_at="DistributedDataParallelConfig.check_for_nan_in_grad; rerun.check_loss",
    )
    check_for_spiky_loss: bool = switch(
        "Flag iterations whose loss is far above the recent maximum.",
        honoured_at="rerun.check_loss",
    )
    distribute_saved_activations: bool = switch(
        "Shard recomputed activations across the tensor-parallel group.",
        honoured_at="TransformerConfig.distribute_saved_activations",
    )
    recompute_method: Optional[str] = flag(
        None,
        "Full recompute: uniform chunks or the first N layers.",
        choices=["uniform", "block"],
        honoured_at="TransformerConfig.recompute_method",
    )
    recompute_num_layers: Optional[int] = flag(
        None,
        "Layers per recompute chunk (uniform) or recomputed layers per pipeline stage (block).",
        honoured_at="TransformerConfig.recompute_num_layers",
    )
    recompute_modules: Optional[List[str]] = flag(
        None,
        "Submodules for selective recompute: core_attn, moe_act, layernorm, mla_up_proj, mlp, "
        "moe, shared_experts (default core_attn).",
        nargs="+",
        honoured_at="TransformerConfig.recompute_modules",
    )
    cpu_offloading_num_layers: int = flag(
        0, "Transformer layers whose activations are offloaded to CPU."
    )
    cpu_offloading_retain_pinned_cpu_buffers: bool = switch(
        "Keep the pinned CPU buffers of activation offloading between iterations."
    )
    fine_grained_activation_offloading: bool = switch("Offload the activations of chosen modules.")
    offload_modules: List[str] = flag([], "Modules whose activations are offloaded.", nargs="+")
    min_offloaded_tensor_size: int = flag(1048576, "Smallest tensor (elements) offloaded.")
    delay_offload_until_cuda_graph: bool = switch(
        "Start offloading only once the CUDA graphs are captured."
    )
    delta_offload_bytes_across_pp_ranks: int = flag(
        0, "Fewer offloaded bytes on each later pipeline rank."
    )
    activation_offload_fraction: float = flag(1.0, "Fraction of the chosen activations offloaded.")
    fine_grained_offloading_max_inflight_offloads: Optional[int] = flag(
        None, "Offloads in flight at once."
    )
    tp_comm_overlap_cfg: Optional[str] = flag(None, "Config file for --tp-comm-overlap.")
    use_cpu_initialization: Optional[bool] = switch(
        "Initialize weights on the CPU.",
        default=None,
        honoured_at="TransformerConfig.use_cpu_initialization",
    )
    empty_unused_memory_level: int = flag(
        0,
        "Call torch.cuda.empty_cache() each iteration: 0 off, 1 moderate, 2 aggressive.",
        choices=[0, 1, 2],
    )
    deterministic_mode: bool = switch(
        "Use deterministic algorithms only (torch.use_deterministic_algorithms).",
        honoured_at="rules/layer.py: torch.use_deterministic_algorithms",
    )
    calculate_per_token_loss: bool = switch(
        "Normalize the loss by the number of non-padded tokens in the global batch instead of "
        "per micro-batch.",
        honoured_at="TransformerConfig.calculate_per_token_loss; "
        "model_families.losses.masked_token_loss; model_setup.setup_model_and_optimizer",
    )
    checkpoint_activations: bool = switch(
        "Removed: use --recompute-activations.",
        honoured_at="rules/deprecated.py: ends with Megatron's hint",
    )
    check_weight_hash_across_dp_replicas_interval: Optional[int] = flag(
        None,
        "Every N iterations (and before the first), check that the parameters of all "
        "data-parallel replicas hash the same; differing replicas end the run.",
        honoured_at="replica_check.check_weight_hashes_if_due",
    )
    gpu_sniff_test_interval: Optional[int] = flag(None, "Iterations between GPU sniff tests.")
    train_sync_interval: Optional[int] = flag(
        None, "Iterations between CPU-GPU synchronizations (keeps the CPU from running ahead)."
    )
    iterations_to_skip: List[int] = flag(
        [], "Iterations whose batch is consumed but not trained on.", nargs="+"
    )
    check_for_large_grads: bool = switch(
        "Treat unusually large gradients like NaN gradients.",
        honoured_at="DistributedDataParallelConfig.check_for_large_grads",
    )
    result_rejected_tracker_filename: Optional[str] = flag(
        None,
        "File recording the results the rerun engine rejected.",
        honoured_at="rerun.build_rerun_state_machine",
    )
    train_iters: Optional[int] = flag(
        None,
        "Total training iterations (exclusive with --train-samples).",
        honoured_at="initialize._update_train_iters; model_setup.get_optimizer_param_scheduler; "
        "training._pretrain",
    )
    train_samples: Optional[int] = flag(
        None,
        "Total training samples (exclusive with --train-iters).",
        honoured_at="initialize._update_train_iters; model_setup.get_optimizer_param_scheduler; "
        "data_iterators.get_train_valid_test_num_samples",
    )
    log_interval: int = flag(
        100,
        "Iterations between log lines.",
        honoured_at="training._params_norm_is_logged; training._train_loop; "
        "training_log.training_log",
    )
    exit_interval: Optional[int] = flag(
        None,
        "Exit once the iteration is divisible by this value.",
        honoured_at="exit_decision.checkpoint_and_decide_exit",
    )
    exit_duration_in_mins: Optional[int] = flag(
        None,
        "Exit after this many minutes of training.",
        honoured_at="exit_decision.checkpoint_and_decide_exit",
    )
    exit_signal_handler: bool = switch(
        "Save a checkpoint and exit when --exit-signal arrives.",
        honoured_at="initialize.initialize_megatron",
    )
    exit_signal: signal.Signals = flag(
        signal.SIGTERM,
        "Signal caught by --exit-signal-handler, by name (default SIGTERM).",
        type=enum_type(signal.Signals),
        choices=list(signal.Signals),
        metavar="SIGNAL",
        honoured_at="initialize.initialize_megatron",
    )
    exit_signal_handler_for_dataloader: bool = switch(
        "Also handle --exit-signal in the data-loader workers."
    )
    exit_signal_handler_for_training: bool = switch(
        "Handle --exit-signal in the training loop only.",
        honoured_at="the training loop already handles --exit-signal in the training loop only",
    )
    tensorboard_dir: Optional[str] = flag(
        None,
        "Write TensorBoard event files to this directory.",
        honoured_at="training._params_norm_is_logged; training_log.training_log; "
        "writers.build_tensorboard_writer",
    )
    masked_softmax_fusion: bool = off_switch(
        "Disable the fused scale+mask+softmax kernel.", options="--no-masked-softmax-fusion"
    )
    bias_gelu_fusion: bool = off_switch(
        "Disable the bias+GeLU fusion.",
        options="--no-bias-gelu-fusion",
        honoured_at="TransformerConfig.bias_activation_fusion",
    )
    bias_swiglu_fusion: bool = off_switch(
        "Disable the bias+SwiGLU fusion.",
        options="--no-bias-swiglu-fusion",
        honoured_at="TransformerConfig.bias_activation_fusion",
    )
    bias_dropout_fusion: bool = off_switch(
        "Disable the bias+dropout fusion.",
        options="--no-bias-dropout-fusion",
        honoured_at="TransformerConfig.bias_dropout_fusion",
    )
    compile_transformer_layers: bool = switch(
        "Compile each transformer layer with torch.compile (this project's flag; Megatron-LM has "
        "none). Not with --recompute-granularity, nor with dropout under tensor parallelism.",
        honoured_at="TransformerConfig.compile_transformer_layers",
        extension=True,
    )
    apply_rope_fusion: bool = off_switch(
        "Disable the fused RoPE kernel.", options="--no-rope-fusion"
    )
    rope_type: Optional[str] = flag(
        None,
        "RoPE variant (MLA defaults to yarn).",
        choices=["rope", "yarn"],
        honoured_at="MLATransformerConfig.rope_type",
    )
    use_fused_weighted_squared_relu: bool = switch("Fused kernel for the weighted squared ReLU.")
    fused_residual_rmsnorm: bool = switch("Fuse the residual add into RMSNorm.")
    cross_entropy_loss_fusion: bool = switch(
        "Fuse the cross-entropy loss computation.",
        honoured_at="TransformerConfig.cross_entropy_loss_fusion",
    )
    cross_entropy_fusion_impl: str = flag(
        "native",
        "Fused cross-entropy implementation.",
        choices=["native", "te"],
        honoured_at="TransformerConfig.cross_entropy_fusion_impl",
    )
    use_flash_attn: bool = switch(
        "Use FlashAttention (with --attention-backend auto: selects flash).",
        honoured_at="rules/deprecated.py -> --attention-backend flash",
    )
    add_bias_linear: bool = off_switch(
        "No biases in the linear layers.",
        options="--disable-bias-linear",
        honoured_at="TransformerConfig.add_bias_linear",
    )
    add_qkv_bias: bool = switch(
        "Bias in the QKV projection only (implied without --disable-bias-linear).",
        honoured_at="TransformerConfig.add_qkv_bias",
    )
    optimizer: str = flag(
        "adam",
        "Optimizer.",
        choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"],
        honoured_at="OptimizerConfig.optimizer",
    )
    optimizer_cpu_offload: bool = switch("Keep the optimizer state on the CPU.")
    optimizer_cuda_graph: bool = switch("Capture the optimizer step in a CUDA graph.")
    optimizer_offload_fraction: float = flag(1.0, "Fraction of the optimizer state offloaded.")
    use_torch_optimizer_for_cpu_offload: bool = switch(
        "Step the offloaded state with torch.optim instead of the fused CPU Adam."
    )
    overlap_cpu_optimizer_d2h_h2d: bool = switch(
        "Overlap the device-host copies of the offloaded optimizer."
    )
    dump_param_to_param_group_map: Optional[str] = flag(
        None, "Write which parameter is in which optimizer group to this file."
    )
    pin_cpu_grads: bool = off_switch(
        "Do not pin the offloaded gradients.", options="--no-pin-cpu-grads"
    )
    pin_cpu_params: bool = off_switch(
        "Do not pin the offloaded parameters.", options="--no-pin-cpu-params"
    )
    dataloader_type: Optional[str] = flag(
        None,
        "Sampler: single pass, cyclic (reshuffled per epoch) or external. Default: single.",
        choices=["single", "cyclic", "external"],
        honoured_at="data_iterators.build_train_valid_test_data_iterators; "
        "data_samplers.build_pretraining_data_loader",
    )
    no_persist_layer_norm: bool = switch("Disable the persistent fused layer-norm kernel.")
    sequence_parallel: bool = switch(
        "Sequence parallelism in the tensor-parallel regions.",
        honoured_at="TransformerConfig.sequence_parallel; "
        "core.pipeline_parallel.p2p_communication.get_tensor_shape; "
        "core.tensor_parallel.grads.allreduce_sequence_parallel_grads",
    )
    gradient_accumulation_fusion: bool = off_switch(
        "Disable fusing weight-gradient accumulation into the GEMM.",
        options="--no-gradient-accumulation-fusion",
        honoured_at="TransformerConfig.gradient_accumulation_fusion; "
        "core.tensor_parallel.layers.LinearWithGradAccumulation; "
        "core.distributed.distributed_data_parallel (readiness without the hook)",
    )
    deprecated_use_mcore_models: bool = switch(
        "Deprecated and ignored: core models are the only models.",
        options="--use-mcore-models",
        honoured_at="no effect, as in Megatron (core models are the only models)",
    )
    manual_gc: bool = switch(
        "Disable automatic garbage collection and collect manually.",
        honoured_at="training.train; training._train_loop",
    )
    manual_gc_interval: int = flag(
        0,
        "Iterations between manual collections (0: only around evaluation).",
        honoured_at="training._train_loop",
    )
    manual_gc_eval: bool = off_switch(
        "No manual collection around evaluation.", honoured_at="training._train_loop"
    )
    cuda_graph_impl: str = flag(
        "none",
        "CUDA graph capture implementation.",
        choices=["none", "local", "transformer_engine", "full_iteration"],
        honoured_at="local: core.transformer.cuda_graphs (per-layer graphs of the training "
        "step); rules/layer.validate_cuda_graphs",
    )
    cuda_graph_warmup_steps: int = flag(
        3,
        "Warm-up steps before graph capture.",
        honoured_at="core.transformer.cuda_graphs.LayerGraphRunner (eager training forwards of "
        "each layer before its capture)",
    )
    enable_cuda_graph: bool = switch(
        "Deprecated: use --cuda-graph-impl local.",
        honoured_at="rules/deprecated.py: becomes --cuda-graph-impl local",
    )
    external_cuda_graph: bool = switch("Deprecated: use --cuda-graph-impl transformer_engine.")
    batch_invariant_mode: bool = switch(
        "Results that do not depend on the batch composition (batch-invariant kernels)."
    )
    batch_invariant_backend: str = flag(
        "te_native",
        "Kernels of --batch-invariant-mode.",
        choices=["te_native", "deepgemm", "triton"],
    )
    clone_scatter_output_in_embedding: bool = off_switch(
        "Do not clone the sequence-parallel scatter output of the embedding."
    )
    mlp_chunks_for_training: int = flag(1, "Chunks the MLP of a training step is split into.")


@flag_group("validation")
class ValidationFlags:
    full_validation: bool = switch("Evaluate the whole validation set each time.")
    multiple_validation_sets: bool = switch("Evaluate each validation dataset separately.")
    validation_set_names: Optional[List[str]] = flag(
        None, "Names of the validation sets (for the logs).", nargs="+"
    )
    start_eval_at_iter: Optional[int] = flag(None, "First iteration at which evaluation may run.")
    eval_iters: int = flag(
        100,
        "Iterations per evaluation of the validation/test set.",
        honoured_at="data_iterators.get_train_valid_test_num_samples; "
        "data_iterators.build_train_valid_test_data_iterators; evaluation.evaluate",
    )
    eval_interval: Optional[int] = flag(
        None,
        "Iterations between evaluations during training (None: evaluate only at the end).",
        honoured_at="training._train_loop; data_iterators.get_train_valid_test_num_samples; "
        "data_iterators.build_train_valid_test_data_iterators",
    )
    eval_global_batch_size: Optional[int] = flag(
        None,
        "Global batch size for evaluation.",
        honoured_at="data_iterators.get_train_valid_test_num_samples; evaluation.evaluate",
    )
    eval_micro_batch_size: Optional[int] = flag(
        None, "Micro batch size for evaluation.", honoured_at="evaluation.evaluate"
    )
    test_mode: bool = switch(
        "Run the real-time tests alongside the experiment.",
        honoured_at="TransformerConfig.test_mode; core.transformer.attention.SelfAttention"
        ".run_realtime_tests",
    )
    skip_train: bool = switch(
        "Skip training; only evaluate (if requested) and exit.", honoured_at="training._pretrain"
    )


@flag_group("rerun engine")
class RerunEngineFlags:
    error_injection_rate: int = flag(
        0,
        "Inject an unexpected result every N validations.",
        honoured_at="rerun.build_rerun_state_machine",
    )
    error_injection_type: str = flag(
        "transient_error",
        "Kind of injected error.",
        choices=["correct_result", "transient_error", "persistent_error"],
        honoured_at="rerun.build_rerun_state_machine",
    )
    rerun_mode: str = flag(
        "validate_results",
        "Rerun engine mode.",
        choices=["disabled", "validate_results", "report_stats"],
        honoured_at="rerun.build_rerun_state_machine",
    )
