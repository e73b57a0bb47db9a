"""Sharded state dicts: every entry names one tensor of the whole (unsplit) model and says which
pieces of it this rank holds.

A checkpoint written from sharded entries is layout-free: it holds each global tensor (the
tensor of the TP=1, PP=1 model, keyed by its global name) cut into chunks, and any layout can
read back the pieces it needs. Tensor parallelism splits a tensor into ``tp_size`` even parts
along ``partition_dim``; with ``stride`` > 1 each rank holds ``stride`` separate blocks (SwiGLU's
fc1 = [gate; up] gives rank r [gate_r; up_r]), so one local tensor may map to several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch


class Chunk(NamedTuple):
    """One rectangular piece of a global tensor held in a local tensor."""

    global_offset: Tuple[int, ...]
    local_offset: Tuple[int, ...]
    shape: Tuple[int, ...]


@dataclass
class ShardedTensor:
    """A rank's share of one global tensor."""

    key: str
    """Global name, e.g. ``decoder.layers.3.self_attention.linear_qkv.weight``."""
    data: torch.Tensor
    """The local tensor: saved from, and loaded into in place."""
    global_shape: Tuple[int, ...]
    """Shape of the whole tensor."""
    chunks: Tuple[Chunk, ...]
    """Where the pieces of ``data`` sit in the global tensor."""
    replica: bool = False
    """True when another rank saves the same pieces: loaded here, never saved from here."""
    name_suffix: str = ""
    """Appended to ``key`` to name the entry in a sharded state dict, where the key alone is not
    unique: a rank holding several layers of a stacked tensor has one entry per layer."""

    @property
    def name(self) -> str:
        """The entry's name in a sharded state dict (unique on the rank)."""
        return self.key + self.name_suffix

    expert: bool = False
    """An MoE expert's tensor: replicated over the expert-data-parallel group, not over DP."""
    optional: bool = False
    """A second key for a tensor saved under another key too (megatron-core's T5 keeps such
    aliases): saved, and loaded only where the checkpoint has it."""
    dp_sharded: bool = False
    """Each data-parallel rank holds its own rows of ``data`` (an FSDP2 shard): saved by every
    DP rank, never spread over them as a replicated tensor is."""
    local_shape: Optional[Tuple[int, ...]] = None
    """The shape the model holds ``data`` in, where ``data`` is a view of another shape (a layer
    of a stacked tensor has a leading layer axis of 1): what ``dist_checkpointing.load`` returns
    the loaded tensor as. None: ``data``'s shape."""

    def view(self, chunk: Chunk) -> torch.Tensor:
        """The part of ``data`` that holds ``chunk`` (a view: writing to it writes ``data``)."""
        out = self.data
        for dim, (start, size) in enumerate(zip(chunk.local_offset, chunk.shape)):
            if start != 0 or size != out.shape[dim]:
                out = out.narrow(dim, start, size)
        return out

    def chunk_at(self, global_offset: Sequence[int]) -> Chunk:
        wanted = tuple(int(x) for x in global_offset)
        for chunk in self.chunks:
            if chunk.global_offset == wanted:
                return chunk
        raise KeyError(f"{self.key} has no chunk at offset {wanted}")

    def with_data(self, key: str, data: torch.Tensor, replica: bool = None) -> "ShardedTensor":
        """The same sharding for another tensor of the same local size (optimizer state), viewed
        in this entry's local shape."""
        if data.numel() == self.data.numel():
            data = data.view(self.data.shape)
        else:
            raise ValueError(
                f"{key}: local shape {tuple(data.shape)} differs from {self.key}'s "
                f"{tuple(self.data.shape)}"
            )
        return ShardedTensor(
            key,
            data,
            self.global_shape,
            self.chunks,
            self.replica if replica is None else replica,
            self.name_suffix,
            self.expert,
            dp_sharded=self.dp_sharded,
        )


@dataclass
class ShardedObject:
    """A picklable object stored as one piece of a grid of objects (Megatron's ShardedObject,
    e.g. a layer's ``_extra_state``); its checkpoint key is :attr:`unique_key`."""

    key: str
    """Name of the grid, e.g. ``decoder.layers.self_attention.linear_qkv._extra_state``."""
    data: object
    """The object (saved with ``torch.save``)."""
    global_shape: Tuple[int, ...]
    """Shape of the grid, e.g. ``(num_layers,)``."""
    global_offset: Tuple[int, ...]
    """This object's place in the grid."""
    replica: bool = False
    """True when another rank saves the same object."""
    expert: bool = False
    """An MoE expert's object: replicated over the expert-data-parallel group, not over DP."""
    read_back: bool = False
    """True: loading replaces :attr:`data` with the object saved under :attr:`unique_key` (the
    RNG state); False: the entry is written but never read (the layers' ``_extra_state``)."""

    @property
    def unique_key(self) -> str:
        offset = ".".join(str(i) for i in self.global_offset)
        shape = ".".join(str(i) for i in self.global_shape)
        return f"{self.key}/shard_{offset}_{shape}"

    @property
    def name(self) -> str:
        return self.unique_key


