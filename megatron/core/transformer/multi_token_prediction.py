"""Multi-token prediction (DeepSeek-V3's MTP; Megatron Core's ``multi_token_prediction``).

Depth k (1..D) predicts token i+k+1 at position i. It takes the previous depth's hidden states
h_{k-1} (h_0: the decoder's output, after its final norm) and the embedding of the input tokens
shifted left by k, and computes

    h_k = final_layernorm(transformer_layer(eh_proj([enorm(emb(x_{i+k})); hnorm(h_{k-1})])))

with the model's own embedding and output layer (shared, not copied). The block sits on the
last pipeline stage (the last virtual stage of the last pipeline rank); its parameters are
``mtp.layers.<k-1>.{enorm, hnorm, eh_proj, transformer_layer, final_layernorm}.*``, Megatron's
names.

The loss of depth k is the cross entropy against the labels shifted left by k, over the loss
mask shifted the same way (the last k positions of each sequence have no target: their mask is
0). Its mean over those tokens, times ``mtp_loss_scaling_factor / D``, is added to the model's
loss in backward only (:class:`MTPLossAutoScaler`, as Megatron does): the forward output is the
main head's. The token counts are those of the whole sequence (summed over context-parallel
ranks), so every layout trains the model of one process.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch

from megatron.core.device import compute_device
from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.utils import init_rng_scope, recompute

MTP_INIT_KEY = 3 << 20
"""Base of the init-RNG keys of the MTP layers (depth k uses MTP_INIT_KEY + k): apart from the
decoder layers' (their numbers) and the output layer's (1 << 20)."""


def mtp_layer_spec(transformer_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules]):
    """The transformer layer of each MTP depth: the decoder's last layer's spec (Megatron's
    ``get_gpt_mtp_block_spec``), so a MoE model's MTP layers are MoE layers."""
    if isinstance(transformer_layer_spec, TransformerBlockSubmodules):
        return transformer_layer_spec.layer_specs[-1]
    return transformer_layer_spec


def roll_tensor(tensor: torch.Tensor, shifts: int = -1, dims: int = -1, cp_group=None):
    """(``tensor`` shifted left by one along ``dims`` with a 0 entering at the sequence's end,
    its sum). Under context parallelism ``tensor`` holds this rank's two load-balanced chunks
    (chunk r and chunk 2*CP-1-r of the sequence): each chunk's new last entry is the first entry
    of the next chunk of the whole sequence, taken from the rank that holds it."""
    if shifts != -1:
        raise ValueError(f"roll_tensor shifts only by -1 (got {shifts})")
    dims = dims % tensor.dim()
    cp_size = C.group_size(cp_group)
    if cp_size == 1:
        rolled = torch.roll(tensor, shifts=-1, dims=dims)
        rolled.select(dims, -1).fill_(0)
        return rolled, rolled.sum()
    front, back = tensor.chunk(2, dim=dims)
    heads = torch.stack([front.select(dims, 0), back.select(dims, 0)]).contiguous()
    # Every rank's two chunk heads: [CP, 2, ...]; a few numbers per sequence.
    gathered = C.all_gather_along_first_dim(heads, cp_group).view(cp_size, *heads.shape)
    rank = C.group_rank(cp_group)
    # Chunk r is followed by chunk r+1 (the front chunk of rank r+1, or for the last rank its
    # own back chunk, chunk CP); chunk 2*CP-1-r by chunk 2*CP-r (rank r-1's back chunk), and
    # the sequence's last chunk (rank 0's back chunk) by nothing.
    front_next = gathered[rank + 1, 0] if rank + 1 < cp_size else gathered[rank, 1]
    back_next = gathered[rank - 1, 1] if rank > 0 else torch.zeros_like(gathered[0, 1])
    parts = []
    for chunk, following in ((front, front_next), (back, back_next)):
        rolled = torch.roll(chunk, shifts=-1, dims=dims)
        rolled.select(dims, -1).copy_(following)
        parts.append(rolled)
    rolled = torch.cat(parts, dim=dims)
    return rolled, rolled.sum()


