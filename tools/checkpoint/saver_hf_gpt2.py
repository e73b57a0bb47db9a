"""Saver plugin ``hf_gpt2``: writes a Hugging Face ``GPT2LMHeadModel`` directory (config.json +
safetensors), loadable with ``transformers.GPT2LMHeadModel.from_pretrained(dir)``."""

from __future__ import annotations

from hf_io import check_plain_checkpoint_args, copy_tokenizer, dtype_name, write_weights
from protocol import ConversionError, get_metadata, qkv_to_separate, receive_model

_HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face GPT-2 saver")
    group.add_argument(
        "--max-shard-size-gb", type=float, default=5.0, help="Largest safetensors file."
    )


def check_gpt2(md):
    problems = []
    if getattr(md, "mla", None):
        problems.append(
            "multi-latent attention (DeepSeek weights: tools/checkpoint/hf_deepseek_v3.py)"
        )
    if md.position_embedding_type != "learned_absolute":
        problems.append(
            f"position embeddings are {md.position_embedding_type!r} (GPT-2 has learned ones)"
        )
    if md.normalization != "LayerNorm":
        problems.append(f"normalization is {md.normalization} (GPT-2 uses LayerNorm)")
    if md.swiglu or md.activation not in _HF_ACTIVATIONS:
        problems.append(f"the MLP uses {'SwiGLU' if md.swiglu else md.activation} (GPT-2: GeLU)")
    if not md.linear_bias:
        problems.append("linear layers have no biases (GPT-2 has them)")
    if md.num_query_groups != md.num_attention_heads:
        problems.append("grouped-query attention (GPT-2 is multi-head)")
    if md.kv_channels * md.num_attention_heads != md.hidden_size:
        problems.append("kv_channels * heads != hidden size")
    if problems:
        raise ConversionError(
            "the model cannot be written as GPT-2: "
            + "; ".join(problems)
            + " (use --saver hf_llama for Llama-style models)"
        )
    check_plain_checkpoint_args(md, "GPT-2")


def save_checkpoint(queue, args, alive=None):
    import torch
    from transformers import GPT2Config

    md = get_metadata(queue, alive)
    check_gpt2(md)
    t = receive_model(queue, md, not args.no_checking, alive)
    h, heads, d = md.hidden_size, md.num_attention_heads, md.kv_channels
    word = t["embedding.word_embeddings.weight"]
    vocab = md.true_vocab_size or word.shape[0]
    dtype = md.params_dtype if isinstance(md.params_dtype, torch.dtype) else torch.float32
    out = {
        "transformer.wte.weight": word[:vocab],
        "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
    }
    for i in range(md.num_layers):
        s, p = f"decoder.layers.{i}.", f"transformer.h.{i}."
        q, k, v = qkv_to_separate(t[s + "self_attention.linear_qkv.weight"], heads, heads, d)
        qb, kb, vb = qkv_to_separate(t[s + "self_attention.linear_qkv.bias"], heads, heads, d)
        out.update(
            {
                p + "ln_1.weight": t[s + "input_layernorm.weight"],
                p + "ln_1.bias": t[s + "input_layernorm.bias"],
                p + "attn.c_attn.weight": torch.cat([q, k, v], dim=0).t(),
                p + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
                p + "attn.c_proj.weight": t[s + "self_attention.linear_proj.weight"].t(),
                p + "attn.c_proj.bias": t[s + "self_attention.linear_proj.bias"],
                p + "ln_2.weight": t[s + "pre_mlp_layernorm.weight"],
                p + "ln_2.bias": t[s + "pre_mlp_layernorm.bias"],
                p + "mlp.c_fc.weight": t[s + "mlp.linear_fc1.weight"].t(),
                p + "mlp.c_fc.bias": t[s + "mlp.linear_fc1.bias"],
                p + "mlp.c_proj.weight": t[s + "mlp.linear_fc2.weight"].t(),
                p + "mlp.c_proj.bias": t[s + "mlp.linear_fc2.bias"],
            }
        )
    out["transformer.ln_f.weight"] = t["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = t["decoder.final_layernorm.bias"]
    if md.output_layer:
        out["lm_head.weight"] = t["output_layer.weight"][:vocab]
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}

    source = (
        md.hf_config
        if isinstance(md.hf_config, dict) and md.hf_config.get("model_type") == "gpt2"
        else {}
    )
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=md.max_position_embeddings,
        n_embd=h,
        n_layer=md.num_layers,
        n_head=heads,
        n_inner=None if md.ffn_hidden_size == 4 * h else md.ffn_hidden_size,
        activation_function=_HF_ACTIVATIONS[md.activation],
        layer_norm_epsilon=md.norm_epsilon,
        resid_pdrop=md.hidden_dropout,
        embd_pdrop=md.hidden_dropout,
        attn_pdrop=md.attention_dropout,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        tie_word_embeddings=not md.output_layer,
        architectures=["GPT2LMHeadModel"],
    )
    config.dtype = dtype_name(dtype)
    config.save_pretrained(args.save_dir)
    write_weights(args.save_dir, out, int(args.max_shard_size_gb * 2**30))
    copy_tokenizer(md.tokenizer_model, args.save_dir)
    print(
        f"saved a Hugging Face GPT-2 model ({md.num_layers} layers, vocab {vocab}) "
        f"to {args.save_dir}"
    )