@dataclass
class PlainObject:
    """A picklable object stored under its key alone, as torch.distributed.checkpoint's own
    planners store a non-tensor value (``torch.save`` of the value itself): the form of
    Megatron-LM's fsdp_dtensor checkpoints (``args``, ``iteration``, ...)."""

    key: str
    data: object
    replica: bool = False
    """True when another rank saves the same object."""
    read_back: bool = False
    """True: loading replaces :attr:`data` with the saved object."""

    @property
    def unique_key(self) -> str:
        return self.key

    @property
    def name(self) -> str:
        return self.key


def replicated(key: str, tensor: torch.Tensor, replica: bool = False) -> ShardedTensor:
    """A tensor every rank holds whole."""
    shape = tuple(tensor.shape)
    zeros = (0,) * len(shape)
    return ShardedTensor(key, tensor, shape, (Chunk(zeros, zeros, shape),), replica)


def tensor_parallel_sharded(
    key: str,
    tensor: torch.Tensor,
    partition_dim: int,
    tp_rank: int,
    tp_size: int,
    stride: int = 1,
    replica: bool = False,
    partition_sizes=None,
) -> ShardedTensor:
    """Rank ``tp_rank``'s shard of a tensor split over ``tp_size`` ranks along ``partition_dim``.

    With ``stride`` s the global dimension is cut into ``s * tp_size`` equal blocks and rank r
    holds blocks r, r + tp_size, ... (in that order), as the tensor-parallel layers split it.
    ``partition_sizes`` (the local sizes of parts of different sizes, each split over TP, as
    Mamba's in_proj [z, x, B, C, dt]): rank r holds its piece of every part, in part order.
    """
    if tp_size == 1:
        return replicated(key, tensor, replica)
    shape = tuple(tensor.shape)
    if not 0 <= partition_dim < len(shape):
        raise ValueError(f"{key}: partition_dim {partition_dim} out of range for shape {shape}")
    local = shape[partition_dim]
    if partition_sizes:
        if sum(partition_sizes) != local:
            raise ValueError(f"{key}: partition sizes {partition_sizes} do not add up to {local}")
        chunks, g_start, l_start = [], 0, 0
        for size in partition_sizes:
            g_off = [0] * len(shape)
            l_off = [0] * len(shape)
            g_off[partition_dim] = g_start + tp_rank * size
            l_off[partition_dim] = l_start
            piece = list(shape)
            piece[partition_dim] = size
            chunks.append(Chunk(tuple(g_off), tuple(l_off), tuple(piece)))
            g_start += size * tp_size
            l_start += size
        global_shape = list(shape)
        global_shape[partition_dim] = local * tp_size
        return ShardedTensor(key, tensor, tuple(global_shape), tuple(chunks), replica)
    if stride < 1 or local % stride:
        raise ValueError(
            f"{key}: local size {local} along dim {partition_dim} "
            f"is not divisible by stride {stride}"
        )
    block = local // stride
    global_shape = list(shape)
    global_shape[partition_dim] = local * tp_size
    chunks: List[Chunk] = []
    for k in range(stride):
        g_off = [0] * len(shape)
        l_off = [0] * len(shape)
        g_off[partition_dim] = (k * tp_size + tp_rank) * block
        l_off[partition_dim] = k * block
        piece = list(shape)
        piece[partition_dim] = block
        chunks.append(Chunk(tuple(g_off), tuple(l_off), tuple(piece)))
    return ShardedTensor(key, tensor, tuple(global_shape), tuple(chunks), replica)


def rows_of(entry: ShardedTensor, start: int, rows: torch.Tensor) -> ShardedTensor:
    """``entry`` (of a tensor this rank would hold whole) cut to the rows ``start .. start +
    len(rows)`` of its dim 0, which ``rows`` holds: an FSDP2 shard of a (TP-local) parameter."""
    stop = start + rows.shape[0]
    chunks = []
    for c in entry.chunks:
        lo, hi = max(c.local_offset[0], start), min(c.local_offset[0] + c.shape[0], stop)
        if lo >= hi:
            continue
        chunks.append(
            Chunk(
                (c.global_offset[0] + lo - c.local_offset[0],) + c.global_offset[1:],
                (lo - start,) + c.local_offset[1:],
                (hi - lo,) + c.shape[1:],
            )
        )
    return ShardedTensor(
        entry.key,
        rows,
        entry.global_shape,
        tuple(chunks),
        entry.replica,
        entry.name_suffix,
        entry.expert,
        dp_sharded=True,
    )


def chunk_volume(chunk: Chunk) -> int:
    volume = 1
    for size in chunk.shape:
        volume *= size
    return volume
