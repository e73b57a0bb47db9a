"""BERT: a bidirectional encoder with a masked-LM head and the binary sentence-order head."""

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module import LanguageModule, adopt_group_sizes
from megatron.core.models.common.padding_mask import key_padding_mask
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.parameters import new_constant_param, new_weight
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    EMBEDDING_INIT_KEY,
    OUTPUT_LAYER_INIT_KEY,
    init_rng_scope,
)

# Init scopes of the heads (transformer layers use their number, see transformer.utils).
_LM_HEAD_INIT_KEY = OUTPUT_LAYER_INIT_KEY + 1
_POOLER_INIT_KEY = OUTPUT_LAYER_INIT_KEY + 2
_BINARY_HEAD_INIT_KEY = OUTPUT_LAYER_INIT_KEY + 3


class _Linear(torch.nn.Module):
    """A dense layer replicated on every tensor-parallel rank (``weight`` [out, in], ``bias``),
    drawn with ``init_method`` and a zero bias, the initialisation of Megatron's
    ``get_linear_layer``."""

    def __init__(self, in_features: int, out_features: int, config, init_method):
        super().__init__()
        self.weight = new_weight((out_features, in_features), config, init_method)
        self.bias = new_constant_param((out_features,), config, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BertLMHead(MegatronModule):
    """dense (h -> h) -> GeLU -> norm: the transform before the (tied) output layer.

    Under sequence parallelism it runs on this rank's [s/TP, b, h] slice, so its parameters'
    gradients are partial and are all-reduced over TP (``sequence_parallel`` set on them)."""

    def __init__(self, hidden_size: int, config):
        super().__init__(config)
        self.dense = _Linear(hidden_size, hidden_size, config, config.init_method)
        self.dense.weight.sequence_parallel = bool(config.sequence_parallel)
        self.dense.bias.sequence_parallel = bool(config.sequence_parallel)
        self.layer_norm = build_norm(config, hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden_states)))


class Pooler(MegatronModule):
    """tanh(dense(hidden state of the token at ``sequence_index``)): the [CLS] summary."""

    def __init__(self, hidden_size: int, config, tp_group=None):
        super().__init__(config)
        self.dense = _Linear(hidden_size, hidden_size, config, config.init_method)
        self.tp_group = tp_group
        self.sequence_parallel = bool(config.sequence_parallel) and tp_group is not None

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        """[s, b, h] (or this rank's [s/TP, b, h]) -> [b, h]."""
        if self.sequence_parallel:
            # Every rank continues with the same (replicated) pooled vector, so the gradient of
            # the gather is this rank's own slice, not a sum over ranks.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, self.tp_group, tensor_parallel_output_grad=False
            )
        return torch.tanh(self.dense(hidden_states[sequence_index]))


