"""torch.distributed.checkpoint (DCP) planners for :class:`ShardedTensor` entries.

DCP's default planners know plain tensors, DTensors and the old ShardedTensor; ours describe
each chunk of a :class:`ShardedTensor` directly as a DCP write/read item, so a tensor-parallel
shard (even one made of several strided blocks) is stored as chunks of the global tensor and
any layout reads back exactly the pieces it holds. The save planner checks on the coordinator
that the chunks of every key tile the global tensor exactly once (nothing written twice,
nothing missing) before a byte is written.

The dict's keys only name the entries; the checkpoint key is each entry's ``key``, so several
entries (the layers of a stacked tensor held by one rank) may write chunks of the same key.
:class:`ShardedObject` entries are written as pickled bytes under their ``unique_key``; those
marked ``read_back`` are read back with ``torch.load(weights_only=True)`` (numpy arrays allowed:
Megatron-LM's RNG state holds numpy's), so no object in a checkpoint can run code.
"""

from __future__ import annotations

import io
from typing import Dict, List, Tuple, Union

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .mapping import Chunk, PlainObject, ShardedObject, ShardedTensor
from .safe_objects import load_object

_MAX_LISTED = 5


class ShardingError(ValueError):
    """The chunks of a sharded state dict do not tile their global tensors exactly once."""


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    # torch.save writes a tensor's whole storage: a view must be copied out first.
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.cpu().contiguous()
    compact = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    return tensor if compact else tensor.clone(memory_format=torch.contiguous_format)


def _overlap(
    a: Tuple[Tuple[int, ...], Tuple[int, ...]], b: Tuple[Tuple[int, ...], Tuple[int, ...]]
) -> bool:
    (a_off, a_size), (b_off, b_size) = a, b
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)
    )


def check_tiling(all_plans: List[SavePlan]) -> None:
    """Raise ShardingError unless, for every key, the chunks written by all ranks lie inside the
    global tensor, agree on its shape and dtype, never overlap and cover every element."""
    per_key: Dict[str, list] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            per_key.setdefault(item.index.fqn, []).append(
                (
                    rank,
                    tuple(data.size),
                    data.properties.dtype,
                    tuple(data.chunk.offsets),
                    tuple(data.chunk.sizes),
                )
            )
    problems = []
    for key, chunks in per_key.items():
        shapes = {c[1] for c in chunks}
        dtypes = {c[2] for c in chunks}
        if len(shapes) > 1 or len(dtypes) > 1:
            problems.append(
                f"{key}: ranks disagree on its global shape/dtype "
                f"({sorted(map(str, shapes | dtypes))})"
            )
            continue
        shape = chunks[0][1]
        total = 1
        for s in shape:
            total *= s
        covered = 0
        for i, (rank, _, _, off, size) in enumerate(chunks):
            if any(o < 0 or o + s > g for o, s, g in zip(off, size, shape)):
                problems.append(
                    f"{key}: chunk at {off} of size {size} from rank {rank} lies outside {shape}"
                )
            volume = 1
            for s in size:
                volume *= s
            covered += volume
            for other_rank, _, _, o_off, o_size in chunks[:i]:
                if _overlap((off, size), (o_off, o_size)):
                    problems.append(
                        f"{key}: chunk at {off} is written by rank {other_rank} and rank {rank}"
                    )
                    break
        if covered < total and not any(p.startswith(f"{key}:") for p in problems):
            problems.append(
                f"{key}: chunks cover {covered} of its {total} elements (shape {shape})"
            )
    if problems:
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise ShardingError(
            "invalid sharding of the checkpoint: " + "; ".join(problems[:_MAX_LISTED]) + more
        )


def chunk_index(
    state_dict: Dict[str, ShardedTensor],
) -> Dict[Tuple[str, Tuple[int, ...]], Tuple[ShardedTensor, Chunk]]:
    """{(checkpoint key, global offset of a chunk): (entry, chunk)} over the tensor entries."""
    index = {}
    for name, sharded in state_dict.items():
        if not isinstance(sharded, ShardedTensor):
            continue
        for chunk in sharded.chunks:
            place = (sharded.key, tuple(chunk.global_offset))
            if place in index:
                raise ValueError(
                    f"{name}: two entries hold the chunk of {sharded.key} at {place[1]}"
                )
            index[place] = (sharded, chunk)
    return index


