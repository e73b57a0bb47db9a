"""Megatron-LM's key layout of a ``torch_dist`` checkpoint, as tables that map our global keys.

megatron-core (observed on 0.16.1 with its local GPT, BERT and T5 specs) writes the transformer
layers of a block **stacked**: one key per kind of parameter with a leading layer axis, e.g.
``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[num_layers, 3h, h]`` (layer ``l``
is the slice at offset ``l`` of that axis, whichever pipeline stage holds it). It uses the
Transformer Engine names even for its local spec (the input norm is fused into ``linear_qkv``,
the pre-MLP norm into ``linear_fc1``, also in a MoE layer, which has no ``linear_fc1``) and
writes one ``_extra_state`` object per layer for each linear module, under
``<stacked key>._extra_state/shard_<layer>_<num_layers>``. The same holds for each block of a
model (BERT's ``encoder.layers``, T5's ``encoder.layers`` and ``decoder.layers``).

A MoE layer's routed experts (``mlp.experts.local_experts.<e>``, ``e`` numbered globally) get a
second leading axis, the expert: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of
shape ``[num_layers, num_experts, ffn, h]`` (each expert-parallel rank writes its experts'
slices, split over expert tensor parallelism below those two axes), with ``_extra_state``
objects on a ``[num_layers, num_experts]`` grid (``shard_<l>.<e>_<L>.<E>``). The router
(``mlp.router.weight``, ``mlp.router.expert_bias``) and the shared experts
(``mlp.shared_experts.*``) are stacked over layers only. A block that mixes dense and MoE
layers (``--moe-layer-freq``) is not stacked: megatron-core keys its layers one by one
(``decoder.layers.<l>.`` with Megatron's names within, the experts on an axis of their own of
shape ``[num_experts, ...]``, each ``_extra_state`` object on a grid of its own).

The layers' specifics are in the tables below; a model family adds rows for a layer of its own:

* :data:`LAYER_RENAMES` -- a layer's tensor named differently by Megatron (with the tensors one
  of which must exist in the same layer for the rename to apply);
* :data:`EXTRA_STATE_MODULES` -- the layer modules that carry an ``_extra_state`` object (written
  for every such module whose ``weight`` the layer has);
* :data:`EXPERT_AXES` -- the per-expert module lists that get the expert axis, and the
  modules of one expert that carry an ``_extra_state`` object.

Outside the layers, each model class says what differs in its ``TOP_LEVEL_EXTRA_STATE`` (modules
for which megatron-core writes an ``_extra_state`` object of a one-element grid) and
``CHECKPOINT_ALIASES`` (tensors megatron-core writes under a second key); see
:class:`~megatron.core.models.common.language_module.LanguageModule`.

The ``torch`` format's model entries get megatron-core's ``_extra_state`` entries too
(:func:`with_extra_state`: one per column/row-parallel linear module, no table needed).

Other keys outside the layers of a block (embeddings, final norm, output layer, BERT's pooler
and heads) are not changed. Checkpoints written before this layout (one key per layer,
``decoder.layers.3.…``, which MoE models here kept until the expert axis was built) are told
apart by :func:`is_per_layer_layout` and read with per-layer keys.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from .mapping import Chunk, ShardedObject, ShardedTensor

LAYERS = "layers."


class Rename(NamedTuple):
    """One tensor of a transformer layer that Megatron names differently."""

    ours: str
    """Key within the layer here, e.g. ``input_layernorm.weight``."""
    megatron: str
    """Key within the layer in Megatron's checkpoint."""
    requires: Tuple[str, ...]
    """Keys within the layer one of which must exist for the rename to apply."""


_HAS_MLP = ("mlp.linear_fc1.weight", "mlp.router.weight")  # a dense or a MoE MLP

