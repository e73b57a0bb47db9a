"""Loader plugin ``hf_gpt2``: a Hugging Face GPT-2 directory (``GPT2LMHeadModel``).

GPT-2 stores its linear layers as ``Conv1D`` ([in, out], transposed here to Megatron's [out, in])
and its fused ``c_attn`` as [q; k; v] over all heads, regrouped here into Megatron's per-head
[q_i, k_i, v_i] layout. ``gelu_new`` is the tanh GeLU, which our MLP computes with the fused
bias-GeLU (``--bias-gelu-fusion``, on by default); exact ``gelu`` gets ``--no-bias-gelu-fusion``.
"""

from __future__ import annotations

from hf_io import HFWeights, has_tokenizer, hf_metadata, read_config
from protocol import ConversionError, put, put_metadata, qkv_from_separate

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face GPT-2 loader")
    group.add_argument(
        "--hf-dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="dtype of the converted weights (default: the dtype in config.json).",
    )


def metadata_from_config(config: dict, args, load_dir: str):
    if config.get("model_type") != "gpt2":
        raise ConversionError(
            f"{load_dir}/config.json has model_type {config.get('model_type')!r}; the hf_gpt2 "
            "loader reads 'gpt2' models (use --loader hf_llama for Llama, Mistral, Qwen2)"
        )
    act = config.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ConversionError(
            f"GPT-2 activation_function {act!r} is not supported (supported: {list(_ACTIVATIONS)})"
        )
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if config.get(key):
            raise ConversionError(f"GPT-2 option {key}=true is not supported by this framework")
    if config.get("scale_attn_weights", True) is False:
        raise ConversionError(
            "GPT-2 option scale_attn_weights=false is not supported by this framework"
        )
    h, heads = config["n_embd"], config["n_head"]
    tokenizer = load_dir if has_tokenizer(load_dir) else None
    return hf_metadata(
        config,
        args,
        tokenizer,
        model_type="GPT",
        num_layers=config["n_layer"],
        hidden_size=h,
        ffn_hidden_size=config.get("n_inner") or 4 * h,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=h // heads,
        seq_length=config.get("n_ctx") or config["n_positions"],
        max_position_embeddings=config["n_positions"],
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        norm_has_bias=True,
        linear_bias=True,
        qkv_bias=True,
        swiglu=False,
        activation=_ACTIVATIONS[act],
        output_layer=not config.get("tie_word_embeddings", True),
        hidden_dropout=config.get("resid_pdrop", 0.1),
        attention_dropout=config.get("attn_pdrop", 0.1),
    )


def load_checkpoint(queue, args, alive=None):
    config = read_config(args.load_dir)
    md = metadata_from_config(config, args, args.load_dir)
    weights = HFWeights(args.load_dir)
    prefix = "transformer." if weights.has("transformer.wte.weight") else ""
    h, ffn, V = md.hidden_size, md.ffn_hidden_size, md.true_vocab_size
    heads, d = md.num_attention_heads, md.kv_channels

    def w(name, shape=None):
        return weights.get(prefix + name, shape).to(md.params_dtype)

    put_metadata(queue, md, alive)
    put(
        queue,
        "embeddings",
        {
            "word embeddings": w("wte.weight", (V, h)),
            "position embeddings": w("wpe.weight", (md.max_position_embeddings, h)),
        },
        alive,
    )
    for i in range(md.num_layers):
        p = f"h.{i}."
        q, k, v = w(p + "attn.c_attn.weight", (h, 3 * h)).t().chunk(3, dim=0)
        qb, kb, vb = w(p + "attn.c_attn.bias", (3 * h,)).chunk(3, dim=0)
        put(
            queue,
            f"transformer layer {i}",
            {
                "input norm weight": w(p + "ln_1.weight", (h,)),
                "input norm bias": w(p + "ln_1.bias", (h,)),
                "qkv weight": qkv_from_separate(q, k, v, heads, heads, d),
                "qkv bias": qkv_from_separate(qb, kb, vb, heads, heads, d),
                "dense weight": w(p + "attn.c_proj.weight", (h, h)).t().contiguous(),
                "dense bias": w(p + "attn.c_proj.bias", (h,)),
                "post norm weight": w(p + "ln_2.weight", (h,)),
                "post norm bias": w(p + "ln_2.bias", (h,)),
                "mlp l0 weight": w(p + "mlp.c_fc.weight", (h, ffn)).t().contiguous(),
                "mlp l0 bias": w(p + "mlp.c_fc.bias", (ffn,)),
                "mlp l1 weight": w(p + "mlp.c_proj.weight", (ffn, h)).t().contiguous(),
                "mlp l1 bias": w(p + "mlp.c_proj.bias", (h,)),
            },
            alive,
        )
    put(
        queue, "final norm", {"weight": w("ln_f.weight", (h,)), "bias": w("ln_f.bias", (h,))}, alive
    )
    if md.output_layer:
        put(
            queue,
            "output layer",
            {"weight": weights.get("lm_head.weight", (V, h)).to(md.params_dtype)},
            alive,
        )
    put(queue, "done", None, alive)
