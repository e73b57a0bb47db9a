"""BERT weights between this code base (Megatron Core names, TP=1) and Hugging Face's
``MegatronBertForPreTraining``, the transformers class with Megatron's pre-norm BERT layer.

(Hugging Face's ``BertForPreTraining`` is the original post-norm BERT: a layer norm after each
residual add and one on the embeddings. Megatron's BERT normalizes before each block and has a
final norm, so its weights compute the same function only in ``MegatronBertForPreTraining``.)

The fused QKV weight holds, per head, its query, key and value rows (Megatron's grouped layout
with one query per group); Hugging Face keeps three matrices. Everything else is a rename.
"""

from __future__ import annotations

from typing import Dict

import torch

# core name after "encoder.layers.N." -> Hugging Face name after "bert.encoder.layer.N."
_LAYER_RENAMES = {
    "input_layernorm.weight": "attention.ln.weight",
    "input_layernorm.bias": "attention.ln.bias",
    "self_attention.linear_proj.weight": "attention.output.dense.weight",
    "self_attention.linear_proj.bias": "attention.output.dense.bias",
    "pre_mlp_layernorm.weight": "ln.weight",
    "pre_mlp_layernorm.bias": "ln.bias",
    "mlp.linear_fc1.weight": "intermediate.dense.weight",
    "mlp.linear_fc1.bias": "intermediate.dense.bias",
    "mlp.linear_fc2.weight": "output.dense.weight",
    "mlp.linear_fc2.bias": "output.dense.bias",
}
_RENAMES = {
    "embedding.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "encoder.final_layernorm.weight": "bert.encoder.ln.weight",
    "encoder.final_layernorm.bias": "bert.encoder.ln.bias",
    "pooler.dense.weight": "bert.pooler.dense.weight",
    "pooler.dense.bias": "bert.pooler.dense.bias",
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "output_layer.bias": "cls.predictions.bias",
    "binary_head.weight": "cls.seq_relationship.weight",
    "binary_head.bias": "cls.seq_relationship.bias",
}


def _num_layers(state: Dict[str, torch.Tensor], prefix: str) -> int:
    numbers = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    if numbers != set(range(len(numbers))):
        raise ValueError(f"layers under {prefix} are not numbered 0..N-1: {sorted(numbers)}")
    return len(numbers)


def core_to_hf(state: Dict[str, torch.Tensor], num_heads: int) -> Dict[str, torch.Tensor]:
    """A TP=1 BertModel state dict (tied output layer) -> MegatronBertForPreTraining's."""
    out = {}
    for core, hf in _RENAMES.items():
        if core in state:
            out[hf] = state[core].clone()
    word = state["embedding.word_embeddings.weight"]
    out["cls.predictions.decoder.weight"] = state.get("output_layer.weight", word).clone()
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    for n in range(_num_layers(state, "encoder.layers.")):
        core, hf = f"encoder.layers.{n}.", f"bert.encoder.layer.{n}."
        for src, dst in _LAYER_RENAMES.items():
            out[hf + dst] = state[core + src].clone()
        for kind in ("weight", "bias"):
            fused = state[f"{core}self_attention.linear_qkv.{kind}"]
            per_head = fused.reshape(num_heads, 3, fused.shape[0] // (3 * num_heads), -1)
            for i, name in enumerate(("query", "key", "value")):
                part = per_head[:, i].reshape(-1, *fused.shape[1:])
                out[f"{hf}attention.self.{name}.{kind}"] = part.clone()
    return out


def hf_to_core(state: Dict[str, torch.Tensor], num_heads: int) -> Dict[str, torch.Tensor]:
    """MegatronBertForPreTraining's state dict -> a TP=1 BertModel's (tied output layer); the
    decoder must equal the word embedding, as Megatron ties them."""
    word = state["bert.embeddings.word_embeddings.weight"]
    decoder = state.get("cls.predictions.decoder.weight")  # absent when saved tied
    if decoder is not None and not torch.equal(decoder, word):
        raise ValueError(
            "the checkpoint's output (decoder) weight differs from its word embedding; "
            "Megatron's BERT ties them"
        )
    out = {}
    for core, hf in _RENAMES.items():
        if hf in state:
            out[core] = state[hf].clone()
    for n in range(_num_layers(state, "bert.encoder.layer.")):
        core, hf = f"encoder.layers.{n}.", f"bert.encoder.layer.{n}."
        for src, dst in _LAYER_RENAMES.items():
            out[core + src] = state[hf + dst].clone()
        for kind in ("weight", "bias"):
            parts = [
                state[f"{hf}attention.self.{name}.{kind}"] for name in ("query", "key", "value")
            ]
            head = parts[0].shape[0] // num_heads
            stacked = torch.stack([p.reshape(num_heads, head, *p.shape[1:]) for p in parts], 1)
            out[f"{core}self_attention.linear_qkv.{kind}"] = stacked.reshape(
                -1, *parts[0].shape[1:]
            ).clone()
    return out
