"""One pre-norm transformer layer, assembled from a spec, in [s, b, h].

    x = x + SelfAttention(input_layernorm(x))
    x = x + CrossAttention(pre_cross_attn_layernorm(x), context)     (encoder-decoder models)
    x = x + MLP(pre_mlp_layernorm(x))                                 (or a mixture of experts)

Which modules fill the slots is the spec's choice (:class:`TransformerLayerSubmodules`): GPT's
local spec is in ``megatron.core.models.gpt.gpt_layer_specs``.
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import IdentityOp, ModuleSpec, build_module
from megatron.core.transformer.utils import model_parallel_rng, recompute

SlotSpec = Union[ModuleSpec, type, None]


@dataclass
class TransformerLayerSubmodules:
    """The modules of a layer (Megatron Core's names, which are also the state-dict names).

    A norm slot left as ``IdentityOp`` has no norm; an attention or MLP slot left as None has no
    such block (GPT and BERT have no cross-attention). The modules are built with:

    * norms: ``(config=, hidden_size=, eps=)``;
    * attentions: ``(config=, layer_number=, pg_collection=)``; the mask type comes from the spec's
      params (``{"attn_mask_type": AttnMaskType.causal}`` for GPT, ``padding`` for BERT);
    * the MLP: ``(config=, pg_collection=)``.

    Attentions and the MLP return ``(output, bias or None)``; self-attention is called as
    ``(x, attention_mask=, rotary_pos_emb=)``, cross-attention as
    ``(x, attention_mask=context_mask, key_value_states=context)``, the MLP as ``(x)``.
    """

    input_layernorm: SlotSpec = IdentityOp
    """Norm before the self-attention."""
    self_attention: SlotSpec = None
    """Self-attention (None: no self-attention block)."""
    pre_cross_attn_layernorm: SlotSpec = IdentityOp
    """Norm before the cross-attention."""
    cross_attention: SlotSpec = None
    """Attention over the encoder output ``context`` (None: no cross-attention block)."""
    pre_mlp_layernorm: SlotSpec = IdentityOp
    """Norm before the MLP."""
    mlp: SlotSpec = None
    """MLP, or a mixture of experts (None: no MLP block)."""


class TransformerLayer(MegatronModule):
    """Each block is norm -> module -> bias-dropout-add. With
    ``apply_residual_connection_post_layernorm`` the residual branch starts from the norm's output
    instead of its input.

    ``layer_number`` is 1-based and global (pipeline stages pass their offset). With sequence
    parallelism the norms, dropout and residual adds run on this rank's [s/TP, b, h] slice.
    """

    def __init__(
        self,
        config,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection=None,
    ):
        super().__init__(config)
        self.submodules_config = submodules
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout

        # Built in this order (the order of the weights drawn from the layer's init generator).
        def norm(spec):
            return build_module(
                spec, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )

        def attention(spec):
            if spec is None:
                return None
            return build_module(
                spec, config=config, layer_number=layer_number, pg_collection=pg_collection
            )

        self.input_layernorm = norm(submodules.input_layernorm)
        self.self_attention = attention(submodules.self_attention)
        self.pre_cross_attn_layernorm = norm(submodules.pre_cross_attn_layernorm)
        self.cross_attention = attention(submodules.cross_attention)
        self.pre_mlp_layernorm = norm(submodules.pre_mlp_layernorm)
        self.mlp = (
            None
            if submodules.mlp is None
            else build_module(submodules.mlp, config=config, pg_collection=pg_collection)
        )

        self.residual_from_norm = config.apply_residual_connection_post_layernorm
        self.fp32_residual = config.fp32_residual_connection
        self.sequence_parallel = config.sequence_parallel
        modules = (
            config.recompute_modules if config.recompute_modules is not None else ["core_attn"]
        )
        selective = config.recompute_granularity == "selective"
        # 'mlp' checkpoints a dense MLP only; a MoE layer has 'moe', 'moe_act' and
        # 'shared_experts' (megatron-core's rule).
        is_moe = getattr(self.mlp, "router", None) is not None
        self.recompute_mlp = selective and "mlp" in modules and not is_moe
        # 'layernorm': the norms' outputs are freed once used and recomputed in backward.
        self.recompute_norms = selective and "layernorm" in modules
        if config.compile_transformer_layers:
            # Compiled on the first call. Parameters are graph inputs (torch.compile's default
            # for modules), so all layers of one shape share the graph instead of compiling
            # one each.
            self.compile()

    def _bias_dropout_add(self, output_with_bias, residual: torch.Tensor) -> torch.Tensor:
        output, bias = output_with_bias
        if self.fp32_residual and residual.dtype != torch.float32:
            residual = residual.float()
        dropout = self.training and self.hidden_dropout > 0.0
        # Under sequence parallelism each TP rank holds a different slice of the sequence.
        with model_parallel_rng(self.config, split_across_tp=dropout and self.sequence_parallel):
            return bias_dropout_add(
                output,
                bias,
                residual,
                self.hidden_dropout,
                self.training,
                fused=self.config.bias_dropout_fusion,
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        inference_context=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [s, b, h] -> (hidden_states [s, b, h], context), the pair that
        Megatron's TransformerLayer.forward returns.

        ``context`` [s_enc, b, h] and ``context_mask`` are the encoder output and its mask for
        the cross-attention; they are returned unchanged for the next layer.
        ``inference_context``: the KV cache during generation (see
        ``megatron.core.inference.contexts``); only the self-attention uses it (the cross-attention
        is given no cache: it reads ``context`` whole at every step).
        """
        if self.self_attention is not None:
            # Passed only when set, so attention modules without a KV cache keep working.
            cache = {} if inference_context is None else {"inference_context": inference_context}
            hidden_states = self._block(
                self.input_layernorm,
                lambda normed: self.self_attention(
                    normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb, **cache
                ),
                hidden_states,
            )
        if self.cross_attention is not None:
            hidden_states = self._block(
                self.pre_cross_attn_layernorm,
                lambda normed: self.cross_attention(
                    normed, attention_mask=context_mask, key_value_states=context
                ),
                hidden_states,
            )
        if self.mlp is not None:

            def mlp(normed):
                if self.recompute_mlp and self.training:
                    return recompute(self.config, self.mlp, normed)
                return self.mlp(normed)

            hidden_states = self._block(self.pre_mlp_layernorm, mlp, hidden_states)
        return hidden_states, context

    def _block(self, norm, module, hidden_states: torch.Tensor) -> torch.Tensor:
        """norm -> module -> bias-dropout-add; with 'layernorm' recompute the norm's output is
        freed once the module has used it and recomputed in backward."""
        norm_checkpoint = None
        if self.recompute_norms and self.training and torch.is_grad_enabled():
            norm_checkpoint = CheckpointWithoutOutput()
            normed = norm_checkpoint.checkpoint(norm, hidden_states)
        else:
            normed = norm(hidden_states)
        residual = normed if self.residual_from_norm else hidden_states
        output_with_bias = module(normed)
        hidden_states = self._bias_dropout_add(output_with_bias, residual)
        if norm_checkpoint is not None:
            norm_checkpoint.discard_output_and_register_recompute(output_with_bias[0])
        return hidden_states
