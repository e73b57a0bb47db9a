"""Training-loop flags: regularization/optimizer, training, initialization, learning rate,
validation and the rerun engine."""

from .builder import ArgGroup

OPTIMIZERS = ["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"]
EXIT_SIGNALS = ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]


def _add_regularization_args(parser):
    g = ArgGroup(parser, "regularization")
    g.float("--attention-dropout", 0.1, "Dropout probability on the attention probabilities.")
    g.float("--hidden-dropout", 0.1, "Dropout probability on the transformer hidden states.")
    g.float("--weight-decay", 0.01, "Weight decay coefficient (decoupled, AdamW style).")
    g.float(
        "--start-weight-decay",
        None,
        "Initial weight decay for a non-constant --weight-decay-incr-style.",
    )
    g.float(
        "--end-weight-decay",
        None,
        "Final weight decay for a non-constant --weight-decay-incr-style.",
    )
    g.str(
        "--weight-decay-incr-style",
        "constant",
        "How weight decay moves from start to end.",
        choices=["constant", "linear", "cosine"],
    )
    g.float("--clip-grad", 1.0, "Clip gradients to this global L2 norm (0: no clipping).")
    g.float("--adam-beta1", 0.9, "Adam beta1.")
    g.float("--adam-beta2", 0.999, "Adam beta2.")
    g.float("--adam-eps", 1e-08, "Adam epsilon.")
    g.float("--sgd-momentum", 0.9, "SGD momentum.")
    g.float("--muon-momentum", 0.9, "Muon momentum (EMA coefficient).")
    g.false(
        "--muon-no-split-qkv",
        "muon_split_qkv",
        "Orthogonalize the fused QKV weight as one matrix instead of Q, K and V apart.",
    )
    g.true("--muon-nesterov", "Nesterov momentum in Muon.")
    g.str(
        "--muon-scale-mode",
        "spectral",
        "Scale of the orthogonalized update: spectral sqrt(max(out, in)), "
        "unit_rms_norm sqrt(out / in), shape_scaling sqrt(max(1, out / in)).",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
    )
    g.str(
        "--muon-fp32-matmul-prec",
        "medium",
        "fp32 matmul precision of the Newton-Schulz iteration (medium: bf16 iterations).",
        choices=["low", "medium", "high"],
    )
    g.str(
        "--muon-coefficient-type",
        "quintic",
        "Newton-Schulz coefficients: simple, quintic, polar_express or aol.",
    )
    g.int("--muon-num-ns-steps", 5, "Newton-Schulz iterations.")
    g.str(
        "--muon-tp-mode",
        "duplicated",
        "Tensor-parallel weights: duplicated (gather the matrix, orthogonalize on every rank), "
        "distributed (iterate on the shards, all-reduce the Gram matrices), blockwise (each "
        "shard alone).",
        choices=["blockwise", "duplicated", "distributed"],
    )
    g.true("--muon-use-syrk", "Triton SYRK kernel for Newton-Schulz (speed only).")
    g.float("--muon-extra-scale-factor", 1.0, "Extra factor on the Muon update.")
    g.str(
        "--muon-scalar-optimizer",
        "adam",
        "Optimizer of the parameters Muon does not take (embeddings, output layer, 1-D).",
        choices=["adam", "lion"],
    )
    g.float("--lion-beta1", 0.95, "Lion beta1 (interpolation of the update direction).")
    g.float("--lion-beta2", 0.98, "Lion beta2 (momentum decay).")
    return parser


