"""Megatron's ``MambaLayer``: x = x + MambaMixer(norm(x)), in [s, b, h]."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.utils import model_parallel_rng

from .mamba_mixer import MambaMixer


class MambaLayer(MegatronModule):
    """``norm`` (the config's norm) then ``mixer`` (:class:`MambaMixer`), with the residual add
    and hidden dropout of a transformer layer. ``layer_number`` is 1-based and global. Called
    like a ``TransformerLayer`` (the attention-only arguments are ignored) and returns the same
    ``(hidden_states, context)`` pair, so a block can mix both."""

    def __init__(self, config, submodules=None, layer_number: int = 1, pg_collection=None):
        super().__init__(config)
        self.layer_number = layer_number
        self.norm = build_norm(config, config.hidden_size, config.layernorm_epsilon)
        self.mixer = MambaMixer(config, layer_number=layer_number, pg_collection=pg_collection)
        self.hidden_dropout = config.hidden_dropout

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        context: Optional[torch.Tensor] = None,
        context_mask=None,
        rotary_pos_emb=None,
        inference_context=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        residual = hidden_states
        out, bias = self.mixer(self.norm(hidden_states), inference_context=inference_context)
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0.0:
            with model_parallel_rng(self.config, split_across_tp=self.config.sequence_parallel):
                out = F.dropout(out, p=self.hidden_dropout, training=True)
        if self.config.fp32_residual_connection and residual.dtype != torch.float32:
            residual = residual.float()
        return residual + out, context
