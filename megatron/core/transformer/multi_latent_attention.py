"""Multi-latent attention (MLA, DeepSeek-V2/V3), Megatron Core's ``MLASelfAttention``.

Per token, with n heads, query/key head size dq = qk_head_dim + qk_pos_emb_head_dim:

* queries: ``linear_q_proj`` h -> n*dq, or with ``q_lora_rank`` r_q the low-rank pair
  ``linear_q_down_proj`` h -> r_q, ``q_layernorm``, ``linear_q_up_proj`` r_q -> n*dq;
* keys/values: ``linear_kv_down_proj`` h -> r_kv + p gives the latent c (r_kv wide) and one
  positional key k_pe (p = qk_pos_emb_head_dim wide, shared by all heads); ``kv_layernorm`` on
  c, then ``linear_kv_up_proj`` r_kv -> n*(qk_head_dim + v_head_dim) gives each head's
  positionless key and its value;
* RoPE (or YaRN) rotates only the last p dims of each query head and k_pe; key = [k_nope, k_pe];
* core attention with softmax scale mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(dq),
  then ``linear_proj`` n*v_head_dim -> h (row-parallel).

The q/kv norms exist with ``config.qk_layernorm`` (Megatron's local spec; its Transformer Engine
spec fuses them into the up projections, see megatron_layout.py).

Tensor parallelism, as Megatron: the up projections and ``linear_q_proj`` are column-parallel
over heads, ``linear_proj`` row-parallel; the down projections are column-parallel over their
latent width and their outputs gathered across TP (with sequence parallelism the latents are
scattered back to the local sequence chunk before their norm, and the up projections gather
them again). k_pe is used by every rank's own heads only, so its gradient is summed across TP
(``copy_to_tensor_model_parallel_region``) before the down projection's backward.

Positions: the layer computes its own rotary tables (GPTModel builds none with MLA), for the full
sequence under sequence parallelism, this rank's two chunks under context parallelism, and from
the KV cache's offset during generation.

Generation: by default the KV cache holds each head's key and value. With ``cache_mla_latents``
it holds the normalized latent c and the rotated k_pe instead (r_kv + p numbers per token rather
than n * (dq + v_head_dim)), and every step up-projects the cached latents again.
"""

import math
from typing import Optional, Tuple

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.context_parallel import cp_chunk_indices
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.utils import recompute, selectively_recomputed
from megatron.core.transformer.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    yarn_get_mscale,
)


def mla_rotary_embedding(config) -> RotaryEmbedding:
    """The rotary embedding of the qk_pos_emb_head_dim dims, by ``config.rope_type``."""
    if config.rope_type == "rope":
        return RotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
        )
    if config.rope_type == "yarn":
        if config.rotary_interleaved:
            raise ValueError("YaRN (--rope-type yarn) does not support --rotary-interleaved")
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_base=config.rotary_base,
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
            mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int,
        )
    raise ValueError(
        f"multi-latent attention supports --rope-type 'rope' or 'yarn', got {config.rope_type!r}"
    )


