"""Loader plugin ``hf_llama``: Hugging Face Llama-family directories (``model_type`` llama, mistral,
qwen2 or mixtral: Llama 2/3, Mistral, Qwen2/2.5, Mixtral): GQA, RoPE, SwiGLU, RMSNorm, tied or
untied output. Mixtral's sparse MLP (router ``block_sparse_moe.gate`` and experts w1 = gate,
w3 = up, w2 = down) becomes an MoE layer with ``num_local_experts`` experts, top
``num_experts_per_tok`` (softmax over the selected logits, as Mixtral renormalizes its top-k).

Hugging Face's Llama weights are already laid out for "rotate half" RoPE, which is also ours
(not ``--rotary-interleaved``), so q/k need no permutation; they are regrouped into Megatron's
per-group [q heads, k, v] QKV layout. Qwen2's q/k/v biases become ``--add-qkv-bias``.
"""

from __future__ import annotations

import sys

from hf_io import HFWeights, has_tokenizer, hf_metadata, read_config
from protocol import ConversionError, put, put_metadata, qkv_from_separate

MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
_LLAMA3_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face Llama-family loader")
    group.add_argument(
        "--hf-dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the converted weights (default: the dtype in config.json).",
    )


def rope_settings(config: dict):
    """(rotary_base, use_rope_scaling, rope_scaling_factor) from transformers 4 or 5 configs."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    params = {**legacy, **params}
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, False, 8.0
    if kind == "llama3":
        for key, value in _LLAMA3_DEFAULTS.items():
            if key in params and float(params[key]) != float(value):
                raise ConversionError(
                    f"llama3 RoPE scaling with {key}={params[key]} is not supported "
                    f"(this framework implements {key}={value})"
                )
        return base, True, float(params.get("factor", 8.0))
    raise ConversionError(
        f"RoPE scaling type {kind!r} is not supported (supported: default, llama3)"
    )


def metadata_from_config(config: dict, args, load_dir: str):
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConversionError(
            f"{load_dir}/config.json has model_type {model_type!r}; the hf_llama loader reads "
            f"{', '.join(MODEL_TYPES)} (use --loader hf_gpt2 for GPT-2)"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ConversionError(
            f"hidden_act {config.get('hidden_act')!r} is not supported (SwiGLU needs 'silu')"
        )
    if config.get("mlp_bias"):
        raise ConversionError("mlp_bias=true is not supported by this framework")
    if model_type == "llama" and config.get("attention_bias"):
        raise ConversionError(
            "Llama attention_bias=true (biases on q/k/v and o_proj) is not supported: this "
            "framework has either no linear biases or q/k/v biases only (Qwen2)"
        )
    h, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    max_pos = config["max_position_embeddings"]
    window = config.get("sliding_window")
    if (
        window is not None
        and (model_type != "qwen2" or config.get("use_sliding_window"))
        and window < max_pos
    ):
        print(
            f"WARNING: {model_type} sliding_window={window} is not implemented here; "
            "the converted model "
            f"attends to the whole sequence (identical for sequences up to {window} tokens)",
            file=sys.stderr,
        )
    base, scaling, factor = rope_settings(config)
    tokenizer = load_dir if has_tokenizer(load_dir) else None
    return hf_metadata(
        config,
        args,
        tokenizer,
        model_type="GPT",
        num_layers=config["num_hidden_layers"],
        hidden_size=h,
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=int(base) if float(base).is_integer() else base,
        rotary_percent=1.0,
        use_rope_scaling=scaling,
        rope_scaling_factor=factor,
        normalization="RMSNorm",
        norm_epsilon=config.get("rms_norm_eps", 1e-6),
        norm_has_bias=False,
        linear_bias=False,
        qkv_bias=model_type == "qwen2",
        swiglu=True,
        activation="silu",
        output_layer=not config.get("tie_word_embeddings", False),
        hidden_dropout=0.0,
        attention_dropout=config.get("attention_dropout", 0.0),
        num_experts=config["num_local_experts"] if model_type == "mixtral" else None,
        moe_router_topk=config["num_experts_per_tok"] if model_type == "mixtral" else None,
    )


def load_checkpoint(queue, args, alive=None):
    config = read_config(args.load_dir)
    md = metadata_from_config(config, args, args.load_dir)
    weights = HFWeights(args.load_dir)
    h, ffn, V = md.hidden_size, md.ffn_hidden_size, md.true_vocab_size
    heads, groups, d = md.num_attention_heads, md.num_query_groups, md.kv_channels

    def w(name, shape=None):
        return weights.get(name, shape).to(md.params_dtype)

    put_metadata(queue, md, alive)
    put(queue, "embeddings", {"word embeddings": w("model.embed_tokens.weight", (V, h))}, alive)
    for i in range(md.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        msg = {
            "input norm weight": w(p + "input_layernorm.weight", (h,)),
            "qkv weight": qkv_from_separate(
                w(a + "q_proj.weight", (heads * d, h)),
                w(a + "k_proj.weight", (groups * d, h)),
                w(a + "v_proj.weight", (groups * d, h)),
                heads,
                groups,
                d,
            ),
            "dense weight": w(a + "o_proj.weight", (h, heads * d)),
            "post norm weight": w(p + "post_attention_layernorm.weight", (h,)),
        }
        if md.num_experts:
            moe = p + "block_sparse_moe."
            msg["router weight"] = w(moe + "gate.weight", (md.num_experts, h))
            for e in range(md.num_experts):
                x = f"{moe}experts.{e}."
                msg[f"expert {e} l0 weight W"] = w(x + "w1.weight", (ffn, h))
                msg[f"expert {e} l0 weight V"] = w(x + "w3.weight", (ffn, h))
                msg[f"expert {e} l1 weight"] = w(x + "w2.weight", (h, ffn))
        else:
            msg["mlp l0 weight W"] = w(p + "mlp.gate_proj.weight", (ffn, h))
            msg["mlp l0 weight V"] = w(p + "mlp.up_proj.weight", (ffn, h))
            msg["mlp l1 weight"] = w(p + "mlp.down_proj.weight", (h, ffn))
        if md.qkv_bias:
            msg["qkv bias"] = qkv_from_separate(
                w(a + "q_proj.bias", (heads * d,)),
                w(a + "k_proj.bias", (groups * d,)),
                w(a + "v_proj.bias", (groups * d,)),
                heads,
                groups,
                d,
            )
        put(queue, f"transformer layer {i}", msg, alive)
    put(queue, "final norm", {"weight": w("model.norm.weight", (h,))}, alive)
    if md.output_layer:
        put(queue, "output layer", {"weight": w("lm_head.weight", (V, h))}, alive)
    put(queue, "done", None, alive)
