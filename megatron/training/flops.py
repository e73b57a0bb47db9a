"""FLOP counting for --log-throughput, as Megatron counts them for GPT models.

Per iteration, forward + backward (3x the forward), with 2 FLOPs per multiply-add:
    12 * B * s * L * h^2 * ( attention + mlp + logits )
    attention = (1 + g/a + s/h) * (d*a/h)     (QKV and output projections, scores and context)
    mlp       = (f/h) * experts_routed_to * (3/2 if SwiGLU else 1)
    logits    = V / (2 * L * h)
with B the global batch size, s the sequence length, L layers, h hidden size, a heads, g query
groups, d the head dimension (kv channels), f the FFN size and V the padded vocabulary. Like
Megatron, causal masking is not discounted, so the figure is comparable with Megatron's logs.
"""

from __future__ import annotations

import os
from typing import Optional

# Dense bf16 peak TFLOP/s per GPU (no sparsity), used for MFU when the device is recognised.
_PEAK_BF16_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "B200": 2250.0,
    "GB200": 2500.0,
    "L40S": 362.0,
    "A10": 125.0,
}


def num_floating_point_operations(args, batch_size: int) -> float:
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    kv_channels = args.kv_channels or args.hidden_size // heads
    query_ratio = kv_channels * heads / args.hidden_size
    experts_routed_to = 1 if not getattr(args, "num_experts", None) else args.moe_router_topk
    gated = 1.5 if args.swiglu else 1.0
    h, s, L = args.hidden_size, args.seq_length, args.num_layers
    return (
        12.0
        * batch_size
        * s
        * L
        * h
        * h
        * (
            (1 + groups / heads + s / h) * query_ratio
            + (args.ffn_hidden_size / h) * experts_routed_to * gated
            + args.padded_vocab_size / (2.0 * L * h)
        )
    )


def peak_tflops_per_device() -> Optional[float]:
    """Peak dense TFLOP/s of this device for MFU: $MEGATRON_PEAK_TFLOPS, else a known GPU's bf16
    peak."""
    override = os.environ.get("MEGATRON_PEAK_TFLOPS")
    if override:
        return float(override)
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key in sorted(_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return _PEAK_BF16_TFLOPS[key]
    return None
