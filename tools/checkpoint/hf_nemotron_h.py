"""Hybrid Mamba models <-> Hugging Face ``NemotronHForCausalLM`` state dicts (TP=1, PP=1).

Megatron's names (``MambaModel``) against transformers' (``model.`` prefix; older checkpoints
use ``backbone.``, read too):

* ``embedding.word_embeddings.weight`` <-> ``model.embeddings.weight``;
* a Mamba layer (``M``): ``norm.weight`` <-> ``norm.weight``, and the mixer's tensors under the
  same names on both sides (``mixer.in_proj.weight`` [z, x, B, C, dt], ``mixer.conv1d.*``,
  ``mixer.dt_bias``, ``mixer.A_log``, ``mixer.D``, ``mixer.norm.weight``,
  ``mixer.out_proj.weight``);
* an attention layer (``*``): ``input_layernorm.weight`` <-> ``norm.weight``, Megatron's grouped
  ``self_attention.linear_qkv.weight`` <-> ``mixer.{q,k,v}_proj.weight``,
  ``self_attention.linear_proj.weight`` <-> ``mixer.o_proj.weight``;
* an MLP layer (``-``, squared ReLU, no gate): ``pre_mlp_layernorm.weight`` <-> ``norm.weight``,
  ``mlp.linear_fc1.weight`` <-> ``mixer.up_proj.weight``, ``mlp.linear_fc2.weight`` <->
  ``mixer.down_proj.weight``;
* ``decoder.final_norm.weight`` <-> ``model.norm_f.weight``, ``output_layer.weight`` <->
  ``lm_head.weight``.

MoE layers (``E``) are not converted (ConversionError).
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import torch
from protocol import ConversionError, qkv_from_separate, qkv_to_separate

from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols

_MAMBA_TENSORS = (
    "mixer.in_proj.weight",
    "mixer.conv1d.weight",
    "mixer.conv1d.bias",
    "mixer.dt_bias",
    "mixer.A_log",
    "mixer.D",
    "mixer.norm.weight",
    "mixer.out_proj.weight",
)


class Shape(NamedTuple):
    """What the attention layers' QKV layout needs."""

    pattern: str
    num_heads: int
    num_groups: int
    head_dim: int


def _hf_prefix(hf: Dict[str, torch.Tensor]) -> str:
    return "backbone." if "backbone.embeddings.weight" in hf else "model."


def megatron_from_hf(hf: Dict[str, torch.Tensor], shape: Shape) -> Dict[str, torch.Tensor]:
    """Our MambaModel state dict from a NemotronH one."""
    p = _hf_prefix(hf)
    out = {"embedding.word_embeddings.weight": hf[p + "embeddings.weight"]}
    for i, symbol in enumerate(layer_symbols(shape.pattern)):
        src, dst = f"{p}layers.{i}.", f"decoder.layers.{i}."
        if symbol == "M":
            out[dst + "norm.weight"] = hf[src + "norm.weight"]
            for name in _MAMBA_TENSORS:
                out[dst + name] = hf[src + name]
        elif symbol == "*":
            out[dst + "input_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "self_attention.linear_qkv.weight"] = qkv_from_separate(
                hf[src + "mixer.q_proj.weight"],
                hf[src + "mixer.k_proj.weight"],
                hf[src + "mixer.v_proj.weight"],
                shape.num_heads,
                shape.num_groups,
                shape.head_dim,
            )
            out[dst + "self_attention.linear_proj.weight"] = hf[src + "mixer.o_proj.weight"]
        elif symbol == "-":
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "norm.weight"]
            out[dst + "mlp.linear_fc1.weight"] = hf[src + "mixer.up_proj.weight"]
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mixer.down_proj.weight"]
        else:
            raise ConversionError(f"layer {i}: MoE layers (E) are not converted to NemotronH")
    out["decoder.final_norm.weight"] = hf[p + "norm_f.weight"]
    out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def hf_from_megatron(ours: Dict[str, torch.Tensor], shape: Shape) -> Dict[str, torch.Tensor]:
    """A NemotronH state dict (``model.`` names) from our MambaModel's."""
    out = {"model.embeddings.weight": ours["embedding.word_embeddings.weight"]}
    for i, symbol in enumerate(layer_symbols(shape.pattern)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == "M":
            out[dst + "norm.weight"] = ours[src + "norm.weight"]
            for name in _MAMBA_TENSORS:
                out[dst + name] = ours[src + name]
        elif symbol == "*":
            out[dst + "norm.weight"] = ours[src + "input_layernorm.weight"]
            q, k, v = qkv_to_separate(
                ours[src + "self_attention.linear_qkv.weight"],
                shape.num_heads,
                shape.num_groups,
                shape.head_dim,
            )
            out[dst + "mixer.q_proj.weight"] = q
            out[dst + "mixer.k_proj.weight"] = k
            out[dst + "mixer.v_proj.weight"] = v
            out[dst + "mixer.o_proj.weight"] = ours[src + "self_attention.linear_proj.weight"]
        elif symbol == "-":
            out[dst + "norm.weight"] = ours[src + "pre_mlp_layernorm.weight"]
            out[dst + "mixer.up_proj.weight"] = ours[src + "mlp.linear_fc1.weight"]
            out[dst + "mixer.down_proj.weight"] = ours[src + "mlp.linear_fc2.weight"]
        else:
            raise ConversionError(f"layer {i}: MoE layers (E) are not converted to NemotronH")
    out["model.norm_f.weight"] = ours["decoder.final_norm.weight"]
    out["lm_head.weight"] = ours["output_layer.weight"]
    return out
