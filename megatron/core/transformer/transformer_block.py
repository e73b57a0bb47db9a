"""A stack of transformer layers plus the final norm; one pipeline stage's slice of the decoder."""

from typing import Optional

import torch

from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import init_rng_scope, recompute


class TransformerBlock(MegatronModule):
    """``layers`` (a ModuleList, indexed locally from 0 as in Megatron's state dicts) and, when
    this block ends the model (``post_process`` and ``post_layer_norm``), ``final_layernorm``.

    A pipeline stage passes ``num_layers`` (its share) and ``layer_number_offset`` (how many
    layers precede it) so each layer knows its global 1-based ``layer_number``. A stage without
    the embedding (``pre_process=False``) reads its input from :meth:`set_input_tensor`.
    """

    def __init__(
        self,
        config,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        num_layers: Optional[int] = None,
        layer_number_offset: int = 0,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection=None,
    ):
        super().__init__(config)
        num_layers = config.num_layers if num_layers is None else num_layers
        if num_layers < 0 or layer_number_offset < 0:
            raise ValueError(
                f"num_layers ({num_layers}) and layer_number_offset ({layer_number_offset}) "
                "must be >= 0"
            )
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.num_layers_per_pipeline_rank = num_layers
        self.layer_number_offset = layer_number_offset
        layers = []
        for i in range(num_layers):
            number = layer_number_offset + i + 1
            with init_rng_scope(config.init_seed, number):
                layers.append(
                    TransformerLayer(
                        config,
                        layer_number=number,
                        attn_mask_type=attn_mask_type,
                        pg_collection=pg_collection,
                    )
                )
        self.layers = torch.nn.ModuleList(layers)
        if post_process and post_layer_norm:
            self.final_layernorm = build_norm(config, config.hidden_size)
        else:
            self.final_layernorm = None
        self.input_tensor = None
        self.tp_group = resolve_pg_collection(config, pg_collection).tp

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The activation received from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    def _checkpointed(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states, _ = layer(
                    hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
                )
            return hidden_states

        return run

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        **kwargs,
    ) -> torch.Tensor:
        """[s, b, h] -> [s, b, h]. ``hidden_states`` is ignored when not ``pre_process``."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError(
                    "TransformerBlock without pre_process needs set_input_tensor() before forward"
                )
            hidden_states = self.input_tensor
        config = self.config
        if config.recompute_granularity == "full" and self.training:
            hidden_states = self._forward_full_recompute(
                hidden_states, attention_mask, rotary_pos_emb
            )
        else:
            for layer in self.layers:
                hidden_states, _ = layer(
                    hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def _forward_full_recompute(self, hidden_states, attention_mask, rotary_pos_emb):
        n = len(self.layers)
        k = self.config.recompute_num_layers
        # With --distribute-saved-activations each TP rank keeps 1/TP of every chunk input.
        distribute = bool(self.config.distribute_saved_activations)
        if self.config.recompute_method == "uniform":
            # Only the input of each chunk of k layers is kept; the chunk reruns in backward.
            for start in range(0, n, k):
                hidden_states = recompute(
                    self.config,
                    self._checkpointed(start, min(start + k, n)),
                    hidden_states,
                    attention_mask,
                    rotary_pos_emb,
                    tp_group=self.tp_group,
                    distribute_saved_activations=distribute,
                )
            return hidden_states
        for i, layer in enumerate(self.layers):  # 'block': the first k layers of this stage
            if i < k:
                hidden_states = recompute(
                    self.config,
                    self._checkpointed(i, i + 1),
                    hidden_states,
                    attention_mask,
                    rotary_pos_emb,
                    tp_group=self.tp_group,
                    distribute_saved_activations=distribute,
                )
            else:
                hidden_states, _ = layer(
                    hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
                )
        return hidden_states