def _add_training_args(parser):
    g = ArgGroup(parser, "training")
    g.int("--micro-batch-size", None, "Samples per model instance per forward/backward pass.")
    g.removed("--batch-size", "use --micro-batch-size (and --global-batch-size)")
    g.int(
        "--global-batch-size",
        None,
        "Samples per optimizer step. Default: "
        "micro-batch-size * data-parallel size (one micro-batch per step).",
    )
    g.list(
        "--rampup-batch-size",
        None,
        "Batch size ramp-up: <start> <increment> <ramp-up "
        'samples>, e.g. "16 8 300000" with --global-batch-size 1024. Needs --train-samples.',
        nargs="*",
    )
    g.str(
        "--step-batch-size-schedule",
        None,
        'Step batch-size schedule "TOKENS:BATCH ...", '
        'e.g. "0:16 2.4B:320" (K/M/B/T suffixes). Excludes --global-batch-size.',
    )
    g.true(
        "--decrease-batch-size-if-needed",
        "Lower the global batch size when "
        "micro-batch-size * data-parallel size does not divide it.",
    )
    g.true(
        "--recompute-activations",
        "Recompute activations in backward (= --recompute-granularity selective).",
    )
    g.str(
        "--recompute-granularity",
        None,
        "Activation recomputation granularity.",
        choices=["full", "selective"],
    )
    g.false(
        "--no-check-for-nan-in-loss-and-grad",
        "check_for_nan_in_loss_and_grad",
        "Do not check the loss and gradients for NaN/Inf.",
    )
    g.true("--check-for-spiky-loss", "Flag iterations whose loss is far above the recent maximum.")
    g.true(
        "--distribute-saved-activations",
        "Shard recomputed activations across the tensor-parallel group.",
    )
    g.str(
        "--recompute-method",
        None,
        "Full recompute: uniform chunks or the first N layers.",
        choices=["uniform", "block"],
    )
    g.int(
        "--recompute-num-layers",
        None,
        "Layers per recompute chunk (uniform) or recomputed layers per pipeline stage (block).",
    )
    g.list(
        "--recompute-modules",
        None,
        "Submodules for selective recompute: core_attn, "
        "moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts (default core_attn).",
        nargs="*",
    )
    g.int(
        "--cpu-offloading-num-layers",
        0,
        "Transformer layers whose activations are offloaded to CPU.",
    )
    g.true("--profile", "Enable nsys profiling between --profile-step-start and -end.")
    g.int("--profile-step-start", 10, "Iteration at which profiling starts.")
    g.int("--profile-step-end", 12, "Iteration at which profiling stops.")
    g.list("--profile-ranks", [0], "Global ranks to profile.", type=int)
    g.true("--use-pytorch-profiler", "Use the PyTorch profiler (TensorBoard trace).")
    g.true("--record-memory-history", "Record CUDA memory history on the last rank.")
    g.str("--memory-snapshot-path", "snapshot.pickle", "Where the memory history is dumped.")
    g.false(
        "--disable-gloo-process-groups",
        "enable_gloo_process_groups",
        "Do not create gloo copies of the process groups.",
    )
    g.true("--tp-comm-overlap", "Overlap tensor-parallel communication with GEMMs.")
    g.str("--tp-comm-overlap-cfg", None, "Config file for --tp-comm-overlap.")
    g.true("--use-cpu-initialization", "Initialize weights on the CPU.", default=None)
    g.int(
        "--empty-unused-memory-level",
        0,
        "Call torch.cuda.empty_cache() each iteration: 0 off, 1 moderate, 2 aggressive.",
        choices=[0, 1, 2],
    )
    g.true(
        "--deterministic-mode",
        "Use deterministic algorithms only (torch.use_deterministic_algorithms).",
    )
    g.true(
        "--calculate-per-token-loss",
        "Normalize the loss by the number of non-padded "
        "tokens in the global batch instead of per micro-batch.",
    )
    g.removed(
        "--checkpoint-activations",
        "use --recompute-activations, or for more control "
        "--recompute-granularity and --recompute-method",
    )
    g.int("--train-iters", None, "Total training iterations (exclusive with --train-samples).")
    g.int("--train-samples", None, "Total training samples (exclusive with --train-iters).")
    g.int("--log-interval", 100, "Iterations between log lines.")
    g.int("--exit-interval", None, "Exit once the iteration is divisible by this value.")
    g.int("--exit-duration-in-mins", None, "Exit after this many minutes of training.")
    g.true("--exit-signal-handler", "Save a checkpoint and exit when --exit-signal arrives.")
    g.str(
        "--exit-signal", "SIGTERM", "Signal caught by --exit-signal-handler.", choices=EXIT_SIGNALS
    )
    g.str("--tensorboard-dir", None, "Write TensorBoard event files to this directory.")
    g.false(
        "--no-masked-softmax-fusion",
        "masked_softmax_fusion",
        "Disable the fused scale+mask+softmax kernel.",
    )
    g.false("--no-bias-gelu-fusion", "bias_gelu_fusion", "Disable the bias+GeLU fusion.")
    g.false("--no-bias-swiglu-fusion", "bias_swiglu_fusion", "Disable the bias+SwiGLU fusion.")
    g.false("--no-bias-dropout-fusion", "bias_dropout_fusion", "Disable the bias+dropout fusion.")
    g.false("--no-rope-fusion", "apply_rope_fusion", "Disable the fused RoPE kernel.")
    g.str("--rope-type", None, "RoPE variant (MLA defaults to yarn).", choices=["rope", "yarn"])
    g.true("--cross-entropy-loss-fusion", "Fuse the cross-entropy loss computation.")
    g.str(
        "--cross-entropy-fusion-impl",
        "native",
        "Fused cross-entropy implementation.",
        choices=["native", "te"],
    )
    g.true("--use-flash-attn", "Use FlashAttention (with --attention-backend auto: selects flash).")
    g.false("--disable-bias-linear", "add_bias_linear", "No biases in the linear layers.")
    g.true(
        "--add-qkv-bias", "Bias in the QKV projection only (implied without --disable-bias-linear)."
    )
    g.str("--optimizer", "adam", "Optimizer.", choices=OPTIMIZERS)
    g.true("--optimizer-cpu-offload", "Keep the optimizer state on the CPU.")
    g.float("--optimizer-offload-fraction", 1.0, "Fraction of the optimizer state offloaded.")
    g.str(
        "--dataloader-type",
        None,
        "Sampler: single pass, cyclic (reshuffled per epoch) or external. Default: single.",
        choices=["single", "cyclic", "external"],
    )
    g.false(
        "--no-async-tensor-model-parallel-allreduce",
        "async_tensor_model_parallel_allreduce",
        "Deprecated and ignored.",
    )
    g.true("--no-persist-layer-norm", "Disable the persistent fused layer-norm kernel.")
    g.true("--sequence-parallel", "Sequence parallelism in the tensor-parallel regions.")
    g.false(
        "--no-gradient-accumulation-fusion",
        "gradient_accumulation_fusion",
        "Disable fusing weight-gradient accumulation into the GEMM.",
    )
    g.true(
        "--use-mcore-models",
        "Deprecated and ignored: core models are the only models.",
        dest="deprecated_use_mcore_models",
    )
    g.removed("--use-legacy-models", "legacy (non-core) models were removed; drop the flag")
    g.true("--manual-gc", "Disable automatic garbage collection and collect manually.")
    g.int(
        "--manual-gc-interval",
        0,
        "Iterations between manual collections (0: only around evaluation).",
    )
    g.false("--no-manual-gc-eval", "manual_gc_eval", "No manual collection around evaluation.")
    g.str(
        "--cuda-graph-impl",
        "none",
        "CUDA graph capture implementation.",
        choices=["none", "local", "transformer_engine", "full_iteration"],
    )
    g.str(
        "--cuda-graph-scope",
        "full",
        "CUDA graph capture scope.",
        choices=["full", "attn", "full_iteration"],
    )
    g.int("--cuda-graph-warmup-steps", 3, "Warm-up steps before graph capture.")
    g.true("--enable-cuda-graph", "Deprecated: use --cuda-graph-impl local.")
    g.true("--external-cuda-graph", "Deprecated: use --cuda-graph-impl transformer_engine.")
    # Spellings from older Megatron releases that were renamed or dropped.
    g.removed(
        "--no-query-key-layer-scaling",
        "query-key layer scaling is off by default; "
        "use --apply-query-key-layer-scaling to turn it on",
    )
    g.removed("--DDP-impl", "the local/torch DDP choice was removed; drop the flag")
    g.removed(
        ("--use-contiguous-buffers-in-local-ddp", "--no-contiguous-buffers-in-local-ddp"),
        "contiguous gradient buffers are always used; drop the flag",
    )
    g.removed("--distribute-checkpointed-activations", "use --distribute-saved-activations")
    g.removed("--activations-checkpoint-method", "use --recompute-method")
    g.removed("--activations-checkpoint-num-layers", "use --recompute-num-layers")
    g.removed("--standalone-embedding-stage", "use --account-for-embedding-in-pipeline-split")
    return parser


