"""Self attention with one fused QKV projection (Megatron's grouped QKV layout).

``linear_qkv`` maps h -> ng * (np/ng + 2) * d. Its output rows are grouped per query group g:
[the np/ng query heads of g, the key head of g, the value head of g], each d wide. This is the
order of Megatron's checkpoints, and tensor parallelism shards whole groups: with TP ranks, rank
t holds groups [t * ng/TP, (t + 1) * ng/TP), i.e. a contiguous block of rows, and its np/TP query
heads. ``linear_proj`` is row-parallel over the same heads.

With ``attention_output_gate`` (``--attention-output-gate``, Qwen3-Next's gated attention) each
group's rows are [queries, gates, key, value] (the gates: one per query head, d wide) and the
attention output is multiplied by sigmoid(gate) before ``linear_proj``, as Megatron does.
"""

from typing import Optional, Tuple

import torch

from megatron.core.tensor_parallel import collectives as C
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.utils import recompute


class SelfAttention(MegatronModule):
    """linear_qkv -> [q_layernorm / k_layernorm] -> RoPE -> core_attention -> linear_proj."""

    def __init__(
        self,
        config,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection=None,
        qk_layernorm: bool = False,
    ):
        super().__init__(config)
        if qk_layernorm and not config.qk_layernorm:
            # QK-norm follows the config here; a spec asking for it must agree with it.
            raise ValueError(
                "the layer spec asks for QK layernorm (qk_layernorm=True) but "
                "config.qk_layernorm is False: set TransformerConfig(qk_layernorm=True)"
            )
        pg_collection = resolve_pg_collection(config, pg_collection)
        tp_group = pg_collection.tp
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_attention_head = config.kv_channels
        tp = config.tensor_model_parallel_size
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.output_gate = bool(config.attention_output_gate)
        gate_size = self.query_projection_size if self.output_gate else 0

        # Built in this order (the initialization draws depend on it) but registered as
        # megatron-core registers them: core_attention, linear_proj, linear_qkv, q/k layernorm.
        # Torch optimizers and Megatron's torch-format checkpoints pair state with parameters by
        # this registration order (see megatron/core/optimizer/param_order.py).
        linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            self.query_projection_size + gate_size + 2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias,
            gather_output=False,
            tp_comm_buffer_name="qkv",
            tp_group=tp_group,
        )
        # Muon orthogonalizes the Q, K and V parts of this weight apart (--muon-no-split-qkv).
        linear_qkv.weight.is_qkv = True
        q_layernorm = k_layernorm = None
        if config.qk_layernorm:
            q_layernorm = build_norm(config, self.hidden_size_per_attention_head)
            k_layernorm = build_norm(config, self.hidden_size_per_attention_head)
            # Replicated over TP but applied to this rank's heads only: like the norms under
            # sequence parallelism, their gradients are summed over TP (Megatron does the same
            # for q/k_layernorm in finalize_model_grads, with or without sequence parallelism).
            for param in (*q_layernorm.parameters(), *k_layernorm.parameters()):
                param.sequence_parallel = tp > 1
        core_attention = DotProductAttention(
            config, layer_number, attn_mask_type, pg_collection=pg_collection
        )
        linear_proj = RowParallelLinear(
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            tp_comm_buffer_name="proj",
            tp_group=tp_group,
        )
        self.core_attention = core_attention
        self.linear_proj = linear_proj
        self.linear_qkv = linear_qkv
        self.q_layernorm = q_layernorm
        self.k_layernorm = k_layernorm
        # --test-mode's replica checks (run_realtime_tests) compare over these groups.
        self._replica_groups = (("DP", pg_collection.dp), ("TP", tp_group))
        self.recompute_core_attention = (
            config.recompute_granularity == "selective"
            and "core_attn"
            in (config.recompute_modules if config.recompute_modules is not None else ["core_attn"])
        )

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, output_gate: bool = False):
        """Split the fused projection into q [s, b, ng, np/ng, d], k and v [s, b, ng, d] (views),
        and with ``output_gate`` the gate [s, b, ng, np/ng, d] after them.

        With sequence parallelism the input is [s/TP, b, h] and linear_qkv gathers it, so the
        sizes are read from its output.
        """
        mixed, _ = self.linear_qkv(hidden_states)
        s, b, _ = mixed.shape
        heads_per_group = (
            self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        )
        mixed = mixed.view(
            s,
            b,
            self.num_query_groups_per_partition,
            heads_per_group * (2 if self.output_gate else 1) + 2,
            self.hidden_size_per_attention_head,
        )
        # One split (its backward is a single cat) instead of three slices (each of whose
        # backward would zero-fill and copy a full-size gradient).
        gate = None
        if self.output_gate:
            query, gate, key, value = torch.split(
                mixed, [heads_per_group, heads_per_group, 1, 1], dim=3
            )
        else:
            query, key, value = torch.split(mixed, [heads_per_group, 1, 1], dim=3)
        key = key.squeeze(3)
        value = value.squeeze(3)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
            key = self.k_layernorm(key)
        if self.config.test_mode:
            self.run_realtime_tests()
        if output_gate:
            return query, key, value, gate
        return query, key, value

    @torch.no_grad()
    def run_realtime_tests(self) -> None:
        """``--test-mode`` (megatron-core's check): the Q and K layernorm parameters must be
        bitwise equal on every data-parallel and every tensor-parallel rank, which silent
        corruption (a bad checkpoint read, a corrupted transfer) would break. Without QK
        layernorm there is nothing to check. A mismatch ends the run naming the parameter."""
        if self.q_layernorm is None:
            return
        named = [
            (f"{norm_name}.{name}", param)
            for norm_name, norm in (
                ("q_layernorm", self.q_layernorm),
                ("k_layernorm", self.k_layernorm),
            )
            for name, param in norm.named_parameters()
        ]
        local = torch.stack([param.detach().float() for _, param in named])
        for parallelism, group in self._replica_groups:
            size = C.group_size(group)
            if size == 1:
                continue
            gathered = [torch.empty_like(local) for _ in range(size)]
            torch.distributed.all_gather(gathered, local, group=group)
            for other, theirs in enumerate(gathered):
                for (name, _), mine, its in zip(named, local, theirs):
                    if not torch.equal(mine, its):
                        raise RuntimeError(
                            f"--test-mode: layer {self.layer_number} {name} differs between "
                            f"{parallelism} ranks {other} and {C.group_rank(group)} "
                            f"(norm of the difference {torch.norm(mine - its).item():.3e})"
                        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
        inference_context=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [s, b, h] -> (output [s, b, h], bias or None).

        ``rotary_pos_emb``: None, a (cos, sin) pair from ``RotaryEmbedding.get_cos_sin`` or a
        Megatron angle table [s, 1, 1, rot] (for the positions of ``hidden_states``).
        ``inference_context``: a ``StaticInferenceContext`` during generation; the new tokens'
        keys and values join its cache and the queries attend over all cached tokens.
        """
        gate = None
        if self.output_gate:
            query, key, value, gate = self.get_query_key_value_tensors(hidden_states, True)
        else:
            query, key, value = self.get_query_key_value_tensors(hidden_states)
        s, b = key.shape[0], key.shape[1]
        if rotary_pos_emb is not None:
            interleaved = self.config.rotary_interleaved
            # Rotating the 5-d query view writes a fresh contiguous tensor, so the head merge
            # below is a view.
            query = apply_rotary_pos_emb(query, rotary_pos_emb, interleaved)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, interleaved)
        query = query.reshape(
            s, b, self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        )
        mask_type = None
        if inference_context is not None:
            if attention_mask is not None:
                raise ValueError("the KV cache (inference_context) builds its own attention mask")
            attention_mask = inference_context.attention_mask(s, key.device)
            key, value = inference_context.append_key_value(self.layer_number, key, value)
            if attention_mask is None and key.shape[0] != s:
                mask_type = AttnMaskType.no_mask  # one new token sees every cached one
        if self.recompute_core_attention and self.training:
            context = recompute(self.config, self.core_attention, query, key, value, attention_mask)
        else:
            context = self.core_attention(
                query, key, value, attention_mask, attn_mask_type=mask_type
            )
        if gate is not None:
            context = context * torch.sigmoid(gate.reshape(context.shape))
        return self.linear_proj(context)


class CrossAttention(MegatronModule):
    """Attention of the hidden states over ``key_value_states`` (the encoder output):
    linear_q -> core_attention -> linear_proj, with keys and values from linear_kv.

    ``linear_kv`` maps h -> ng * 2 * d with rows grouped per query group [key, value] (Megatron's
    layout); tensor parallelism shards whole groups like SelfAttention's ``linear_qkv``. With
    sequence parallelism both projections gather their own [s/TP, b, h] input."""

    def __init__(
        self,
        config,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        pg_collection=None,
    ):
        super().__init__(config)
        pg_collection = resolve_pg_collection(config, pg_collection)
        tp_group = pg_collection.tp
        if pg_collection.cp_size > 1:
            raise ValueError("cross-attention does not support context parallelism")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.hidden_size_per_attention_head = config.kv_channels
        tp = config.tensor_model_parallel_size
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        query_size = config.kv_channels * config.num_attention_heads
        kv_size = config.kv_channels * config.num_query_groups
        bias = config.add_bias_linear or config.add_qkv_bias
        # Built in this order (the initialization draws depend on it) but registered as
        # megatron-core registers them: core_attention, linear_proj, linear_q, linear_kv.
        linear_q = ColumnParallelLinear(
            config.hidden_size,
            query_size,
            config=config,
            init_method=config.init_method,
            bias=bias,
            gather_output=False,
            tp_group=tp_group,
        )
        linear_kv = ColumnParallelLinear(
            config.hidden_size,
            2 * kv_size,
            config=config,
            init_method=config.init_method,
            bias=bias,
            gather_output=False,
            tp_group=tp_group,
        )
        core_attention = DotProductAttention(
            config, layer_number, attn_mask_type, pg_collection=pg_collection
        )
        linear_proj = RowParallelLinear(
            query_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            tp_group=tp_group,
        )
        self.core_attention = core_attention
        self.linear_proj = linear_proj
        self.linear_q = linear_q
        self.linear_kv = linear_kv

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        rotary_pos_emb=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [sq, b, h], key_value_states [sk, b, h] -> (output [sq, b, h], bias)."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the encoder output)")
        query, _ = self.linear_q(hidden_states)
        sq, b, _ = query.shape
        d = self.hidden_size_per_attention_head
        query = query.view(sq, b, self.num_attention_heads_per_partition, d)
        mixed, _ = self.linear_kv(key_value_states)
        sk = mixed.shape[0]
        mixed = mixed.view(sk, b, self.num_query_groups_per_partition, 2, d)
        key, value = mixed.unbind(3)
        context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)
