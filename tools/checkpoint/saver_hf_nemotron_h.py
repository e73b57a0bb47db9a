"""Saver plugin ``hf_nemotron_h`` (``--model-type MAMBA``): writes a Hugging Face
``NemotronHForCausalLM`` directory (config.json + safetensors, with the names and per-expert
layout that transformers' ``save_pretrained`` writes) from a hybrid model
(``protocol_hybrid.py``)."""

from __future__ import annotations

from hf_io import copy_tokenizer, dtype_name, write_weights
from hf_nemotron_h import (
    Shape,
    config_from_trainer_args,
    hf_from_megatron,
    trainer_args_from_config,
)
from protocol import ConversionError, get_metadata
from protocol_hybrid import receive_hybrid_model

MEGATRON_MODEL_TYPES = ("MAMBA",)


def add_arguments(parser):
    group = parser.add_argument_group(title="Hugging Face NemotronH saver")
    group.add_argument(
        "--max-shard-size-gb", type=float, default=5.0, help="Largest safetensors file."
    )


def _check(md) -> dict:
    """The trainer settings of ``md`` that NemotronH can express; ConversionError otherwise."""
    problems = []
    if md.normalization != "RMSNorm" or md.norm_has_bias:
        problems.append(f"normalization is {md.normalization} (NemotronH uses RMSNorm)")
    if md.activation != "squared_relu" or md.swiglu:
        problems.append("the MLPs are not squared ReLU (--squared-relu)")
    if md.linear_bias or md.qkv_bias:
        problems.append("linear layers have biases")
    if md.position_embedding_type not in ("none", None):
        problems.append(f"{md.position_embedding_type} position embeddings (NemotronH has none)")
    extra = md.hybrid_args or {}
    if md.num_experts and (
        extra.get("moe_router_score_function") != "sigmoid"
        or not extra.get("moe_router_enable_expert_bias")
        or not extra.get("moe_shared_expert_intermediate_size")
    ):
        problems.append(
            "the MoE layers are not NemotronH's (sigmoid router with --moe-router-enable-expert-"
            "bias and a shared expert)"
        )
    if problems:
        raise ConversionError("the model cannot be written as NemotronH: " + "; ".join(problems))
    a = dict(
        extra,
        hybrid_override_pattern=md.hybrid_override_pattern,
        hidden_size=md.hidden_size,
        ffn_hidden_size=md.ffn_hidden_size,
        num_attention_heads=md.num_attention_heads,
        num_query_groups=md.num_query_groups,
        kv_channels=md.kv_channels,
        norm_epsilon=md.norm_epsilon,
        untie_embeddings_and_output_weights=bool(md.output_layer),
        num_experts=md.num_experts,
        moe_router_topk=md.moe_router_topk,
    )
    if a.get("num_experts") and not a.get("moe_ffn_hidden_size"):
        a["moe_ffn_hidden_size"] = md.ffn_hidden_size
    config = config_from_trainer_args(a)
    trainer_args_from_config(config)  # what cannot come back (e.g. the group top-k) stops here
    return config


def save_checkpoint(queue, args, alive=None):
    import torch
    import transformers

    md = get_metadata(queue, alive)
    config = _check(md)
    ours = receive_hybrid_model(queue, md, not args.no_checking, alive)
    vocab = md.true_vocab_size or ours["embedding.word_embeddings.weight"].shape[0]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in ours:
            ours[name] = ours[name][:vocab]
    shape = Shape(
        md.hybrid_override_pattern,
        md.num_attention_heads,
        md.num_query_groups,
        md.kv_channels,
        md.num_experts or 0,
        per_expert_files=True,
    )
    try:
        hf = hf_from_megatron(ours, shape)
    except KeyError as exc:
        raise ConversionError(f"the model lacks the tensor {exc} NemotronH needs") from None
    dtype = md.params_dtype if isinstance(md.params_dtype, torch.dtype) else torch.float32
    # save_pretrained's names: the "backbone." prefix of NVIDIA's checkpoints
    out = {
        ("backbone." + k[len("model.") :] if k.startswith("model.") else k): v.to(dtype)
        for k, v in hf.items()
    }
    source = md.hf_config if isinstance(md.hf_config, dict) else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        if key in source:
            config[key] = source[key]
    config.setdefault("max_position_embeddings", md.max_position_embeddings)
    config.pop("model_type")
    hf_config = transformers.NemotronHConfig(vocab_size=vocab, **config)
    hf_config.dtype = dtype_name(dtype)
    hf_config.save_pretrained(args.save_dir)
    write_weights(args.save_dir, out, int(args.max_shard_size_gb * 2**30))
    copy_tokenizer(md.tokenizer_model, args.save_dir)
    print(
        f"saved a Hugging Face NemotronHForCausalLM ({md.num_layers} layers "
        f"{md.hybrid_override_pattern}, vocab {vocab}) to {args.save_dir}"
    )
