"""Model-shape flags: network size, MLA, Transformer Engine / fp8 / fp4.

(MoE flags are in moe.py; hybrid and experimental attention variants in variants.py; the
legacy vision and biencoder groups in legacy.py.)"""

from megatron.core.transformer.enums import AttnBackend

from .builder import ArgGroup, enum_type, moe_freq_type, no_rope_freq_type, tuple_type

POSITION_EMBEDDING_TYPES = ["learned_absolute", "rope", "yarn", "mrope", "relative", "none"]


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
    g._add(
        "--attention-backend",
        type=enum_type(AttnBackend),
        default=AttnBackend.auto,
        choices=list(AttnBackend),
        metavar="{" + ",".join(member.name for member in AttnBackend) + "}",
        help="Attention kernel: flash/fused run torch "
        "scaled_dot_product_attention; unfused/local materialise the scores where they can "
        "(no mask tensor, fp32); auto takes unfused on CPU up to "
        "seq 1024 and SDPA otherwise.",
    )
    g.int(
        "--flash-attention-version",
        None,
        "FlashAttention major version to use.",
        choices=[2, 3, 4],
    )
    g.str(
        "--softmax-type",
        "vanilla",
        "Attention softmax: vanilla, off-by-one (an extra zero logit) or learnable "
        "(a learned sink logit per head).",
        choices=["vanilla", "off-by-one", "learnable"],
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
    g._add(
        "--window-size",
        type=tuple_type,
        default=None,
        help='Sliding-window attention (left, right), e.g. "(128, 0)".',
    )
    g._add(
        "--window-attn-skip-freq",
        type=moe_freq_type,
        default=None,
        help="Layers that use full attention instead of the sliding window: an int N (every "
        'Nth layer) or a list pattern such as "([0]*3+[1])*2".',
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
    g.int(
        "--yarn-original-max-position-embeddings",
        None,
        "YaRN: the context length the model was trained with.",
    )
    g.float("--yarn-beta-fast", None, "YaRN: fast rotation boundary.")
    g.float("--yarn-beta-slow", None, "YaRN: slow rotation boundary.")
    g.true(
        "--yarn-correction-range-round-to-int",
        "YaRN: round the correction range to integers.",
        default=None,
    )
    g.false(
        "--no-yarn-correction-range-round-to-int",
        "yarn_correction_range_round_to_int",
        "YaRN: keep the correction range fractional.",
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
        type=no_rope_freq_type,
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
    g.float("--norm-epsilon", 1e-5, "Epsilon of LayerNorm / RMSNorm.", dest="layernorm_epsilon")
    g.true(
        "--apply-layernorm-1p",
        "Zero-centred norm weights: the layer computes (1 + gamma).",
        dest="layernorm_zero_centered_gamma",
    )
    g.true(
        "--apply-residual-connection-post-layernorm",
        "Take the residual after the layer norm (original BERT ordering).",
    )
    g.true("--openai-gelu", "Use OpenAI's tanh GeLU approximation.")
    g.true("--squared-relu", "Use squared ReLU instead of GeLU.")
    g.true("--swiglu", "Use SwiGLU (gated SiLU) instead of GeLU.")
    g.true("--quick-geglu", "Use the quick-GeLU gated linear unit (x * sigmoid(1.702 x)).")
    g.float("--glu-linear-offset", 0.0, "Offset added to the linear half of a gated unit.")
    g.float(
        "--activation-func-clamp-value",
        None,
        "Clamp the activation input to [-value, value].",
    )
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
    g.true("--qk-l2-norm", "L2-normalize queries and keys per head before attention.")
    g.true("--qk-clip", "Clip the query/key weights when attention logits grow (QK-clip).")
    g.float("--qk-clip-alpha", 0.5, "Share of the QK-clip scaling applied to the queries.")
    g.float(
        "--qk-clip-threshold",
        100,
        "Largest attention logit before QK-clip rescales the weights.",
    )
    g.true("--attention-output-gate", "Gate the attention output with a sigmoid.")
    g.true("--multi-latent-attention", "Use multi-latent attention (see the mla group).")
    g.int("--mtp-num-layers", None, "Number of multi-token-prediction layers.")
    g.float("--mtp-loss-scaling-factor", 0.1, "Weight of the multi-token-prediction loss.")
    g.true("--mtp-standalone", "Place the multi-token-prediction layers on their own stage.")
    g.true("--mtp-use-repeated-layer", "Reuse one multi-token-prediction layer for every depth.")
    g.true("--mtp-detach-heads", "Detach the multi-token-prediction heads from the trunk.")
    g.true("--mtp-hsm", "Hidden-state mixing in the multi-token-prediction layers.")
    g.str(
        "--mtp-hybrid-override-pattern",
        None,
        "Hybrid layer pattern of the multi-token-prediction layers.",
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
    g.true("--cache-mla-latents", "Cache the compressed latents instead of keys and values.")
    g.true("--mla-down-proj-fusion", "Fuse the query and key/value down projections.")
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
    g.str("--fp8-quantizer-factory", None, "Python path of a custom fp8 quantizer factory.")
    g.no("fp8-wgrad", "Compute weight gradients in higher precision.")
    g.true("--fp8-output-proj", "Run the attention output projection in fp8.")
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
    g.true("--fp4-param-gather", "Keep parameters in fp4 and all-gather them in fp4.")
    g.str("--fp4-format", None, "FP4 format.", choices=["e2m1"], dest="fp4")
    g.str("--fp4-recipe", "nvfp4", "FP4 scaling recipe.", choices=["nvfp4", "custom"])
    g.str("--fp4-quantizer-factory", None, "Python path of a custom fp4 quantizer factory.")
    g._add(
        "--te-precision-config-file",
        default=None,
        help="Transformer Engine per-layer precision configuration file.",
    )
    g.true("--use-kitchen-attention", "Use the Kitchen attention kernels.")
    g.str(
        "--kitchen-attention-backend",
        "sdpa",
        "Kitchen attention backend.",
        choices=["sdpa", "fa"],
    )
    g.true("--use-te-activation-func", "Use Transformer Engine's activation kernels.")
    g.true("--use-transformer-engine-op-fuser", "Use Transformer Engine's operation fuser.")
    return parser
