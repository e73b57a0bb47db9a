"""``TransformerConfig``: the architecture of a transformer stack (Megatron Core field names).

Field names equal Megatron's, which equal the argparse ``dest`` names of the matching flags where
Megatron has a flag (``--norm-epsilon`` is the exception: its field is ``layernorm_epsilon``,
Megatron's field name for it). Fusion flags are stored for compatibility; the plain PyTorch path
computes the same math whether they are on or off (one deliberate exception: see
``bias_activation_fusion``).
"""

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.config_rules import (
    CP_COMM_TYPES,
    LINEAR_ATTENTION_VARIANTS,
    compiled_layers_dropout_fits,
    compiled_layers_without_recompute,
    cp_comm_types_fit,
    heads_split_into_query_groups,
    heads_split_over_tp,
    hidden_splits_into_heads,
    linear_attention_pattern,
    mup_settings_given,
    mup_width_mult_matches,
    query_groups_split_over_tp,
)
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.feature_fields import (
    UnsupportedFeatureFields,
    refuse_unsupported_features,
)
from megatron.core.transformer.moe.moe_config import MoEConfig, validate_moe_config
from megatron.core.transformer.utils import init_method_normal, scaled_init_method_normal

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_RECOMPUTE_GRANULARITIES = ("full", "selective")
_RECOMPUTE_METHODS = ("uniform", "block")
# Submodules that selective recompute can checkpoint in this implementation.
SUPPORTED_RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)


