"""Logging, inference and the smaller groups: autoresume, straggler detection, experimental,
fault-tolerance package."""

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
    g.false(
        "--no-log-loss-scale-to-tensorboard",
        "log_loss_scale_to_tensorboard",
        "Do not write the loss scale to TensorBoard.",
    )
    g.true("--log-validation-ppl-to-tensorboard", "Write validation perplexity to TensorBoard.")
    g.true("--log-memory-to-tensorboard", "Write memory statistics to TensorBoard.")
    g.true("--log-world-size-to-tensorboard", "Write the world size to TensorBoard.")
    g.int(
        "--log-memory-interval",
        None,
        "Iterations between memory reports (a multiple of --log-interval).",
    )
    g.str("--wandb-project", "", 'Weights & Biases project ("" disables wandb).')
    g.str("--wandb-entity", "", "Weights & Biases entity (team or user).")
    g.str("--wandb-exp-name", "", "Weights & Biases run name.")
    g.str("--wandb-save-dir", "", "Local wandb directory (default: <save>/wandb).")
    g.int("--logging-level", None, "Python logging level (e.g. 20 = INFO).")
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


def _add_inference_args(parser):
    g = ArgGroup(parser, "inference")
    g.int(
        "--inference-batch-times-seqlen-threshold",
        -1,
        "Split inference batches for pipelining above this batch*seqlen (-1: never).",
    )
    g.int(
        "--max-tokens-to-oom",
        12000,
        "Refuse requests with more tokens (prompt + generation) than this.",
    )
    g.true("--output-bert-embeddings", "Output mean-pooled BERT embeddings.")
    g.str("--bert-embedder-type", "megatron", "BERT embedder.", choices=["megatron", "huggingface"])
    g.true("--flash-decode", "Use the flash-decoding kernel.")
    g.int(
        "--inference-max-requests",
        8,
        "Maximum concurrent inference requests.",
        dest="inference_max_batch_size",
    )
    g.int(
        "--inference-max-seq-length",
        2560,
        "Maximum inference sequence length (prompt + generation).",
    )
    return parser


def _add_experimental_args(parser):
    g = ArgGroup(parser, "experimental")
    g.true("--enable-experimental", "Enable experimental features.")
    g.list("--spec", None, 'Custom layer spec: <module> <function> (or "local").', nargs="*")
    g.float("--hybrid-attention-ratio", 0.0, "Share of attention layers in a hybrid model.")
    g.float("--hybrid-mlp-ratio", 0.0, "Share of MLP layers in a hybrid model.")
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
    g.int("--mamba-state-dim", 128, "Mamba state dimension.")
    g.int("--mamba-head-dim", 64, "Mamba head dimension.")
    g.int("--mamba-num-groups", 8, "Mamba groups.")
    g.int("--mamba-num-heads", None, "Mamba heads.")
    g.true("--is-hybrid-model", "The model is a hybrid (Mamba/attention) model.")
    g.str("--yaml-cfg", None, "Read the configuration from this YAML file instead of flags.")
    g.true(
        "--use-precision-aware-optimizer",
        "Keep main params / optimizer states in the dtypes below (Transformer Engine FusedAdam).",
    )
    g.str("--main-grads-dtype", "fp32", "Main gradient dtype.", choices=["fp32", "bf16"])
    g.str("--main-params-dtype", "fp32", "Main parameter dtype.", choices=["fp32", "fp16"])
    g.str("--exp-avg-dtype", "fp32", "Adam first-moment dtype.", choices=_LOW_PRECISION)
    g.str("--exp-avg-sq-dtype", "fp32", "Adam second-moment dtype.", choices=_LOW_PRECISION)
    return parser


def _add_ft_package_args(parser):
    g = ArgGroup(parser, "ft_package")
    g.true("--enable-ft-package", "Enable the NVIDIA fault-tolerance package.")
    g.true("--calc-ft-timeouts", "Let the fault-tolerance package compute its timeouts.")
    return parser
