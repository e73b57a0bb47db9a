"""Inference and text-generation flags (static and dynamic batching engines, CUDA graphs for
inference, inference-time kernels)."""

from .builder import ArgGroup

_STATE_DTYPES = ["bf16", "fp16", "fp32"]


def _parse_cuda_graph_modules_arg(value):
    """One module name of `--cuda-graph-modules` / `--cuda-graph-scope` (Megatron's parser
    name); the names are checked where CUDA graphs are built."""
    return str(value)


def _add_inference_args(parser):
    g = ArgGroup(parser, "inference")
    _static_engine(g)
    _dynamic_batching(g)
    _kernels_and_graphs(g)
    return parser


def _static_engine(g):
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
    g._add(
        "--bert-embedder-type",
        default="megatron",
        choices=["megatron", "huggingface"],
        help="BERT embedder.",
    )
    g.true("--flash-decode", "Use the flash-decoding kernel.")
    g.true("--use-legacy-static-engine", "Use the legacy static-batching inference engine.")
    g.int("--inference-max-requests", 8, "Maximum concurrent inference requests.")
    g.int(
        "--inference-max-seq-length",
        2560,
        "Maximum inference sequence length (prompt + generation).",
    )
    g.int("--num-speculative-tokens", 0, "Tokens drafted per step by speculative decoding.")
    g.int("--inference-logging-step-interval", 0, "Steps between inference log lines (0: off).")
    g.both("--inference-text-gen-server-logging", False, "Log the text-generation server.")
    g.both("--inference-wandb-logging", False, "Report inference metrics to Weights & Biases.")
    g.int("--inference-coordinator-port", None, "Port of the inference coordinator.")
    g.str("--inference-shards", None, "Inference shard layout.")
    g.both(
        "--inference-use-synchronous-zmq-collectives",
        False,
        "Use synchronous ZMQ collectives between inference ranks.",
    )
    g.both(
        "--inference-disable-ep-consensus",
        False,
        "Skip the expert-parallel consensus step of the inference engine.",
    )
    for kind in ("conv", "ssm"):
        g.str(
            f"--mamba-inference-{kind}-states-dtype",
            "bf16",
            f"Dtype of the Mamba {kind} states during inference.",
            choices=_STATE_DTYPES,
        )


def _dynamic_batching(g):
    prefix = "--inference-dynamic-batching"
    g.true(prefix, "Use the dynamic-batching inference engine.")
    g.float(f"{prefix}-buffer-size-gb", 40.0, "KV-cache buffer size (GB).")
    g.float(f"{prefix}-paused-buffer-size-gb", None, "Buffer for paused requests (GB).")
    g.float(f"{prefix}-mamba-memory-ratio", None, "Share of the buffer for Mamba states.")
    g.int(f"{prefix}-block-size", 256, "Tokens per KV-cache block.")
    g.int(f"{prefix}-max-requests", None, "Maximum active requests.")
    g.int(f"{prefix}-max-tokens", None, "Maximum active tokens.")
    g.int(f"{prefix}-num-cuda-graphs", 16, "CUDA graphs captured for decode batch sizes.")
    g.true(f"{prefix}-track-paused-request-events", "Record pause/resume events per request.")
    g.true(f"{prefix}-track-generated-token-events", "Record an event per generated token.")
    g.int(
        f"{prefix}-unified-memory-level",
        0,
        "Use CUDA unified memory for the KV cache (1) or not (0).",
        choices=[0, 1],
    )
    g.both(
        f"{prefix}-prefix-caching",
        False,
        "Reuse the KV cache of shared prompt prefixes.",
        dest="inference_dynamic_batching_enable_prefix_caching",
    )
    g.str(
        f"{prefix}-prefix-caching-eviction-policy",
        "ref_zero",
        "Which cached prefix blocks are evicted first.",
        choices=["ref_zero", "lru"],
    )
    g.str(
        f"{prefix}-prefix-caching-coordinator-policy",
        "load_balanced",
        "How the coordinator routes requests with cached prefixes.",
        choices=["longest_prefix", "first_prefix_block", "load_balanced"],
    )
    g.float(
        f"{prefix}-prefix-caching-routing-alpha",
        0.5,
        "Weight of prefix reuse against load when routing.",
    )
    g.float(f"{prefix}-prefix-caching-mamba-gb", None, "Memory for cached Mamba states (GB).")
    g.int(
        f"{prefix}-cuda-graph-mixed-prefill-count",
        16,
        "Prefill requests covered by the mixed CUDA graphs.",
    )
    g.str(
        f"{prefix}-cuda-graph-sizing-distribution",
        "exponential",
        "How the captured CUDA-graph batch sizes are spaced.",
        choices=["exponential", "linear"],
    )
    g.str(
        f"{prefix}-sampling-backend",
        "torch",
        "Token sampling implementation.",
        choices=["torch", "flashinfer"],
    )
    g.false(
        "--use-same-sampling-seed-across-dp-ranks",
        "offset_sampling_seed_by_dp_rank",
        "Sample with the same seed on every data-parallel rank.",
    )
    g.str(
        f"{prefix}-async-sched-mode",
        "legacy",
        "Scheduling mode of the dynamic engine.",
        choices=["legacy", "async"],
    )
    g.str(
        f"{prefix}-logprobs-mode",
        "raw_logprobs",
        "Log-probabilities returned: before or after sampling transforms.",
        choices=["raw_logprobs", "processed_logprobs"],
    )
    g.true("--enable-chunked-prefill", "Split long prefills into chunks.")


def _kernels_and_graphs(g):
    g._add(
        "--cuda-graph-scope",
        type=_parse_cuda_graph_modules_arg,
        nargs="+",
        default=None,
        dest="cuda_graph_scope_deprecated",
        help="Deprecated: use --cuda-graph-modules.",
    )
    g._add(
        "--cuda-graph-modules",
        type=_parse_cuda_graph_modules_arg,
        nargs="+",
        default=[],
        help="Modules captured in CUDA graphs (attn, mlp, moe, ...; default: whole layers).",
    )
    g.str(
        "--inference-cuda-graph-scope",
        None,
        "What inference CUDA graphs capture.",
        choices=["none", "layer", "block"],
    )
    g.true("--decode-only-cuda-graphs", "Capture CUDA graphs for decode steps only.")
    g.true("--inference-cuda-graph-all-prefills", "Capture CUDA graphs for every prefill size.")
    g.int("--inference-cuda-graph-max-tokens", 512, "Largest token count captured in a graph.")
    g.str(
        "--symmetric-ar-type",
        None,
        "Symmetric-memory all-reduce algorithm.",
        choices=["two_shot", "one_shot", "multimem_all_reduce"],
    )
    g.true("--nccl-all-reduce-for-prefill", "Use NCCL all-reduce during prefill.")
    g.true("--inference-fuse-tp-communication", "Fuse tensor-parallel communication at inference.")
    g.true("--inference-disable-triton-nvls-kernels", "Do not use the Triton NVLS kernels.")
    g.str(
        "--inference-grouped-gemm-backend",
        "vllm",
        "Grouped GEMM used by MoE inference.",
        choices=["flashinfer", "torch", "vllm"],
    )
    g.true(
        "--inference-moe-disable-fused-quant-kernels",
        "No fused quantization kernels in MoE inference.",
    )
    g.str(
        "--inference-moe-token-dispatcher-type",
        "nvls",
        "Token dispatcher of MoE inference.",
        choices=["nccl", "nvls"],
    )
    g.int("--mlp-chunks-for-prefill", 1, "Chunks the MLP of a prefill is split into.")
