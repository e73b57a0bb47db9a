"""Model-shape flags: network size, muP, MoE, MLA, Transformer Engine / fp8, legacy vision."""

from .builder import ArgGroup, layer_pattern_type

POSITION_EMBEDDING_TYPES = ["learned_absolute", "rope", "yarn", "mrope", "relative", "none"]
ATTENTION_BACKENDS = ["flash", "fused", "unfused", "local", "auto"]


def _add_network_size_args(parser):
    g = ArgGroup(parser, "network size")
    g.int("--num-layers", None, "Number of transformer layers.")
    g.int(
        "--encoder-num-layers",
        None,
        "Number of encoder transformer layers (T5); alternative spelling of --num-layers.",
    )
    g.int("--decoder-num-layers", None, "Number of decoder transformer layers (T5).")
    g.int("--hidden-size", None, "Transformer hidden size.")
    g.int(
        "--ffn-hidden-size",
        None,
        "Hidden size of the MLP. Default: 4 * hidden-size, or "
        "int(4 * hidden-size * 2/3 / 64) * 64 with --swiglu.",
    )
    g.int("--num-attention-heads", None, "Number of attention heads.")
    g.str(
        "--attention-backend",
        "auto",
        "Attention kernel: flash/fused run torch "
        "scaled_dot_product_attention; unfused/local materialise the scores where they can "
        "(no mask tensor); auto takes unfused for fp32 on CPU up to "
        "seq 1024 and SDPA otherwise.",
        choices=ATTENTION_BACKENDS,
    )
    g.int(
        "--kv-channels",
        None,
        "Per-head projection size. Default: hidden-size // num-attention-heads.",
    )
    g.true("--group-query-attention", "Use grouped-query attention (see --num-query-groups).")
    g.int(
        "--num-query-groups",
        1,
        "Number of key/value head groups; only read with --group-query-attention.",
    )
    g.int(
        "--max-position-embeddings",
        None,
        "Maximum sequence length the position "
        "embedding supports (size of the learned position table).",
    )
    g.str(
        "--position-embedding-type",
        "learned_absolute",
        "Position embedding type.",
        choices=POSITION_EMBEDDING_TYPES,
    )
    g.int("--relative-attention-num-buckets", 32, "Buckets for relative position embeddings.")
    g.int(
        "--relative-attention-max-distance",
        128,
        "Maximum distance for relative position embeddings.",
    )
    g.true("--use-rotary-position-embeddings", "Deprecated: use --position-embedding-type rope.")
    g.int("--rotary-base", 10000, "Base (theta) of the rotary embedding frequencies.")
    g.float("--rotary-percent", 1.0, "Fraction of each head dimension that is rotated.")
    g.true("--rotary-interleaved", "Rotate interleaved (even/odd) pairs instead of halves.")
    g.int(
        "--rotary-seq-len-interpolation-factor",
        None,
        "Linear position interpolation factor for rotary embeddings.",
    )
    g.true("--use-rope-scaling", "Apply the llama3.x RoPE frequency scaling.")
    g.float("--rope-scaling-factor", 8.0, "RoPE scaling factor for --use-rope-scaling.")
    g._add(
        "--no-rope-freq",
        type=layer_pattern_type,
        default=None,
        help="Layers that skip "
        'RoPE: an int N (every Nth layer) or a list pattern such as "([0]*3+[1])*2".',
    )
    g.false(
        "--no-position-embedding",
        "add_position_embedding",
        "Deprecated: use --position-embedding-type none.",
    )
    g.list("--mrope-section", None, "Channel sections for multimodal RoPE.", type=int)
    g.int(
        "--make-vocab-size-divisible-by",
        128,
        "Pad the vocabulary so that its size is "
        "divisible by this value times the tensor-parallel size.",
    )
    g.str("--normalization", "LayerNorm", "Normalization layer.", choices=["LayerNorm", "RMSNorm"])
    g.float("--norm-epsilon", 1e-5, "Epsilon of LayerNorm / RMSNorm.")
    g.true("--apply-layernorm-1p", "Zero-centred norm weights: the layer computes (1 + gamma).")
    g.true(
        "--apply-residual-connection-post-layernorm",
        "Take the residual after the layer norm (original BERT ordering).",
    )
    g.true("--openai-gelu", "Use OpenAI's tanh GeLU approximation.")
    g.true("--squared-relu", "Use squared ReLU instead of GeLU.")
    g.true("--swiglu", "Use SwiGLU (gated SiLU) instead of GeLU.")
    g._add(
        "--onnx-safe",
        type=bool,
        required=False,
        help="Use workarounds for the torch ONNX exporter.",
    )
    g.false("--bert-no-binary-head", "bert_binary_head", "Disable the BERT binary head.")
    g.true(
        "--untie-embeddings-and-output-weights",
        "Use a separate output layer instead of the transposed input embedding.",
    )
    g.true("--qk-layernorm", "Normalize queries and keys per head before attention.")
    g.true("--multi-latent-attention", "Use multi-latent attention (see the mla group).")
    g.int("--mtp-num-layers", None, "Number of multi-token-prediction layers.")
    g.float("--mtp-loss-scaling-factor", 0.1, "Weight of the multi-token-prediction loss.")
    return parser