class BertModel(LanguageModule):
    """embedding (word + position + token type) -> encoder -> [pooler -> binary_head] and
    lm_head -> output_layer [-> per-token masked-LM cross entropy].

    State dict names are Megatron Core's: ``embedding.{word,position,tokentype}_embeddings.weight``,
    ``encoder.layers.N.*`` (the GPT layer's names), ``encoder.final_layernorm.*``,
    ``lm_head.{dense,layer_norm}.*``, ``output_layer.bias`` (``output_layer.weight`` only when
    untied), ``pooler.dense.*`` and ``binary_head.*`` (with ``add_binary_head``).

    Pipeline stages (``pre_process``/``post_process``, ``vp_stage``), tensor and sequence
    parallelism work as in :class:`~megatron.core.models.gpt.GPTModel`; the tied output layer on a
    last stage without the embedding is synchronized through ``sync_shared_embedding``.
    """

    TOP_LEVEL_EXTRA_STATE = ("output_layer",)
    # The token types, the LM head transform, the pooler and the binary head.
    TP_REPLICATED_PREFIXES = (
        "embedding.tokentype_embeddings.",
        "lm_head.dense.",
        "lm_head.layer_norm.",
        "pooler.",
        "binary_head.",
    )
    LEGACY_CHILD_ORDER = ("pooler", "binary_head")

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        vp_stage: Optional[int] = None,
        pg_collection=None,
    ):
        """megatron-core 0.16's arguments in its order; ``rotary_percent`` and
        ``seq_len_interpolation_factor`` only concern RoPE, which BERT does not use here."""
        del rotary_percent, seq_len_interpolation_factor
        if return_embeddings:
            raise ValueError("BertModel: return_embeddings=True is not supported")
        if transformer_layer_spec is None:
            raise ValueError("BertModel needs a transformer_layer_spec, e.g. bert_layer_local_spec")
        config, pgs = adopt_group_sizes(config, pg_collection)
        super().__init__(config)
        self.pg_collection = pgs
        if self.pg_collection.cp_size > 1:
            raise ValueError("BERT does not support context parallelism (--context-parallel-size)")
        if position_embedding_type != "learned_absolute":
            raise ValueError(
                f"BERT uses learned absolute position embeddings, got {position_embedding_type!r} "
                "(--position-embedding-type)"
            )
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.tp_group = self.pg_collection.tp
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.add_binary_head = add_binary_head
        self.num_tokentypes = num_tokentypes
        self.vp_stage = vp_stage

        if pre_process:
            with init_rng_scope(config.init_seed, EMBEDDING_INIT_KEY):
                self.embedding = LanguageModelEmbedding(
                    config,
                    vocab_size,
                    max_sequence_length,
                    position_embedding_type="learned_absolute",
                    num_tokentypes=num_tokentypes,
                    pg_collection=self.pg_collection,
                )
        self.encoder = TransformerBlock(
            config,
            transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
        )
        if post_process:
            with init_rng_scope(config.init_seed, _LM_HEAD_INIT_KEY):
                self.lm_head = BertLMHead(config.hidden_size, config)
            with init_rng_scope(config.init_seed, OUTPUT_LAYER_INIT_KEY):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    config=config,
                    init_method=config.init_method,
                    bias=True,
                    gather_output=not parallel_output,
                    skip_weight_param_allocation=pre_process
                    and share_embeddings_and_output_weights,
                    tp_group=self.tp_group,
                )
            if add_binary_head:
                tp_group = self.tp_group if self.pg_collection.tp_size > 1 else None
                with init_rng_scope(config.init_seed, _POOLER_INIT_KEY):
                    pooler = Pooler(config.hidden_size, config, tp_group)
                with init_rng_scope(config.init_seed, _BINARY_HEAD_INIT_KEY):
                    binary_head = _Linear(config.hidden_size, 2, config, config.init_method)
                # Registered as megatron-core registers them (binary_head first): the order in
                # which torch optimizers and the torch format pair state with parameters.
                self.binary_head = binary_head
                self.pooler = pooler
        self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Activation [s, b, h] from the previous pipeline stage (a list of one is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(
                    f"BertModel.set_input_tensor expects one tensor, got {len(input_tensor)}"
                )
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tokentype_ids: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """input_ids, tokentype_ids [b, s]; attention_mask: the [b, s] padding mask (1 = token).

        Returns ``(logits [b, s, V or V/TP], binary_logits [b, 2] or None)`` without
        ``lm_labels``, else ``(per-token masked-LM losses [b, s], binary_logits)``. A stage without
        ``post_process`` returns its hidden states [s, b, h]."""
        mask = key_padding_mask(attention_mask)
        hidden = None
        if self.pre_process:
            if self.num_tokentypes > 0 and tokentype_ids is None:
                raise ValueError("BertModel with token types needs tokentype_ids")
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            hidden = self.embedding(
                input_ids, position_ids, tokentype_ids if self.num_tokentypes > 0 else None
            )
        hidden = self.encoder(hidden, attention_mask=mask)
        if not self.post_process:
            return hidden
        binary_logits = None
        if self.add_binary_head:
            binary_logits = self.binary_head(self.pooler(hidden, 0))
        transformed = self.lm_head(hidden)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        if self.output_layer.sequence_parallel:
            logits, _ = self.output_layer(transformed, weight=weight)  # gathers the sequence
            logits = logits.transpose(0, 1)
        else:
            logits, _ = self.output_layer(transformed.transpose(0, 1), weight=weight)
        if lm_labels is None:
            return logits, binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits
