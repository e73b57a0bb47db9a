"""Flags of model variants beyond the plain GPT layer: experimental attention (DSA, gated
delta nets / linear attention), hybrid Mamba models, manifold hyper-connections and
heterogeneous per-layer configurations."""

from .builder import ArgGroup, la_freq_type


def _add_experimental_attention_variant_args(parser):
    g = ArgGroup(parser, "experimental_attention_variant")
    g.str(
        "--experimental-attention-variant",
        None,
        "Attention variant replacing softmax attention.",
        choices=["gdn", "gdn2", "dsa", "gated_delta_net"],
    )
    g._add(
        "--linear-attention-freq",
        type=la_freq_type,
        default=None,
        help="Layers that use linear attention: an int N (every Nth layer) or a list pattern "
        'such as "([1]*3+[0])*2".',
    )
    g.int("--linear-conv-kernel-dim", 4, "Convolution kernel size of linear attention.")
    g.int("--linear-key-head-dim", 128, "Key head dimension of linear attention.")
    g.int("--linear-value-head-dim", 128, "Value head dimension of linear attention.")
    g.int("--linear-num-key-heads", 16, "Key heads of linear attention.")
    g.int("--linear-num-value-heads", 32, "Value heads of linear attention.")
    # DeepSeek sparse attention (DSA): a light indexer picks the keys each query attends to.
    g.int("--dsa-indexer-n-heads", None, "DSA: indexer heads.")
    g.int("--dsa-indexer-head-dim", None, "DSA: indexer head dimension.")
    g.int("--dsa-indexer-topk", None, "DSA: keys selected per query.")
    g.int("--dsa-indexer-topk-freq", 1, "DSA: layers between two top-k selections.")
    g.int("--dsa-indexer-skip-topk-offset", 0, "DSA: offset of the layers that reuse a top-k.")
    g.float("--dsa-indexer-loss-coeff", None, "DSA: weight of the indexer loss.")
    g.true("--dsa-indexer-use-sparse-loss", "DSA: compute the indexer loss on the top-k only.")
    g.str(
        "--dsa-kernel-backend",
        "none",
        "DSA: sparse attention kernels.",
        choices=["none", "tilelang", "cudnn"],
    )
    g.true("--dsa-indexer-rope-interleaved", "DSA: interleaved RoPE in the indexer.")
    g.no("dsa-indexer-rotate-activation", "DSA: no Hadamard rotation of the indexer inputs.")
    g.no("dsa-indexer-scoring-relu", "DSA: no ReLU on the indexer scores.")
    g.float("--dsa-indexer-k-norm-epsilon", None, "DSA: epsilon of the indexer key norm.")
    g.true("--dsa-indexer-k-norm-fp32", "DSA: compute the indexer key norm in fp32.")
    return parser


def _add_hybrid_model_args(parser):
    g = ArgGroup(parser, "hybrid models")
    g.true("--is-hybrid-model", "The model is a hybrid (Mamba/attention) model.")
    g.int("--mamba-state-dim", 128, "Mamba state dimension.")
    g.int("--mamba-head-dim", 64, "Mamba head dimension.")
    g.int("--mamba-num-groups", 8, "Mamba groups.")
    g.int("--mamba-num-heads", None, "Mamba heads.")
    g.false(
        "--disable-mamba-mem-eff-path",
        "use_mamba_mem_eff_path",
        "Do not use Mamba's memory-efficient fused path.",
    )
    g.int("--gdp-num-householder", 3, "Householder reflections per gated delta product.")
    g.true("--gdp-cutedsl-kernel", "Run gated delta products with the CuTe DSL kernel.")
    g.int(
        "--gdp-num-chunk-states-to-recompute",
        2,
        "Chunk states of gated delta products recomputed in backward.",
    )
    return parser


def _add_hyper_connection_args(parser):
    g = ArgGroup(parser, "manifold hyper-connections")
    g.true("--enable-mhc-connections", "Replace residual connections by hyper-connections.")
    g.int("--mhc-num-residual-streams", 4, "Residual streams of the hyper-connections.")
    g.int("--mhc-sinkhorn-iterations", 20, "Sinkhorn iterations projecting the mixing matrix.")
    g.float("--mhc-init-gating-factor", 0.01, "Initial gating factor of the hyper-connections.")
    g.int("--mhc-recompute-layer-num", None, "Layers whose hyper-connections are recomputed.")
    return parser


def _add_heterogeneous_args(parser):
    g = ArgGroup(parser, "heterogeneous architecture")
    g.str(
        "--heterogeneous-layers-config-path",
        None,
        "JSON file describing each layer of a heterogeneous model.",
    )
    g.str(
        "--heterogeneous-layers-config-encoded-json",
        None,
        "The same description given inline as a JSON string.",
    )
    return parser
