"""Activation terms of a multi-latent attention layer for the theoretical memory report
(theoretical_memory.py): what its attention part saves for backward, and which attention path
keeps the s x s scores."""


def mla_attention_elements(args, sequence_parallel: bool = False):
    """(outside TP, inside TP before the split) elements per token that a multi-latent attention
    layer's attention part saves for backward, as the standard formula counts QKV's 2 and 4 (h
    wide). Outside: the input norm's input and the down projections' (shared) input; the q
    latent (q LoRA) as q_layernorm's input and q_up_proj's; the kv latent as kv_layernorm's input
    and kv_up_proj's. The latent is a view of kv_down's [r_kv + p] output, so that whole output
    stays (under sequence parallelism the scattered r_kv-wide chunk instead). Inside: the
    rotated query and key (n heads x qk_head_dim + qk_pos_emb_head_dim), kv_up_proj's output
    n x (qk_head_dim + v_head_dim), kept whole because the value is a view of it, and the output
    projection's input (n x v_head_dim). RoPE keeps only its cos/sin tables (no activation)."""
    h, n = args.hidden_size, args.num_attention_heads
    rank_q, rank_kv, pos = args.q_lora_rank, args.kv_lora_rank, args.qk_pos_emb_head_dim
    norms = bool(getattr(args, "qk_layernorm", False))
    outside = 2 * h
    if rank_q:
        outside += rank_q * (2 if norms else 1)
    outside += (rank_kv if sequence_parallel else rank_kv + pos) + (rank_kv if norms else 0)
    query = n * (args.qk_head_dim + pos)
    inside = 2 * query + n * (args.qk_head_dim + args.v_head_dim) + n * args.v_head_dim
    return outside, inside


def mla_head_dims_differ(args) -> bool:
    """Multi-latent attention with query/key heads (qk_head_dim + qk_pos_emb_head_dim) of
    another width than its value heads (v_head_dim), as DeepSeek-V3's 192 and 128."""
    return (
        bool(getattr(args, "multi_latent_attention", False))
        and args.qk_head_dim + args.qk_pos_emb_head_dim != args.v_head_dim
    )


def mla_takes_sdpa_math(args, device_type: str) -> bool:
    """Multi-latent attention whose value heads differ from its query/key heads takes SDPA
    (dot_product_attention), mask or not: on a CPU its math fallback, which keeps the
    probabilities; a GPU runs a kernel that keeps one statistic per query row."""
    return (
        mla_head_dims_differ(args)
        and device_type == "cpu"
        and getattr(args, "context_parallel_size", 1) == 1
    )
