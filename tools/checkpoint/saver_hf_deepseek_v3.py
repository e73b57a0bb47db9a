"""Saver plugin ``hf_deepseek_v3``: writes a Hugging Face ``DeepseekV3ForCausalLM`` directory
(config.json + safetensors in the per-expert layout of DeepSeek's released files, which
transformers' ``from_pretrained`` reads) from a model with multi-latent attention (and
``--qk-layernorm``, RMSNorm, SwiGLU, no biases) whose MoE layers, if any, follow the dense ones
and use the sigmoid router with shared experts.

A model that came from Hugging Face keeps its source's ``rope_interleave`` and token ids;
otherwise the RoPE rows are written interleaved, DeepSeek's layout. ``--mtp-num-layers`` depths
become layers ``num_hidden_layers + k`` as in DeepSeek's files (with copies of the embedding and
output layer; transformers itself ignores those layers).
"""

from __future__ import annotations

import sys

import hf_deepseek_v3
from hf_io import copy_tokenizer, dtype_name, write_weights
from protocol import MTP_LAYER, ConversionError, get_metadata, receive_model

from megatron.checkpointing.saved_args import saved_value


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face DeepSeek-V3 saver")
    group.add_argument(
        "--max-shard-size-gb", type=float, default=5.0, help="Largest safetensors file."
    )


# MLA flags named differently in MLATransformerConfig.
_MLA_CONFIG_NAMES = {
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def effective_mla(mla: dict) -> dict:
    """``md.mla`` with each unset flag replaced by what the model uses: MLATransformerConfig's
    default (Megatron-LM: --rope-type defaults to yarn under MLA)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    out = dict(mla)
    for name, value in mla.items():
        field = _MLA_CONFIG_NAMES.get(name, name)
        if value is None and field in defaults and field != "q_lora_rank":
            out[name] = defaults[field]
    return out


def _problems(md) -> list:
    """What DeepseekV3ForCausalLM cannot express, one phrase each."""
    if not getattr(md, "mla", None):
        return ["the attention is not multi-latent attention (--multi-latent-attention)"]
    mla = effective_mla(md.mla)
    problems = []
    if not mla.get("latent_norms"):
        problems.append("the latent norms are missing (--qk-layernorm)")
    if mla.get("rope_type") not in ("rope", "yarn"):
        problems.append(f"--rope-type {mla.get('rope_type')}")
    if mla.get("rope_type") == "rope" and mla.get("rotary_scaling_factor", 1.0) > 1.0:
        # Megatron scales the softmax by mscale(factor, mscale_all_dim)^2 under either rope type;
        # Hugging Face only under YaRN.
        if mla.get("mscale_all_dim"):
            problems.append(
                "--rope-type rope with --rotary-scaling-factor > 1 and --mscale-all-dim "
                "(a softmax scale Hugging Face applies only with YaRN)"
            )
    if md.position_embedding_type != "rope" or md.rotary_percent != 1.0:
        problems.append("position embeddings are not full RoPE")
    if md.normalization != "RMSNorm":
        problems.append(f"normalization is {md.normalization}")
    if not md.swiglu or md.linear_bias or md.qkv_bias:
        problems.append("the MLPs are not SwiGLU without biases")
    if md.num_experts:
        moe = getattr(md, "moe", None) or {}
        freq = moe.get("moe_layer_freq") or [1] * md.num_layers
        dense = freq.index(1) if 1 in freq else md.num_layers
        if not all(freq[dense:]):
            problems.append(f"the MoE layers {freq} do not all follow the dense ones")
        if moe.get("moe_router_score_function") != "sigmoid":
            problems.append("the router is not sigmoid (--moe-router-score-function sigmoid)")
        ffn = moe.get("moe_ffn_hidden_size") or md.ffn_hidden_size
        shared = moe.get("moe_shared_expert_intermediate_size") or 0
        if not shared or shared % ffn:
            problems.append(
                f"the shared expert width {shared} is not a positive multiple of the experts' {ffn}"
            )
        groups, group_topk = moe.get("moe_router_num_groups"), moe.get("moe_router_group_topk")
        if groups and (not group_topk or md.moe_router_topk != 2 * group_topk):
            problems.append(
                f"group-limited routing with topk {md.moe_router_topk} over {group_topk} groups "
                "(Hugging Face scores a group by its best 2 experts: topk must be 2 x group topk)"
            )
    a = md.checkpoint_args
    for name, flag in (
        ("layernorm_zero_centered_gamma", "--apply-layernorm-1p"),
        ("rotary_interleaved", "--rotary-interleaved"),
        ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm"),
        ("moe_shared_expert_gate", "--moe-shared-expert-gate"),
    ):
        if a is not None and saved_value(a, name, None):
            problems.append(f"it was trained with {flag}")
    return problems


def hf_config_kwargs(md, vocab: int) -> dict:
    """DeepseekV3Config's arguments for ``md``."""
    mla, moe = effective_mla(md.mla), getattr(md, "moe", None) or {}
    source = md.hf_config if isinstance(md.hf_config, dict) else {}
    if source.get("model_type") != "deepseek_v3":
        source = {}
    rope = {"rope_type": "default", "rope_theta": float(md.rotary_base)}
    if mla["rope_type"] == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": float(md.rotary_base),
            "factor": float(mla["rotary_scaling_factor"]),
            "original_max_position_embeddings": mla["yarn_original_max_position_embeddings"],
            "beta_fast": float(mla["yarn_beta_fast"]),
            "beta_slow": float(mla["yarn_beta_slow"]),
            "mscale": float(mla["mscale"]),
            "mscale_all_dim": float(mla["mscale_all_dim"]),
        }
        if mla.get("yarn_correction_range_round_to_int") is False:
            rope["truncate"] = False
    experts = md.num_experts
    freq = moe.get("moe_layer_freq") or [1] * md.num_layers
    topk = md.moe_router_topk if experts else 1
    ffn = moe.get("moe_ffn_hidden_size") or md.ffn_hidden_size
    return dict(
        vocab_size=vocab,
        hidden_size=md.hidden_size,
        intermediate_size=md.ffn_hidden_size,
        moe_intermediate_size=ffn,
        num_hidden_layers=md.num_layers,
        num_attention_heads=md.num_attention_heads,
        num_key_value_heads=md.num_attention_heads,
        n_shared_experts=(moe.get("moe_shared_expert_intermediate_size") or ffn) // ffn,
        n_routed_experts=experts or 1,
        routed_scaling_factor=float(moe.get("moe_router_topk_scaling_factor") or 1.0),
        kv_lora_rank=mla["kv_lora_rank"],
        q_lora_rank=mla["q_lora_rank"],
        qk_rope_head_dim=mla["qk_pos_emb_head_dim"],
        v_head_dim=mla["v_head_dim"],
        qk_nope_head_dim=mla["qk_head_dim"],
        n_group=moe.get("moe_router_num_groups") or 1,
        topk_group=moe.get("moe_router_group_topk") or 1,
        num_experts_per_tok=topk,
        # No MoE layer at all: every layer dense.
        first_k_dense_replace=freq.index(1) if experts and 1 in freq else md.num_layers,
        norm_topk_prob=True,  # Megatron's sigmoid router normalizes its top-k
        hidden_act="silu",
        max_position_embeddings=md.max_position_embeddings,
        rms_norm_eps=md.norm_epsilon,
        tie_word_embeddings=not md.output_layer,
        rope_parameters=rope,
        rope_interleave=source.get("rope_interleave", True),
        attention_bias=False,
        attention_dropout=md.attention_dropout or 0.0,
        num_nextn_predict_layers=md.mtp_num_layers or source.get("num_nextn_predict_layers", 0),
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        architectures=["DeepseekV3ForCausalLM"],
    )


