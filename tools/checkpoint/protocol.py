"""The message protocol between a checkpoint loader and a saver (Megatron's tools/checkpoint).

The loader puts, in this order, on one queue:

1. a metadata ``argparse.Namespace`` (see :data:`METADATA_FIELDS`);
2. ``"embeddings"``: ``word embeddings`` [V, h] (V = the source's rows, padding included) and,
   with learned positions, ``position embeddings`` [P, h];
3. ``"transformer layer N"`` for N = 0 .. num_layers-1, full (unsharded) tensors in Megatron's
   layout: ``input norm weight`` (+ ``bias``), ``qkv weight`` [ng*(np/ng+2)*d, h] in the grouped
   QKV layout (+ ``qkv bias``) or, with multi-latent attention (``md.mla``), its tensors under
   ``mla <name within self_attention>`` (:func:`mla_shapes`), ``dense weight`` [h, np*d] (d:
   v_head_dim under MLA) (+ ``dense bias``), ``post norm
   weight`` (+ ``bias``), ``mlp l0 weight`` [ffn, h] or, with SwiGLU, ``mlp l0 weight W`` (gate)
   and ``mlp l0 weight V`` (up) (biases likewise), ``mlp l1 weight`` [h, ffn] (+ ``mlp l1 bias``);
   with ``num_experts`` (MoE, SwiGLU experts without biases) instead of the MLP of the layers
   :func:`layer_is_moe` names: ``router weight`` [E, h], with ``md.moe``'s expert bias ``router
   bias`` [E] (the aux-loss-free ``expert_bias``), per expert e ``expert e l0 weight W`` / ``V``
   [f, h] and ``expert e l1 weight`` [h, f] (f: ``moe_ffn_hidden_size``), and with shared experts
   ``shared mlp l0 weight W`` / ``V`` [s, h] and ``shared mlp l1 weight`` [h, s] (s:
   ``moe_shared_expert_intermediate_size``);
4. with ``md.mtp_num_layers``, ``"mtp layer K"`` for each multi-token-prediction depth K: the
   tensors of a transformer layer message (MoE as the last decoder layer is) plus ``enorm
   weight``, ``hnorm weight``, ``mtp final norm weight`` (+ ``bias``) and ``eh proj weight``
   [h, 2h] (:func:`layer_messages`);
5. ``"final norm"``: ``weight`` (+ ``bias``);
6. ``"output layer"``: ``weight`` [V, h], only when the output layer is not tied;
7. ``"done"``. A loader that fails puts ``"exit"`` instead, and the saver stops.

Each message is a dict carrying its own ``name``; the saver checks the name and, unless
``--no-checking``, that no tensor was left unread.
"""

from __future__ import annotations

import argparse
import math
import queue as queue_module
from typing import Callable, Dict, Optional

import torch

from megatron.checkpointing.errors import ConversionError
from megatron.checkpointing.saved_args import MLA_ARGS

# Fields every loader sets on the metadata Namespace (Megatron's names where Megatron has one).
METADATA_FIELDS = (
    "model_type",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "norm_epsilon",
    "norm_has_bias",
    "linear_bias",
    "qkv_bias",
    "swiglu",
    "activation",
    "output_layer",
    "hidden_dropout",
    "attention_dropout",
    "true_vocab_size",
    "make_vocab_size_divisible_by",
    "tokenizer_type",
    "tokenizer_model",
    "iteration",
    "params_dtype",
    "bert_binary_head",
    "previous_tensor_parallel_size",
    "previous_pipeline_parallel_size",
    "checkpoint_args",
    "consumed_train_samples",
    "consumed_valid_samples",
    "hf_config",
    "num_experts",
    "moe_router_topk",
    "mla",
    # hybrid (Mamba) models, see protocol_hybrid.py
    "hybrid_override_pattern",
    "hybrid_args",
    "moe",
    "mtp_num_layers",
)

# An MTP depth's transformer layer, within ``mtp.layers.<k>.``; its message's own norms.
MTP_LAYER = "transformer_layer."
_MTP_NORMS = (("enorm", "enorm"), ("hnorm", "hnorm"), ("mtp final norm", "final_layernorm"))

