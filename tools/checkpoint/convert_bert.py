"""``convert.py --model-type BERT``: BERT checkpoints between parallel layouts and to Hugging Face.

Supported: ``--loader core --saver core`` (a ``torch``-format checkpoint rewritten at
``--target-tensor-parallel-size`` / ``--target-pipeline-parallel-size`` /
``--target-num-virtual-stages-per-pipeline-rank``) and ``--loader core --saver
hf_megatron_bert`` (a transformers ``MegatronBertForPreTraining`` directory: config.json and
safetensors), and ``--loader hf_megatron_bert --saver core`` back. The Hugging Face model
applies one activation to the MLP and the LM head: the MLP must use the exact GeLU
(``--no-bias-gelu-fusion``; the fused bias-GeLU is the tanh approximation). Everything runs in
this process on the CPU: a BERT state dict is small next to the models the queue protocol of the
GPT plugins is built for.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import hf_megatron_bert
from protocol import ConversionError, padded_vocab_size, resize_vocab

from megatron.checkpointing.torch_format import TorchCheckpointReader, TorchCheckpointWriter

LOADERS = ("core", "hf_megatron_bert")
SAVERS = ("core", "hf_megatron_bert")
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.bias", "output_layer.weight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="BERT conversion")
    group.add_argument(
        "--target-tensor-parallel-size", type=int, default=None, help="TP of the saved model."
    )
    group.add_argument(
        "--target-pipeline-parallel-size", type=int, default=None, help="PP of the saved model."
    )
    group.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Model chunks per pipeline rank (interleaved schedule); default none.",
    )


def _read_core(load_dir: str):
    reader = TorchCheckpointReader(load_dir)
    args = reader.args
    if not any(name.startswith("encoder.layers.") for name in reader.names()):
        raise ConversionError(
            f"{load_dir} is not a BERT checkpoint (no encoder.layers.*); use --model-type GPT"
        )
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    state = {
        name: reader.tensor(name)
        for name in reader.names()
        if not (tied and name == "output_layer.weight")
    }
    return reader, args, state


def _save_core(args, reader, state, source_args) -> None:
    target = copy.copy(source_args)
    target.tensor_model_parallel_size = args.target_tensor_parallel_size or 1
    target.pipeline_model_parallel_size = args.target_pipeline_parallel_size or 1
    target.virtual_pipeline_model_parallel_size = args.target_num_virtual_stages_per_pipeline_rank
    target.num_virtual_stages_per_pipeline_rank = args.target_num_virtual_stages_per_pipeline_rank
    target.num_layers_per_virtual_pipeline_stage = None
    rows = state["embedding.word_embeddings.weight"].shape[0]
    divisible_by = getattr(source_args, "make_vocab_size_divisible_by", 128)
    target.padded_vocab_size = padded_vocab_size(
        rows, divisible_by, target.tensor_model_parallel_size
    )
    writer = TorchCheckpointWriter(
        args.save_dir,
        target,
        reader.checkpoint_iteration,
        reader.release,
        state["embedding.word_embeddings.weight"].dtype,
        reader.swiglu,
    )
    for name, tensor in state.items():
        if name in _VOCAB_ROWS:
            tensor = resize_vocab(tensor, target.padded_vocab_size)
        writer.add(name, tensor)
    writer.write()


def _save_hf(args, state, source_args) -> None:
    from hf_io import write_weights

    heads = source_args.num_attention_heads
    if getattr(source_args, "bias_gelu_fusion", False) and source_args.add_bias_linear:
        raise ConversionError(
            "the checkpoint's MLP uses the tanh-approximated GeLU (--bias-gelu-fusion, the "
            "default) and its LM head the exact one; MegatronBertForPreTraining has one "
            "activation for both: train with --no-bias-gelu-fusion to export"
        )
    if getattr(source_args, "num_query_groups", heads) != heads:
        raise ConversionError("MegatronBertForPreTraining has no grouped-query attention")
    if getattr(source_args, "normalization", "LayerNorm") != "LayerNorm" or getattr(
        source_args, "swiglu", False
    ):
        raise ConversionError("MegatronBertForPreTraining needs LayerNorm and a GeLU MLP")
    if "binary_head.weight" not in state:
        raise ConversionError(
            "the checkpoint has no binary head (--bert-no-binary-head); "
            "MegatronBertForPreTraining needs one"
        )
    tensors = hf_megatron_bert.core_to_hf(state, heads)
    vocab, hidden = tensors["bert.embeddings.word_embeddings.weight"].shape
    config = {
        "architectures": ["MegatronBertForPreTraining"],
        "model_type": "megatron-bert",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": source_args.num_layers,
        "num_attention_heads": heads,
        "intermediate_size": source_args.ffn_hidden_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": source_args.hidden_dropout,
        "attention_probs_dropout_prob": source_args.attention_dropout,
        "max_position_embeddings": source_args.max_position_embeddings,
        "type_vocab_size": 2,
        "initializer_range": getattr(source_args, "init_method_std", 0.02),
        "layer_norm_eps": source_args.layernorm_epsilon,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    }
    os.makedirs(args.save_dir, exist_ok=True)
    # The decoder weight is the word embedding (tied); the bias is saved under both names.
    tensors.pop("cls.predictions.decoder.weight")
    tensors.pop("cls.predictions.decoder.bias")
    write_weights(args.save_dir, tensors)
    with open(os.path.join(args.save_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _read_hf(load_dir: str):
    """(a reader-like source, Megatron args, core state) of a MegatronBertForPreTraining dir."""
    from hf_io import HFWeights, read_config

    from megatron.training.arguments import ArgumentValidationError, parse_args, validate_args

    config = read_config(load_dir)
    if config.get("model_type") != "megatron-bert" or config.get("hidden_act") != "gelu":
        raise ConversionError(
            f"{load_dir} is not a MegatronBertForPreTraining with GeLU (model_type "
            f"{config.get('model_type')!r}, hidden_act {config.get('hidden_act')!r})"
        )
    if config.get("type_vocab_size", 2) != 2:
        raise ConversionError(f"{load_dir}: type_vocab_size must be 2 (BERT's A/B segments)")
    weights = HFWeights(load_dir)
    state = {name: weights.get(name) for name in weights.keys()}
    flags = [
        "--num-layers", config["num_hidden_layers"], "--hidden-size", config["hidden_size"],
        "--ffn-hidden-size", config["intermediate_size"],
        "--num-attention-heads", config["num_attention_heads"],
        "--max-position-embeddings", config["max_position_embeddings"],
        "--seq-length", config["max_position_embeddings"],
        "--norm-epsilon", config.get("layer_norm_eps", 1e-12), "--no-bias-gelu-fusion",
        "--hidden-dropout", config.get("hidden_dropout_prob", 0.1),
        "--attention-dropout", config.get("attention_probs_dropout_prob", 0.1),
        "--micro-batch-size", 1, "--tokenizer-type", "NullTokenizer",
        "--vocab-size", config["vocab_size"],
        "--ckpt-format", "torch", "--skip-train",
    ]  # fmt: skip
    try:
        args = parse_args(argv=[str(f) for f in flags])
        args.world_size = 1
        args = validate_args(args)
    except (ArgumentValidationError, SystemExit) as exc:
        raise ConversionError(f"{load_dir}: the model does not fit the trainer's flags: {exc}")
    args.padded_vocab_size = config["vocab_size"]
    args.iteration = 0
    source = argparse.Namespace(checkpoint_iteration=0, release=True, swiglu=False)
    return source, args, hf_megatron_bert.hf_to_core(state, config["num_attention_heads"])


def convert(args) -> None:
    if args.loader not in LOADERS or args.saver not in SAVERS:
        raise ConversionError(
            f"--model-type BERT converts with --loader {'/'.join(LOADERS)} and --saver "
            f"{'/'.join(SAVERS)}; got --loader {args.loader} --saver {args.saver}"
        )
    if args.loader == "core":
        reader, source_args, state = _read_core(args.load_dir)
    else:
        if args.saver != "core":
            raise ConversionError("--loader hf_megatron_bert saves with --saver core")
        reader, source_args, state = _read_hf(args.load_dir)
    if args.saver == "core":
        _save_core(args, reader, state, source_args)
    else:
        _save_hf(args, state, source_args)