class _MTPLayerView:
    """MTP depth k's transformer layer under the name of Hugging Face's layer L + k."""

    def __init__(self, t, layers: int, depth: int):
        self.t, self.src, self.dst = t, f"decoder.layers.{layers + depth}.", f"mtp.layers.{depth}."

    def __getitem__(self, name):
        return self.t[self.dst + MTP_LAYER + name[len(self.src) :]]


def _mtp_to_hf(t, mapping: dict, depth: int, out: dict) -> dict:
    """Hugging Face's layer ``L + depth`` (DeepSeek's MTP layout, with the copies of the
    embedding and output layer its files hold)."""
    layers = mapping["num_hidden_layers"]
    p, own = f"model.layers.{layers + depth}.", f"mtp.layers.{depth}."
    layer = hf_deepseek_v3.layer_to_hf(
        _MTPLayerView(t, layers, depth), mapping, layers + depth, fused_experts=False
    )
    layer[p + "enorm.weight"] = t[own + "enorm.weight"]
    layer[p + "hnorm.weight"] = t[own + "hnorm.weight"]
    layer[p + "eh_proj.weight"] = t[own + "eh_proj.weight"]
    layer[p + "shared_head.norm.weight"] = t[own + "final_layernorm.weight"]
    # Copies: safetensors refuses tensors that share memory.
    layer[p + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
    head = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    layer[p + "shared_head.head.weight"] = head.clone()
    return layer


def save_checkpoint(queue, args, alive=None):
    import torch
    import transformers

    md = get_metadata(queue, alive)
    problems = _problems(md)
    if problems:
        raise ConversionError(
            "the model cannot be written as DeepseekV3ForCausalLM: " + "; ".join(problems)
        )
    if not getattr(md, "moe", None) and md.num_experts:
        raise ConversionError("a Mixtral-style MoE cannot be written as DeepseekV3ForCausalLM")
    if md.norm_epsilon != hf_deepseek_v3.LATENT_NORM_EPS:
        print(
            f"WARNING: {hf_deepseek_v3.latent_eps_note(md.norm_epsilon)}",
            file=sys.stderr,
            flush=True,
        )
    t = receive_model(queue, md, not args.no_checking, alive)
    word = t["embedding.word_embeddings.weight"]
    vocab = md.true_vocab_size or word.shape[0]
    dtype = md.params_dtype if isinstance(md.params_dtype, torch.dtype) else torch.float32
    config = transformers.DeepseekV3Config(**hf_config_kwargs(md, vocab))
    mapping = config.to_dict()
    out = {"model.embed_tokens.weight": word[:vocab]}
    for i in range(md.num_layers):
        out.update(hf_deepseek_v3.layer_to_hf(t, mapping, i, fused_experts=False))
    out["model.norm.weight"] = t["decoder.final_layernorm.weight"]
    if md.output_layer:
        out["lm_head.weight"] = t["output_layer.weight"][:vocab]
    for k in range(md.mtp_num_layers or 0):
        out.update(_mtp_to_hf(t, mapping, k, out))
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    config.dtype = dtype_name(dtype)
    config.save_pretrained(args.save_dir)
    write_weights(args.save_dir, out, int(args.max_shard_size_gb * 2**30))
    copy_tokenizer(md.tokenizer_model, args.save_dir)
    print(
        f"saved a Hugging Face DeepseekV3ForCausalLM ({md.num_layers} layers, vocab {vocab}) "
        f"to {args.save_dir}"
    )