# Mixture-of-experts settings beyond num_experts / moe_router_topk carried in ``md.moe`` (None:
# every layer MoE with experts of ffn_hidden_size, softmax router, no shared expert: Mixtral);
# the flag of each is ``--`` + its name with dashes. ``moe_layer_freq``: one 0/1 per layer.
MOE_FIELDS = (
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
)

# Multi-latent attention settings carried in ``md.mla`` (None: ordinary attention); the flag of
# each is ``--`` + its name with dashes. ``latent_norms``: the q/kv latent norms (--qk-layernorm).
MLA_FIELDS = MLA_ARGS + ("latent_norms",)

# Activations the protocol knows: what the MLP computes (Megatron's fused bias-GeLU is 'gelu_tanh').
ACTIVATIONS = ("gelu_tanh", "gelu", "silu", "squared_relu")


def new_metadata(**values) -> argparse.Namespace:
    md = argparse.Namespace(**{name: None for name in METADATA_FIELDS})
    for key, value in values.items():
        setattr(md, key, value)
    return md


def check_metadata(md) -> None:
    missing = [
        f
        for f in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "normalization",
            "activation",
        )
        if getattr(md, f, None) is None
    ]
    if missing:
        raise ConversionError(f"loader metadata lacks {missing}")
    if md.activation not in ACTIVATIONS:
        raise ConversionError(f"unknown activation {md.activation!r} in the loader metadata")


def put(
    q, name: str, message: Optional[Dict] = None, alive: Optional[Callable[[], bool]] = None
) -> None:
    """Put a named message; while the queue is full, stop with an error if the saver has died."""
    item = dict(message or {})
    item["name"] = name
    _put_raw(q, item, alive)


def _put_raw(q, item, alive) -> None:
    while True:
        try:
            q.put(item, timeout=1.0)
            return
        except queue_module.Full:
            if alive is not None and not alive():
                raise ConversionError(
                    "the saver stopped before reading every message (see its error above)"
                )


def put_metadata(q, md, alive: Optional[Callable[[], bool]] = None) -> None:
    """The metadata goes first, as a bare Namespace (as Megatron's loaders send it)."""
    check_metadata(md)
    _put_raw(q, md, alive)


def get_metadata(q, alive: Optional[Callable[[], bool]] = None):
    item = _get_raw(q, "metadata", alive)
    if isinstance(item, dict) and item.get("name") == "exit":
        raise ConversionError("the loader failed (see its error above); nothing was saved")
    if not isinstance(item, argparse.Namespace):
        raise ConversionError(
            f"protocol error: expected the metadata Namespace first, got {type(item).__name__}"
        )
    return item


def _get_raw(q, expected, alive):
    while True:
        try:
            return q.get(timeout=1.0)
        except queue_module.Empty:
            if alive is not None and not alive():
                raise ConversionError(f"the loader stopped before sending '{expected}'")


def get(q, expected: str, alive: Optional[Callable[[], bool]] = None) -> Dict:
    """The next message, which must be ``expected``; ``exit`` from the loader stops the saver."""
    item = _get_raw(q, expected, alive)
    name = item.get("name") if isinstance(item, dict) else None
    if name == "exit":
        raise ConversionError("the loader failed (see its error above); nothing was saved")
    if name != expected:
        raise ConversionError(f"protocol error: expected message '{expected}', got '{name}'")
    return item


def take(message: Dict, key: str, shape=None) -> torch.Tensor:
    """Remove and return ``message[key]``, checking its shape; errors name the message and
    tensor."""
    if key not in message:
        raise ConversionError(f"message '{message.get('name')}' has no tensor '{key}'")
    tensor = message.pop(key)
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ConversionError(
            f"shape mismatch for '{key}' in message '{message.get('name')}': "
            f"got {tuple(tensor.shape)}, expected {tuple(shape)}"
        )
    return tensor


def take_optional(message: Dict, key: str, present: bool, shape=None) -> Optional[torch.Tensor]:
    if not present:
        if key in message:
            raise ConversionError(
                f"message '{message.get('name')}' has '{key}', which the metadata says "
                "the model does not have"
            )
        return None
    return take(message, key, shape)


