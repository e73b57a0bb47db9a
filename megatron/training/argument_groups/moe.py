"""Mixture-of-experts flags: expert parallelism, router, token dispatch, expert kernels."""

from .builder import ArgGroup, moe_freq_type

LOAD_BALANCING_TYPES = [
    "aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "sinkhorn",
    "quantile_balancing",
    "none",
]


def _add_moe_args(parser):
    g = ArgGroup(parser, "moe")
    _expert_parallelism(g)
    _experts(g)
    _router(g)
    _dispatch(g)
    _overlap_and_memory(g)
    return parser


def _expert_parallelism(g):
    g.int("--expert-model-parallel-size", 1, "Degree of expert model parallelism.")
    g.int(
        "--expert-tensor-parallel-size",
        None,
        "Tensor parallelism inside experts. Default: --tensor-model-parallel-size.",
    )
    g.int(
        "--expert-tensor-parallel-num-weight-shards",
        None,
        "Shards of each expert weight across the expert tensor-parallel group.",
    )
    g.int("--num-experts", None, "Number of experts per MoE layer (None or 0: dense model).")
    g._add(
        "--moe-layer-freq",
        type=moe_freq_type,
        default=1,
        help="MoE layer frequency: "
        'an int N (every Nth layer is MoE) or a list pattern such as "([1]*3+[0])*2".',
    )


def _experts(g):
    g.int("--moe-ffn-hidden-size", None, "Hidden size of each expert. Default: --ffn-hidden-size.")
    g.int("--moe-latent-size", None, "Latent size the experts work in (None: hidden size).")
    g.int(
        "--moe-shared-expert-intermediate-size",
        None,
        "Total hidden size of the shared experts (None: no shared expert).",
    )
    g.true("--moe-shared-expert-gate", "Gate the shared expert output with a sigmoid.")
    g.int(
        "--moe-shared-expert-glu-interleave-size",
        None,
        "Interleave size of the shared expert's gated linear unit weights.",
    )
    g.int(
        "--moe-mlp-glu-interleave-size",
        None,
        "Interleave size of the experts' gated linear unit weights.",
    )
    g.true("--moe-grouped-gemm", "Run the local experts with one grouped GEMM.")
    g.true("--use-grouped-gemm-for-shared-expert", "Run the shared expert with a grouped GEMM.")
    g.true("--use-grouped-gemm-for-dense-mlp", "Run dense MLPs with a grouped GEMM.")
    g.true("--moe-use-grouped-tensor", "Keep the expert weights in one grouped tensor.")
    g.true("--moe-single-grouped-weight", "Store all expert weights of a layer as one parameter.")
    g.true("--moe-single-grouped-bias", "Store all expert biases of a layer as one parameter.")
    g.true(
        "--moe-layer-recompute",
        "Recompute MoE layers in backward (deprecated: --recompute-modules moe).",
    )
    g.true("--moe-use-upcycling", "Convert a dense checkpoint into an MoE model.")
    g.int(
        "--moe-upcycling-granularity",
        1,
        "Experts made from each dense MLP when upcycling (fine-grained upcycling).",
    )
    g.true("--moe-apply-probs-on-input", "Multiply the router probabilities into the inputs.")
    g.true("--moe-per-layer-logging", "Log auxiliary losses per MoE layer.")


def _router(g):
    g.list(
        "--moe-router-load-balancing-type",
        "aux_loss",
        "Router load-balancing method (one per MoE layer group, or one for all).",
        choices=LOAD_BALANCING_TYPES,
    )
    g.str("--moe-router-dtype", None, "Dtype of the routing computation.", choices=["fp32", "fp64"])
    g.str(
        "--moe-router-score-function",
        "softmax",
        "Router score function.",
        choices=["softmax", "sigmoid", "sqrtsoftplus"],
    )
    g.int("--moe-router-topk", 2, "Number of experts each token is routed to.")
    g.true("--moe-router-pre-softmax", "Apply the softmax before the top-k selection.")
    g.int("--moe-router-num-groups", None, "Expert groups for group-limited routing.")
    g.int("--moe-router-group-topk", None, "Selected groups for group-limited routing.")
    g.float("--moe-router-topk-scaling-factor", None, "Scaling factor of the top-k scores.")
    g.true("--moe-router-enable-expert-bias", "Aux-loss-free balancing with a learned expert bias.")
    g.float("--moe-router-bias-update-rate", 1e-3, "Update rate of the expert bias.")
    g.float(
        "--moe-router-quantile-balancing-ema",
        0.0,
        "EMA factor of quantile load balancing.",
    )
    g.true("--moe-router-force-load-balancing", "Route tokens uniformly (benchmarking aid).")
    g.float(
        "--moe-router-force-biased",
        None,
        "Skew the forced routing towards some experts (benchmarking aid).",
    )
    g.true("--moe-router-padding-for-quantization", "Pad routing maps for quantized experts.")
    g.true("--moe-router-padding-for-fp8", "Pad routing maps for fp8 experts (deprecated name).")
    g.true("--moe-router-fusion", "Fuse the router's top-k and score computation.")
    g.true("--moe-enable-routing-replay", "Record and replay routing decisions.")
    g.list("--moe-aux-loss-coeff", 0.0, "Auxiliary load-balancing loss coefficient(s).", type=float)
    g.float("--moe-z-loss-coeff", None, "Router z-loss coefficient.")
    g.float("--moe-input-jitter-eps", None, "Multiplicative jitter applied to router inputs.")


