"""FLOP counting for --log-throughput, as Megatron counts them for GPT models.

Per iteration, forward + backward (3x the forward), with 2 FLOPs per multiply-add:
    12 * B * s * L * h^2 * ( attention + mlp + logits )
    attention = (1 + g/a + s/h) * (d*a/h)     (QKV and output projections, scores and context)
    mlp       = (L_dense * f + L_moe * (f_moe * k + f_shared)) / (L * h) * (3/2 if SwiGLU else 1)
    logits    = V / (2 * L * h)
with B the global batch size, s the sequence length, L layers (with ``--mtp-num-layers`` D
each multi-token-prediction depth adds a layer like the last one, its eh_proj and norms,
6 * B * s * (3h + 2h^2), and an output layer: logits times D + 1), h hidden size, a heads, g query
groups, d the head dimension (kv channels), f the FFN size and V the padded vocabulary. With
experts, L_moe of the layers (``--moe-layer-freq``) run k = ``--moe-router-topk`` experts of
width f_moe (``--moe-ffn-hidden-size``) and a shared expert of width f_shared per token; the
router's small GEMM (h x E) is not counted and causal masking is not discounted (the scores term
is s/h, not s/2h). Megatron's formula leaves out the router GEMM and counts the full score matrix
too, so the figure is comparable with Megatron's logs.

With multi-latent attention the attention term is replaced by its multiply-adds per token and
layer, M = q + kv + s*a*(dq + dv) + a*dv*h (6 * B * s * L * M FLOPs), where q = h*a*dq, or
r_q*(h + a*dq) with --q-lora-rank r_q; kv = h*(r_kv + p) + r_kv*a*(dn + dv); dq = dn + p
(--qk-head-dim dn, --qk-pos-emb-head-dim p), dv = --v-head-dim, r_kv = --kv-lora-rank. The norms
and RoPE are not counted; the full score matrix is, as above.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron.core.transformer.config_rules import linear_attention_pattern

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
    gated = 1.5 if args.swiglu else 1.0
    h, s = args.hidden_size, args.seq_length
    moe_layers = _num_moe_layers(args)
    # Multi-token prediction: each depth is one more layer like the model's last, an eh_proj
    # [2h -> h] and its norms, and one more output layer (Megatron's count).
    mtp = getattr(args, "mtp_num_layers", None) or 0
    if moe_layers and _last_layer_is_moe(args):
        moe_layers += mtp
    L = args.num_layers + mtp
    mlp_width = (L - moe_layers) * args.ffn_hidden_size
    if moe_layers:
        moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
        shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
        mlp_width += moe_layers * (moe_ffn * args.moe_router_topk + shared)
    if getattr(args, "multi_latent_attention", False):
        attention = mla_attention_macs(args) / (2.0 * h * h)
    else:
        attention = (1 + groups / heads + s / h) * query_ratio
        if getattr(args, "attention_output_gate", False):
            attention += 0.5 * query_ratio  # the gates' share of linear_qkv
    linear_layers = _num_linear_attention_layers(args)
    if linear_layers:
        # Gated delta net layers replace softmax attention in some layers (Megatron's count).
        attention = (
            (args.num_layers - linear_layers) * attention
            + linear_layers * gated_delta_net_macs(args) / (2.0 * h * h)
        ) / args.num_layers
    return (
        12.0
        * batch_size
        * s
        * L
        * h
        * h
        * (
            attention
            + mlp_width / (L * h) * gated
            + args.padded_vocab_size * (mtp + 1) / (2.0 * L * h)
        )
    ) + 6.0 * batch_size * s * mtp * (3 * h + 2 * h * h)


def mla_attention_macs(args) -> float:
    """Multiply-adds per token of one multi-latent attention layer's forward (module doc)."""
    h, a, s = args.hidden_size, args.num_attention_heads, args.seq_length
    dq = args.qk_head_dim + args.qk_pos_emb_head_dim
    dv = args.v_head_dim
    if args.q_lora_rank is None:
        q = h * a * dq
    else:
        q = args.q_lora_rank * (h + a * dq)
    kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
    kv += args.kv_lora_rank * a * (args.qk_head_dim + dv)
    return float(q + kv + s * a * (dq + dv) + a * dv * h)


def gated_delta_net_macs(args) -> float:
    """Multiply-adds per token of one gated delta net layer's forward, as Megatron counts them:
    in_proj, conv1d, the delta rule (4 products of the value-head size squared per head),
    out_proj."""
    h = args.hidden_size
    qk = args.linear_key_head_dim * args.linear_num_key_heads
    v = args.linear_value_head_dim * args.linear_num_value_heads
    nv = args.linear_num_value_heads
    return float(
        h * (2 * qk + 2 * v + 2 * nv)
        + args.linear_conv_kernel_dim * (2 * qk + v)
        + 4 * nv * args.linear_value_head_dim**2
        + h * v
    )


def _num_linear_attention_layers(args) -> int:
    if getattr(args, "experimental_attention_variant", None) != "gated_delta_net":
        return 0
    return sum(linear_attention_pattern(args.linear_attention_freq, args.num_layers))


def _num_moe_layers(args) -> int:
    if not getattr(args, "num_experts", None):
        return 0
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return sum(1 for v in freq if v)
    return len(range(0, args.num_layers, freq))


def _last_layer_is_moe(args) -> bool:
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, (list, tuple)):
        return bool(freq[-1])
    return (args.num_layers - 1) % freq == 0


def peak_tflops_per_device() -> Optional[float]:
    """Peak dense TFLOP/s of this device for MFU: $MEGATRON_PEAK_TFLOPS, else a known GPU's bf16
    peak."""
    override = os.environ.get("MEGATRON_PEAK_TFLOPS")
    if override:
        return float(override)
    import torch

    from megatron.core.device import compute_device

    device = compute_device()
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(_PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return _PEAK_BF16_TFLOPS[key]
    return None
