"""GPT decoder-only language model with Megatron Core's module names (local layer spec)."""

from typing import Optional, Union

import torch

from megatron.core.fusions.fused_linear_cross_entropy import linear_cross_entropy
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module import LanguageModule, adopt_group_sizes
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.context_parallel import cp_chunk_indices
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock
from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    EMBEDDING_INIT_KEY,
    OUTPUT_LAYER_INIT_KEY,
    init_rng_scope,
)

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class GPTModel(LanguageModule):
    """embedding -> decoder (TransformerBlock) -> output_layer [-> per-token cross entropy].

    State dict names follow Megatron Core's local spec: ``embedding.word_embeddings.weight``,
    ``embedding.position_embeddings.weight``, ``decoder.layers.N.{input_layernorm,
    self_attention.{linear_qkv,q_layernorm,k_layernorm,linear_proj}, pre_mlp_layernorm,
    mlp.{linear_fc1,linear_fc2}}.*``, ``decoder.final_layernorm.*``, ``output_layer.weight``
    (absent when the output layer reuses the word embedding).

    The layers are built from ``transformer_layer_spec`` (a layer spec such as
    ``get_gpt_layer_local_spec()``, or per-layer specs in a ``TransformerBlockSubmodules`` such as
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)``; the arguments up to
    ``vp_stage`` are megatron-core 0.16's, in its order). A pipeline stage
    builds its slice with ``pre_process``/``post_process`` and its virtual stage ``vp_stage``: the
    layers it holds follow from the config's pipeline split and the pipeline rank of
    ``pg_collection`` (``num_layers``/``layer_number_offset`` override them for a chunk built by
    hand); ``set_input_tensor`` feeds a stage without the embedding.

    Model parallelism: ``pg_collection`` (a ``ProcessGroupCollection`` or the ``ParallelState`` of
    ``initialize_model_parallel``) gives the tensor- and context-parallel groups; None means those
    of the current ``parallel_state`` (megatron-core's fallback), and one process (TP = CP = 1)
    when there is none. Under TP every projection, the embedding and the output layer are
    sharded (the tied output layer uses the embedding's vocab shard), and with ``parallel_output``
    the logits are this rank's vocab slice [b, s, V/TP]; the loss is the vocab-parallel cross
    entropy. Under CP the inputs are this rank's two load-balanced sequence chunks
    (``get_batch_on_this_cp_rank``) and the per-token losses are for those tokens.
    """

    block_class = TransformerBlock
    """The decoder's class (a hybrid model's stack subclasses it)."""

    def __init__(
        self,
        config: TransformerConfig,
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
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
        *,
        num_layers: Optional[int] = None,
        layer_number_offset: Optional[int] = None,
    ):
        config, pgs = adopt_group_sizes(config, pg_collection)
        super().__init__(config)
        self.pg_collection = pgs
        self.tp_group = self.pg_collection.tp
        self.cp_group = self.pg_collection.cp
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type {position_embedding_type!r} is not supported "
                f"(--position-embedding-type); choose one of {_POSITION_EMBEDDING_TYPES}"
            )
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if mtp_block_spec is not None and not config.mtp_num_layers:
            raise ValueError(
                "GPTModel: multi-token prediction (mtp_block_spec) needs config.mtp_num_layers >= 1"
            )
        if mtp_block_spec is not None and position_embedding_type not in ("rope", "none"):
            raise ValueError(
                "GPTModel: multi-token prediction needs position_embedding_type rope or none "
                f"(--position-embedding-type), got {position_embedding_type!r}"
            )
        if transformer_layer_spec is None:
            raise ValueError(
                "GPTModel needs a transformer_layer_spec, e.g. get_gpt_layer_local_spec() or "
                "get_gpt_decoder_block_spec(config, use_transformer_engine=False)"
            )
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        # Multi-token prediction sits on the last (virtual) stage and needs the word embedding.
        self.mtp_process = mtp_block_spec is not None and post_process

        if pre_process or self.mtp_process:
            with init_rng_scope(config.init_seed, EMBEDDING_INIT_KEY):
                self.embedding = LanguageModelEmbedding(
                    config,
                    vocab_size,
                    max_sequence_length,
                    position_embedding_type=position_embedding_type,
                    scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
                    pg_collection=self.pg_collection,
                )
        # Multi-latent attention rotates its own positional dims (multi_latent_attention.py).
        if position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization,
            )
        else:
            self.rotary_pos_emb = None
        self.vp_stage = vp_stage
        self.decoder = self.block_class(
            config,
            transformer_layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
            num_layers=num_layers,
            layer_number_offset=layer_number_offset,
        )
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(
                config, mtp_block_spec, pg_collection=self.pg_collection
            )
        if post_process:
            with init_rng_scope(config.init_seed, OUTPUT_LAYER_INIT_KEY):
                self.output_layer = self._build_output_layer(
                    config,
                    vocab_size,
                    parallel_output,
                    pre_process or self.mtp_process,
                    share_embeddings_and_output_weights,
                )
        self.setup_embeddings_and_output_layer()
        self._causal_masks = {}

    def _build_output_layer(
        self, config, vocab_size, parallel_output, pre_process, share_embeddings_and_output_weights
    ):
        return ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            # muP treats the untied output layer like the embedding (base init and LR).
            init_method=config.embedding_init_method if config.use_mup else config.init_method,
            bias=False,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
            tp_group=self.tp_group,
        )

    def _fused_output_layer_and_loss(
        self, hidden_states: torch.Tensor, labels: torch.Tensor, weight: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``--cross-entropy-loss-fusion``: output layer + cross entropy in one autograd Function
        over chunks of tokens (the [b, s, V] logits never exist at once, and no fp32 copy of them;
        see fused_linear_cross_entropy), per-token losses
        [b, s] as the unfused path returns. Both ``--cross-entropy-fusion-impl`` values (native,
        te) run this function: there is no Transformer Engine here. Under TP the weight is this
        rank's vocab shard and the loss is the vocab-parallel one; the input mapping below is the
        output layer's (its backward reduces the hidden states' gradient over TP)."""
        layer = self.output_layer
        if weight is None:
            weight = layer.weight
        if layer.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, self.tp_group)
        else:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, self.tp_group)
        # Rows in the hidden states' own [s, b] order: no transposed copy of [s, b, h].
        losses = linear_cross_entropy(
            hidden_states,
            weight,
            labels.t(),
            tp_group=self.tp_group,
            fp32_softmax=not self.fp16_lm_cross_entropy,
        )
        return losses.t().contiguous()

    def set_input_tensor(self, input_tensor) -> None:
        """Activation [s, b, h] from the previous pipeline stage (a list of one is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(
                    f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}"
                )
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _drop_causal_mask(self, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Return None when the mask is exactly the causal mask, so attention takes SDPA's faster
        is_causal path; checked once per forward (O(b * s^2) compares, far below attention's
        cost)."""
        if attention_mask is None:
            return None
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask must be a bool tensor (True = masked), got {attention_mask.dtype}"
            )
        s = attention_mask.shape[-1]
        if (
            attention_mask.dim() != 4
            or attention_mask.shape[-2] != s
            or attention_mask.shape[1] != 1
        ):
            raise ValueError(
                f"attention_mask must have shape [b, 1, s, s], got {tuple(attention_mask.shape)}"
            )
        key = (s, attention_mask.device)
        causal = self._causal_masks.get(key)
        if causal is None:
            causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).triu_(1)
            if len(self._causal_masks) >= 4:
                self._causal_masks.clear()
            self._causal_masks[key] = causal
        if torch.equal(attention_mask, causal.expand_as(attention_mask)):
            return None
        return attention_mask

    def _rotary_tables(self, source: torch.Tensor, offset: int = 0):
        """RoPE tables for the sequence attention sees: the whole local sequence (gathered over TP
        with sequence parallelism), and with CP this rank's chunks of the full sequence. During
        generation the tokens start at position ``offset`` (the KV cache holds the earlier ones)."""
        seq_len = source.shape[0]
        if offset:
            return self.rotary_pos_emb.get_cos_sin(
                seq_len, self._activation_dtype(), source.device, offset=offset
            )
        if self.config.sequence_parallel and self.pg_collection.tp_size > 1:
            seq_len *= self.pg_collection.tp_size
        cp_size = self.pg_collection.cp_size
        if cp_size == 1:
            return self.rotary_pos_emb.get_cos_sin(seq_len, self._activation_dtype(), source.device)
        cos, sin = self.rotary_pos_emb.get_cos_sin(
            seq_len * cp_size, self._activation_dtype(), source.device
        )
        index = cp_chunk_indices(seq_len, cp_size, self.pg_collection.cp_rank, cos.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def _activation_dtype(self) -> torch.dtype:
        # The dtype the attention sees is the parameters' (a Float16Module may have cast them).
        for layer in self.decoder.layers:
            # The first softmax-attention layer (gated delta net layers have no linear_proj).
            linear_proj = getattr(getattr(layer, "self_attention", None), "linear_proj", None)
            if linear_proj is not None:
                return linear_proj.weight.dtype
        return self.config.params_dtype

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        inference_context=None,
        **kwargs,
    ) -> torch.Tensor:
        """input_ids, position_ids [b, s]; attention_mask bool [b, 1, s, s] (True = masked) or None
        for causal.

        Returns logits [b, s, V] when ``labels`` is None, else per-token losses [b, s] (fp32 unless
        ``fp16_lm_cross_entropy``). Stages without ``post_process`` return hidden states [s, b, h].
        Argument order is Megatron's: pass ``labels`` by keyword. ``loss_mask`` [b, s] is used only
        by multi-token prediction (the caller applies it to the returned main losses).

        ``inference_context`` (a ``StaticInferenceContext``): generation with a KV cache; the
        inputs are the tokens after the cached ones (``position_ids`` continue from the cache's
        ``sequence_len_offset``), ``attention_mask`` is None, and the caller advances the cache.
        """
        if kwargs:
            unsupported = sorted(k for k, v in kwargs.items() if v is not None)
            if unsupported:
                raise ValueError(f"GPTModel.forward: unsupported arguments {unsupported}")
        if decoder_input is not None and not torch.is_floating_point(decoder_input):
            raise ValueError(
                "GPTModel.forward: decoder_input (4th argument) must be float hidden states "
                "[s, b, h]; "
                "pass labels by keyword (labels=...)"
            )
        cp_size, cp_rank = self.pg_collection.cp_size, self.pg_collection.cp_rank
        if inference_context is not None and (cp_size > 1 or self.config.sequence_parallel):
            raise ValueError(
                "generation with a KV cache supports neither context parallelism "
                "(--context-parallel-size > 1) nor --sequence-parallel"
            )
        if cp_size > 1:
            if attention_mask is not None:
                raise ValueError(
                    "explicit attention masks (--reset-attention-mask) are not supported with "
                    "context parallelism (--context-parallel-size > 1)"
                )
            if position_ids is None and input_ids is not None:
                position_ids = cp_chunk_indices(
                    input_ids.shape[1], cp_size, cp_rank, input_ids.device
                ).unsqueeze(0)
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids, position_ids)
        attention_mask = self._drop_causal_mask(attention_mask)

        rotary = None
        if self.rotary_pos_emb is not None:
            source = decoder_input if decoder_input is not None else self.decoder.input_tensor
            if source is None:
                raise ValueError(
                    "GPTModel without pre_process needs set_input_tensor() before forward"
                )
            offset = 0 if inference_context is None else inference_context.sequence_len_offset
            rotary = self._rotary_tables(source, offset)

        cache = {} if inference_context is None else {"inference_context": inference_context}
        hidden_states = self.decoder(
            decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary, **cache
        )
        if not self.post_process:
            return hidden_states

        if self.mtp_process and labels is not None and self.training:
            hidden_states = self._attach_mtp_losses(
                input_ids, hidden_states, attention_mask, rotary, labels, loss_mask
            )
        return self._output_layer_and_loss(hidden_states, labels)

    def _output_layer_and_loss(
        self, hidden_states: torch.Tensor, labels: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The head: hidden states [s, b, h] -> logits [b, s, V] (``labels`` None) or per-token
        losses [b, s]."""
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        if (
            labels is not None
            and self.config.cross_entropy_loss_fusion
            and self.output_layer.bias is None
        ):
            # The logits are never formed: scaling the hidden states scales them (no bias).
            hidden_states = self.scale_logits(hidden_states)
            return self._fused_output_layer_and_loss(hidden_states, labels, weight)
        if self.output_layer.sequence_parallel:
            # The output layer gathers the [s/TP, b, h] slices along the sequence (dim 0).
            logits, _ = self.output_layer(hidden_states, weight=weight)
            logits = logits.transpose(0, 1)
        else:
            # Transposing the [s, b, h] hidden states (not the [s, b, V] logits) gives [b, s, V]
            # logits with the cheaper copy.
            logits, _ = self.output_layer(hidden_states.transpose(0, 1), weight=weight)
        logits = self.scale_logits(logits)
        if labels is None:
            return logits
        return self.compute_language_model_loss(labels, logits)

    # ------------------------------------------------------------ multi-token prediction
    def set_mtp_loss_scale(self, scale) -> None:
        """The factor the MTP losses take in backward (the schedule's, per micro-batch)."""
        if self.mtp_process:
            self.mtp.set_mtp_loss_scale(scale)

    def _attach_mtp_losses(
        self, input_ids, hidden_states, attention_mask, rotary, labels, loss_mask
    ) -> torch.Tensor:
        """Run the MTP depths on the decoder's output and attach their losses, computed by the
        main head's own loss function, to the main head's input (for backward)."""
        if input_ids is None:
            raise ValueError("GPTModel with multi-token prediction needs input_ids")
        mtp_hidden = self.mtp(
            input_ids,
            hidden_states,
            self.embedding,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary,
        )
        return self.mtp.attach_losses(
            hidden_states, mtp_hidden, labels, loss_mask, self._output_layer_and_loss
        )