LAYER_RENAMES: Tuple[Rename, ...] = (
    Rename(
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        ("self_attention.linear_qkv.weight",),
    ),
    Rename(
        "input_layernorm.bias",
        "self_attention.linear_qkv.layer_norm_bias",
        ("self_attention.linear_qkv.weight",),
    ),
    # Multi-latent attention: Megatron's Transformer Engine spec fuses the latent norms into the
    # up projections.
    Rename(
        "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight",
        ("self_attention.linear_q_up_proj.weight",),
    ),
    Rename(
        "self_attention.q_layernorm.bias",
        "self_attention.linear_q_up_proj.layer_norm_bias",
        ("self_attention.linear_q_up_proj.weight",),
    ),
    Rename(
        "self_attention.kv_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight",
        ("self_attention.linear_kv_up_proj.weight",),
    ),
    Rename(
        "self_attention.kv_layernorm.bias",
        "self_attention.linear_kv_up_proj.layer_norm_bias",
        ("self_attention.linear_kv_up_proj.weight",),
    ),
    Rename("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", _HAS_MLP),
    Rename("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", _HAS_MLP),
    # A gated delta net layer: Megatron's spec fuses the input norm into in_proj.
    Rename(
        "input_layernorm.weight",
        "self_attention.in_proj.layer_norm_weight",
        ("self_attention.in_proj.weight",),
    ),
    Rename(
        "input_layernorm.bias",
        "self_attention.in_proj.layer_norm_bias",
        ("self_attention.in_proj.weight",),
    ),
    # A Mamba layer (Megatron's spec fuses its norm into in_proj).
    Rename("norm.weight", "mixer.in_proj.layer_norm_weight", ("mixer.in_proj.weight",)),
    Rename("norm.bias", "mixer.in_proj.layer_norm_bias", ("mixer.in_proj.weight",)),
)

EXTRA_STATE_MODULES: Tuple[str, ...] = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.linear_q_proj",
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
    "cross_attention.linear_q",
    "cross_attention.linear_kv",
    "cross_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
    "mixer.in_proj",
    "mixer.out_proj",
    "self_attention.in_proj",
    "self_attention.out_proj",
)

# A multi-token-prediction depth (``mtp.layers.<k>.``, always keyed layer by layer) holds a
# transformer layer under ``transformer_layer.``, named within as the decoder's layers are, and
# its column-parallel ``eh_proj``.
MTP_INNER_LAYER = "transformer_layer."
LAYER_RENAMES = LAYER_RENAMES + tuple(
    Rename(
        MTP_INNER_LAYER + r.ours,
        MTP_INNER_LAYER + r.megatron,
        tuple(MTP_INNER_LAYER + k for k in r.requires),
    )
    for r in LAYER_RENAMES
)
EXTRA_STATE_MODULES = (
    EXTRA_STATE_MODULES + tuple(MTP_INNER_LAYER + m for m in EXTRA_STATE_MODULES) + ("eh_proj",)
)


class ExpertAxis(NamedTuple):
    """A list of experts in a layer that Megatron stores with an expert axis."""

    ours: str
    """Prefix within the layer of expert ``e``'s keys, without ``e``: ``mlp.experts.local_experts.``
    (``e`` is the global expert index)."""
    megatron: str
    """Prefix within the layer of the stacked keys in Megatron's checkpoint."""
    extra_state_modules: Tuple[str, ...]
    """The modules of one expert that carry an ``_extra_state`` object."""


EXPERT_AXES: Tuple[ExpertAxis, ...] = (
    ExpertAxis("mlp.experts.local_experts.", "mlp.experts.experts.", ("linear_fc1", "linear_fc2")),
    ExpertAxis(
        MTP_INNER_LAYER + "mlp.experts.local_experts.",
        MTP_INNER_LAYER + "mlp.experts.experts.",
        ("linear_fc1", "linear_fc2"),
    ),
)

# What megatron-core stores for the extra state of a linear layer without fp8 metadata.
EMPTY_EXTRA_STATE = None
EXTRA_STATE_SUFFIX = "._extra_state"

