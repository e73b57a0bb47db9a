"""Megatron-LM's key layout of a ``torch_dist`` checkpoint, as tables that map our global keys.

megatron-core (observed on 0.16.1 with its local GPT spec) writes the transformer layers of a
block **stacked**: one key per kind of parameter with a leading layer axis, e.g.
``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[num_layers, 3h, h]`` (layer ``l``
is the slice at offset ``l`` of that axis, whichever pipeline stage holds it). It uses the
Transformer Engine names even for its local spec (the input norm is fused into ``linear_qkv``,
the pre-MLP norm into ``linear_fc1``) and writes one ``_extra_state`` object per layer for each
linear module, under ``<stacked key>._extra_state/shard_<layer>_<num_layers>``.

Everything model-specific is in the tables below; a model family adds rows:

* :data:`LAYER_RENAMES` -- a layer's tensor named differently by Megatron (with the tensor that
  must exist in the same layer for the rename to apply: a MoE layer has no ``mlp.linear_fc1``,
  so its ``pre_mlp_layernorm`` keeps its name);
* :data:`EXTRA_STATE_MODULES` -- the layer modules that carry an ``_extra_state`` object (written
  for every such module whose ``weight`` the layer has).

The ``torch`` format's model entries get megatron-core's ``_extra_state`` entries too
(:func:`with_extra_state`: one per column/row-parallel linear module, no table needed).

Keys outside the layers of a block (embeddings, final norm, output layer) are not changed.
Checkpoints written before this layout (one key per layer, ``decoder.layers.3.…``) are told
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
    requires: str
    """Key within the layer that must exist for the rename to apply."""


LAYER_RENAMES: Tuple[Rename, ...] = (
    Rename(
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
    ),
    Rename(
        "input_layernorm.bias",
        "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight",
    ),
    Rename("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight"),
    Rename("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight"),
)

EXTRA_STATE_MODULES: Tuple[str, ...] = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)

# What megatron-core stores for the extra state of a linear layer without fp8 metadata.
EMPTY_EXTRA_STATE = None
EXTRA_STATE_SUFFIX = "._extra_state"

_LAYER_KEY = re.compile(r"^(?P<block>(?:.*\.)?layers\.)(?P<index>\d+)\.(?P<rest>.+)$")


def split_layer_key(key: str) -> Optional[Tuple[str, int, str]]:
    """(block prefix ending in ``layers.``, layer index, key within the layer), or None."""
    match = _LAYER_KEY.match(key)
    if match is None:
        return None
    return match.group("block"), int(match.group("index")), match.group("rest")


def _renames_for(layer_keys: Iterable[str]) -> Dict[str, str]:
    present = set(layer_keys)
    return {r.ours: r.megatron for r in LAYER_RENAMES if r.requires in present}


def _stacked(entry: ShardedTensor, key: str, layer: int, num_layers: int) -> ShardedTensor:
    """``entry`` (one layer's tensor) as the slice ``layer`` of a tensor with a layer axis."""
    chunks = tuple(
        Chunk((layer,) + c.global_offset, (0,) + c.local_offset, (1,) + c.shape)
        for c in entry.chunks
    )
    return ShardedTensor(
        key,
        entry.data.unsqueeze(0),
        (num_layers,) + entry.global_shape,
        chunks,
        entry.replica,
        name_suffix=f"@layer{layer}",
    )


def to_megatron_layout(
    entries: Dict[str, ShardedTensor], num_layers: Dict[str, int], writes_extra_state: bool
) -> Tuple[Dict[str, ShardedTensor], Dict[str, ShardedTensor], List[ShardedObject]]:
    """Stack and rename the per-layer entries (global keys ``<block>layers.<l>.<rest>``).

    ``num_layers`` gives the number of layers of the whole model for each block prefix. Returns
    ({new key: entry}, {old key: new entry}, the ``_extra_state`` objects); the objects are
    marked replica unless ``writes_extra_state`` (one rank of each layer's TP x DP group writes).
    """
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
        rest = _renames_for(per_layer[(block, layer)]).get(rest, rest)
        new = _stacked(entry, block + rest, layer, num_layers[block])
        if new.name in out:
            raise ValueError(f"two tensors map to the layer {layer} slice of {new.key}")
        out[new.name] = by_old[key] = new
    for (block, layer), keys in sorted(per_layer.items()):
        for module in EXTRA_STATE_MODULES:
            if module + ".weight" in keys:
                objects.append(
                    ShardedObject(
                        f"{block}{module}._extra_state",
                        EMPTY_EXTRA_STATE,
                        (num_layers[block],),
                        (layer,),
                        replica=not writes_extra_state,
                    )
                )
    return out, by_old, objects


def with_extra_state(chunk: torch.nn.Module, state: Dict[str, object]) -> Dict[str, object]:
    """``state`` (``chunk.state_dict()``) with the ``_extra_state`` entries that megatron-core's
    state_dict() has, so that Megatron-LM loads a ``torch``-format file strictly: its column- and
    row-parallel linear layers (every one, the output layer included) define an empty extra
    state; ours are the same modules and keep none."""
    out = dict(state)
    for name, module in chunk.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            out.setdefault(name + EXTRA_STATE_SUFFIX, EMPTY_EXTRA_STATE)
    return out


def without_extra_state(state: Dict[str, object]) -> Dict[str, object]:
    """``state`` without ``_extra_state`` entries (Megatron-LM's, or written by
    :func:`with_extra_state`): none of our modules keeps extra state."""
    return {k: v for k, v in state.items() if not k.endswith(EXTRA_STATE_SUFFIX)}


def is_per_layer_layout(checkpoint_keys: Iterable[str]) -> bool:
    """True for a checkpoint written before the Megatron layout (``…layers.<l>.…`` keys)."""
    return any(split_layer_key(k) is not None for k in checkpoint_keys)


def unstack(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Full tensors of a Megatron-layout checkpoint under our per-layer names (offline tools).

    A stacked key ``<block>layers.<rest>`` of shape ``[L, ...]`` becomes ``<block>layers.<l>.
    <our rest>`` for each layer ``l``; other keys are kept.
    """
    back = {r.megatron: r.ours for r in LAYER_RENAMES}
    out: Dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        head, sep, rest = key.rpartition(LAYERS)
        if not sep or split_layer_key(key) is not None or tensor.dim() == 0:
            out[key] = tensor
            continue
        for layer in range(tensor.shape[0]):
            out[f"{head}{LAYERS}{layer}.{back.get(rest, rest)}"] = tensor[layer]
    return out
