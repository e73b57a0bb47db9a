"""Logging, profiling and the smaller groups: autoresume, straggler detection, experimental,
fault-tolerance package, one logger, OpenTelemetry, multi-storage client, workload inspector."""

from .builder import ArgGroup

_LOW_PRECISION = ["fp32", "fp16", "bf16", "fp8"]


def _add_logging_args(parser):
    g = ArgGroup(parser, "logging")
    g.true("--log-params-norm", "Compute and log the parameter norm.")
    g.true("--log-num-zeros-in-grad", "Compute and log the number of zeros in the gradients.")
    g.true("--log-throughput", "Compute and log the throughput per GPU (TFLOP/s/GPU).")
    g.true("--log-progress", "Write progress (tokens, FLOPs) to progress.txt in --save.")
    g.int(
        "--timing-log-level",
        0,
        "Timer detail: 0 iteration time only, 1 once-per-iteration operations, 2 everything.",
        choices=range(0, 3),
    )
    g.false(
        "--no-barrier-with-level-1-timing",
        "barrier_with_L1_time",
        "No barrier before level-1 timers.",
    )
    g.str(
        "--timing-log-option",
        "minmax",
        "Timer report across ranks: max, minmax or all.",
        choices=["max", "minmax", "all"],
    )
    g.int("--tensorboard-log-interval", 1, "Iterations between TensorBoard writes.")
    g.int("--tensorboard-queue-size", 1000, "TensorBoard event queue size.")
    g.true("--log-timers-to-tensorboard", "Write timers to TensorBoard.")
    g.no("log-loss-scale-to-tensorboard", "Do not write the loss scale to TensorBoard.")
    g.true("--log-validation-ppl-to-tensorboard", "Write validation perplexity to TensorBoard.")
    g.true(
        "--log-memory-to-tensorboard",
        "Write memory statistics to TensorBoard (on a CPU: the process's resident set size).",
    )
    g.true("--log-world-size-to-tensorboard", "Write the world size to TensorBoard.")
    g.int(
        "--log-memory-interval",
        None,
        "Iterations between memory reports (a multiple of --log-interval).",
    )
    g.true("--log-device-memory-used", "Log the device memory in use (as the driver sees it).")
    g.true("--log-max-attention-logit", "Log the largest attention logit of each layer.")
    g.true("--log-energy", "Log the energy the GPUs used.")
    g.str("--config-logger-dir", "", "Dump each module's inputs and config to this directory.")
    g.str("--wandb-project", None, "Weights & Biases project (unset: no wandb).")
    g.str("--wandb-entity", None, "Weights & Biases entity (team or user).")
    g.str("--wandb-exp-name", None, "Weights & Biases run name.")
    g.str("--wandb-save-dir", None, "Local wandb directory (default: <save>/wandb).")
    g.int("--logging-level", None, "Python logging level (e.g. 20 = INFO).")
    return parser


def _add_profiling_args(parser):
    g = ArgGroup(parser, "profiling")
    g.true("--profile", "Enable nsys profiling between --profile-step-start and -end.")
    g.int("--profile-step-start", 10, "Iteration at which profiling starts.")
    g.int("--profile-step-end", 12, "Iteration at which profiling stops.")
    g.true("--use-pytorch-profiler", "Use the PyTorch profiler (TensorBoard trace).")
    g.true("--pytorch-profiler-collect-shapes", "PyTorch profiler: record tensor shapes.")
    g.true("--pytorch-profiler-collect-callstack", "PyTorch profiler: record call stacks.")
    g.true("--pytorch-profiler-collect-chakra", "PyTorch profiler: write Chakra traces.")
    g.list("--profile-ranks", [], "Global ranks to profile.", type=int)
    g.true("--record-memory-history", "Record CUDA memory history on the last rank.")
    g.str("--memory-snapshot-path", "snapshot.pickle", "Where the memory history is dumped.")
    g.true("--record-shapes", "Record tensor shapes in the profile.")
    g.true("--nvtx-ranges", "Mark modules with NVTX ranges.")
    return parser


def _add_autoresume_args(parser):
    g = ArgGroup(parser, "autoresume")
    g.true("--adlr-autoresume", "Enable autoresume on the ADLR cluster.")
    g.int("--adlr-autoresume-interval", 1000, "Iterations between autoresume checks.")
    return parser


def _add_straggler_detector_args(parser):
    g = ArgGroup(parser, "straggler")
    g.true("--log-straggler", "Track and log stragglers per GPU.")
    g.true("--disable-straggler-on-startup", "Start with the straggler detector off.")
    g.int("--straggler-ctrlr-port", 65535, "Port that toggles the straggler detector.")
    g.int("--straggler-minmax-count", 1, "Ranks reported with the highest/lowest throughput.")
    return parser


