"""T5: an encoder-decoder transformer with one shared embedding and a tied LM head."""

import dataclasses
from typing import Optional, Union

import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module import LanguageModule, adopt_group_sizes
from megatron.core.models.common.padding_mask import key_padding_mask
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    EMBEDDING_INIT_KEY,
    OUTPUT_LAYER_INIT_KEY,
    init_rng_scope,
)

# The decoder's layers are numbered from 1 like the encoder's; their init streams must differ.
_DECODER_INIT_SEED_SHIFT = 7919


class T5LMHead(MegatronModule):
    """``output_layer``: hidden -> vocabulary logits with a bias, its weight the word embedding
    unless untied."""

    def __init__(self, config, vocab_size, parallel_output, pre_process, share, tp_group):
        super().__init__(config)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=config.init_method,
            bias=True,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share,
            tp_group=tp_group,
        )

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor]):
        """[s, b, h] (or [s/TP, b, h] under sequence parallelism) -> logits [b, s, V/TP]."""
        if self.output_layer.sequence_parallel:
            logits, _ = self.output_layer(hidden_states, weight=weight)
            return logits.transpose(0, 1)
        logits, _ = self.output_layer(hidden_states.transpose(0, 1), weight=weight)
        return logits


class T5Model(LanguageModule):
    """embedding -> encoder; embedding -> decoder (cross-attending to the encoder output) ->
    lm_head [-> per-token cross entropy].

    State dict names are Megatron Core's: ``embedding.*`` (shared by both stacks),
    ``encoder.layers.N.*``, ``encoder.final_layernorm.*``, ``decoder.layers.N.{input_layernorm,
    self_attention, pre_cross_attn_layernorm, cross_attention.{linear_q, linear_kv, linear_proj},
    pre_mlp_layernorm, mlp}.*``, ``decoder.final_layernorm.*``, ``lm_head.output_layer.bias``
    (and ``.weight`` when untied).

    ``config.num_layers`` is the decoder's depth, ``encoder_config.num_layers`` the encoder's.
    Tensor and sequence parallelism work as in GPT; pipeline parallelism is refused (as in
    Megatron Core's T5).
    """

    TOP_LEVEL_EXTRA_STATE = ("lm_head.output_layer", "output_layer")
    # megatron-core's T5Model keeps the embedding's position table and the LM head's output
    # layer as attributes of its own.
    CHECKPOINT_ALIASES = (
        ("position_embeddings.weight", "embedding.position_embeddings.weight"),
        ("output_layer.bias", "lm_head.output_layer.bias"),
    )

    def __init__(
        self,
        config: TransformerConfig,
        encoder_config: TransformerConfig,
        transformer_encoder_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
        transformer_decoder_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules],
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
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        add_encoder: bool = True,
        add_decoder: bool = True,
        pg_collection=None,
    ):
        """megatron-core 0.16's arguments in its order. The layer specs are a layer's spec or a
        block's (``get_t5_encoder_with_local_block_spec(n)``); ``rotary_percent``,
        ``seq_len_interpolation_factor`` and the relative-attention sizes only concern position
        embeddings T5 does not use here."""
        del rotary_percent, seq_len_interpolation_factor
        del relative_attention_num_buckets, relative_attention_max_distance
        if not (add_encoder and add_decoder):
            raise ValueError("T5Model: add_encoder/add_decoder=False is not supported")
        if transformer_encoder_layer_spec is None or transformer_decoder_layer_spec is None:
            raise ValueError(
                "T5Model needs transformer_encoder_layer_spec and transformer_decoder_layer_spec, "
                "e.g. get_t5_encoder_with_local_block_spec(n) / "
                "get_t5_decoder_with_local_block_spec(n)"
            )
        config, pgs = adopt_group_sizes(config, pg_collection)
        encoder_config, _ = adopt_group_sizes(encoder_config, pgs)
        super().__init__(config)
        self.pg_collection = pgs
        if config.pipeline_model_parallel_size > 1 or not (pre_process and post_process):
            raise ValueError("Pipeline parallelism is not supported for T5.")
        if self.pg_collection.cp_size > 1:
            raise ValueError("T5 does not support context parallelism (--context-parallel-size)")
        if position_embedding_type != "learned_absolute":
            raise ValueError(
                f"T5 here uses learned absolute position embeddings, got "
                f"{position_embedding_type!r} (--position-embedding-type)"
            )
        self.tp_group = self.pg_collection.tp
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights

        with init_rng_scope(config.init_seed, EMBEDDING_INIT_KEY):
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size,
                max_sequence_length,
                position_embedding_type="learned_absolute",
                pg_collection=self.pg_collection,
            )
        self.encoder = TransformerBlock(
            encoder_config,
            transformer_encoder_layer_spec,
            pg_collection=self.pg_collection,
            num_layers=encoder_config.num_layers,
        )
        decoder_config = config
        if config.init_seed is not None:
            decoder_config = dataclasses.replace(
                config, init_seed=config.init_seed + _DECODER_INIT_SEED_SHIFT
            )
        self.decoder = TransformerBlock(
            decoder_config,
            transformer_decoder_layer_spec,
            pg_collection=self.pg_collection,
            num_layers=config.num_layers,
        )
        with init_rng_scope(config.init_seed, OUTPUT_LAYER_INIT_KEY):
            self.lm_head = T5LMHead(
                config,
                vocab_size,
                parallel_output,
                pre_process,
                share_embeddings_and_output_weights,
                self.tp_group,
            )
        self.setup_embeddings_and_output_layer()

    @property
    def output_layer(self):
        """The LM head's projection (LanguageModule's name for it)."""
        return self.lm_head.output_layer

    def set_input_tensor(self, input_tensor) -> None:
        if input_tensor is not None and not (
            isinstance(input_tensor, (list, tuple)) and all(t is None for t in input_tensor)
        ):
            raise ValueError("Pipeline parallelism is not supported for T5.")

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_padding_mask: torch.Tensor,
        decoder_padding_mask: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Encoder ids [b, s_enc], decoder ids [b, s_dec]; padding masks [b, s] (1 = token).

        The encoder attends to its real tokens, the decoder causally to itself (its pads follow
        its tokens, so a real token never sees one) and to the encoder's real tokens. Returns
        logits [b, s_dec, V/TP] without ``lm_labels``, else per-token losses [b, s_dec]."""
        del decoder_padding_mask  # the causal mask already hides the trailing pads
        key_mask = key_padding_mask(encoder_padding_mask)
        encoder_input = self.embedding(encoder_input_ids)
        encoder_output = self.encoder(encoder_input, attention_mask=key_mask)
        decoder_input = self.embedding(decoder_input_ids)
        decoder_output = self.decoder(
            decoder_input, attention_mask=None, context=encoder_output, context_mask=key_mask
        )
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        logits = self.lm_head(decoder_output, weight)
        if lm_labels is None:
            return logits
        return self.compute_language_model_loss(lm_labels, logits)