def _dispatch(g):
    g.str(
        "--moe-token-dispatcher-type",
        "allgather",
        "Token dispatcher.",
        choices=["allgather", "alltoall", "flex"],
    )
    g.true("--moe-enable-deepep", "Dispatch tokens with DeepEP (deprecated: flex dispatcher).")
    g.str(
        "--moe-flex-dispatcher-backend",
        "deepep",
        "Backend of the flex token dispatcher.",
        choices=["deepep", "hybridep", "ncclep"],
    )
    g.int("--moe-flex-dispatcher-num-sms", None, "SMs the flex dispatcher may use.")
    g.int("--moe-deepep-num-sms", None, "SMs DeepEP may use.")
    g.int("--moe-hybridep-num-sms", None, "SMs HybridEP may use.")
    g.int("--moe-hybridep-num-blocks-permute", None, "Thread blocks of HybridEP's permute.")
    g.int("--moe-hybridep-num-blocks-unpermute", None, "Thread blocks of HybridEP's unpermute.")
    g.int("--moe-hybridep-num-sms-preprocessing", 108, "SMs of HybridEP's preprocessing.")
    g.true("--moe-hybridep-pad-uneven-dispatch-inputs", "Pad uneven HybridEP dispatch inputs.")
    g.true("--moe-permute-fusion-into-hybridep", "Fuse the permutation into HybridEP.")
    g.true("--moe-ncclep-zero-copy", "Zero-copy buffers for the NCCL EP dispatcher.")
    g.str(
        "--moe-dispatch-fwd-dtype",
        "bf16",
        "Dtype of the tokens sent in the forward dispatch.",
        choices=["bf16", "mxfp8"],
    )
    g.str(
        "--moe-combine-bwd-dtype",
        "bf16",
        "Dtype of the gradients sent in the backward combine.",
        choices=["bf16", "mxfp8"],
    )
    g.true("--moe-permute-fusion", "Fuse the token permutation kernels.")
    g.float("--moe-expert-capacity-factor", None, "Expert capacity factor (None: no dropping).")
    g.float(
        "--moe-expert-rank-capacity-factor",
        None,
        "Capacity factor per expert-parallel rank (None: no dropping).",
    )
    g.true("--moe-pad-expert-input-to-capacity", "Pad each expert input to its capacity.")
    g.str(
        "--moe-token-drop-policy",
        "probs",
        "Which tokens are dropped beyond capacity.",
        choices=["probs", "position"],
    )
    g.true(
        "--moe-pad-experts-for-cuda-graph-inference",
        "Pad the experts to fixed sizes for CUDA-graph inference.",
    )


def _overlap_and_memory(g):
    g.true("--moe-shared-expert-overlap", "Overlap shared experts with token dispatch.")
    g.true(
        "--overlap-moe-expert-parallel-comm",
        "Overlap expert-parallel communication with computation across micro-batches.",
    )
    g.true("--delay-wgrad-compute", "Delay the expert weight-gradient GEMMs to overlap them.")
    g.true(
        "--overlap-dispatch-backward-with-experts-wgrad",
        "Overlap the backward dispatch with the experts' weight gradients.",
    )
    g.true(
        "--ep-overlap-early-attn-memory-release",
        "Release attention memory early when overlapping expert-parallel communication.",
    )
    g.true("--high-priority-a2a-comm-stream", "Run the all-to-all on a high-priority stream.")
    g.true("--moe-paged-stash", "Stash expert activations in paged buffers.")
    g.int("--moe-paged-stash-page-size", 64, "Page size (tokens) of the paged stash.")
    g.float(
        "--moe-paged-stash-buffer-size-factor-cuda",
        1.1,
        "GPU paged-stash buffer size as a multiple of the expected size.",
    )
    g.float(
        "--moe-paged-stash-buffer-size-factor-cpu",
        0.0,
        "CPU paged-stash buffer size as a multiple of the expected size.",
    )
    g.str("--moe-routing-trace-path", None, "Write the routing decisions to this directory.")
    g.int(
        "--moe-routing-trace-max-training-iters",
        None,
        "Iterations whose routing is traced (None: all).",
    )
    g.true("--moe-routing-trace-capture-logits", "Also trace the router logits.")
    g.true("--moe-routing-trace-capture-hidden-states", "Also trace the router inputs.")
    g.true("--moe-routing-trace-dump-weights", "Also dump the router weights.")