def _add_experimental_args(parser):
    g = ArgGroup(parser, "experimental")
    g.true("--enable-experimental", "Enable experimental features.")
    g.list("--spec", None, 'Custom layer spec: <module> <function> (or "local").', nargs="*")
    g.removed(
        ("--hybrid-attention-ratio", "--hybrid-mlp-ratio"),
        "the layer mix of a hybrid model is given by --hybrid-layer-pattern",
    )
    g.str(
        "--hybrid-override-pattern",
        None,
        "Hybrid layer pattern (older name of --hybrid-layer-pattern).",
    )
    g.str(
        "--hybrid-layer-pattern",
        None,
        "Hybrid layer pattern: M mamba, * attention, - MLP, E MoE, | pipeline split.",
    )
    g.str("--yaml-cfg", None, "Read the configuration from this YAML file instead of flags.")
    g.true(
        "--use-precision-aware-optimizer",
        "Keep main params / optimizer states in the dtypes below (Transformer Engine FusedAdam).",
    )
    g._add(
        "--main-grads-dtype", default="fp32", choices=["fp32", "bf16"], help="Main gradient dtype."
    )
    g._add(
        "--main-params-dtype",
        default="fp32",
        choices=["fp32", "fp16"],
        help="Main parameter dtype.",
    )
    g._add(
        "--exp-avg-dtype", default="fp32", choices=_LOW_PRECISION, help="Adam first-moment dtype."
    )
    g._add(
        "--exp-avg-sq-dtype",
        default="fp32",
        choices=_LOW_PRECISION,
        help="Adam second-moment dtype.",
    )
    for name, default, choices in (
        ("main-params", "fp32", ["fp32", "bf16", "fp16", "auto"]),
        ("main-grads", "auto", ["fp32", "bf16", "fp16", "auto"]),
        ("grad-comm", "auto", ["fp32", "fp16", "bf16", "auto"]),
    ):
        g._add(
            f"--megatron-fsdp-{name}-dtype",
            default=default,
            choices=choices,
            help=f"Megatron-FSDP {name.replace('-', ' ')} dtype.",
        )
    g.true(
        "--megatron-fsdp-enable-fine-grained-param-gather",
        "Megatron-FSDP: gather parameters per module instead of per bucket.",
    )
    g.true(
        "--megatron-fsdp-max-pool-double-buffer",
        "Megatron-FSDP: size the double buffer for the largest pool.",
    )
    g.true(
        "--fsdp-db-use-persist-buf-on-alloc-fail",
        "Megatron-FSDP: fall back to a persistent buffer when the double buffer cannot be "
        "allocated.",
    )
    return parser


def _add_ft_package_args(parser):
    g = ArgGroup(parser, "ft_package")
    g.true("--enable-ft-package", "Enable the NVIDIA fault-tolerance package.")
    g.true("--calc-ft-timeouts", "Let the fault-tolerance package compute its timeouts.")
    g.int("--ft-num-warmup-iters", 5, "Iterations before the fault-tolerance timeouts apply.")
    return parser


def _add_one_logger_args(parser):
    g = ArgGroup(parser, "one logger")
    g.false("--no-one-logger", "enable_one_logger", "Do not report to NVIDIA's one logger.")
    g.str("--one-logger-project", "megatron-lm", "One logger project.")
    g.str("--one-logger-run-name", None, "One logger run name.")
    g.true("--one-logger-async", "Report to the one logger asynchronously.")
    g.str("--app-tag-run-name", None, "Application tag: run name.")
    g.str("--app-tag-run-version", "0.0.0", "Application tag: run version.")
    return parser


def _add_opentelemetry_args(parser):
    g = ArgGroup(parser, "opentelemetry")
    g.true("--otel-enabled", "Export OpenTelemetry traces.")
    g.str("--otel-service-name", None, "OpenTelemetry service name.")
    g.str("--otel-span-groups", None, "Comma-separated span groups to export.")
    return parser


def _add_msc_args(parser):
    g = ArgGroup(parser, "msc")
    g.true("--enable-msc", "Read and write checkpoints and data through the multi-storage client.")
    g.true(
        "--disable-msc",
        "Deprecated: the multi-storage client is off by default.",
        dest="disable_msc_deprecated",
    )
    return parser


def _add_workload_inspector_args(parser):
    g = ArgGroup(parser, "workload inspector")
    g.true("--run-workload-inspector-server", "Start the workload inspector server.")
    return parser
