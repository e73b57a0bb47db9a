"""One pre-norm transformer layer: x + Attn(LN(x)), then x + MLP(LN(x)), in [s, b, h]."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.utils import model_parallel_rng, recompute


class TransformerLayer(MegatronModule):
    """input_layernorm -> self_attention -> bias-dropout-add -> pre_mlp_layernorm -> mlp ->
    bias-dropout-add. With ``apply_residual_connection_post_layernorm`` the residual branch
    starts from the norm's output instead of its input.

    ``layer_number`` is 1-based and global (pipeline stages pass their offset). With sequence
    parallelism the norms, dropout and residual adds run on this rank's [s/TP, b, h] slice.
    """

    def __init__(
        self,
        config,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection=None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.input_layernorm = build_norm(config, config.hidden_size)
        self.self_attention = SelfAttention(
            config, layer_number, attn_mask_type, pg_collection=pg_collection
        )
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size)
        self.mlp = MLP(config, pg_collection=pg_collection)
        self.residual_from_norm = config.apply_residual_connection_post_layernorm
        self.fp32_residual = config.fp32_residual_connection
        modules = (
            config.recompute_modules if config.recompute_modules is not None else ["core_attn"]
        )
        selective = config.recompute_granularity == "selective"
        self.recompute_mlp = selective and "mlp" in modules
        # 'layernorm': the norms' outputs are freed once used and recomputed in backward.
        self.recompute_norms = selective and "layernorm" in modules

    def _bias_dropout_add(self, output_with_bias, residual: torch.Tensor) -> torch.Tensor:
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        if self.training and self.hidden_dropout > 0.0:
            # Under sequence parallelism each TP rank holds a different slice of the sequence.
            with model_parallel_rng(self.config, split_across_tp=self.config.sequence_parallel):
                output = F.dropout(output, p=self.hidden_dropout, training=True)
        if self.fp32_residual and residual.dtype != torch.float32:
            residual = residual.float()
        return residual + output

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, None]:
        """hidden_states [s, b, h] -> (hidden_states [s, b, h], context=None) as in Megatron."""
        norm_checkpoint = self._norm_checkpoint()
        normed = self._norm(self.input_layernorm, hidden_states, norm_checkpoint)
        residual = normed if self.residual_from_norm else hidden_states
        attention_output = self.self_attention(
            normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        hidden_states = self._bias_dropout_add(attention_output, residual)
        if norm_checkpoint is not None:
            norm_checkpoint.discard_output_and_register_recompute(attention_output[0])

        norm_checkpoint = self._norm_checkpoint()
        normed = self._norm(self.pre_mlp_layernorm, hidden_states, norm_checkpoint)
        residual = normed if self.residual_from_norm else hidden_states
        if self.recompute_mlp and self.training:
            mlp_output = recompute(self.config, self.mlp, normed)
        else:
            mlp_output = self.mlp(normed)
        hidden_states = self._bias_dropout_add(mlp_output, residual)
        if norm_checkpoint is not None:
            norm_checkpoint.discard_output_and_register_recompute(mlp_output[0])
        return hidden_states, None

    def _norm_checkpoint(self):
        if self.recompute_norms and self.training and torch.is_grad_enabled():
            return CheckpointWithoutOutput()
        return None

    @staticmethod
    def _norm(norm, hidden_states, norm_checkpoint):
        if norm_checkpoint is None:
            return norm(hidden_states)
        return norm_checkpoint.checkpoint(norm, hidden_states)