class ShardedSavePlanner(SavePlanner):
    """Writes every non-replica chunk (and object) of a flat ``{name: entry}`` dict."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        for key, value in state_dict.items():
            if not isinstance(value, (ShardedTensor, ShardedObject, PlainObject)):
                raise TypeError(f"{key}: expected a ShardedTensor, got {type(value).__name__}")
        self.state_dict: Dict[str, Union[ShardedTensor, ShardedObject]] = state_dict
        self._chunks = chunk_index(state_dict)
        self._objects = {
            v.unique_key: v
            for v in state_dict.values()
            if isinstance(v, (ShardedObject, PlainObject))
        }
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for sharded in self.state_dict.values():
            if sharded.replica:
                continue
            if isinstance(sharded, (ShardedObject, PlainObject)):
                items.append(
                    WriteItem(index=MetadataIndex(sharded.unique_key), type=WriteItemType.BYTE_IO)
                )
                continue
            properties = TensorProperties(dtype=sharded.data.dtype)
            for chunk in sharded.chunks:
                offsets = torch.Size(chunk.global_offset)
                items.append(
                    WriteItem(
                        index=MetadataIndex(sharded.key, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(
                                offsets=offsets, sizes=torch.Size(chunk.shape)
                            ),
                            properties=properties,
                            size=torch.Size(sharded.global_shape),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        check_tiling(all_plans)
        plans, metadata = create_default_global_save_plan(all_plans)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            # megatron-core stores, under an object's unique key, the list of the objects its
            # rank holds for that key (one): it reads back a list.
            obj = self._objects[write_item.index.fqn]
            torch.save(obj.data if isinstance(obj, PlainObject) else [obj.data], buffer)
            buffer.seek(0)
            return buffer
        sharded, chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        return _compact_cpu(sharded.view(chunk))


class ShardedLoadPlanner(LoadPlanner):
    """Reads, for every entry of a flat ``{name: ShardedTensor}`` dict, the saved pieces that
    overlap its chunks, straight into its local tensor; and for every ``read_back``
    :class:`ShardedObject`, the object saved under its unique key, into its ``data``."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict: Dict[str, Union[ShardedTensor, ShardedObject]] = state_dict
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, ShardedTensor)}
        self._chunks = chunk_index(tensors)
        self._objects = {
            v.unique_key: v
            for v in state_dict.values()
            if isinstance(v, (ShardedObject, PlainObject))
        }
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        for key, entry in self._objects.items():
            if not isinstance(self.metadata.state_dict_metadata.get(key), BytesStorageMetadata):
                raise KeyError(f"{key} is not an object in the checkpoint")
            index = MetadataIndex(key)
            requests.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=index,
                    dest_offsets=torch.Size((0,)),
                    storage_index=index,
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        for sharded in self.state_dict.values():
            if isinstance(sharded, (ShardedObject, PlainObject)):
                continue
            key = sharded.key
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"{key} is not a tensor in the checkpoint")
            if tuple(md.size) != tuple(sharded.global_shape):
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(md.size)} "
                    f"vs model {tuple(sharded.global_shape)}"
                )
            local = [
                ChunkStorageMetadata(offsets=torch.Size(c.global_offset), sizes=torch.Size(c.shape))
                for c in sharded.chunks
            ]
            requests += create_read_items_for_chunk_list(key, md, local)
        return LoadPlan(requests)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        key = read_item.dest_index.fqn
        if key not in self._objects:
            raise ValueError(f"{key}: unexpected non-tensor entry in the checkpoint")
        obj = self._objects[key]
        obj.data = load_object(value, key, in_list=not isinstance(obj, PlainObject))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        sharded, chunk = self._chunks[
            (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        ]
        target = sharded.view(chunk)
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            if start != 0 or length != target.shape[dim]:
                target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already in place
