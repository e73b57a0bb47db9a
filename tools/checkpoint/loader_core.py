"""Loader plugin ``core``: our Megatron Core checkpoint (``--ckpt-format torch`` at any
TP/PP/virtual stages, its shards merged into full tensors; or ``torch_dist``, whose tensors are
already global) sent in the protocol of ``protocol.py``."""

from __future__ import annotations

import sys

from protocol import (
    MLA_FIELDS,
    MOE_FIELDS,
    ConversionError,
    layer_messages,
    mla_shapes,
    moe_message,
    mtp_message,
    new_metadata,
    put,
    put_metadata,
)

from megatron.checkpointing.saved_args import saved_value

MEGATRON_MODEL_TYPES = ("GPT", "MAMBA")  # --model-type values it converts


def add_arguments(parser):
    group = parser.add_argument_group(title="core loader")
    group.add_argument(
        "--true-vocab-size",
        type=int,
        default=None,
        help="Vocabulary size without padding; the padding rows are dropped. Default: the "
        "'true_vocab_size' the converter stored in the checkpoint's args, else keep all rows.",
    )
    group.add_argument(
        "--vocab-file",
        default=None,
        help="Alternative to --true-vocab-size: a GPT-2 vocab.json whose size is taken.",
    )
    group.add_argument(
        "--megatron-path", default=None, help="Prepended to sys.path (base of the framework)."
    )
    group.add_argument(
        "--position-embedding-type",
        default=None,
        help="Accepted for compatibility; the checkpoint's args decide.",
    )
    group.add_argument(
        "--loader-transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Accepted for compatibility: this framework's checkpoints use the local layer names.",
    )


def _true_vocab_size(args, ckpt_args):
    if args.true_vocab_size is not None and args.vocab_file is not None:
        raise ConversionError("give only one of --true-vocab-size and --vocab-file")
    if args.true_vocab_size is not None:
        return args.true_vocab_size
    if args.vocab_file is not None:
        import json

        try:
            with open(args.vocab_file) as f:
                return len(json.load(f))
        except (OSError, ValueError) as exc:
            raise ConversionError(f"--vocab-file {args.vocab_file}: {exc}") from None
    return getattr(ckpt_args, "true_vocab_size", None)


def metadata_from_args(a, true_vocab_size, tp, pp, iteration):
    if getattr(a, "squared_relu", False):
        raise ConversionError("--squared-relu checkpoints are not supported by the converter yet")
    if getattr(a, "num_experts", None) and (
        not getattr(a, "swiglu", False)
        or getattr(a, "add_bias_linear", True)
        or getattr(a, "moe_shared_expert_gate", False)
    ):
        raise ConversionError(
            "the converter handles MoE checkpoints with SwiGLU experts without biases and "
            "ungated shared experts only"
        )
    heads = a.num_attention_heads
    groups = a.num_query_groups if getattr(a, "group_query_attention", False) else heads
    swiglu = bool(getattr(a, "swiglu", False))
    linear_bias = bool(getattr(a, "add_bias_linear", True))
    if swiglu:
        activation = "silu"
    elif linear_bias and getattr(a, "bias_gelu_fusion", True):
        activation = "gelu_tanh"  # Megatron's fused bias-GeLU is the tanh approximation
    else:
        activation = "gelu"
    return new_metadata(
        model_type="GPT",
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=getattr(a, "kv_channels", None) or a.hidden_size // heads,
        seq_length=getattr(a, "seq_length", None),
        max_position_embeddings=a.max_position_embeddings,
        position_embedding_type=getattr(a, "position_embedding_type", "learned_absolute"),
        rotary_base=getattr(a, "rotary_base", 10000),
        rotary_percent=getattr(a, "rotary_percent", 1.0),
        use_rope_scaling=bool(getattr(a, "use_rope_scaling", False)),
        rope_scaling_factor=getattr(a, "rope_scaling_factor", 8.0),
        normalization=getattr(a, "normalization", "LayerNorm"),
        norm_epsilon=saved_value(a, "layernorm_epsilon", 1e-5),
        norm_has_bias=getattr(a, "normalization", "LayerNorm") == "LayerNorm",
        linear_bias=linear_bias,
        qkv_bias=linear_bias or bool(getattr(a, "add_qkv_bias", False)),
        swiglu=swiglu,
        activation=activation,
        output_layer=bool(getattr(a, "untie_embeddings_and_output_weights", False)),
        hidden_dropout=getattr(a, "hidden_dropout", 0.1),
        attention_dropout=getattr(a, "attention_dropout", 0.1),
        true_vocab_size=true_vocab_size,
        make_vocab_size_divisible_by=getattr(a, "make_vocab_size_divisible_by", 128),
        tokenizer_type=getattr(a, "tokenizer_type", None),
        tokenizer_model=getattr(a, "tokenizer_model", None),
        iteration=iteration,
        params_dtype=getattr(a, "params_dtype", None),
        bert_binary_head=False,
        previous_tensor_parallel_size=tp,
        previous_pipeline_parallel_size=pp,
        checkpoint_args=a,
        consumed_train_samples=getattr(a, "consumed_train_samples", 0),
        consumed_valid_samples=getattr(a, "consumed_valid_samples", 0),
        hf_config=getattr(a, "hf_config", None),
        num_experts=getattr(a, "num_experts", None),
        moe_router_topk=getattr(a, "moe_router_topk", None),
        mla=_mla_settings(a),
        moe=_moe_settings(a),
        mtp_num_layers=getattr(a, "mtp_num_layers", None) or None,
    )


