"""What a run reports: logging, TensorBoard and W&B, profiling, straggler detection,
NVIDIA's one logger, OpenTelemetry and the workload inspector."""

from typing import List, Optional

from megatron.training.flags.spec import flag, flag_group, off_switch, switch


@flag_group("profiling")
class ProfilingFlags:
    profile: bool = switch("Enable nsys profiling between --profile-step-start and -end.")
    profile_step_start: int = flag(10, "Iteration at which profiling starts.")
    profile_step_end: int = flag(12, "Iteration at which profiling stops.")
    use_pytorch_profiler: bool = switch("Use the PyTorch profiler (TensorBoard trace).")
    pytorch_profiler_collect_shapes: bool = switch("PyTorch profiler: record tensor shapes.")
    pytorch_profiler_collect_callstack: bool = switch("PyTorch profiler: record call stacks.")
    pytorch_profiler_collect_chakra: bool = switch("PyTorch profiler: write Chakra traces.")
    profile_ranks: List[int] = flag([], "Global ranks to profile.", nargs="+")
    record_memory_history: bool = switch("Record CUDA memory history on the last rank.")
    memory_snapshot_path: str = flag("snapshot.pickle", "Where the memory history is dumped.")
    record_shapes: bool = switch("Record tensor shapes in the profile.")
    nvtx_ranges: bool = switch("Mark modules with NVTX ranges.")


@flag_group("logging")
class LoggingFlags:
    log_params_norm: bool = switch(
        "Compute and log the parameter norm.", honoured_at="training._train_loop"
    )
    log_num_zeros_in_grad: bool = switch(
        "Compute and log the number of zeros in the gradients.",
        honoured_at="OptimizerConfig.log_num_zeros_in_grad",
    )
    log_throughput: bool = switch(
        "Compute and log the throughput per GPU (TFLOP/s/GPU).",
        honoured_at="training_log.training_log",
    )
    log_progress: bool = switch(
        "Write progress (tokens, FLOPs) to progress.txt in --save.",
        honoured_at="training._pretrain; exit_decision.save_if_not_saved; "
        "checkpointing_dist._commit",
    )
    timing_log_level: int = flag(
        0,
        "Timer detail: 0 iteration time only, 1 once-per-iteration operations, 2 everything.",
        choices=range(0, 3),
        honoured_at="initialize.initialize_megatron",
    )
    barrier_with_L1_time: bool = off_switch(
        "No barrier before level-1 timers.",
        options="--no-barrier-with-level-1-timing",
        honoured_at="TransformerConfig.barrier_with_L1_time; "
        "OptimizerConfig.barrier_with_L1_time; training.train_step",
    )
    timing_log_option: str = flag(
        "minmax",
        "Timer report across ranks: max, minmax or all.",
        choices=["max", "minmax", "all"],
        honoured_at="initialize.initialize_megatron",
    )
    tensorboard_log_interval: int = flag(
        1,
        "Iterations between TensorBoard writes.",
        honoured_at="training.train_step; training._params_norm_is_logged; "
        "training_log.training_log",
    )
    tensorboard_queue_size: int = flag(
        1000, "TensorBoard event queue size.", honoured_at="writers.build_tensorboard_writer"
    )
    log_timers_to_tensorboard: bool = switch(
        "Write timers to TensorBoard.", honoured_at="training_log.training_log"
    )
    log_loss_scale_to_tensorboard: bool = off_switch(
        "Do not write the loss scale to TensorBoard.", honoured_at="training_log.training_log"
    )
    log_validation_ppl_to_tensorboard: bool = switch(
        "Write validation perplexity to TensorBoard.", honoured_at="training_log.print_evaluation"
    )
    log_memory_to_tensorboard: bool = switch(
        "Write memory statistics to TensorBoard (on a CPU: the process's resident set size).",
        honoured_at="initialize._note_cpu_memory_statistics; training_log.training_log",
    )
    log_world_size_to_tensorboard: bool = switch(
        "Write the world size to TensorBoard.", honoured_at="training_log.training_log"
    )
    log_memory_interval: Optional[int] = flag(
        None, "Iterations between memory reports (a multiple of --log-interval)."
    )
    log_device_memory_used: bool = switch("Log the device memory in use (as the driver sees it).")
    log_max_attention_logit: bool = switch("Log the largest attention logit of each layer.")
    log_energy: bool = switch("Log the energy the GPUs used.")
    config_logger_dir: str = flag("", "Dump each module's inputs and config to this directory.")
    wandb_project: Optional[str] = flag(
        None,
        "Weights & Biases project (unset: no wandb).",
        honoured_at="training._params_norm_is_logged; writers.build_wandb_writer",
    )
    wandb_entity: Optional[str] = flag(
        None, "Weights & Biases entity (team or user).", honoured_at="writers.build_wandb_writer"
    )
    wandb_exp_name: Optional[str] = flag(
        None, "Weights & Biases run name.", honoured_at="writers.build_wandb_writer"
    )
    wandb_save_dir: Optional[str] = flag(
        None,
        "Local wandb directory (default: <save>/wandb).",
        honoured_at="writers.build_wandb_writer",
    )
    logging_level: Optional[int] = flag(
        None,
        "Python logging level (e.g. 20 = INFO).",
        honoured_at="initialize._apply_process_settings",
    )


@flag_group("one logger")
class OneLoggerFlags:
    enable_one_logger: bool = off_switch(
        "Do not report to NVIDIA's one logger.",
        options="--no-one-logger",
        honoured_at="this code base never reports to NVIDIA's one logger",
    )
    one_logger_project: str = flag("megatron-lm", "One logger project.")
    one_logger_run_name: Optional[str] = flag(None, "One logger run name.")
    one_logger_async: bool = switch("Report to the one logger asynchronously.")
    app_tag_run_name: Optional[str] = flag(None, "Application tag: run name.")
    app_tag_run_version: str = flag("0.0.0", "Application tag: run version.")


@flag_group("opentelemetry")
class OpenTelemetryFlags:
    otel_enabled: bool = switch("Export OpenTelemetry traces.")
    otel_service_name: Optional[str] = flag(None, "OpenTelemetry service name.")
    otel_span_groups: Optional[str] = flag(None, "Comma-separated span groups to export.")


@flag_group("straggler")
class StragglerFlags:
    log_straggler: bool = switch(
        "Track and log stragglers per GPU.", honoured_at="training._train_loop"
    )
    disable_straggler_on_startup: bool = switch("Start with the straggler detector off.")
    straggler_ctrlr_port: int = flag(65535, "Port that toggles the straggler detector.")
    straggler_minmax_count: int = flag(
        1, "Ranks reported with the highest/lowest throughput.", honoured_at="training._train_loop"
    )


@flag_group("workload inspector")
class WorkloadInspectorFlags:
    run_workload_inspector_server: bool = switch("Start the workload inspector server.")
