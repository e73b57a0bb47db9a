"""Core attention softmax(q k^T * scale + mask) v: torch's ``F.scaled_dot_product_attention``
(SDPA) or the unfused blocked attention of blocked_attention.py.

``config.attention_backend`` picks the kernel: 'flash'/'fused' always SDPA; 'unfused'/'local'
the unfused path wherever it applies (no mask tensor), SDPA elsewhere; 'auto' the unfused path
for fp32/fp64 inputs on CPU up to UNFUSED_AUTO_MAX_SEQ tokens, SDPA otherwise.

Inputs are in Megatron's [s, b, heads, d] layout; they are handed to SDPA as strided
[b, heads, s, d] views (no copies). SDPA's CPU and CUDA kernels return the output in the
query's memory order, so the final [s, b, heads * d] reshape is normally a view.

Precision (``--attention-softmax-in-fp32``, ``--apply-query-key-layer-scaling``): with fp16/bf16
inputs the unfused path computes the scores in the input dtype and the softmax in fp32 when
``config.attention_softmax_in_fp32`` is set, in the input dtype otherwise (Megatron's unfused
attention). With ``config.apply_query_key_layer_scaling`` it scales the score GEMM by an extra
1/layer_number, which keeps fp16 scores finite, and multiplies the fp32 scores back before the
softmax. SDPA's kernels (and ring attention, which merges its blocks in fp32) never hold the
scores in half precision: they accumulate the softmax in fp32 whatever the flag says, as the
fused kernels Megatron uses for those cases do, so the layer scaling's divide-and-multiply-back
would cancel exactly there and is not done. Half-precision inputs therefore take the unfused
path only when ``--attention-backend unfused``/``local`` asks for it.

Masks follow Megatron: a boolean ``attention_mask`` broadcastable to [b, 1, s, s] where True
means "masked out". With ``attention_mask=None`` the mask type decides: causal masks use SDPA's
``is_causal`` path (which skips the masked blocks), ``no_mask`` attends everywhere. Grouped-query
attention uses SDPA's ``enable_gqa`` (query head j reads key/value group j // (heads / groups),
Megatron's grouping), without repeating keys and values; the unfused path repeats them.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.process_groups import resolve_pg_collection
from megatron.core.transformer.blocked_attention import blocked_attention
from megatron.core.transformer.context_parallel import ring_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import model_parallel_rng

# 'auto' runs the unfused path on CPU up to this many tokens per sequence: measured 1.15-1.65x
# faster than SDPA's flash kernel at 256-1024 and only 1.03-1.14x at 2048 (fp32, head dim 64,
# benchmarks/attention_cpu.py). Its saved probabilities grow as seq^2, so longer sequences keep
# the flash kernel.
UNFUSED_AUTO_MAX_SEQ = 1024
_UNFUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class DotProductAttention(MegatronModule):
    """Scaled dot-product attention with dropout on the probabilities (no parameters)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        pg_collection=None,
    ):
        super().__init__(config)
        self.pg_collection = resolve_pg_collection(config, pg_collection)
        self.cp_group = self.pg_collection.cp
        self.cp_size = self.pg_collection.cp_size
        if self.cp_size > 1:
            # Every cp_comm_type (p2p, a2a, allgather, a2a+p2p over the hierarchical groups)
            # computes the same attention; here it always runs as the p2p ring over the whole
            # CP group (TransformerConfig checks the values, the start-up log names the ring).
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(
                    f"context parallelism supports causal attention only, got {attn_mask_type}"
                )
        if attn_mask_type not in (
            AttnMaskType.causal,
            AttnMaskType.no_mask,
            AttnMaskType.padding,
            AttnMaskType.arbitrary,
        ):
            raise ValueError(f"attention mask type {attn_mask_type} is not supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_dropout = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale
        self.softmax_in_fp32 = bool(config.attention_softmax_in_fp32)
        # Query-key layer scaling: the unfused path's score GEMM scales by softmax_scale /
        # layer_number and the fp32 softmax multiplies the scores back by layer_number.
        self.softmax_rescale = (
            float(self.layer_number) if config.apply_query_key_layer_scaling else 1.0
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
    ) -> torch.Tensor:
        """query [sq, b, np, d], key/value [sk, b, ng, d] -> context [sq, b, np * d]."""
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.cp_size > 1 and attention_mask is not None:
            raise ValueError(
                "explicit attention masks (--reset-attention-mask) are not supported with "
                "context parallelism (--context-parallel-size > 1)"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # Each TP rank holds different heads: their dropout masks come from per-rank streams.
        with model_parallel_rng(self.config, split_across_tp=dropout_p > 0.0):
            if self.cp_size > 1:
                return ring_attention(
                    query, key, value, self.cp_group, self.softmax_scale, dropout_p, self.training
                )
            if value.shape[-1] == key.shape[-1] and self._use_unfused(
                query, key, attention_mask, mask_type
            ):
                return blocked_attention(
                    query,
                    key,
                    value,
                    self.softmax_scale / self.softmax_rescale,
                    causal=mask_type == AttnMaskType.causal,
                    dropout_p=dropout_p,
                    softmax_in_fp32=self.softmax_in_fp32,
                    softmax_rescale=self.softmax_rescale,
                )
            return self._sdpa(query, key, value, attention_mask, mask_type, dropout_p)

    def _sdpa(self, query, key, value, attention_mask, mask_type, dropout_p) -> torch.Tensor:
        """torch's scaled_dot_product_attention on [b, heads, s, d] views -> [sq, b, np * d]."""
        sq, b, np_, _ = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        sdpa_mask = None
        is_causal = False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(
                    f"attention_mask must be a bool tensor (True = masked), "
                    f"got {attention_mask.dtype}"
                )
            sdpa_mask = ~attention_mask  # SDPA's boolean masks mean "may attend"
        elif mask_type == AttnMaskType.causal:
            if key.shape[0] != sq:
                raise ValueError(
                    f"causal attention without an explicit mask needs equal query and key lengths, "
                    f"got {sq} and {key.shape[0]}"
                )
            is_causal = True
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=sdpa_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != np_,
        )
        # [b, np, sq, dv] -> [sq, b, np * dv] (dv = d but for multi-latent attention)
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * v.shape[-1])

    def _use_unfused(self, query, key, attention_mask, mask_type) -> bool:
        """Whether the unfused path of blocked_attention.py runs this call (see the module doc).
        Keys and values of different widths (multi-latent attention) take SDPA."""
        maskless = attention_mask is None and (
            mask_type == AttnMaskType.no_mask
            or (mask_type == AttnMaskType.causal and key.shape[0] == query.shape[0])
        )
        return maskless and unfused_attention_runs(
            self.config.attention_backend, query.dtype, query.device.type, query.shape[0]
        )


def unfused_attention_runs(
    backend: str, dtype: torch.dtype, device_type: str, seq_length: int
) -> bool:
    """Whether a call without a mask tensor (causal over equal lengths, or no mask) takes the
    unfused path, by ``--attention-backend`` name, input dtype, device type and sequence length.

    The theoretical memory report asks the same question: only that path keeps the attention
    scores for backward (SDPA's kernels keep one row statistic per query)."""
    if backend in ("flash", "fused"):
        return False
    if backend in ("unfused", "local"):
        return dtype in _UNFUSED_DTYPES
    # 'auto' keeps half precision on SDPA (the unfused path was measured faster in fp32).
    return (
        dtype in (torch.float32, torch.float64)
        and device_type == "cpu"
        and seq_length <= UNFUSED_AUTO_MAX_SEQ
    )