def _moe_settings(a):
    """``md.moe`` of a checkpoint's args: its MoE flags (the layer pattern as one 0/1 per layer),
    or None without experts."""
    if not getattr(a, "num_experts", None):
        return None
    settings = {name: getattr(a, name, None) for name in MOE_FIELDS}
    freq = settings["moe_layer_freq"] or 1
    if not isinstance(freq, (list, tuple)):
        freq = [int(i % freq == 0) for i in range(a.num_layers)]
    settings["moe_layer_freq"] = [int(x) for x in freq]
    settings["moe_ffn_hidden_size"] = settings["moe_ffn_hidden_size"] or a.ffn_hidden_size
    return settings


def _mla_settings(a):
    """``md.mla`` of a checkpoint's args: its multi-latent attention flags, or None."""
    if not getattr(a, "multi_latent_attention", False):
        return None
    settings = {name: getattr(a, name, None) for name in MLA_FIELDS}
    settings["latent_norms"] = bool(getattr(a, "qk_layernorm", False))
    return settings


def send_model(queue, reader, md, alive=None) -> None:
    """Messages from any reader that returns full tensors by global name (torch or torch_dist)."""
    t = reader.tensor
    embeddings = {"word embeddings": t("embedding.word_embeddings.weight")}
    if md.position_embedding_type == "learned_absolute":
        embeddings["position embeddings"] = t("embedding.position_embeddings.weight")
    put(queue, "embeddings", embeddings, alive)
    for message, p, moe in layer_messages(md):
        msg = mtp_message(t, md, p) if p.startswith("mtp.") else {}
        msg |= {
            "input norm weight": t(p + "input_layernorm.weight"),
            "dense weight": t(p + "self_attention.linear_proj.weight"),
            "post norm weight": t(p + "pre_mlp_layernorm.weight"),
        }
        if md.mla:
            for name in mla_shapes(md):
                msg["mla " + name] = t(p + "self_attention." + name)
        else:
            msg["qkv weight"] = t(p + "self_attention.linear_qkv.weight")
        if md.norm_has_bias:
            msg["input norm bias"] = t(p + "input_layernorm.bias")
            msg["post norm bias"] = t(p + "pre_mlp_layernorm.bias")
        if md.qkv_bias and not md.mla:
            msg["qkv bias"] = t(p + "self_attention.linear_qkv.bias")
        if md.linear_bias:
            msg["dense bias"] = t(p + "self_attention.linear_proj.bias")
        if moe:
            msg.update(moe_message(t, md, p))
            put(queue, message, {k: v.clone() for k, v in msg.items()}, alive)
            continue
        msg["mlp l1 weight"] = t(p + "mlp.linear_fc2.weight")
        if md.linear_bias:
            msg["mlp l1 bias"] = t(p + "mlp.linear_fc2.bias")
        fc1 = t(p + "mlp.linear_fc1.weight")
        fc1_bias = t(p + "mlp.linear_fc1.bias") if md.linear_bias else None
        if md.swiglu:
            msg["mlp l0 weight W"], msg["mlp l0 weight V"] = fc1.chunk(2, dim=0)
            if fc1_bias is not None:
                msg["mlp l0 bias W"], msg["mlp l0 bias V"] = fc1_bias.chunk(2, dim=0)
        else:
            msg["mlp l0 weight"] = fc1
            if fc1_bias is not None:
                msg["mlp l0 bias"] = fc1_bias
        put(queue, message, {k: v.clone() for k, v in msg.items()}, alive)
    final = {"weight": t("decoder.final_layernorm.weight")}
    if md.norm_has_bias:
        final["bias"] = t("decoder.final_layernorm.bias")
    put(queue, "final norm", final, alive)
    if md.output_layer:
        put(queue, "output layer", {"weight": t("output_layer.weight")}, alive)
    put(queue, "done", None, alive)


def check_hybrid_model_type(args, a) -> bool:
    """Whether the checkpoint is a hybrid (Mamba) model, which --model-type must say."""
    from core_hybrid import is_hybrid

    hybrid = is_hybrid(a)
    wanted = getattr(args, "model_type", "GPT") == "MAMBA"
    if hybrid != wanted:
        raise ConversionError(
            f"{args.load_dir} is {'a hybrid (Mamba)' if hybrid else 'not a hybrid'} checkpoint "
            f"(hybrid_override_pattern in its args); use --model-type "
            f"{'MAMBA' if hybrid else 'GPT'}"
        )
    return hybrid


def load_checkpoint(queue, args, alive=None):
    if args.megatron_path:
        sys.path.insert(0, args.megatron_path)
    from megatron.checkpointing.dist_format import DistCheckpointReader
    from megatron.checkpointing.layout import detect_format, find_iteration_dir
    from megatron.checkpointing.torch_format import TorchCheckpointReader

    if detect_format(find_iteration_dir(args.load_dir)[0]) == "torch_dist":
        reader = DistCheckpointReader(args.load_dir)
    else:
        reader = TorchCheckpointReader(args.load_dir)
    a = reader.args
    rest = (
        _true_vocab_size(args, a),
        reader.tp,
        reader.pp,
        None if reader.release else reader.checkpoint_iteration,
    )
    if check_hybrid_model_type(args, a):
        from core_hybrid import hybrid_metadata_from_args, load_hybrid

        load_hybrid(queue, reader, hybrid_metadata_from_args(a, metadata_from_args, *rest), alive)
        return
    md = metadata_from_args(a, *rest)
    put_metadata(queue, md, alive)
    send_model(queue, reader, md, alive)