def _add_initialization_args(parser):
    g = ArgGroup(parser, "initialization")
    g.int("--seed", 1234, "Random seed for python, numpy, torch and CUDA.")
    g.true(
        "--data-parallel-random-init",
        "Initialize parameters differently on each data-parallel rank.",
    )
    g.float("--init-method-std", 0.02, "Standard deviation of the normal weight init.")
    g.float(
        "--embedding-init-method-std",
        None,
        "Standard deviation for the embedding init (default: --init-method-std).",
    )
    g.true("--init-method-xavier-uniform", "Xavier-uniform weight initialization.")
    return parser


def _add_learning_rate_args(parser):
    g = ArgGroup(parser, "learning rate")
    g.float("--lr", None, "Peak learning rate (after warm-up).")
    g.str(
        "--lr-decay-style",
        "linear",
        "Learning rate decay function.",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    g.str(
        "--lr-wsd-decay-style",
        "exponential",
        "Decay of the WSD annealing phase.",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    g.int("--lr-decay-iters", None, "Iterations to decay over. Default: --train-iters.")
    g.int("--lr-decay-samples", None, "Samples to decay over. Default: --train-samples.")
    g.int("--lr-wsd-decay-samples", None, "Samples in the WSD annealing phase.")
    g.int("--lr-wsd-decay-iters", None, "Iterations in the WSD annealing phase.")
    g.float("--lr-warmup-fraction", None, "Warm-up length as a fraction of the decay length.")
    g.int("--lr-warmup-iters", 0, "Iterations of linear warm-up.")
    g.int("--lr-warmup-samples", 0, "Samples of linear warm-up.")
    g.float("--lr-warmup-init", 0.0, "Learning rate at the start of warm-up.")
    g.removed("--warmup", "use --lr-warmup-fraction, --lr-warmup-iters or --lr-warmup-samples")
    g.float("--min-lr", 0.0, "Floor of the learning rate.")
    g.true(
        ("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
        "Use the scheduler values from the command line, ignoring the checkpoint.",
        dest="override_opt_param_scheduler",
    )
    g.true(
        ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"),
        "Use the scheduler values stored in the checkpoint.",
        dest="use_checkpoint_opt_param_scheduler",
    )
    g.removed(
        ("--override-lr-scheduler", "--use-checkpoint-lr-scheduler"),
        "renamed to --override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler",
    )
    g.float("--decoupled-lr", None, "Separate learning rate for the embedding and output layer.")
    g.float("--decoupled-min-lr", None, "Minimum of --decoupled-lr.")
    g.true("--freeze-all-layers", "Train nothing: freeze every parameter.")
    return parser


def _add_validation_args(parser):
    g = ArgGroup(parser, "validation")
    g.true("--full-validation", "Evaluate the whole validation set each time.")
    g.true("--multiple-validation-sets", "Evaluate each validation dataset separately.")
    g.list(
        "--validation-set-names", None, "Names of the validation sets (for the logs).", nargs="*"
    )
    g.int("--eval-iters", 100, "Iterations per evaluation of the validation/test set.")
    g.int(
        "--eval-interval",
        None,
        "Iterations between evaluations during training (None: evaluate only at the end).",
    )
    g.int("--eval-global-batch-size", None, "Global batch size for evaluation.")
    g.int("--eval-micro-batch-size", None, "Micro batch size for evaluation.")
    g.true("--test-mode", "Run the real-time tests alongside the experiment.")
    g.true("--skip-train", "Skip training; only evaluate (if requested) and exit.")
    return parser


def _add_rerun_machine_args(parser):
    g = ArgGroup(parser, "rerun engine")
    g.int("--error-injection-rate", 0, "Inject an unexpected result every N validations.")
    g.str(
        "--error-injection-type",
        "transient_error",
        "Kind of injected error.",
        choices=["correct_result", "transient_error", "persistent_error"],
    )
    g.str(
        "--rerun-mode",
        "validate_results",
        "Rerun engine mode.",
        choices=["disabled", "validate_results", "report_stats"],
    )
    return parser