_LAYER_KEY = re.compile(r"^(?P<block>(?:.*\.)?layers\.)(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT_INDEX = re.compile(r"^(?P<index>\d+)\.(?P<rest>.+)$")


def split_layer_key(key: str) -> Optional[Tuple[str, int, str]]:
    """(block prefix ending in ``layers.``, layer index, key within the layer), or None."""
    match = _LAYER_KEY.match(key)
    if match is None:
        return None
    return match.group("block"), int(match.group("index")), match.group("rest")


def split_expert_key(rest: str) -> Optional[Tuple[ExpertAxis, int, str]]:
    """(expert list, global expert index, key within the expert) of a key within a layer, or
    None for a key outside the experts."""
    for axis in EXPERT_AXES:
        if rest.startswith(axis.ours):
            match = _EXPERT_INDEX.match(rest[len(axis.ours) :])
            if match is not None:
                return axis, int(match.group("index")), match.group("rest")
    return None


def _renames_for(layer_keys: Iterable[str]) -> Dict[str, str]:
    present = set(layer_keys)
    return {r.ours: r.megatron for r in LAYER_RENAMES if present.intersection(r.requires)}


def _stacked(
    entry: ShardedTensor, key: str, index: Tuple[int, ...], size: Tuple[int, ...], suffix: str
) -> ShardedTensor:
    """``entry`` (one layer's, or one expert's, tensor) as the slice ``index`` of a tensor with
    leading axes of sizes ``size`` (the layer axis and/or the expert axis; none: ``entry`` under
    ``key``); ``suffix`` makes its name unique on the rank."""
    lead = len(index)
    chunks = tuple(
        Chunk(index + c.global_offset, (0,) * lead + c.local_offset, (1,) * lead + c.shape)
        for c in entry.chunks
    )
    data = entry.data
    for _ in range(lead):
        data = data.unsqueeze(0)
    return ShardedTensor(
        key,
        data,
        size + entry.global_shape,
        chunks,
        entry.replica,
        name_suffix=suffix,
        expert=entry.expert,
        dp_sharded=entry.dp_sharded,
    )


def to_megatron_layout(
    entries: Dict[str, ShardedTensor],
    num_layers: Dict[str, int],
    writes_extra_state: bool,
    num_experts: int = 0,
    writes_expert_extra_state: bool = True,
    layer_by_layer: Iterable[str] = (),
) -> Tuple[Dict[str, ShardedTensor], Dict[str, ShardedTensor], List[ShardedObject]]:
    """Stack and rename the per-layer entries (global keys ``<block>layers.<l>.<rest>``).

    ``num_layers`` gives the number of layers of the whole model for each block prefix,
    ``num_experts`` the number of routed experts of a MoE layer. The blocks ``layer_by_layer``
    (whose layers differ: dense and MoE) are not stacked, as megatron-core keys them: Megatron's
    names under ``<block>layers.<l>.``, the experts on an axis of their own.

    Returns ({new name: entry}, {old key: new entry}, the ``_extra_state`` objects); the objects
    are marked replica unless ``writes_extra_state`` (one rank of each layer's TP x DP group
    writes), those of the experts unless ``writes_expert_extra_state`` (one rank of each expert's
    ETP x EDP group).
    """
    one_by_one = set(layer_by_layer)
    per_layer: Dict[Tuple[str, int], List[str]] = {}
    for key in entries:
        parts = split_layer_key(key)
        if parts is not None and parts[0] in num_layers:
            per_layer.setdefault(parts[:2], []).append(parts[2])
    out: Dict[str, ShardedTensor] = {}
    by_old: Dict[str, ShardedTensor] = {}
    objects: List[ShardedObject] = []
    for key, entry in entries.items():
        parts = split_layer_key(key)
        if parts is None or parts[0] not in num_layers:
            out[key] = by_old[key] = entry
            continue
        block, layer, rest = parts
        if block in one_by_one:
            head, lead, size, suffix = f"{block}{layer}.", (), (), ""
        else:
            head, lead, size, suffix = block, (layer,), (num_layers[block],), f"@layer{layer}"
        expert = split_expert_key(rest)
        if expert is not None:
            axis, index, inner = expert
            if not 0 <= index < num_experts:
                raise ValueError(f"{key}: expert {index} outside the model's {num_experts}")
            new = _stacked(
                entry,
                head + axis.megatron + inner,
                lead + (index,),
                size + (num_experts,),
                f"{suffix}.expert{index}",
            )
        else:
            rest = _renames_for(per_layer[(block, layer)]).get(rest, rest)
            new = _stacked(entry, head + rest, lead, size, suffix)
        if new.name in out:
            raise ValueError(f"two tensors map to the slice {new.name_suffix} of {new.key}")
        out[new.name] = by_old[key] = new
    for (block, layer), keys in sorted(per_layer.items()):
        present = set(keys)
        if block in one_by_one:  # a grid of one object per layer
            head, grid, place = f"{block}{layer}.", (1,), (0,)
        else:
            head, grid, place = block, (num_layers[block],), (layer,)
        for module in EXTRA_STATE_MODULES:
            if module + ".weight" in present:
                objects.append(
                    ShardedObject(
                        f"{head}{module}{EXTRA_STATE_SUFFIX}",
                        EMPTY_EXTRA_STATE,
                        grid,
                        place,
                        replica=not writes_extra_state,
                    )
                )
        experts = sorted(
            {(e[0], e[1]) for e in map(split_expert_key, keys) if e is not None},
            key=lambda pair: (pair[0].ours, pair[1]),
        )
        for axis, index in experts:
            for module in axis.extra_state_modules:
                if f"{axis.ours}{index}.{module}.weight" in present:
                    objects.append(
                        ShardedObject(
                            f"{head}{axis.megatron}{module}{EXTRA_STATE_SUFFIX}",
                            EMPTY_EXTRA_STATE,
                            (grid if block not in one_by_one else ()) + (num_experts,),
                            (place if block not in one_by_one else ()) + (index,),
                            replica=not writes_expert_extra_state,
                            expert=True,
                        )
                    )
    return out, by_old, objects


# The linear modules of a layer (attention, cross-attention, MLP, shared and routed experts) that
# megatron-core builds as column- or row-parallel linears, each with an (empty) extra state.
LINEAR_MODULE_NAMES: Tuple[str, ...] = (
    "linear_qkv",
    "linear_q",
    "linear_kv",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "eh_proj",  # a multi-token-prediction depth's
)


def extra_state_names(keys: Iterable[str], output_layer: bool) -> List[str]:
    """The ``_extra_state`` entries megatron-core's ``state_dict()`` has beside the tensors
    ``keys`` of a model chunk (by name, for offline tools that hold no model): one for each
    linear module of :data:`LINEAR_MODULE_NAMES` whose weight is there, and the output layer's
    when the chunk has one (``output_layer``: the last stage, tied or not)."""
    names = []
    for key in keys:
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEAR_MODULE_NAMES:
            names.append(module + EXTRA_STATE_SUFFIX)
    if output_layer:
        names.append("output_layer" + EXTRA_STATE_SUFFIX)
    return names


def with_extra_state(chunk: torch.nn.Module, state: Dict[str, object]) -> Dict[str, object]:
    """``state`` (``chunk.state_dict()``) with the ``_extra_state`` entries that megatron-core's
    state_dict() has, so that Megatron-LM loads a ``torch``-format file strictly: its column- and
    row-parallel linear layers (every one, the output layer and each routed expert's included)
    define an empty extra state; ours keep none."""
    out = dict(state)
    for name, module in chunk.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            out.setdefault(name + EXTRA_STATE_SUFFIX, EMPTY_EXTRA_STATE)
    # Our experts are plain modules (not the TP linears): named by the table.
    for key in state:
        layer = split_layer_key(key)
        expert = split_expert_key(layer[2]) if layer is not None else None
        if expert is not None and expert[2].rpartition(".")[0] in expert[0].extra_state_modules:
            out.setdefault(key.rpartition(".")[0] + EXTRA_STATE_SUFFIX, EMPTY_EXTRA_STATE)
    return out


def without_extra_state(state: Dict[str, object]) -> Dict[str, object]:
    """``state`` without ``_extra_state`` entries (Megatron-LM's, or written by
    :func:`with_extra_state`): none of our modules keeps extra state."""
    return {k: v for k, v in state.items() if not k.endswith(EXTRA_STATE_SUFFIX)}


def is_per_layer_layout(checkpoint_keys: Iterable[str]) -> bool:
    """True for a checkpoint written before the Megatron layout: ``…layers.<l>.…`` keys with
    our names within the layer (``input_layernorm``, ``local_experts.<e>``), not Megatron's (which
    it also keys layer by layer for a model mixing dense and MoE layers)."""
    ours = {r.ours for r in LAYER_RENAMES}
    for key in checkpoint_keys:
        parts = split_layer_key(key)
        if parts is not None and (parts[2] in ours or split_expert_key(parts[2]) is not None):
            return True
    return False


def unstack(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Full tensors of a Megatron-layout checkpoint under our per-layer names (offline tools).

    A stacked key ``<block>layers.<rest>`` of shape ``[L, ...]`` becomes ``<block>layers.<l>.
    <our rest>`` for each layer ``l``; an expert key ``<block>layers.<experts>.<rest>`` of shape
    ``[L, E, ...]`` becomes ``<block>layers.<l>.<our experts>.<e>.<rest>``; a key already layer
    by layer (``<block>layers.<l>.<rest>``, a model mixing dense and MoE layers) gets our names
    and its experts split; other keys are kept.
    """
    back = {r.megatron: r.ours for r in LAYER_RENAMES}
    out: Dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        parts = split_layer_key(key)
        if parts is not None:
            block, layer, rest = parts
            layers = {layer: tensor.unsqueeze(0)}
        else:
            head, sep, rest = key.rpartition(LAYERS)
            if not sep or tensor.dim() == 0:
                out[key] = tensor
                continue
            block = head + LAYERS
            layers = dict(enumerate(tensor))
        axis = next((a for a in EXPERT_AXES if rest.startswith(a.megatron)), None)
        for layer, value in layers.items():
            if parts is not None:
                value = value[0]
            if axis is None:
                out[f"{block}{layer}.{back.get(rest, rest)}"] = value
                continue
            inner = rest[len(axis.megatron) :]
            for expert in range(value.shape[0]):
                out[f"{block}{layer}.{axis.ours}{expert}.{inner}"] = value[expert]
    return out
