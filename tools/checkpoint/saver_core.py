"""Saver plugin ``core``: writes our Megatron Core checkpoint (``--ckpt-format torch``) split for
``--target-tensor-parallel-size`` x ``--target-pipeline-parallel-size`` (optionally with virtual
stages), with an ``args`` Namespace holding the model flags the trainer must be given.

A checkpoint converted from Hugging Face is a ``release`` checkpoint (tracker ``release``,
directory ``release/``, no optimizer state), which the trainer loads as iteration 0 like a
``--finetune`` start. A Megatron -> Megatron reshard keeps the source's iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import sys

import torch
from protocol import ConversionError, get_metadata, padded_vocab_size, receive_model, resize_vocab

_DTYPE_FLAGS = {torch.bfloat16: ["--bf16"], torch.float16: ["--fp16"], torch.float32: [], None: []}


MEGATRON_MODEL_TYPES = ("GPT", "MAMBA")  # --model-type values it converts


def add_arguments(parser):
    group = parser.add_argument_group(title="core saver")
    group.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=None,
        help="TP of the saved checkpoint (default: the source's, or 1).",
    )
    group.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        default=None,
        help="PP of the saved checkpoint (default: the source's, or 1).",
    )
    group.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (interleaved schedule); default none.",
    )
    group.add_argument(
        "--target-expert-parallel-size",
        "--target-expert-model-parallel-size",
        dest="target_expert_parallel_size",
        type=int,
        default=1,
        help="EP of the saved checkpoint (MoE models: the experts are split over EP ranks).",
    )
    group.add_argument(
        "--target-make-vocab-size-divisible-by",
        type=int,
        default=None,
        help="Vocabulary padding multiple (times TP); default: the source's, or 128.",
    )
    group.add_argument(
        "--saver-transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Accepted for compatibility; checkpoints use the local layer names.",
    )


def model_flags(md, tp: int, pp: int, vpp, ep: int = 1) -> list:
    """The flags that build this model in our trainer (also what the user must pass)."""
    if md.activation == "silu" and not md.swiglu:
        raise ConversionError("a non-gated SiLU MLP is not supported by this framework")
    if md.activation == "gelu_tanh" and not md.linear_bias:
        raise ConversionError(
            "tanh-approximated GeLU without linear biases is not supported by this framework "
            "(its tanh GeLU is the fused bias-GeLU)"
        )
    flags = [
        "--num-layers",
        md.num_layers,
        "--hidden-size",
        md.hidden_size,
        "--ffn-hidden-size",
        md.ffn_hidden_size,
        "--num-attention-heads",
        md.num_attention_heads,
    ]
    if md.kv_channels != md.hidden_size // md.num_attention_heads:
        flags += ["--kv-channels", md.kv_channels]
    flags += mla_flags(getattr(md, "mla", None))
    if md.num_query_groups != md.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", md.num_query_groups]
    flags += [
        "--max-position-embeddings",
        md.max_position_embeddings,
        "--seq-length",
        md.seq_length or md.max_position_embeddings,
        "--position-embedding-type",
        md.position_embedding_type,
    ]
    if md.position_embedding_type == "rope":
        flags += ["--rotary-base", md.rotary_base, "--rotary-percent", md.rotary_percent]
        if md.use_rope_scaling:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", md.rope_scaling_factor]
    flags += ["--normalization", md.normalization, "--norm-epsilon", md.norm_epsilon]
    if md.swiglu:
        flags += ["--swiglu"]
    if md.activation == "squared_relu":
        flags += ["--squared-relu"]
    if not md.linear_bias:
        flags += ["--disable-bias-linear"]
        if md.qkv_bias:
            flags += ["--add-qkv-bias"]
    if md.activation == "gelu" and md.linear_bias:
        flags += [
            "--no-bias-gelu-fusion"
        ]  # exact GeLU; the fused bias-GeLU is the tanh approximation
    if md.output_layer:
        flags += ["--untie-embeddings-and-output-weights"]
    flags += [
        "--hidden-dropout",
        md.hidden_dropout if md.hidden_dropout is not None else 0.1,
        "--attention-dropout",
        md.attention_dropout if md.attention_dropout is not None else 0.1,
    ]
    if getattr(md, "num_experts", None):
        flags += ["--num-experts", md.num_experts, "--moe-router-topk", md.moe_router_topk]
        flags += moe_flags(getattr(md, "moe", None))
        flags += ["--expert-model-parallel-size", ep]
        if tp > 1:
            flags += ["--sequence-parallel"]  # MoE with TP needs it
    elif ep != 1:
        raise ConversionError("--target-expert-parallel-size > 1 needs a mixture-of-experts model")
    if getattr(md, "mtp_num_layers", None):
        flags += ["--mtp-num-layers", md.mtp_num_layers]
    flags += ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    if vpp:
        flags += ["--num-virtual-stages-per-pipeline-rank", vpp]
    flags += _DTYPE_FLAGS.get(md.params_dtype, [])
    if md.tokenizer_type:
        flags += ["--tokenizer-type", md.tokenizer_type]
        if md.tokenizer_model:
            flags += ["--tokenizer-model", md.tokenizer_model]
        # The vocabulary flags the tokenizer type needs (NullTokenizer's size, GPT-2's files),
        # as the trainer's checkpoint recorded them.
        saved = md.checkpoint_args
        for dest in ("vocab_size", "vocab_file", "merge_file"):
            value = getattr(saved, dest, None) if saved is not None else None
            if value is not None:
                flags += ["--" + dest.replace("_", "-"), value]
    return [str(f) for f in flags]


def mla_flags(mla) -> list:
    """The multi-latent attention flags of ``md.mla`` (none for ordinary attention)."""
    if not mla:
        return []
    flags = ["--multi-latent-attention"]
    for name, value in mla.items():
        if name == "latent_norms":
            flags += ["--qk-layernorm"] if value else []
        elif name == "yarn_correction_range_round_to_int":
            if value is not None:
                flags += ["--" + ("" if value else "no-") + name.replace("_", "-")]
        elif value is not None:
            flags += ["--" + name.replace("_", "-"), value]
    return flags


def moe_flags(moe) -> list:
    """The MoE flags of ``md.moe`` beyond --num-experts / --moe-router-topk (none for None)."""
    flags = []
    for name, value in (moe or {}).items():
        flag = "--" + name.replace("_", "-")
        if name == "moe_layer_freq":
            if any(not x for x in value):  # every layer MoE is the default (1)
                flags += [flag, "[" + ",".join(str(int(x)) for x in value) + "]"]
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, value]
    return flags


def build_args(
    md, flags: list, padded_vocab: int, divisible_by: int, iteration
) -> argparse.Namespace:
    """Validate the flags with the trainer's own parser, then keep the source's other args."""
    from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args

    # Batch flags only satisfy the validation: the interleaved schedule wants >= PP micro-batches,
    # and the EP ranks are data-parallel ranks of the dense layers (one micro-batch each).
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    ep_flag = "--expert-model-parallel-size"
    ep = int(flags[flags.index(ep_flag) + 1]) if ep_flag in flags else 1
    argv = flags + [
        "--make-vocab-size-divisible-by",
        str(divisible_by),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(pp * ep),
        "--skip-train",
        "--ckpt-format",
        "torch",
    ]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(argv=argv)
            tp = args.tensor_model_parallel_size
            args.world_size = tp * args.pipeline_model_parallel_size
            # EP ranks are data-parallel ranks of the dense layers: TP x PP x EP processes.
            args.world_size *= args.expert_model_parallel_size
            args = validate_args(args)
    except ArgumentValidationError as exc:
        raise ConversionError(
            f"the converted model does not fit the trainer's flags: {exc}"
        ) from None
    except SystemExit:
        raise ConversionError(f"the trainer's parser rejected the flags {' '.join(argv)}") from None
    if md.checkpoint_args is not None:
        merged = copy.copy(md.checkpoint_args)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "num_virtual_stages_per_pipeline_rank",
            "num_layers_per_virtual_pipeline_stage",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
            "make_vocab_size_divisible_by",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "sequence_parallel",
            "world_size",
            "data_parallel_size",
        ):
            if hasattr(args, name):
                setattr(merged, name, getattr(args, name))
        args = merged
    args.padded_vocab_size = padded_vocab
    args.true_vocab_size = md.true_vocab_size
    args.iteration = iteration or 0
    args.consumed_train_samples = md.consumed_train_samples or 0 if iteration else 0
    args.consumed_valid_samples = md.consumed_valid_samples or 0 if iteration else 0
    args.converted_model_flags = " ".join(flags)
    if md.hf_config is not None:
        args.hf_config = md.hf_config
    return args


def save_checkpoint(queue, args, alive=None):
    from megatron.checkpointing.torch_format import TorchCheckpointWriter

    md = get_metadata(queue, alive)
    ep = args.target_expert_parallel_size
    if ep < 1:
        raise ConversionError(f"--target-expert-parallel-size must be >= 1, got {ep}")
    tp = args.target_tensor_parallel_size or md.previous_tensor_parallel_size or 1
    pp = args.target_pipeline_parallel_size or md.previous_pipeline_parallel_size or 1
    vpp = args.target_num_virtual_stages_per_pipeline_rank
    vpp = vpp if vpp and vpp > 1 else None
    divisible_by = (
        args.target_make_vocab_size_divisible_by or md.make_vocab_size_divisible_by or 128
    )
    hybrid = md.model_type == "MAMBA"
    if hybrid:
        from protocol_hybrid import hybrid_flags, receive_hybrid_model

        flags = model_flags(md, tp, pp, vpp, ep) + hybrid_flags(md)
        tensors = receive_hybrid_model(queue, md, not args.no_checking, alive)
    else:
        flags = model_flags(md, tp, pp, vpp, ep)
        tensors = receive_model(queue, md, not args.no_checking, alive)

    source_rows = tensors["embedding.word_embeddings.weight"].shape[0]
    padded = padded_vocab_size(md.true_vocab_size or source_rows, divisible_by, tp)
    iteration = md.iteration or None
    margs = build_args(md, flags, padded, divisible_by, iteration)
    if hybrid:
        from core_hybrid import check_trainer_args

        check_trainer_args(margs)
    dtype = md.params_dtype if isinstance(md.params_dtype, torch.dtype) else torch.float32
    writer = TorchCheckpointWriter(
        args.save_dir,
        margs,
        iteration or 0,
        release=iteration is None,
        dtype=dtype,
        swiglu=bool(md.swiglu),
    )
    for name, tensor in tensors.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = resize_vocab(tensor, padded)
        writer.add(name, tensor)
    paths = writer.write()
    print(
        f"saved {len(paths)} checkpoint file(s) (TP={tp}, PP={pp}{f', VP={vpp}' if vpp else ''}"
        f"{f', EP={ep}' if ep > 1 else ''}, "
        f"padded vocab {padded}) to {args.save_dir}"
    )
    print(
        "train or load it with these model flags (plus your data, tokenizer and training flags"
        + (", and --finetune or --no-load-optim --no-load-rng" if iteration else "")
        + "):"
    )
    print(
        "  "
        + " ".join(flags)
        + f" --make-vocab-size-divisible-by {divisible_by} --ckpt-format torch "
        f"--load {args.save_dir}"
    )
    sys.stdout.flush()
