"""Flags of model variants beyond the plain GPT layer: experimental attention (DSA, gated
delta nets / linear attention), hybrid Mamba models, manifold hyper-connections and
heterogeneous per-layer configurations."""

from typing import List, Optional, Union

from megatron.training.flags.spec import flag, flag_group, off_switch, switch
from megatron.training.flags.types import la_freq_type

_GDN = "megatron.core.ssm.gated_delta_net.GatedDeltaNet (gated_delta_net only)"
_GDN_SPEC = (
    "megatron.core.models.gpt.experimental_attention_variant_module_specs "
    "(the layers of gated delta net and of softmax attention)"
)


@flag_group("experimental_attention_variant")
class ExperimentalAttentionVariantFlags:
    experimental_attention_variant: Optional[str] = flag(
        None,
        "Attention variant replacing softmax attention.",
        choices=["gdn", "gdn2", "dsa", "gated_delta_net"],
        honoured_at=_GDN,
    )
    linear_attention_freq: Optional[Union[int, List[int]]] = flag(
        None,
        "Layers that use linear attention: an int N (every Nth layer) or a list pattern such as "
        '"([1]*3+[0])*2".',
        type=la_freq_type,
        honoured_at=_GDN_SPEC,
    )
    linear_conv_kernel_dim: int = flag(
        4, "Convolution kernel size of linear attention.", honoured_at=_GDN
    )
    linear_key_head_dim: int = flag(
        128, "Key head dimension of linear attention.", honoured_at=_GDN
    )
    linear_value_head_dim: int = flag(
        128, "Value head dimension of linear attention.", honoured_at=_GDN
    )
    linear_num_key_heads: int = flag(16, "Key heads of linear attention.", honoured_at=_GDN)
    linear_num_value_heads: int = flag(32, "Value heads of linear attention.", honoured_at=_GDN)
    # DeepSeek sparse attention (DSA): a light indexer picks the keys each query attends to.
    dsa_indexer_n_heads: Optional[int] = flag(None, "DSA: indexer heads.")
    dsa_indexer_head_dim: Optional[int] = flag(None, "DSA: indexer head dimension.")
    dsa_indexer_topk: Optional[int] = flag(None, "DSA: keys selected per query.")
    dsa_indexer_topk_freq: int = flag(1, "DSA: layers between two top-k selections.")
    dsa_indexer_skip_topk_offset: int = flag(0, "DSA: offset of the layers that reuse a top-k.")
    dsa_indexer_loss_coeff: Optional[float] = flag(None, "DSA: weight of the indexer loss.")
    dsa_indexer_use_sparse_loss: bool = switch("DSA: compute the indexer loss on the top-k only.")
    dsa_kernel_backend: str = flag(
        "none", "DSA: sparse attention kernels.", choices=["none", "tilelang", "cudnn"]
    )
    dsa_indexer_rope_interleaved: bool = switch("DSA: interleaved RoPE in the indexer.")
    dsa_indexer_rotate_activation: bool = off_switch(
        "DSA: no Hadamard rotation of the indexer inputs."
    )
    dsa_indexer_scoring_relu: bool = off_switch("DSA: no ReLU on the indexer scores.")
    dsa_indexer_k_norm_epsilon: Optional[float] = flag(
        None, "DSA: epsilon of the indexer key norm."
    )
    dsa_indexer_k_norm_fp32: bool = switch("DSA: compute the indexer key norm in fp32.")


_MIXER = "megatron.core.ssm.mamba_mixer.MambaMixer (pretrain_mamba.py)"


@flag_group("hybrid models")
class HybridModelFlags:
    is_hybrid_model: bool = switch(
        "The model is a hybrid (Mamba/attention) model.",
        honoured_at="TransformerConfig.is_hybrid_model",
    )
    mamba_state_dim: int = flag(128, "Mamba state dimension.", honoured_at=_MIXER)
    mamba_head_dim: int = flag(64, "Mamba head dimension.", honoured_at=_MIXER)
    mamba_num_groups: int = flag(8, "Mamba groups.", honoured_at=_MIXER)
    mamba_num_heads: Optional[int] = flag(None, "Mamba heads.", honoured_at=_MIXER)
    use_mamba_mem_eff_path: bool = off_switch(
        "Do not use Mamba's memory-efficient fused path.", options="--disable-mamba-mem-eff-path"
    )
    gdp_num_householder: int = flag(3, "Householder reflections per gated delta product.")
    gdp_cutedsl_kernel: bool = switch("Run gated delta products with the CuTe DSL kernel.")
    gdp_num_chunk_states_to_recompute: int = flag(
        2, "Chunk states of gated delta products recomputed in backward."
    )


@flag_group("manifold hyper-connections")
class HyperConnectionFlags:
    enable_mhc_connections: bool = switch("Replace residual connections by hyper-connections.")
    mhc_num_residual_streams: int = flag(4, "Residual streams of the hyper-connections.")
    mhc_sinkhorn_iterations: int = flag(20, "Sinkhorn iterations projecting the mixing matrix.")
    mhc_init_gating_factor: float = flag(0.01, "Initial gating factor of the hyper-connections.")
    mhc_recompute_layer_num: Optional[int] = flag(
        None, "Layers whose hyper-connections are recomputed."
    )


@flag_group("heterogeneous architecture")
class HeterogeneousFlags:
    heterogeneous_layers_config_path: Optional[str] = flag(
        None, "JSON file describing each layer of a heterogeneous model."
    )
    heterogeneous_layers_config_encoded_json: Optional[str] = flag(
        None, "The same description given inline as a JSON string."
    )
