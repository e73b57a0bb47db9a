"""Reading and writing Hugging Face model directories without instantiating the model.

Read: ``config.json`` plus ``model.safetensors``, a sharded ``model.safetensors.index.json``, or
(older repos) ``pytorch_model.bin`` / its index, the latter with ``weights_only=True``. Tensors are
read one by one (safetensors memory-maps), so a conversion never holds two copies of the model.
Write: ``config.json`` through the ``transformers`` config class (so ``from_pretrained`` accepts
it), weights as safetensors shards with ``{"format": "pt"}`` metadata and an index when sharded,
and the tokenizer files found next to the source model.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterable, Optional

import torch
from protocol import ConversionError, new_metadata

from megatron.checkpointing.saved_args import saved_value

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def read_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise ConversionError(f"--load-dir {model_dir} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(
            f"{path} not found: --load-dir must be a Hugging Face model directory"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from None


def config_dtype(config: dict, override: Optional[str] = None) -> torch.dtype:
    name = override or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ConversionError(f"unsupported dtype {name!r} in config.json")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


class HFWeights:
    """Tensors of a Hugging Face directory by name; errors name the tensor and the directory."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._where: Dict[str, str] = {}
        self._open: Dict[str, object] = {}
        st_index = os.path.join(model_dir, "model.safetensors.index.json")
        bin_index = os.path.join(model_dir, "pytorch_model.bin.index.json")
        if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            self._add_file("model.safetensors")
        elif os.path.isfile(st_index):
            self._add_index(st_index)
        elif os.path.isfile(os.path.join(model_dir, "pytorch_model.bin")):
            self._add_file("pytorch_model.bin")
        elif os.path.isfile(bin_index):
            self._add_index(bin_index)
        else:
            raise ConversionError(
                f"{model_dir} holds no model.safetensors, model.safetensors.index.json or "
                "pytorch_model.bin"
            )

    def _add_index(self, path: str) -> None:
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ConversionError(f"{path} is not a valid weight index: {exc}") from None
        self._where.update(weight_map)
        for file in set(weight_map.values()):
            if not os.path.isfile(os.path.join(self.model_dir, file)):
                raise ConversionError(
                    f"{path} names {file}, which is missing from {self.model_dir}"
                )

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.model_dir, file)
            try:
                if file.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[file] = safe_open(path, framework="pt", device="cpu")
                else:
                    self._open[file] = torch.load(
                        path, map_location="cpu", weights_only=True, mmap=True
                    )
            except Exception as exc:  # truncated / foreign files
                raise ConversionError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        return self._open[file]

    def _add_file(self, file: str) -> None:
        handle = self._handle(file)
        for key in handle.keys():
            self._where[key] = file

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape=None) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(
                f"tensor '{name}' is missing from the Hugging Face checkpoint in {self.model_dir}"
            )
        handle = self._handle(self._where[name])
        tensor = handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise ConversionError(
                f"shape mismatch for '{name}' in {self.model_dir}: got {tuple(tensor.shape)}, "
                f"expected {tuple(shape)} (from config.json)"
            )
        return tensor


def write_weights(
    save_dir: str, tensors: Dict[str, torch.Tensor], max_shard_bytes: int = 5 * 2**30
) -> None:
    """safetensors shards (``model.safetensors`` when one is enough) plus the index when sharded."""
    from safetensors.torch import save_file

    os.makedirs(save_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(save_dir, file), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    with open(os.path.join(save_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def copy_tokenizer(source_dir: Optional[str], save_dir: str) -> None:
    if not source_dir or not os.path.isdir(source_dir):
        return
    for name in TOKENIZER_FILES:
        path = os.path.join(source_dir, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(save_dir, name))


def hf_metadata(config: dict, args, tokenizer: Optional[str], **model_fields):
    """Conversion metadata of an HF model: ``model_fields`` plus what every HF import shares
    (vocab from the config, a fresh run at TP=PP=1 with no Megatron training state)."""
    return new_metadata(
        **model_fields,
        true_vocab_size=config["vocab_size"],
        make_vocab_size_divisible_by=128,
        tokenizer_type="HuggingFaceTokenizer" if tokenizer else None,
        tokenizer_model=tokenizer,
        iteration=None,
        params_dtype=config_dtype(config, args.hf_dtype),
        bert_binary_head=False,
        previous_tensor_parallel_size=1,
        previous_pipeline_parallel_size=1,
        checkpoint_args=None,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        hf_config=config,
    )


def has_tokenizer(model_dir: str) -> bool:
    return any(
        os.path.isfile(os.path.join(model_dir, n))
        for n in ("tokenizer.json", "vocab.json", "tokenizer.model")
    )


def check_plain_checkpoint_args(md, target: str) -> None:
    """Options of our model that a Hugging Face architecture cannot express."""
    a = md.checkpoint_args
    if a is None:
        return
    for name, flag in (
        ("layernorm_zero_centered_gamma", "--apply-layernorm-1p"),
        ("qk_layernorm", "--qk-layernorm"),
        ("rotary_interleaved", "--rotary-interleaved"),
        ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm"),
        ("use_rotary_position_embeddings", None),
    ):
        if flag and saved_value(a, name, False):
            raise ConversionError(
                f"a model trained with {flag} cannot be written as a {target} model"
            )
