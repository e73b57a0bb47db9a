"""A model chunk's state as sharded entries keyed by global names, computed from the outside.

The global name of a tensor is its key in the whole model at TP=1, PP=1:
* a pipeline stage's layers are numbered from 0 locally; a module that carries
  ``layer_number_offset`` and a ``layers`` list (the TransformerBlock) shifts them, so
  ``decoder.layers.0`` of a stage whose first layer is the model's fourth becomes
  ``decoder.layers.3``;
* a tensor-parallel parameter (``tensor_model_parallel`` set by the TP layers) is the
  ``partition_dim`` shard of the global tensor (``partition_stride`` blocks for fused weights);
  other tensors are replicated over TP and saved by TP rank 0 only;
* an MoE layer's experts (``experts.local_experts.<i>``, local index i on this expert-parallel
  rank) are numbered globally, shifted by the experts module's ``local_expert_offset``; they
  are split over the expert-tensor-parallel ranks instead of TP and marked ``expert``;
* an FSDP2 parameter (a DTensor sharded on dim 0 over DP x CP) gives the rows of the tensor above
  that this rank's shard holds (``dp_sharded``: every DP rank saves its own);
* with tied input/output embeddings, the last stage's ``output_layer.weight`` is a copy of the
  first stage's ``embedding.word_embeddings.weight``: loaded from that key, never saved.

Then, by default, the layers (and a MoE layer's experts) are stacked (or, mixing dense and MoE
layers, keyed layer by layer) and renamed as Megatron-LM writes them (:mod:`.megatron_layout`);
``megatron_layout=False`` keeps one key per layer, the layout of checkpoints written here
before.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Iterable, List, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from .mapping import ShardedObject, ShardedTensor, replicated, rows_of, tensor_parallel_sharded
from .megatron_layout import (
    EMPTY_EXTRA_STATE,
    EXTRA_STATE_SUFFIX,
    to_megatron_layout,
)

MTP_LAYERS = "mtp.layers."
"""The multi-token-prediction depths: Megatron keys them one by one (``mtp.layers.<k>.``)."""
TIED_OUTPUT_KEY = "output_layer.weight"
TIED_EMBEDDING_KEY = "embedding.word_embeddings.weight"


def _blocks(chunk: torch.nn.Module) -> List[Tuple[str, int, int]]:
    """(state-dict prefix of a layer list, number of model layers before it, number of layers of
    the whole model) for each block, longest prefix first; the MTP depths form a block."""
    found = []
    for name, module in chunk.named_modules():
        if (name + ".layers.").endswith(MTP_LAYERS) and getattr(module, "is_mtp_block", False):
            found.append((name + ".layers.", 0, len(module.layers)))
            continue
        offset = getattr(module, "layer_number_offset", None)
        if isinstance(offset, int) and isinstance(
            getattr(module, "layers", None), torch.nn.ModuleList
        ):
            total = getattr(getattr(module, "config", None), "num_layers", None)
            if not isinstance(total, int):
                total = offset + len(module.layers)
            found.append(((name + "." if name else "") + "layers.", offset, total))
    return sorted(found, key=lambda item: -len(item[0]))


def _layer_offsets(chunk: torch.nn.Module) -> List[Tuple[str, int]]:
    """(state-dict prefix of a layer list, number of model layers before it) for each block."""
    return [(prefix, offset) for prefix, offset, _ in _blocks(chunk)]


def _expert_offsets(chunk: torch.nn.Module) -> List[Tuple[str, int, int]]:
    """(state-dict prefix of a local-experts list, global index of its first expert, number of
    experts of the whole layer)."""
    found = []
    for name, module in chunk.named_modules():
        offset = getattr(module, "local_expert_offset", None)
        if isinstance(offset, int) and isinstance(
            getattr(module, "local_experts", None), torch.nn.ModuleList
        ):
            total = getattr(getattr(module, "config", None), "num_moe_experts", None)
            if not isinstance(total, int):
                total = offset + len(module.local_experts)
            found.append(((name + "." if name else "") + "local_experts.", offset, total))
    return found


def global_key(local_key: str, offsets: Iterable[Tuple[str, int]]) -> str:
    """``local_key`` with its local layer index shifted by the block's layer offset."""
    for prefix, offset in offsets:
        if local_key.startswith(prefix):
            match = re.match(r"(\d+)(\..*)?$", local_key[len(prefix) :])
            if match:
                return f"{prefix}{int(match.group(1)) + offset}{match.group(2) or ''}"
    return local_key


