"""A hybrid model's FLOPs and parameters, layer by layer of its pattern.

FLOPs (2 per multiply-add, 3x the forward for forward and backward) per token: a Mamba layer's
in_proj (h x (2 d_in + 2 g n + heads)), the SSD scan (about 7 d_in n, Megatron's estimate) and
out_proj (d_in x h); an attention layer's QKV, scores, context and projection; an MLP layer's
two GEMMs (fc1 doubled with SwiGLU); a MoE layer's router-selected experts (top-k) and shared
expert; then the logits. Parameters are counted exactly per layer; the memory report's
``per_layer`` is their mean over the layers (the report multiplies it by the layers of a stage).
Activations use GPT's per-layer estimate (an upper bound for Mamba and single-block layers)."""

from __future__ import annotations

from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols
from megatron.training.theoretical_memory import ParameterCount, _mlp_size, _norm_size
from megatron.training.theoretical_memory import count_parameters as _gpt_parameters


def hybrid_pattern(args) -> str:
    return args.hybrid_layer_pattern or args.hybrid_override_pattern


def mamba_sizes(args):
    """(d_inner, heads, groups x state) of a Mamba layer."""
    heads = args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim
    return heads * args.mamba_head_dim, heads, args.mamba_num_groups * args.mamba_state_dim


def _layer_parameters(args, symbol: str, d_conv: int = 4) -> int:
    h = args.hidden_size
    if symbol == "M":
        d_in, heads, gn = mamba_sizes(args)
        conv_dim = d_in + 2 * gn
        in_proj = h * (2 * d_in + 2 * gn + heads)
        return _norm_size(args, h) + in_proj + conv_dim * (d_conv + 1) + 3 * heads + d_in + d_in * h
    gpt = _gpt_parameters(args, None)
    bias = bool(args.add_bias_linear)
    mlp = _mlp_size(h, args.ffn_hidden_size, args.swiglu, bias) + _norm_size(args, h)
    if symbol == "-":
        return mlp
    if symbol == "*":
        return gpt.per_layer - mlp
    if not getattr(args, "num_experts", None):
        raise ValueError("--hybrid-override-pattern has an E (MoE) layer but no --num-experts")
    return gpt.moe_layer - (gpt.per_layer - mlp) + _norm_size(args, h)


def count_parameters(args, padded_vocab_size) -> ParameterCount:
    count = _gpt_parameters(args, padded_vocab_size)
    symbols = layer_symbols(hybrid_pattern(args))
    total = sum(_layer_parameters(args, s) for s in symbols)
    count.per_layer, count.layers_remainder = divmod(total, len(symbols))
    count.per_layer_replicated = _norm_size(args, args.hidden_size)
    count.num_moe_layers = 0
    return count


def num_floating_point_operations(args, batch_size: int) -> float:
    h, s = args.hidden_size, args.seq_length
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    d = args.kv_channels or h // heads
    gated = 2 if args.swiglu else 1
    per_token = 0.0
    for symbol in layer_symbols(hybrid_pattern(args)):
        if symbol == "M":
            d_in, nheads, gn = mamba_sizes(args)
            per_token += 2 * h * (2 * d_in + 2 * gn + nheads) + 7 * d_in * args.mamba_state_dim
            per_token += 2 * d_in * h
        elif symbol == "*":
            per_token += 2 * h * d * (heads + 2 * groups) + 4 * s * d * heads + 2 * d * heads * h
        elif symbol == "-":
            per_token += 2 * h * args.ffn_hidden_size * (gated + 1)
        else:
            ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
            shared = getattr(args, "moe_shared_expert_intermediate_size", None) or 0
            per_token += 2 * h * args.num_experts
            per_token += 2 * h * (ffn * args.moe_router_topk + shared) * (gated + 1)
    per_token += 2 * h * args.padded_vocab_size
    return 3.0 * batch_size * s * per_token