# Megatron's name for the MTP losses' scaler: the same identity-with-a-gradient as the MoE
# auxiliary losses' (the scale is the main loss's factor, passed with each call).
MTPLossAutoScaler = MoEAuxLossAutoScaler


class MultiTokenPredictionLayer(MegatronModule):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj`` (column-parallel [2h -> h], no bias),
    ``transformer_layer`` and ``final_layernorm``."""

    def __init__(self, config, layer_spec: ModuleSpec, depth: int, pg_collection=None):
        super().__init__(config)
        pgs = resolve_pg_collection(config, pg_collection)
        self.tp_group = pgs.tp
        self.depth = depth
        self.enorm = build_norm(config, config.hidden_size, config.layernorm_epsilon)
        self.hnorm = build_norm(config, config.hidden_size, config.layernorm_epsilon)
        self.eh_proj = ColumnParallelLinear(
            config.hidden_size * 2,
            config.hidden_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            tp_group=self.tp_group,
        )
        # Megatron numbers an MTP layer's transformer layer by its depth (1, 2, ...).
        self.transformer_layer = build_module(
            layer_spec, config=config, layer_number=depth, pg_collection=pg_collection
        )
        self.final_layernorm = build_norm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states, decoder_input, attention_mask=None, rotary_pos_emb=None):
        """h_{k-1} and the shifted tokens' embedding, both [s, b, h] (or [s/TP, b, h] with
        sequence parallelism) -> h_k of the same shape."""
        combined = torch.cat((self.enorm(decoder_input), self.hnorm(hidden_states)), dim=-1)
        # With sequence parallelism eh_proj gathers the sequence: [s, b, h/TP] here.
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected, self.tp_group)
        if self.eh_proj.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected, self.tp_group)
        out, _ = self.transformer_layer(
            projected, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
        )
        return self.final_layernorm(out)


class MultiTokenPredictionBlock(MegatronModule):
    """The ``config.mtp_num_layers`` depths (``layers``), run in sequence.

    ``set_mtp_loss_scale`` (called by the schedule before each micro-batch) gives the factor the
    MTP losses take in backward; ``tracked`` holds this step's per-depth loss sums on this rank
    (each micro-batch's mean loss, summed over micro-batches), read and cleared by the trainer
    (:meth:`mtp_metrics`, :meth:`reset_mtp_metrics`)."""

    is_mtp_block = True
    """Checkpoints key its layers one by one (``mtp.layers.<k>.``, Megatron's layout)."""

    def __init__(self, config, layer_spec: ModuleSpec, pg_collection=None):
        super().__init__(config)
        num = config.mtp_num_layers
        if not num or num < 1:
            raise ValueError(f"MultiTokenPredictionBlock needs mtp_num_layers >= 1 (got {num})")
        pgs = resolve_pg_collection(config, pg_collection)
        self.cp_group = pgs.cp
        layers = []
        for depth in range(1, num + 1):
            with init_rng_scope(config.init_seed, MTP_INIT_KEY + depth):
                layers.append(MultiTokenPredictionLayer(config, layer_spec, depth, pg_collection))
        self.layers = torch.nn.ModuleList(layers)
        self.loss_scale: Union[float, torch.Tensor] = 1.0
        self.tracked: Optional[torch.Tensor] = None

    def set_mtp_loss_scale(self, scale) -> None:
        self.loss_scale = scale

    # -------------------------------------------------------------------- MoE in MTP layers
    def _moe_routers(self):
        for layer in self.layers:
            router = getattr(getattr(layer.transformer_layer, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                yield router

    def set_moe_aux_loss_scale(self, scale) -> None:
        for router in self._moe_routers():
            router.aux_loss_scale = scale

    def reset_moe_metrics(self) -> None:
        for router in self._moe_routers():
            router.tracked.clear()

    def moe_metrics(self, names: Sequence[str]) -> torch.Tensor:
        """[len(names), mtp_num_layers]: what each depth's router tracked (0 for a dense one)."""
        values = torch.zeros(
            len(names), len(self.layers), dtype=torch.float32, device=compute_device()
        )
        for depth, layer in enumerate(self.layers):
            router = getattr(getattr(layer.transformer_layer, "mlp", None), "router", None)
            if not isinstance(router, TopKRouter):
                continue
            for i, name in enumerate(names):
                if name in router.tracked:
                    values[i, depth] = router.tracked[name].to(values.device)
        return values

    # -------------------------------------------------------------------------- logging
    def mtp_metrics(self) -> torch.Tensor:
        """[mtp_num_layers] float32: this step's per-depth loss sums on this rank."""
        if self.tracked is None:
            return torch.zeros(len(self.layers), dtype=torch.float32, device=compute_device())
        return self.tracked.clone()

    def reset_mtp_metrics(self) -> None:
        self.tracked = None

    def _track(self, depth_index: int, value: torch.Tensor) -> None:
        if self.tracked is None:
            self.tracked = torch.zeros(len(self.layers), dtype=torch.float32, device=value.device)
        self.tracked[depth_index] += value.detach().float()

    # -------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        embedding: Callable,
        attention_mask=None,
        rotary_pos_emb=None,
    ) -> List[torch.Tensor]:
        """[h_1, ..., h_D] from the decoder's output h_0 and the input tokens [b, s];
        ``embedding(input_ids, position_ids)`` is the model's word embedding."""
        outputs = []
        for layer in self.layers:
            input_ids, _ = roll_tensor(input_ids, cp_group=self.cp_group)
            # MTP runs with RoPE or no position embedding: the embedding reads no positions.
            decoder_input = embedding(input_ids, None)
            args = (hidden_states, decoder_input, attention_mask, rotary_pos_emb)
            if self._recomputes():
                hidden_states = recompute(self.config, layer, *args, tp_group=layer.tp_group)
            else:
                hidden_states = layer(*args)
            outputs.append(hidden_states)
        return outputs

    def _recomputes(self) -> bool:
        """Megatron recomputes each depth with ``--recompute-granularity full`` and the uniform
        method (its 'block' method is not implemented for MTP and skips it, as here)."""
        config = self.config
        return (
            self.training
            and config.recompute_granularity == "full"
            and config.recompute_method == "uniform"
        )

    def attach_losses(
        self,
        hidden_states: torch.Tensor,
        mtp_hidden_states: Sequence[torch.Tensor],
        labels: torch.Tensor,
        loss_mask: Optional[torch.Tensor],
        head_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``hidden_states`` (the main head's input) with each depth's scaled loss attached for
        backward (:class:`MTPLossAutoScaler`), and the losses tracked for the log.

        ``head_losses(h, labels)`` is the main head's per-token loss [b, s] (output layer and
        cross entropy, the same function the model's loss uses); ``labels`` and ``loss_mask``
        are [b, s] (this rank's chunks under context parallelism)."""
        config = self.config
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        loss_mask = loss_mask.float()
        original_tokens = self._sequence_sum(loss_mask.sum())
        scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        for index, h in enumerate(mtp_hidden_states):
            labels, _ = roll_tensor(labels, cp_group=self.cp_group)
            loss_mask, local_tokens = roll_tensor(loss_mask, cp_group=self.cp_group)
            tokens = self._sequence_sum(local_tokens).clamp(min=1)
            losses = head_losses(h, labels)
            masked = losses * loss_mask.to(losses.dtype)
            mean_part = masked.sum() / tokens  # this rank's part of the sequence's mean
            self._track(index, mean_part)
            if config.calculate_per_token_loss:
                # The trainer divides every gradient by the main loss's token count; MTP's
                # fewer tokens are weighted as their own mean would be.
                attached = scale * masked * (original_tokens / tokens)
            else:
                attached = scale * masked / tokens
            hidden_states = MTPLossAutoScaler.apply(hidden_states, attached, self.loss_scale)
        return hidden_states

    def _sequence_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A count over this rank's tokens summed over the context-parallel ranks."""
        if C.group_size(self.cp_group) == 1:
            return value
        return C.all_reduce(value.detach().clone(), self.cp_group)