def _add_mup_args(parser):
    """muP flags; Megatron lists them in its "transformer configuration" group."""
    g = ArgGroup(parser, "transformer configuration")
    g.true(
        "--use-mup",
        "Maximal Update Parameterization: width-scaled init, attention scale, "
        "output-logit scale and per-parameter-group learning rates (see --mup-*).",
    )
    g.float(
        "--mup-width-mult",
        1.0,
        "Width multiplier; derived as hidden-size / mup-base-hidden-size (a value given here "
        "must equal the derived one).",
    )
    g.int(
        "--mup-base-hidden-size",
        None,
        "Hidden size of the base model the hyperparameters were tuned on (default: hidden-size).",
    )
    g.float("--mup-embedding-mult", 1.0, "Multiplier of the embedding output (muP).")
    g.float(
        "--mup-output-mult",
        1.0,
        "Multiplier of the output logits; 1.0 means 1 / width multiplier under --use-mup.",
    )
    g.float(
        "--mup-base-head-dim",
        None,
        "Base head dimension: the attention scale becomes sqrt(base) / kv-channels^power.",
    )
    g.float(
        "--mup-attn-scale-power",
        1.0,
        "Attention scale 1 / kv-channels^power under --use-mup (0.5: standard, 1.0: muP).",
    )
    return parser