class MLASelfAttention(MegatronModule):
    """Causal self-attention through compressed query and key/value latents (module doc)."""

    def __init__(
        self,
        config,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection=None,
        cp_comm_type: Optional[str] = None,
    ):
        super().__init__(config)
        if not getattr(config, "multi_latent_attention", False):
            raise ValueError("MLASelfAttention needs an MLATransformerConfig")
        del cp_comm_type  # the config's (checked by DotProductAttention)
        self.pg_collection = resolve_pg_collection(config, pg_collection)
        tp_group = self.pg_collection.tp
        self.tp_group = tp_group
        self.tp_size = self.pg_collection.tp_size
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        heads = config.num_attention_heads
        if heads % self.tp_size:
            raise ValueError(
                f"num_attention_heads {heads} is not divisible by the tensor-parallel size "
                f"{self.tp_size} (--tensor-model-parallel-size)"
            )
        self.num_attention_heads_per_partition = heads // self.tp_size
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.rotary_pos_emb = mla_rotary_embedding(config)
        mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_head_dim)

        def column(inp, out, name):
            return ColumnParallelLinear(
                inp,
                out,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                tp_comm_buffer_name=name,
                tp_group=tp_group,
            )

        # megatron-core's registration order (optimizer state and torch-format files pair with
        # parameters by it): core_attention, linear_proj, the q projections, kv down, kv up,
        # q_layernorm, kv_layernorm.
        self.core_attention = DotProductAttention(
            config,
            layer_number,
            attn_mask_type,
            softmax_scale=self.softmax_scale,
            pg_collection=self.pg_collection,
        )
        self.linear_proj = RowParallelLinear(
            heads * config.v_head_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            tp_comm_buffer_name="proj",
            tp_group=tp_group,
        )
        if config.q_lora_rank is None:
            self.linear_q_proj = column(config.hidden_size, heads * self.q_head_dim, "q_proj")
        else:
            self.linear_q_down_proj = column(config.hidden_size, config.q_lora_rank, "q_down_proj")
            self.linear_q_up_proj = column(config.q_lora_rank, heads * self.q_head_dim, "q_up_proj")
        self.linear_kv_down_proj = column(
            config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, "kv_down_proj"
        )
        self.linear_kv_up_proj = column(
            config.kv_lora_rank, heads * (config.qk_head_dim + config.v_head_dim), "kv_up_proj"
        )
        self.q_layernorm = self.kv_layernorm = None
        if config.qk_layernorm:
            if config.q_lora_rank is not None:
                self.q_layernorm = build_norm(config, config.q_lora_rank)
            self.kv_layernorm = build_norm(config, config.kv_lora_rank)
        self.recompute_core_attention = selectively_recomputed(config, "core_attn")
        self.recompute_up_proj = selectively_recomputed(config, "mla_up_proj")

    def _full_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """A down projection's output [s, b, width/TP] -> [s, b, width] on every rank (the local
        sequence chunk [s/TP, b, width] under sequence parallelism)."""
        if self.tp_size == 1:
            return latent
        return gather_from_tensor_model_parallel_region(latent, self.tp_group)

    def _to_sequence_chunk(self, latent: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(latent, self.tp_group)
        return latent

    def _rotary_tables(self, seq_len: int, dtype, device, inference_context):
        """(cos, sin) [s, 1, 1, p/2] for the positions of this rank's ``seq_len`` tokens."""
        if inference_context is not None:
            return self.rotary_pos_emb.get_cos_sin(
                seq_len, dtype, device, offset=inference_context.sequence_len_offset
            )
        cp_size = self.pg_collection.cp_size
        if cp_size == 1:
            return self.rotary_pos_emb.get_cos_sin(seq_len, dtype, device)
        cos, sin = self.rotary_pos_emb.get_cos_sin(seq_len * cp_size, dtype, device)
        index = cp_chunk_indices(seq_len, cp_size, self.pg_collection.cp_rank, cos.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def _query_latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The input of the query (up) projection: the normalized q latent with a q LoRA rank,
        else the hidden states."""
        if self.config.q_lora_rank is None:
            return hidden_states
        latent = self._to_sequence_chunk(
            self._full_latent(self.linear_q_down_proj(hidden_states)[0])
        )
        if self.q_layernorm is not None:
            latent = self.q_layernorm(latent)
        return latent

    def _rotated_query(self, q_latent, cos, sin) -> torch.Tensor:
        """Per-head queries [s, b, n/TP, dq + p] (s the full sequence under sequence parallelism)
        with the rotary embedding applied to their positional part."""
        cfg = self.config
        up = self.linear_q_proj if cfg.q_lora_rank is None else self.linear_q_up_proj
        query = up(q_latent)[0]
        s, b = query.shape[0], query.shape[1]
        query = query.view(s, b, self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_pe = torch.split(query, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        q_pe = apply_rotary_pos_emb(q_pe, (cos, sin), cfg.rotary_interleaved)
        return torch.cat([q_nope, q_pe], dim=-1)

    def _up_projections(self, q_latent, latent, k_pe, cos, sin):
        """(query, key, value) from the latents and the un-rotated k_pe: the part that
        'mla_up_proj' selective recompute repeats in backward."""
        query = self._rotated_query(q_latent, cos, sin)
        k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(2), (cos, sin), self.config.rotary_interleaved)
        key, value = self._keys_values(latent, k_pe.squeeze(2))
        return query, key, value

    def _packed_up_projections(self, q_latent, latent, k_pe, cos, sin) -> torch.Tensor:
        """:meth:`_up_projections` concatenated on the last dimension [s, b, n/TP, 2 dqk + v]."""
        return torch.cat(self._up_projections(q_latent, latent, k_pe, cos, sin), dim=-1)

    def _latents(self, hidden_states: torch.Tensor):
        """(normalized kv latent, un-rotated k_pe [s, b, p]); the latent is the local sequence
        chunk under sequence parallelism, k_pe the full sequence."""
        cfg = self.config
        combined = self._full_latent(self.linear_kv_down_proj(hidden_states)[0])
        latent, k_pe = torch.split(combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if self.tp_size > 1:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        latent = self._to_sequence_chunk(latent)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        return latent, k_pe

    def _keys_values(self, latent: torch.Tensor, k_pe: torch.Tensor):
        """Per-head keys [s, b, n/TP, dq] and values [s, b, n/TP, v] from the latents and the
        rotated k_pe [s, b, p]."""
        cfg = self.config
        kv = self.linear_kv_up_proj(latent)[0]
        kv = kv.view(*kv.shape[:2], self.num_attention_heads_per_partition, -1)
        k_nope, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.num_attention_heads_per_partition, -1)
        return torch.cat([k_nope, k_pe], dim=-1), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        inference_context=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [s, b, h] -> (output [s, b, h], bias or None)."""
        if rotary_pos_emb is not None:
            raise ValueError("multi-latent attention computes its own rotary embedding")
        cfg = self.config
        q_latent = self._query_latent(hidden_states)
        latent, k_pe = self._latents(hidden_states)
        s = k_pe.shape[0]  # the full sequence of this rank (also under sequence parallelism)
        cos, sin = self._rotary_tables(s, k_pe.dtype, k_pe.device, inference_context)

        mask_type = None
        up_proj_checkpoint = None
        if inference_context is None and self.recompute_up_proj and self.training:
            # Megatron's output-discarding checkpoint: query, key and value (one packed tensor,
            # so that one storage is freed) are dropped once core attention has used them and
            # recomputed from the latents when its output gradient arrives.
            up_proj_checkpoint = CheckpointWithoutOutput()
            packed = up_proj_checkpoint.checkpoint(
                self._packed_up_projections, q_latent, latent, k_pe, cos, sin
            )
            dqk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
            query, key, value = torch.split(packed, [dqk, dqk, cfg.v_head_dim], dim=-1)
        elif inference_context is None:
            query, key, value = self._up_projections(q_latent, latent, k_pe, cos, sin)
        else:
            query = self._rotated_query(q_latent, cos, sin)
            k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(2), (cos, sin), cfg.rotary_interleaved)
            k_pe = k_pe.squeeze(2)
            if attention_mask is not None:
                raise ValueError("the KV cache (inference_context) builds its own attention mask")
            attention_mask = inference_context.attention_mask(s, query.device)
            if cfg.cache_mla_latents:
                latent, k_pe = inference_context.append_key_value(self.layer_number, latent, k_pe)
                key, value = self._keys_values(latent, k_pe)
            else:
                key, value = self._keys_values(latent, k_pe)
                key, value = inference_context.append_key_value(self.layer_number, key, value)
            if attention_mask is None and key.shape[0] != s:
                mask_type = AttnMaskType.no_mask  # one new token sees every cached one
        if self.recompute_core_attention and self.training:
            context = recompute(cfg, self.core_attention, query, key, value, attention_mask)
        else:
            context = self.core_attention(
                query, key, value, attention_mask, attn_mask_type=mask_type
            )
        if up_proj_checkpoint is not None:
            up_proj_checkpoint.discard_output_and_register_recompute(context)
        return self.linear_proj(context)
