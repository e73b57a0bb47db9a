"""Hybrid Mamba models (``--model-type MAMBA``, Megatron's ``MambaModel``) in the converter
protocol of ``protocol.py``, which this extends without changing its GPT messages.

Metadata: the ordinary fields (``model_type`` ``"MAMBA"``, ``activation`` ``"squared_relu"`` for
``--squared-relu``, ``num_experts`` / ``moe_router_topk`` when there are MoE layers, position
embeddings ``"none"`` as NemotronH has) plus

* ``hybrid_override_pattern``: one symbol per layer (Megatron's name): ``M`` Mamba, ``*``
  attention, ``-`` MLP, ``E`` MoE;
* ``hybrid_args``: {trainer argument: value} of the hybrid model's settings beyond the GPT ones
  (:data:`HYBRID_ARGS`: the ``--mamba-*`` sizes and the MoE layers' sizes and router), which the
  core saver passes on as flags.

Messages: ``"embeddings"`` (``word embeddings``, and ``position embeddings`` when learned),
then ``"transformer layer N"`` for every layer, carrying ``"layer kind"`` (:data:`LAYER_KINDS`:
``mamba``, ``attention``, ``mlp`` or ``moe``, which must be the pattern's symbol) and the layer's
full (unsharded) tensors under their Megatron names within the layer (``norm.weight``,
``mixer.in_proj.weight`` ... ``self_attention.linear_qkv.weight`` in the grouped QKV layout,
``mlp.experts.local_experts.<e>.linear_fc1.weight`` with global expert numbers), then ``"final
norm"`` (``weight``), ``"output layer"`` (``weight``, untied models only) and ``"done"``.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional

import torch
from protocol import ConversionError, check_empty, get, put, take

from megatron.core.ssm.mamba_hybrid_layer_allocation import layer_symbols

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

# The trainer arguments a hybrid model adds to the GPT ones (carried in ``md.hybrid_args``).
HYBRID_ARGS = (
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
)

_MAMBA = (
    "norm.weight",
    "mixer.in_proj.weight",
    "mixer.conv1d.weight",
    "mixer.conv1d.bias",
    "mixer.dt_bias",
    "mixer.A_log",
    "mixer.D",
    "mixer.norm.weight",
    "mixer.out_proj.weight",
)
_ATTENTION = (
    "input_layernorm.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
)
_MLP = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def layer_kinds(md) -> list:
    try:
        return [LAYER_KINDS[s] for s in layer_symbols(md.hybrid_override_pattern or "")]
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


def required_tensors(md, kind: str) -> tuple:
    """The tensors a layer of ``kind`` must carry (it may carry more, e.g. norm biases)."""
    if kind == "mamba":
        return _MAMBA
    if kind == "attention":
        return _ATTENTION
    if kind == "mlp":
        return _MLP
    extra = md.hybrid_args or {}
    names = ["pre_mlp_layernorm.weight", "mlp.router.weight"]
    if extra.get("moe_router_enable_expert_bias"):
        names.append("mlp.router.expert_bias")
    for e in range(md.num_experts or 0):
        names += [f"mlp.experts.local_experts.{e}.linear_fc{n}.weight" for n in (1, 2)]
    if extra.get("moe_shared_expert_intermediate_size"):
        names += [f"mlp.shared_experts.linear_fc{n}.weight" for n in (1, 2)]
    return tuple(names)


def check_hybrid_metadata(md) -> None:
    if md.model_type != "MAMBA" or not md.hybrid_override_pattern:
        raise ConversionError(
            f"the loader sent a {md.model_type} model without a hybrid layer pattern; "
            "--model-type MAMBA needs a hybrid (Mamba) checkpoint"
        )
    kinds = layer_kinds(md)
    if len(kinds) != md.num_layers:
        raise ConversionError(
            f"hybrid_override_pattern {md.hybrid_override_pattern!r} has {len(kinds)} layers, "
            f"the metadata {md.num_layers}"
        )
    if "moe" in kinds and not md.num_experts:
        raise ConversionError("the pattern has MoE layers (E) but the metadata no num_experts")


def send_hybrid_model(
    queue,
    md,
    tensor: Callable[[str], torch.Tensor],
    layer_names: Callable[[int], Iterable[str]],
    alive=None,
) -> None:
    """Every message after the metadata: ``tensor(global name)`` gives a full tensor,
    ``layer_names(i)`` the names within layer i to send."""
    check_hybrid_metadata(md)
    embeddings = {"word embeddings": tensor("embedding.word_embeddings.weight")}
    if md.position_embedding_type == "learned_absolute":
        embeddings["position embeddings"] = tensor("embedding.position_embeddings.weight")
    put(queue, "embeddings", embeddings, alive)
    for i, kind in enumerate(layer_kinds(md)):
        prefix = f"decoder.layers.{i}."
        msg = {name: tensor(prefix + name).clone() for name in layer_names(i)}
        msg["layer kind"] = kind
        put(queue, f"transformer layer {i}", msg, alive)
    put(queue, "final norm", {"weight": tensor("decoder.final_norm.weight")}, alive)
    if md.output_layer:
        put(queue, "output layer", {"weight": tensor("output_layer.weight")}, alive)
    put(queue, "done", None, alive)


def receive_hybrid_model(queue, md, checking: bool = True, alive=None) -> Dict[str, torch.Tensor]:
    """Every message after the metadata, as full tensors by global Megatron name; each layer's
    kind checked against the pattern and its required tensors against the kind."""
    check_hybrid_metadata(md)
    out: Dict[str, torch.Tensor] = {}
    msg = get(queue, "embeddings", alive)
    out["embedding.word_embeddings.weight"] = take(msg, "word embeddings")
    if md.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = take(msg, "position embeddings")
    check_empty(msg, checking)
    for i, kind in enumerate(layer_kinds(md)):
        msg = get(queue, f"transformer layer {i}", alive)
        sent = msg.pop("layer kind", None)
        if sent != kind:
            raise ConversionError(
                f"layer {i}: the loader sent a {sent!r} layer, the pattern "
                f"{md.hybrid_override_pattern!r} says {kind!r}"
            )
        missing = [n for n in required_tensors(md, kind) if n not in msg]
        if missing:
            raise ConversionError(f"message 'transformer layer {i}' ({kind}) lacks {missing}")
        for name in [n for n in msg if n != "name"]:
            out[f"decoder.layers.{i}.{name}"] = msg.pop(name)
    msg = get(queue, "final norm", alive)
    out["decoder.final_norm.weight"] = take(msg, "weight")
    check_empty(msg, checking)
    if md.output_layer:
        msg = get(queue, "output layer", alive)
        out["output_layer.weight"] = take(msg, "weight")
        check_empty(msg, checking)
    get(queue, "done", alive)
    return out


def hybrid_flags(md) -> list:
    """The trainer flags of ``md``'s hybrid settings (added to the GPT ones)."""
    flags = ["--hybrid-override-pattern", md.hybrid_override_pattern]
    for name, value in (md.hybrid_args or {}).items():
        if name not in HYBRID_ARGS:
            raise ConversionError(f"unknown hybrid setting {name!r} in the loader metadata")
        if value is None or value is False:
            continue
        flags += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    return flags


def hybrid_args_of(namespace) -> Dict[str, Optional[object]]:
    """``md.hybrid_args`` of a trainer args Namespace."""
    return {name: getattr(namespace, name, None) for name in HYBRID_ARGS}