def _add_moe_args(parser):
    g = ArgGroup(parser, "moe")
    g.int("--expert-model-parallel-size", 1, "Degree of expert model parallelism.")
    g.int(
        "--expert-tensor-parallel-size",
        None,
        "Tensor parallelism inside experts. Default: --tensor-model-parallel-size.",
    )
    g.int("--num-experts", None, "Number of experts per MoE layer (None or 0: dense model).")
    g._add(
        "--moe-layer-freq",
        type=layer_pattern_type,
        default=1,
        help="MoE layer frequency: "
        'an int N (every Nth layer is MoE) or a list pattern such as "([1]*3+[0])*2".',
    )
    g.int("--moe-ffn-hidden-size", None, "Hidden size of each expert. Default: --ffn-hidden-size.")
    g.int(
        "--moe-shared-expert-intermediate-size",
        None,
        "Total hidden size of the shared experts (None: no shared expert).",
    )
    g.true("--moe-shared-expert-gate", "Gate the shared expert output with a sigmoid.")
    g.true("--moe-shared-expert-overlap", "Overlap shared experts with token dispatch.")
    g.true("--moe-grouped-gemm", "Run the local experts with one grouped GEMM.")
    g.true(
        "--moe-layer-recompute",
        "Recompute MoE layers in backward (deprecated: --recompute-modules moe).",
    )
    g.true("--moe-use-upcycling", "Convert a dense checkpoint into an MoE model.")
    g.list(
        "--moe-router-load-balancing-type",
        "aux_loss",
        "Router load-balancing method (one per MoE layer group, or one for all).",
        choices=[
            "aux_loss",
            "seq_aux_loss",
            "global_aux_loss",
            "sinkhorn",
            "quantile_balancing",
            "none",
        ],
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
    g.list("--moe-aux-loss-coeff", 0.0, "Auxiliary load-balancing loss coefficient(s).", type=float)
    g.float("--moe-z-loss-coeff", None, "Router z-loss coefficient.")
    g.float("--moe-input-jitter-eps", None, "Multiplicative jitter applied to router inputs.")
    g.true("--moe-per-layer-logging", "Log auxiliary losses per MoE layer.")
    g.str(
        "--moe-token-dispatcher-type",
        "allgather",
        "Token dispatcher.",
        choices=["allgather", "alltoall", "flex"],
    )
    g.true("--moe-permute-fusion", "Fuse the token permutation kernels.")
    g.float("--moe-expert-capacity-factor", None, "Expert capacity factor (None: no dropping).")
    g.true("--moe-pad-expert-input-to-capacity", "Pad each expert input to its capacity.")
    g.str(
        "--moe-token-drop-policy",
        "probs",
        "Which tokens are dropped beyond capacity.",
        choices=["probs", "position"],
    )
    return parser


def _add_mla_args(parser):
    g = ArgGroup(parser, "mla")
    g.int("--q-lora-rank", None, "Rank of the low-rank query projection (None: full rank).")
    g.int("--kv-lora-rank", 32, "Rank of the low-rank key/value projection.")
    g.int("--qk-head-dim", 128, "Query/key head dimension without the positional part.")
    g.int("--qk-pos-emb-head-dim", 64, "Query/key head dimension carrying RoPE.")
    g.int("--v-head-dim", 128, "Value head dimension.")
    g.float("--rotary-scaling-factor", 1.0, "YaRN rotary scaling factor.")
    g.float("--mscale", 1.0, "YaRN mscale.")
    g.float("--mscale-all-dim", 0.0, "YaRN mscale applied to all dimensions.")
    return parser


def _add_transformer_engine_args(parser):
    g = ArgGroup(parser, "Transformer-Engine")
    g.str(
        "--fp8-format",
        None,
        "FP8 format (hybrid = E4M3 forward, E5M2 backward).",
        choices=["e4m3", "hybrid"],
        dest="fp8",
    )
    g.str(
        "--fp8-recipe",
        "delayed",
        "FP8 scaling recipe.",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
    )
    g.int("--fp8-margin", 0, "Scaling margin for fp8.")
    g.int("--fp8-interval", 1, "Deprecated and ignored by Megatron.")
    g.int("--fp8-amax-history-len", 1, "Steps of amax history kept per tensor.")
    g.str(
        "--fp8-amax-compute-algo",
        "most_recent",
        "How amax is taken from the history.",
        choices=["most_recent", "max"],
    )
    g.false("--no-fp8-wgrad", "fp8_wgrad", "Compute weight gradients in higher precision.")
    g.str(
        "--transformer-impl",
        "transformer_engine",
        "Transformer implementation. This code base always runs its local PyTorch implementation.",
        choices=["local", "transformer_engine", "inference_optimized"],
    )
    g.true("--fp8-param-gather", "Keep parameters in fp8 and all-gather them in fp8.")
    g.true("--first-last-layers-bf16", "Keep the first and last layers in bf16 under fp8.")
    g.int("--num-layers-at-start-in-bf16", 1, "Layers kept in bf16 at the start.")
    g.int("--num-layers-at-end-in-bf16", 1, "Layers kept in bf16 at the end.")
    g.true("--te-rng-tracker", "Use Transformer Engine's RNG tracker.")
    g.true("--inference-rng-tracker", "Use an RNG tracker configured for inference.")
    return parser


def _add_vision_args(parser):
    # Legacy vision (ViT) flags: kept so old scripts parse; nothing here affects GPT.
    g = ArgGroup(parser, "vision")
    g.int("--num-classes", 1000, "Number of classes of the vision classification task.")
    g.int("--img-h", 224, "Image height.")
    g.int("--img-w", 224, "Image width.")
    g.int("--num-channels", 3, "Image channels.")
    g.int("--patch-dim", 16, "Patch size.")
    g.true("--vision-pretraining", "Run vision pretraining.")
    g.str(
        "--vision-pretraining-type",
        "classify",
        "Vision pretraining objective.",
        choices=["classify", "inpaint", "dino"],
    )
    g.str("--vision-backbone-type", "vit", "Vision backbone.", choices=["vit", "mit", "swin"])
    return parser