def check_empty(message: Dict, checking: bool = True) -> None:
    left = sorted(k for k in message if k != "name")
    if left and checking:
        raise ConversionError(
            f"message '{message.get('name')}' has tensors the saver does not know: {left} "
            "(pass --no-checking to drop them)"
        )


# ---- Megatron's grouped QKV layout ---------------------------------------------------------------


def qkv_from_separate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """[np*d, ...], [ng*d, ...], [ng*d, ...] -> grouped [ng*(np/ng+2)*d, ...] (weights or
    biases)."""
    rest = q.shape[1:]
    per_group = num_heads // num_groups
    q = q.reshape(num_groups, per_group * head_dim, *rest)
    k = k.reshape(num_groups, head_dim, *rest)
    v = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(num_groups * (per_group + 2) * head_dim, *rest)


def qkv_to_separate(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """Inverse of :func:`qkv_from_separate`: (q [np*d, ...], k [ng*d, ...], v [ng*d, ...])."""
    rest = qkv.shape[1:]
    per_group = num_heads // num_groups
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest).contiguous(),
        k.reshape(num_groups * head_dim, *rest).contiguous(),
        v.reshape(num_groups * head_dim, *rest).contiguous(),
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's padding: a multiple of make_vocab_size_divisible_by * TP."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def resize_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut to ``rows`` or pad with zero rows (padding rows are never real tokens)."""
    if weight.shape[0] >= rows:
        return weight[:rows].clone()
    pad = torch.zeros(rows - weight.shape[0], *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([weight, pad], dim=0)


def mla_shapes(md) -> Dict[str, tuple]:
    """The multi-latent attention tensors of a layer (names within ``self_attention``) and their
    full shapes."""
    mla, h, heads = md.mla, md.hidden_size, md.num_attention_heads
    q_width = heads * (mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"])
    rank_q, rank_kv = mla["q_lora_rank"], mla["kv_lora_rank"]
    shapes = {}
    if rank_q is None:
        shapes["linear_q_proj.weight"] = (q_width, h)
    else:
        shapes["linear_q_down_proj.weight"] = (rank_q, h)
        shapes["linear_q_up_proj.weight"] = (q_width, rank_q)
    shapes["linear_kv_down_proj.weight"] = (rank_kv + mla["qk_pos_emb_head_dim"], h)
    shapes["linear_kv_up_proj.weight"] = (heads * (mla["qk_head_dim"] + mla["v_head_dim"]), rank_kv)
    if mla["latent_norms"]:
        norms = {"kv_layernorm": rank_kv} if rank_q is None else {"q_layernorm": rank_q}
        norms["kv_layernorm"] = rank_kv
        for norm, width in norms.items():
            shapes[f"{norm}.weight"] = (width,)
            if md.norm_has_bias:
                shapes[f"{norm}.bias"] = (width,)
    return shapes


def layer_is_moe(md, layer: int) -> bool:
    """Whether layer ``layer``'s MLP is a mixture of experts (``md.moe['moe_layer_freq']``)."""
    if not getattr(md, "num_experts", None):
        return False
    moe = getattr(md, "moe", None)
    return not moe or bool(moe["moe_layer_freq"][layer])


def moe_sizes(md):
    """(routed expert width, shared expert width or 0) of ``md``."""
    moe = getattr(md, "moe", None) or {}
    return (
        moe.get("moe_ffn_hidden_size") or md.ffn_hidden_size,
        moe.get("moe_shared_expert_intermediate_size") or 0,
    )


def moe_message(t: Callable[[str], torch.Tensor], md, prefix: str) -> Dict[str, torch.Tensor]:
    """The MoE part of a layer message from full tensors by global name (``t(name)``)."""
    msg = {"router weight": t(prefix + "mlp.router.weight")}
    if (getattr(md, "moe", None) or {}).get("moe_router_enable_expert_bias"):
        msg["router bias"] = t(prefix + "mlp.router.expert_bias")
    for e in range(md.num_experts):
        x = f"{prefix}mlp.experts.local_experts.{e}."
        gate, up = t(x + "linear_fc1.weight").chunk(2, dim=0)
        msg[f"expert {e} l0 weight W"], msg[f"expert {e} l0 weight V"] = gate, up
        msg[f"expert {e} l1 weight"] = t(x + "linear_fc2.weight")
    if moe_sizes(md)[1]:
        x = prefix + "mlp.shared_experts."
        gate, up = t(x + "linear_fc1.weight").chunk(2, dim=0)
        msg["shared mlp l0 weight W"], msg["shared mlp l0 weight V"] = gate, up
        msg["shared mlp l1 weight"] = t(x + "linear_fc2.weight")
    return msg


def _receive_gated(msg, key: str, name: str, width: int, h: int, out) -> None:
    out[name + "linear_fc1.weight"] = torch.cat(
        [take(msg, f"{key} l0 weight W", (width, h)), take(msg, f"{key} l0 weight V", (width, h))],
        dim=0,
    )
    out[name + "linear_fc2.weight"] = take(msg, f"{key} l1 weight", (h, width))


def _receive_experts(msg, md, prefix: str, out: Dict[str, torch.Tensor]) -> None:
    """Router and experts of one MoE layer (global expert numbers in the names)."""
    h, (ffn, shared) = md.hidden_size, moe_sizes(md)
    if not md.swiglu or md.linear_bias:
        raise ConversionError("MoE conversion supports SwiGLU experts without biases only")
    out[prefix + "mlp.router.weight"] = take(msg, "router weight", (md.num_experts, h))
    if (getattr(md, "moe", None) or {}).get("moe_router_enable_expert_bias"):
        out[prefix + "mlp.router.expert_bias"] = take(msg, "router bias", (md.num_experts,))
    for e in range(md.num_experts):
        x = f"{prefix}mlp.experts.local_experts.{e}."
        _receive_gated(msg, f"expert {e}", x, ffn, h, out)
    if shared:
        _receive_gated(msg, "shared mlp", prefix + "mlp.shared_experts.", shared, h, out)


def layer_messages(md):
    """(message name, global name prefix of its transformer layer, whether its MLP is MoE) of
    every layer message: the decoder's, then each multi-token-prediction depth's (``md.
    mtp_num_layers``; its layer is built like the decoder's last, as Megatron's MTP spec is)."""
    out = [
        (f"transformer layer {i}", f"decoder.layers.{i}.", layer_is_moe(md, i))
        for i in range(md.num_layers)
    ]
    last_moe = layer_is_moe(md, md.num_layers - 1)
    for k in range(getattr(md, "mtp_num_layers", None) or 0):
        out.append((f"mtp layer {k}", f"mtp.layers.{k}.{MTP_LAYER}", last_moe))
    return out


def mtp_message(t: Callable[[str], torch.Tensor], md, prefix: str) -> Dict[str, torch.Tensor]:
    """An MTP depth's own tensors (``prefix``: its transformer layer's) for its layer message."""
    depth = prefix[: -len(MTP_LAYER)]
    msg = {}
    for key, name in _MTP_NORMS:
        msg[key + " weight"] = t(depth + name + ".weight")
        if md.norm_has_bias:
            msg[key + " bias"] = t(depth + name + ".bias")
    msg["eh proj weight"] = t(depth + "eh_proj.weight")
    return msg


def _receive_mtp_depth(msg, md, prefix: str, out: Dict[str, torch.Tensor]) -> None:
    depth, h = prefix[: -len(MTP_LAYER)], md.hidden_size
    for key, name in _MTP_NORMS:
        out[depth + name + ".weight"] = take(msg, key + " weight", (h,))
        bias = take_optional(msg, key + " bias", md.norm_has_bias, (h,))
        if bias is not None:
            out[depth + name + ".bias"] = bias
    out[depth + "eh_proj.weight"] = take(msg, "eh proj weight", (h, 2 * h))


def receive_model(
    q, md, checking: bool = True, alive: Optional[Callable[[], bool]] = None
) -> Dict[str, torch.Tensor]:
    """Read every model message after the metadata; returns full tensors by global MCore name
    (SwiGLU fc1 as [gate; up]), each shape checked against the metadata."""
    h, ffn, d = md.hidden_size, md.ffn_hidden_size, md.kv_channels
    qkv_rows = md.num_query_groups * (md.num_attention_heads // md.num_query_groups + 2) * d
    out: Dict[str, torch.Tensor] = {}
    msg = get(q, "embeddings", alive)
    word = take(msg, "word embeddings")
    if word.dim() != 2 or word.shape[1] != h:
        raise ConversionError(
            f"shape mismatch for 'word embeddings': got {tuple(word.shape)}, expected [vocab, {h}]"
        )
    out["embedding.word_embeddings.weight"] = word
    learned = md.position_embedding_type == "learned_absolute"
    pos = take_optional(msg, "position embeddings", learned, (md.max_position_embeddings, h))
    if pos is not None:
        out["embedding.position_embeddings.weight"] = pos
    check_empty(msg, checking)
    for message, p, moe in layer_messages(md):
        msg = get(q, message, alive)
        if p.startswith("mtp."):
            _receive_mtp_depth(msg, md, p, out)
        out[p + "input_layernorm.weight"] = take(msg, "input norm weight", (h,))
        bias = take_optional(msg, "input norm bias", md.norm_has_bias, (h,))
        if bias is not None:
            out[p + "input_layernorm.bias"] = bias
        mla = getattr(md, "mla", None)
        if mla:
            for name, shape in mla_shapes(md).items():
                out[p + "self_attention." + name] = take(msg, "mla " + name, shape)
        else:
            out[p + "self_attention.linear_qkv.weight"] = take(msg, "qkv weight", (qkv_rows, h))
            bias = take_optional(msg, "qkv bias", md.qkv_bias, (qkv_rows,))
            if bias is not None:
                out[p + "self_attention.linear_qkv.bias"] = bias
        value_width = mla["v_head_dim"] if mla else d
        out[p + "self_attention.linear_proj.weight"] = take(
            msg, "dense weight", (h, md.num_attention_heads * value_width)
        )
        bias = take_optional(msg, "dense bias", md.linear_bias, (h,))
        if bias is not None:
            out[p + "self_attention.linear_proj.bias"] = bias
        out[p + "pre_mlp_layernorm.weight"] = take(msg, "post norm weight", (h,))
        bias = take_optional(msg, "post norm bias", md.norm_has_bias, (h,))
        if bias is not None:
            out[p + "pre_mlp_layernorm.bias"] = bias
        if moe:
            _receive_experts(msg, md, p, out)
        elif md.swiglu:
            out[p + "mlp.linear_fc1.weight"] = torch.cat(
                [take(msg, "mlp l0 weight W", (ffn, h)), take(msg, "mlp l0 weight V", (ffn, h))],
                dim=0,
            )
            if md.linear_bias:
                out[p + "mlp.linear_fc1.bias"] = torch.cat(
                    [take(msg, "mlp l0 bias W", (ffn,)), take(msg, "mlp l0 bias V", (ffn,))], dim=0
                )
        else:
            out[p + "mlp.linear_fc1.weight"] = take(msg, "mlp l0 weight", (ffn, h))
            bias = take_optional(msg, "mlp l0 bias", md.linear_bias, (ffn,))
            if bias is not None:
                out[p + "mlp.linear_fc1.bias"] = bias
        if not moe:
            out[p + "mlp.linear_fc2.weight"] = take(msg, "mlp l1 weight", (h, ffn))
            bias = take_optional(msg, "mlp l1 bias", md.linear_bias, (h,))
            if bias is not None:
                out[p + "mlp.linear_fc2.bias"] = bias
        check_empty(msg, checking)
    msg = get(q, "final norm", alive)
    out["decoder.final_layernorm.weight"] = take(msg, "weight", (h,))
    bias = take_optional(msg, "bias", md.norm_has_bias, (h,))
    if bias is not None:
        out["decoder.final_layernorm.bias"] = bias
    check_empty(msg, checking)
    if md.output_layer:
        msg = get(q, "output layer", alive)
        weight = take(msg, "weight")
        if weight.dim() != 2 or weight.shape[1] != h:
            raise ConversionError(
                f"shape mismatch for 'output layer' weight: got {tuple(weight.shape)}, "
                f"expected [vocab, {h}]"
            )
        out["output_layer.weight"] = weight
        check_empty(msg, checking)
    get(q, "done", alive)
    return out