def _has_mixed_layers(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` mixes dense and MoE layers (``--moe-layer-freq`` above 1 or a list, as
    megatron-core decides it), gated delta net and attention layers, or is a hybrid model (a
    block marked ``KEYED_LAYER_BY_LAYER``): its blocks are then keyed layer by layer, not
    stacked."""
    for module in chunk.modules():
        if getattr(type(module), "KEYED_LAYER_BY_LAYER", False):
            return True
        config = getattr(module, "config", None)
        if config is None:
            continue
        # Gated delta net layers among softmax-attention ones (Megatron-LM's later blocks key
        # them layer by layer too: a list or an int above 1 of --linear-attention-freq).
        linear = getattr(config, "linear_attention_freq", None)
        if getattr(config, "experimental_attention_variant", None) and (
            isinstance(linear, (list, tuple)) or (isinstance(linear, int) and linear > 1)
        ):
            return True
        if not getattr(config, "num_moe_experts", None):
            continue
        freq = getattr(config, "moe_layer_freq", 1)
        if isinstance(freq, (list, tuple)) or freq > 1:
            return True
    return False


def _ties_output_to_embedding(chunk: torch.nn.Module) -> bool:
    return bool(
        getattr(chunk, "share_embeddings_and_output_weights", False)
        and getattr(chunk, "post_process", False)
        and not getattr(chunk, "pre_process", True)
    )


def model_sharded_state_dict(
    chunks: Sequence[torch.nn.Module],
    tp_rank: int = 0,
    tp_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
    megatron_layout: bool = True,
) -> Tuple[Dict[str, ShardedTensor], Dict[int, ShardedTensor]]:
    """Sharded entries for the (unwrapped) model chunks of this rank (``etp_*``: its expert
    tensor-parallel rank and size).

    Returns ``({entry name: entry}, {id(parameter): entry})``; the second map lets the optimizer
    state of a parameter be keyed and sharded like the parameter. ``replica`` is set for tensors
    another TP rank (or the first pipeline stage, for a tied output layer) saves. In Megatron's
    layout the first map also holds the layers' ``_extra_state`` objects (ShardedObject).
    """
    # Here, not at module level: torch.distributed.tensor (with sympy) costs about a second of
    # start-up that a run saving no torch_dist checkpoint never needs.
    from torch.distributed.tensor import DTensor

    entries: Dict[str, ShardedTensor] = {}
    by_param: Dict[int, ShardedTensor] = {}
    num_layers: Dict[str, int] = {}
    num_experts = 0
    for chunk in chunks:
        blocks = _blocks(chunk)
        num_layers.update({prefix: total for prefix, _, total in blocks})
        offsets = [(prefix, offset) for prefix, offset, _ in blocks]
        expert_offsets = _expert_offsets(chunk)
        num_experts = max([num_experts] + [total for _, _, total in expert_offsets])
        expert_offsets = [(prefix, offset) for prefix, offset, _ in expert_offsets]
        tied = _ties_output_to_embedding(chunk)
        for local_key, tensor in chunk.state_dict(keep_vars=True).items():
            if not torch.is_tensor(tensor) or local_key.endswith("_extra_state"):
                continue
            key = global_key(global_key(local_key, expert_offsets), offsets)
            if not getattr(tensor, "allreduce", True):
                entry = _expert_entry(key, tensor, etp_rank, etp_size)
                if key in entries:
                    raise ValueError(f"two tensors of this rank map to the checkpoint key {key}")
                entries[key] = by_param[id(tensor)] = entry
                continue
            forced_replica = False
            if tied and local_key == TIED_OUTPUT_KEY:
                key, forced_replica = TIED_EMBEDDING_KEY, True
            elif getattr(tensor, "shared", False) and key == TIED_EMBEDDING_KEY:
                # The last stage's copy of the embedding (multi-token prediction's).
                forced_replica = True
            if key in entries:
                raise ValueError(f"two tensors of this rank map to the checkpoint key {key}")
            data = tensor.detach()
            if getattr(tensor, "tensor_model_parallel", False) and tp_size > 1:
                entry = tensor_parallel_sharded(
                    key,
                    data,
                    int(tensor.partition_dim),
                    tp_rank,
                    tp_size,
                    int(getattr(tensor, "partition_stride", 1)),
                    replica=forced_replica,
                    partition_sizes=getattr(tensor, "partition_sizes", None),
                )
            else:
                entry = replicated(key, data, replica=forced_replica or tp_rank != 0)
            if isinstance(data, DTensor):
                entry = _fsdp_rows(entry, data)
            entries[key] = entry
            by_param[id(tensor)] = entry
    if not megatron_layout:
        return entries, by_param
    stacked, by_old, objects = to_megatron_layout(
        entries,
        num_layers,
        writes_extra_state=tp_rank == 0,
        num_experts=num_experts,
        writes_expert_extra_state=etp_rank == 0,
        layer_by_layer={
            prefix
            for chunk in chunks
            for prefix, _, _ in _blocks(chunk)
            if _has_mixed_layers(chunk) or prefix.endswith(MTP_LAYERS)
        },
    )
    for chunk in chunks:
        # The model class's own keys outside the layers (LanguageModule's hooks).
        for alias, ours in getattr(type(chunk), "CHECKPOINT_ALIASES", ()):
            if ours in stacked:
                entry = stacked[ours]
                stacked[alias] = ShardedTensor(
                    alias,
                    entry.data,
                    entry.global_shape,
                    entry.chunks,
                    entry.replica,
                    dp_sharded=entry.dp_sharded,
                )
                stacked[alias].optional = True
        for module in getattr(type(chunk), "TOP_LEVEL_EXTRA_STATE", ()):
            if any(k.startswith(module + ".") for k in stacked):
                objects.append(
                    ShardedObject(
                        module + EXTRA_STATE_SUFFIX, EMPTY_EXTRA_STATE, (1,), (0,), tp_rank != 0
                    )
                )
    out: Dict[str, object] = dict(stacked)
    out.update({o.name: o for o in objects})
    return out, {pid: by_old[e.key] for pid, e in by_param.items()}


def _expert_entry(key: str, tensor: torch.Tensor, etp_rank: int, etp_size: int) -> ShardedTensor:
    from torch.distributed.tensor import DTensor  # lazily, as in model_sharded_state_dict

    data = tensor.detach()
    if getattr(tensor, "tensor_model_parallel", False) and etp_size > 1:
        entry = tensor_parallel_sharded(
            key,
            data,
            int(tensor.partition_dim),
            etp_rank,
            etp_size,
            int(getattr(tensor, "partition_stride", 1)),
        )
    else:
        entry = replicated(key, data, replica=etp_rank != 0)
    if isinstance(data, DTensor):  # Megatron-FSDP: sharded over expert DP
        entry = _fsdp_rows(entry, data)
    entry.expert = True
    return entry


def _fsdp_rows(entry: ShardedTensor, param: DTensor) -> ShardedTensor:
    """The entry of an FSDP2 parameter: the rows of dim 0 that this rank's shard holds (FSDP2
    cuts dim 0 as ``torch.chunk`` does: ceil(rows / DP) rows per rank, the last ones fewer)."""
    from torch.distributed.tensor import Shard  # lazily, as in model_sharded_state_dict

    if len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
        raise ValueError(f"{entry.key}: FSDP2 parameter placed {param.placements}, not Shard(0)")
    if param.placements[0].dim != 0:
        raise ValueError(f"{entry.key}: FSDP2 parameter sharded on dim {param.placements[0].dim}")
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size())
    start = min(rows, param.device_mesh.get_local_rank() * per_rank)
    local = param.to_local()
    if local.shape[0] != min(rows, start + per_rank) - start:
        raise ValueError(f"{entry.key}: FSDP2 shard of {local.shape[0]} rows at row {start}")
    return rows_of(entry, start, local)


def spread_writes(
    entries: Dict[str, ShardedTensor], dp_rank: int, dp_size: int, fully_parallel: bool = True
) -> None:
    """Let one data-parallel replica save each non-replica entry: DP rank 0 for all of them, or,
    ``fully_parallel``, the ranks in turn balanced by bytes (every replica computes the same
    assignment from the same keys and sizes)."""
    if dp_size <= 1:
        return
    if not fully_parallel:
        for entry in entries.values():
            if not getattr(entry, "dp_sharded", False):
                entry.replica = entry.replica or dp_rank != 0
        return
    entries = {k: e for k, e in entries.items() if not getattr(e, "dp_sharded", False)}
    load = [0] * dp_size
    order = sorted(
        (k for k, e in entries.items() if not e.replica), key=lambda k: (-_nbytes(entries[k]), k)
    )
    for key in order:
        writer = min(range(dp_size), key=lambda r: (load[r], r))
        load[writer] += _nbytes(entries[key])
        entries[key].replica = writer != dp_rank


def _nbytes(entry) -> int:
    if isinstance(entry, ShardedObject):
        return 1
    return entry.data.numel() * entry.data.element_size()
