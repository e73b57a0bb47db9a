"""Saver plugin ``hf_llama``: writes a Hugging Face Llama-family directory (``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM`` or, for an MoE model, ``MixtralForCausalLM``;
config.json + safetensors).

``--hf-model-type auto`` keeps the source's family when it came from Hugging Face, else picks
qwen2 for a model with q/k/v biases and llama otherwise.
"""

from __future__ import annotations

from hf_io import check_plain_checkpoint_args, copy_tokenizer, dtype_name, write_weights
from protocol import ConversionError, get_metadata, qkv_to_separate, receive_model

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face Llama-family saver")
    group.add_argument(
        "--hf-model-type",
        default="auto",
        choices=["auto", "llama", "mistral", "qwen2", "mixtral"],
        help="Architecture written to config.json.",
    )
    group.add_argument(
        "--max-shard-size-gb", type=float, default=5.0, help="Largest safetensors file."
    )


def choose_model_type(md, requested: str) -> str:
    source = md.hf_config.get("model_type") if isinstance(md.hf_config, dict) else None
    if requested == "auto":
        requested = source if source in _CLASSES else ("qwen2" if md.qkv_bias else "llama")
        if getattr(md, "num_experts", None):
            requested = "mixtral"
    if bool(getattr(md, "num_experts", None)) != (requested == "mixtral"):
        raise ConversionError(
            "a mixture-of-experts model is written as mixtral and only it "
            f"(--hf-model-type {requested})"
        )
    if md.qkv_bias and requested != "qwen2":
        raise ConversionError(
            f"a model with q/k/v biases (--add-qkv-bias) can only be written as qwen2, "
            f"not {requested} (--hf-model-type)"
        )
    if not md.qkv_bias and requested == "qwen2":
        raise ConversionError(
            "qwen2 has q/k/v biases but this model has none; use --hf-model-type llama"
        )
    return requested


def check_llama(md):
    problems = []
    if getattr(md, "mla", None):
        problems.append(
            "multi-latent attention (DeepSeek weights: tools/checkpoint/hf_deepseek_v3.py)"
        )
    if md.position_embedding_type != "rope" or md.rotary_percent != 1.0:
        problems.append("position embeddings are not full RoPE")
    if md.normalization != "RMSNorm":
        problems.append(f"normalization is {md.normalization} (Llama uses RMSNorm)")
    if not md.swiglu:
        problems.append("the MLP is not SwiGLU")
    if md.linear_bias:
        problems.append("linear layers have biases")
    moe = getattr(md, "moe", None) or {}
    if moe and (
        not all(moe.get("moe_layer_freq") or [1])
        or moe.get("moe_shared_expert_intermediate_size")
        or (moe.get("moe_ffn_hidden_size") or md.ffn_hidden_size) != md.ffn_hidden_size
        or moe.get("moe_router_score_function", "softmax") != "softmax"
        or moe.get("moe_router_enable_expert_bias")
        or moe.get("moe_router_num_groups")
    ):
        problems.append(
            "the MoE is not Mixtral's (dense layers, shared experts, a sigmoid or grouped "
            "router or an expert bias: DeepSeek-V3 models use --saver hf_deepseek_v3)"
        )
    if problems:
        raise ConversionError(
            "the model cannot be written as a Llama-family model: "
            + "; ".join(problems)
            + " (use --saver hf_gpt2 for GPT-2 models)"
        )
    check_plain_checkpoint_args(md, "Llama-family")


def save_checkpoint(queue, args, alive=None):
    import torch
    import transformers

    md = get_metadata(queue, alive)
    check_llama(md)
    model_type = choose_model_type(md, args.hf_model_type)
    t = receive_model(queue, md, not args.no_checking, alive)
    h, heads, groups, d, ffn = (
        md.hidden_size,
        md.num_attention_heads,
        md.num_query_groups,
        md.kv_channels,
        md.ffn_hidden_size,
    )
    word = t["embedding.word_embeddings.weight"]
    vocab = md.true_vocab_size or word.shape[0]
    dtype = md.params_dtype if isinstance(md.params_dtype, torch.dtype) else torch.float32
    out = {"model.embed_tokens.weight": word[:vocab]}
    for i in range(md.num_layers):
        s, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = qkv_to_separate(t[s + "self_attention.linear_qkv.weight"], heads, groups, d)
        out.update(
            {
                p + "input_layernorm.weight": t[s + "input_layernorm.weight"],
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": t[s + "self_attention.linear_proj.weight"],
                p + "post_attention_layernorm.weight": t[s + "pre_mlp_layernorm.weight"],
            }
        )
        if md.num_experts:
            moe = p + "block_sparse_moe."
            out[moe + "gate.weight"] = t[s + "mlp.router.weight"]
            for e in range(md.num_experts):
                x = f"{s}mlp.experts.local_experts.{e}."
                gate, up = t[x + "linear_fc1.weight"].chunk(2, dim=0)
                out[f"{moe}experts.{e}.w1.weight"] = gate
                out[f"{moe}experts.{e}.w3.weight"] = up
                out[f"{moe}experts.{e}.w2.weight"] = t[x + "linear_fc2.weight"]
        else:
            gate, up = t[s + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out[p + "mlp.gate_proj.weight"] = gate
            out[p + "mlp.up_proj.weight"] = up
            out[p + "mlp.down_proj.weight"] = t[s + "mlp.linear_fc2.weight"]
        if md.qkv_bias:
            qb, kb, vb = qkv_to_separate(t[s + "self_attention.linear_qkv.bias"], heads, groups, d)
            out.update(
                {
                    p + "self_attn.q_proj.bias": qb,
                    p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb,
                }
            )
    out["model.norm.weight"] = t["decoder.final_layernorm.weight"]
    if md.output_layer:
        out["lm_head.weight"] = t["output_layer.weight"][:vocab]
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}

    rope = {"rope_type": "default", "rope_theta": float(md.rotary_base)}
    if md.use_rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(md.rotary_base),
            "factor": float(md.rope_scaling_factor),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    source = (
        md.hf_config
        if isinstance(md.hf_config, dict) and md.hf_config.get("model_type") == model_type
        else {}
    )
    config_name, arch = _CLASSES[model_type]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=md.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=d,
        max_position_embeddings=md.max_position_embeddings,
        rms_norm_eps=md.norm_epsilon,
        hidden_act="silu",
        tie_word_embeddings=not md.output_layer,
        rope_parameters=rope,
        attention_dropout=md.attention_dropout or 0.0,
        architectures=[arch],
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
    )
    if model_type in ("mistral", "mixtral"):
        kwargs["sliding_window"] = source.get("sliding_window")
    if model_type == "mixtral":
        kwargs["num_local_experts"] = md.num_experts
        kwargs["num_experts_per_tok"] = md.moe_router_topk
    config = getattr(transformers, config_name)(**kwargs)
    config.dtype = dtype_name(dtype)
    config.save_pretrained(args.save_dir)
    write_weights(args.save_dir, out, int(args.max_shard_size_gb * 2**30))
    copy_tokenizer(md.tokenizer_model, args.save_dir)
    print(f"saved a Hugging Face {arch} ({md.num_layers} layers, vocab {vocab}) to {args.save_dir}")