@dataclass
class TransformerConfig(ModelParallelConfig, MoEConfig, UnsupportedFeatureFields):
    """Configuration of a transformer stack (layers, attention, MLP, norms, init); the
    mixture-of-experts fields come from :class:`MoEConfig`, and megatron-core's fields of
    features this code base lacks from :class:`UnsupportedFeatureFields` (their defaults
    accepted, other values refused where they would change the model)."""

    # ---------------------------------------------------------------- sizes
    num_layers: int = 0
    """Number of transformer layers (``--num-layers``)."""

    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Layers of the first pipeline stage when the split is uneven
    (``--decoder-first-pipeline-num-layers``); None splits evenly."""

    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Layers of the last pipeline stage when the split is uneven
    (``--decoder-last-pipeline-num-layers``); None splits evenly."""

    account_for_embedding_in_pipeline_split: bool = False
    """The embedding takes the place of one layer on the first (virtual) pipeline stage."""

    account_for_loss_in_pipeline_split: bool = False
    """The loss takes the place of one layer on the last (virtual) pipeline stage."""

    hidden_size: int = 0
    """Width of the residual stream (``--hidden-size``)."""

    num_attention_heads: int = 0
    """Number of query heads (``--num-attention-heads``)."""

    num_query_groups: Optional[int] = None
    """Number of key/value heads for grouped-query attention (``--num-query-groups``, used with
    ``--group-query-attention``); None means num_attention_heads (plain multi-head attention)."""

    ffn_hidden_size: Optional[int] = None
    """Width of the MLP's hidden layer (``--ffn-hidden-size``); None means 4 * hidden_size. (With
    ``--swiglu`` the argument parser, not this class, picks int(4h * 2/3 / 64) * 64.)"""

    kv_channels: Optional[int] = None
    """Size of one attention head (``--kv-channels``); None means
    hidden_size // num_attention_heads."""

    softmax_scale: Optional[float] = None
    """Scale applied to q.k before the softmax; None means 1 / sqrt(kv_channels)."""

    # ---------------------------------------------------------------- regularization
    hidden_dropout: float = 0.1
    """Dropout on the embedding output and on each sublayer output before the residual add
    (``--hidden-dropout``)."""

    attention_dropout: float = 0.1
    """Dropout on the attention probabilities (``--attention-dropout``)."""

    # ---------------------------------------------------------------- residual / norms
    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32 when parameters are fp16/bf16
    (``--fp32-residual-connection``)."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from the norm's output instead of its input
    (``--apply-residual-connection-post-layernorm``)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (flag ``--norm-epsilon``; Megatron keeps this field name)."""

    layernorm_zero_centered_gamma: bool = False
    """Store norm weights centred on zero and scale by (1 + weight) (``--apply-layernorm-1p``)."""

    normalization: str = "LayerNorm"
    """Norm type: 'LayerNorm' or 'RMSNorm' (``--normalization``)."""

    qk_layernorm: bool = False
    """Normalize each query and key head (over the head dim) before RoPE (``--qk-layernorm``)."""
    test_mode: bool = False
    """Real-time consistency checks while training: every forward of an attention layer with QK
    layernorm checks that its Q/K layernorm parameters are identical on all data-parallel and
    tensor-parallel ranks (``--test-mode``; SelfAttention.run_realtime_tests)."""

    # ---------------------------------------------------------------- linear layers / MLP
    add_bias_linear: bool = True
    """Biases in all linear layers of attention and MLP (``--disable-bias-linear`` turns it off)."""

    add_qkv_bias: bool = False
    """Bias in the QKV projection even when add_bias_linear is off (``--add-qkv-bias``)."""

    gated_linear_unit: bool = False
    """Gated MLP: linear_fc1 produces [gate; up] and the MLP computes act(gate) * up (``--swiglu``
    together with activation_func=F.silu)."""

    activation_func: Callable = F.gelu
    """Activation of the MLP: F.gelu (default), F.silu for SwiGLU, squared_relu for
    ``--squared-relu``."""

    # ---------------------------------------------------------------- attention
    rotary_interleaved: bool = False
    """RoPE rotates interleaved pairs (x[2i], x[2i+1]) instead of halves (x[i], x[i + d/2])
    (``--rotary-interleaved``)."""

    apply_query_key_layer_scaling: bool = False
    """Scale the score GEMM by an extra 1/layer_number and multiply the fp32 scores back before
    the softmax, so fp16 scores do not overflow (``--apply-query-key-layer-scaling``). The same
    function up to rounding; implies attention_softmax_in_fp32. Only the unfused attention path
    holds half-precision scores, so only it divides and multiplies back
    (dot_product_attention.py)."""

    attention_backend: str = "auto"
    """Attention kernel (``--attention-backend``): 'flash' and 'fused' run torch's
    scaled_dot_product_attention; 'unfused' and 'local' materialise the scores
    (megatron/core/transformer/blocked_attention.py) wherever that path applies (no explicit
    mask) and SDPA elsewhere; 'auto' takes the unfused path for fp32/fp64 on CPU up to
    ``UNFUSED_AUTO_MAX_SEQ`` tokens (where it was measured faster) and SDPA otherwise."""

    attention_softmax_in_fp32: bool = True
    """Run the attention softmax (and its backward) in fp32 when the inputs are fp16/bf16
    (``--attention-softmax-in-fp32``; Megatron Core's default is True, the flag's is False). The
    unfused path upcasts the scores; without it the softmax runs in the input dtype. SDPA's
    kernels and ring attention accumulate in fp32 either way (dot_product_attention.py)."""

    # ---------------------------------------------------------------- context parallelism
    cp_comm_type: Optional[Union[str, List[str]]] = None
    """How attention exchanges keys/values across context-parallel ranks (``--cp-comm-type``):
    'p2p' (ring attention; the only one implemented here), 'a2a', 'allgather', 'a2a+p2p'; one
    value or one per layer. None means 'p2p'."""

    # ---------------------------------------------------------------- initialization
    init_method_std: float = 0.02
    """Std of the normal init of every weight matrix and embedding (``--init-method-std``)."""

    init_method: Optional[Callable] = None
    """Init of weight matrices (QKV, fc1, the output layer); None means N(0, init_method_std),
    or N(0, init_method_std / sqrt(mup_width_mult)) with use_mup. ``--init-method-xavier-uniform``
    sets torch.nn.init.xavier_uniform_ (drawn on the full, unsplit matrix)."""

    embedding_init_method_std: Optional[float] = None
    """Std of the normal init of the word and position embeddings
    (``--embedding-init-method-std``); None means init_method_std."""

    embedding_init_method: Optional[Callable] = None
    """Init of the word, position and token-type embeddings; None means N(0,
    embedding_init_method_std), or init_method when that was given and the two stds agree
    (Megatron's rule: ``--init-method-xavier-uniform`` also initializes the embeddings)."""

    output_layer_init_method: Optional[Callable] = None
    """Init of the projections into the residual stream (linear_proj, linear_fc2); None means
    N(0, init_method_std / sqrt(2 * num_layers)), or / sqrt(num_layers) in a hybrid model."""

    is_hybrid_model: bool = False
    """A hybrid model (``--is-hybrid-model``): each of its layers has one residual branch, not
    two, so the default output-layer init divides by sqrt(num_layers) (megatron-core's rule)."""

    init_model_with_meta_device: bool = False
    """Create parameters on the meta device, without initializing them
    (``--init-model-with-meta-device``)."""

    init_seed: Optional[int] = None
    """Seed of the layout-independent initialization. When set, the embedding, each transformer
    layer (by its global layer number) and the output layer draw their weights from a CPU generator
    of their own seeded from this value, so every pipeline layout builds exactly the weights of the
    one-process model. None draws everything from the global CPU generator in build order."""

    # ---------------------------------------------------------------- muP
    use_mup: bool = False
    """Maximal Update Parameterization (``--use-mup``): hidden weights drawn with std /
    sqrt(mup_width_mult), attention scaled by 1/kv_channels^mup_attn_scale_power, logits
    multiplied by mup_output_mult, embeddings by mup_embedding_mult; the optimizer scales the
    learning rate (and Adam's epsilon) of the hidden matrices (megatron/core/optimizer)."""

    mup_width_mult: float = 1.0
    """hidden_size / mup_base_hidden_size, derived under use_mup (``--mup-width-mult``; a value
    other than 1.0 given here must equal the derived one)."""

    mup_base_hidden_size: Optional[int] = None
    """Hidden size of the base model whose hyperparameters are transferred
    (``--mup-base-hidden-size``); None means hidden_size (width multiplier 1)."""

    mup_embedding_mult: float = 1.0
    """Multiplier of the embedding output under use_mup (``--mup-embedding-mult``)."""

    mup_output_mult: float = 1.0
    """Multiplier of the output logits under use_mup (``--mup-output-mult``); 1.0 becomes
    1 / mup_width_mult."""

    mup_base_head_dim: Optional[float] = None
    """Base head dimension (``--mup-base-head-dim``): under use_mup the attention scale is
    sqrt(mup_base_head_dim) / kv_channels^mup_attn_scale_power; None means a numerator of 1."""

    mup_attn_scale_power: float = 1.0
    """Power of kv_channels in the muP attention scale (``--mup-attn-scale-power``; 1.0: muP's
    1/d, 0.5: the standard 1/sqrt(d)). Used when softmax_scale is not given."""

    # ---------------------------------------------------------------- fusions (stored)
    bias_activation_fusion: bool = False
    """Fuse the bias add with the MLP activation
    (``--no-bias-gelu-fusion``/``--no-bias-swiglu-fusion`` turn it off). Megatron's fused bias-GeLU
    kernel (and Transformer Engine's GeLU) is the tanh approximation, so with this flag on,
    add_bias_linear on and activation_func F.gelu, the MLP uses F.gelu(approximate='tanh') to
    reproduce Megatron's numerics: a torch.compile'd kernel on CUDA, a hand-written function on
    CPU (megatron/core/fusions/fused_bias_gelu.py). Other activations are exact and unfused."""

    masked_softmax_fusion: bool = False
    """Fused scale-mask-softmax kernel (``--no-masked-softmax-fusion``). Stored only (SDPA is
    used)."""

    persist_layer_norm: bool = False
    """Apex persistent LayerNorm kernel (``--no-persist-layer-norm``). Stored only."""

    memory_efficient_layer_norm: bool = False
    """Apex memory-efficient LayerNorm. Stored only."""

    bias_dropout_fusion: bool = False
    """Fused bias + dropout + residual add (``--no-bias-dropout-fusion``): one torch.compile'd
    kernel on CUDA, the unfused ops elsewhere (megatron/core/fusions/fused_bias_dropout.py). The
    same function; on CUDA its dropout masks are drawn by ``bernoulli_`` from the same generator
    instead of aten's fused dropout kernel."""

    apply_rope_fusion: bool = False
    """Fused RoPE kernel (``--no-rope-fusion``). Stored only: the plain RoPE is identical math."""

    compile_transformer_layers: bool = False
    """Compile each transformer layer's forward (and so its backward) with torch.compile
    (``--compile-transformer-layers``, an extension of this project: Megatron-LM has no such
    switch). The layers of a model share one compiled graph. Not with activation recompute, nor
    with dropout under tensor parallelism (config_rules.compiled_layers_*)."""

    cross_entropy_loss_fusion: bool = False
    """Fuse the output layer with the cross entropy (``--cross-entropy-loss-fusion``): the logits
    are never kept; their softmax numerator becomes the gradient in place. Used when labels are
    given (megatron/core/fusions/fused_linear_cross_entropy.py)."""

    cross_entropy_fusion_impl: str = "native"
    """Which fused cross entropy to use: 'native' or 'te' (``--cross-entropy-fusion-impl``); both
    run the same local fused path here (Transformer Engine is not used)."""

    calculate_per_token_loss: bool = False
    """Divide the summed loss by the number of tokens of the whole global batch instead of per
    micro-batch (``--calculate-per-token-loss``). Read by the training loop / schedules."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths (``--mtp-num-layers``; None: none), built on the last
    pipeline stage (megatron.core.transformer.multi_token_prediction)."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean of the MTP depths' losses (``--mtp-loss-scaling-factor``)."""

    # ---------------------------------------------------------------- activation recompute
    recompute_granularity: Optional[str] = None
    """None, 'full' (recompute whole layers) or 'selective' (recompute only recompute_modules)
    (``--recompute-granularity``)."""

    recompute_method: Optional[str] = None
    """With 'full': 'uniform' (checkpoint chunks of recompute_num_layers layers) or 'block'
    (checkpoint the first recompute_num_layers layers of the stage) (``--recompute-method``)."""

    recompute_num_layers: Optional[int] = None
    """Layers per recompute chunk ('uniform') or recomputed layers per stage ('block')
    (``--recompute-num-layers``)."""

    distribute_saved_activations: bool = False
    """Shard checkpointed layer inputs across the tensor parallel ranks
    (``--distribute-saved-activations``)."""

    recompute_modules: Optional[List[str]] = None
    """Submodules recomputed by selective recompute (``--recompute-modules``); None means
    ['core_attn']. This implementation has 'core_attn', 'layernorm' (the input and pre-MLP
    norms: their outputs are freed after use and recomputed in backward) and 'mlp'."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} must be a positive integer ({flag}), got {value!r}")
        if not heads_split_over_tp(self.num_attention_heads, self.tensor_model_parallel_size):
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}, --num-attention-heads) "
                "must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}, "
                "--tensor-model-parallel-size)"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if not heads_split_into_query_groups(self.num_attention_heads, self.num_query_groups):
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups}) (--num-query-groups)"
            )
        if not query_groups_split_over_tp(self.num_query_groups, self.tensor_model_parallel_size):
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}, --num-query-groups) "
                "must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}, "
                "--tensor-model-parallel-size)"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size <= 0:
            raise ValueError(
                f"ffn_hidden_size must be positive (--ffn-hidden-size), got {self.ffn_hidden_size}"
            )
        if self.ffn_hidden_size % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"ffn_hidden_size ({self.ffn_hidden_size}, --ffn-hidden-size) "
                "must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size}, "
                "--tensor-model-parallel-size)"
            )
        if isinstance(self.attention_backend, AttnBackend):  # megatron-core passes the enum
            self.attention_backend = self.attention_backend.name
        if self.attention_backend not in ("flash", "fused", "unfused", "local", "auto"):
            raise ValueError(
                f"attention_backend {self.attention_backend!r} unknown (--attention-backend: "
                "flash, fused, unfused, local, auto)"
            )
        if self.cp_comm_type is not None:
            types = (
                [self.cp_comm_type]
                if isinstance(self.cp_comm_type, str)
                else list(self.cp_comm_type)
            )
            unknown = [t for t in types if t not in CP_COMM_TYPES]
            if unknown:
                raise ValueError(
                    f"cp_comm_type {unknown} unknown (--cp-comm-type: p2p, a2a, allgather, a2a+p2p)"
                )
            if not isinstance(self.cp_comm_type, str) and not cp_comm_types_fit(
                len(types), self.num_layers
            ):
                raise ValueError(
                    f"cp_comm_type takes one value or one per layer ({self.num_layers}), "
                    f"got {len(types)} (--cp-comm-type)"
                )
        if self.kv_channels is None:
            if not hidden_splits_into_heads(self.hidden_size, self.num_attention_heads):
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) unless kv_channels (--kv-channels) is given"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.kv_channels <= 0:
            raise ValueError(
                f"kv_channels must be positive (--kv-channels), got {self.kv_channels}"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1) (--{name.replace('_', '-')}), got {p}")
        self._check_compiled_layers()
        if self.layernorm_epsilon <= 0:
            raise ValueError(
                f"layernorm_epsilon must be positive (--norm-epsilon), got {self.layernorm_epsilon}"
            )
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {_NORMALIZATIONS} (--normalization), "
                f"got {self.normalization!r}"
            )
        if not callable(self.activation_func):
            raise ValueError(f"activation_func must be callable, got {self.activation_func!r}")
        if self.init_method_std <= 0:
            raise ValueError(
                f"init_method_std must be positive (--init-method-std), got {self.init_method_std}"
            )
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        self._validate_recompute()
        validate_moe_config(self)
        self._validate_experimental_attention()
        refuse_unsupported_features(self)
        self._apply_mup()
        self._set_init_methods()

    def _validate_experimental_attention(self):
        """Megatron's rules for ``experimental_attention_variant='gated_delta_net'`` (the only
        variant here): a layer pattern, value heads a multiple of key heads; the attention
        output gate exists for SelfAttention only."""
        if self.attention_output_gate and self.multi_latent_attention:
            raise ValueError(
                "attention_output_gate (--attention-output-gate) is not supported with "
                "multi-latent attention here"
            )
        variant = self.experimental_attention_variant
        if variant is None:
            if self.linear_attention_freq is not None:
                raise ValueError(
                    "linear_attention_freq (--linear-attention-freq) needs "
                    "experimental_attention_variant='gated_delta_net'"
                )
            return
        if variant not in LINEAR_ATTENTION_VARIANTS:
            raise ValueError(
                f"TransformerConfig: experimental_attention_variant={variant!r} is not supported "
                f"here (supported: {', '.join(LINEAR_ATTENTION_VARIANTS)})"
            )
        if self.linear_attention_freq is None:
            raise ValueError(
                "linear_attention_freq (--linear-attention-freq) must be set for gated_delta_net"
            )
        try:
            linear_attention_pattern(self.linear_attention_freq, self.num_layers)
        except ValueError as error:
            raise ValueError(f"linear_attention_freq (--linear-attention-freq) {error}") from None
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )

    def _apply_mup(self):
        """Derive the muP width multiplier, attention scale and output multiplier (Megatron)."""
        if not self.use_mup:
            given = ["--" + name.replace("_", "-") for name in mup_settings_given(self)]
            if given:
                raise ValueError(f"{', '.join(given)} only take effect with --use-mup")
            return
        if self.mup_base_hidden_size is None:
            self.mup_base_hidden_size = self.hidden_size
        if self.mup_base_hidden_size <= 0:
            raise ValueError(
                f"--mup-base-hidden-size must be positive, got {self.mup_base_hidden_size}"
            )
        width_mult = self.hidden_size / self.mup_base_hidden_size
        if not mup_width_mult_matches(
            self.mup_width_mult, self.hidden_size, self.mup_base_hidden_size
        ):
            raise ValueError(
                f"--mup-width-mult {self.mup_width_mult} does not match --hidden-size "
                f"{self.hidden_size} / --mup-base-hidden-size {self.mup_base_hidden_size} = "
                f"{width_mult:g}"
            )
        self.mup_width_mult = width_mult
        if self.softmax_scale is None:
            numerator = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim**0.5
            self.softmax_scale = numerator / self.kv_channels**self.mup_attn_scale_power
        if self.mup_output_mult == 1.0 and width_mult != 1.0:
            self.mup_output_mult = 1.0 / width_mult

    def _check_compiled_layers(self):
        compiled = self.compile_transformer_layers
        if not compiled_layers_without_recompute(compiled, self.recompute_granularity):
            raise ValueError(
                "compile_transformer_layers (--compile-transformer-layers) cannot be combined "
                f"with recompute_granularity {self.recompute_granularity!r} "
                "(--recompute-granularity)"
            )
        if not compiled_layers_dropout_fits(
            compiled, self.tensor_model_parallel_size, self.hidden_dropout, self.attention_dropout
        ):
            raise ValueError(
                "compile_transformer_layers (--compile-transformer-layers) needs hidden_dropout "
                "and attention_dropout 0 (--hidden-dropout, --attention-dropout) under "
                "tensor_model_parallel_size > 1"
            )

    def _set_init_methods(self):
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method_std <= 0:
            raise ValueError(
                "embedding_init_method_std must be positive (--embedding-init-method-std), "
                f"got {self.embedding_init_method_std}"
            )
        if self.embedding_init_method is None:
            same_std = self.embedding_init_method_std == self.init_method_std
            if self.init_method is not None and same_std:
                self.embedding_init_method = self.init_method
            else:
                self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
        # muP divides the variance of every matrix with a hidden-size fan-in by the width.
        width = math.sqrt(self.mup_width_mult) if self.use_mup else 1.0
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std / width)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std / width,
                self.num_layers,
                multiplier=1.0 if self.is_hybrid_model else 2.0,
            )

    def _validate_recompute(self):
        granularity = self.recompute_granularity
        if self.distribute_saved_activations and granularity != "full":
            raise ValueError(
                "distribute_saved_activations (--distribute-saved-activations) needs "
                f"--recompute-granularity full, got {granularity!r}"
            )
        if granularity is None:
            return
        if granularity not in _RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity must be one of {_RECOMPUTE_GRANULARITIES} "
                f"(--recompute-granularity), got {granularity!r}"
            )
        if granularity == "full":
            if self.recompute_method not in _RECOMPUTE_METHODS:
                raise ValueError(
                    "recompute_granularity 'full' needs recompute_method in "
                    f"{_RECOMPUTE_METHODS} (--recompute-method), got {self.recompute_method!r}"
                )
            if self.recompute_num_layers is None or self.recompute_num_layers < 0:
                raise ValueError(
                    "recompute_granularity 'full' needs recompute_num_layers >= 0 "
                    f"(--recompute-num-layers), got {self.recompute_num_layers!r}"
                )
            if self.recompute_method == "uniform" and self.recompute_num_layers == 0:
                raise ValueError(
                    "recompute_method 'uniform' needs recompute_num_layers >= 1 "
                    "(--recompute-num-layers)"
                )
        else:
            if self.recompute_method is not None:
                raise ValueError(
                    "recompute_method (--recompute-method) must not be set with "
                    "recompute_granularity 'selective'"
                )
            if self.recompute_num_layers is not None:
                raise ValueError(
                    "recompute_num_layers (--recompute-num-layers) must not be set with "
                    "recompute_granularity 'selective'"
                )
            modules = (
                self.recompute_modules if self.recompute_modules is not None else ["core_attn"]
            )
            unsupported = [m for m in modules if m not in SUPPORTED_RECOMPUTE_MODULES]
            if unsupported:
                raise ValueError(
                    f"recompute_modules {unsupported} are not supported (--recompute-modules); "
                    f"supported: {list(SUPPORTED_RECOMPUTE_MODULES)}"
                )
            if "mla_up_proj" in modules and not self.multi_latent_attention:
                raise ValueError(
                    "recompute_modules 'mla_up_proj' (--recompute-modules) needs "
                    "multi_latent_attention (--multi-latent-attention)"
                )
        if self.distribute_saved_activations and self.sequence_parallel:
            raise ValueError(
                "distribute_saved_activations (--distribute-saved-activations) cannot be used "
                "with sequence_parallel (--sequence-parallel)"
            )


@dataclass
class MLATransformerConfig(TransformerConfig):
    """megatron-core's configuration of multi-latent attention models (DeepSeek-V2/V3 style),
    with its fields and defaults (see multi_latent_attention.py and
    yarn_rotary_pos_embedding.py)."""

    multi_latent_attention: bool = True
    normalization: str = "RMSNorm"
    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str = "yarn"
    rotary_base: float = 10000
    rotary_percent: float = 1.0
    rotary_scaling_factor: float = 40
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    cache_mla_latents: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not self.multi_latent_attention:
            raise ValueError("MLATransformerConfig needs multi_latent_attention=True")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} must be a positive integer ({flag}), got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(
                f"q_lora_rank must be None or positive (--q-lora-rank), got {self.q_lora_rank}"
            )
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(
                "qk_pos_emb_head_dim (--qk-pos-emb-head-dim) must be even (RoPE rotates pairs), "
                f"got {self.qk_pos_emb_head_dim}"
            )
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(
                f"rope_type must be 'rope' or 'yarn' (--rope-type), got {self.rope_type!r}"
            )
