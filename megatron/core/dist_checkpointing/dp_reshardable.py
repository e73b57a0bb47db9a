"""megatron-core's default distributed-optimizer checkpoint layout, ``dp_reshardable``.

megatron-core keeps its distributed optimizer's state in the layout of its grad buffers and
writes it so: per model-parallel rank ``m``, grad buffer ``g`` (model chunk by chunk, one per
(param dtype, grad dtype)) and bucket ``b``, one flat tensor per state name::

    optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_(<pd>, <gd>).bucket_idx_<b>.<name>

(``<pd>``, ``<gd>``: the param and grad dtypes) with ``<name>`` ``param`` (the fp32 main
weights), ``exp_avg`` and ``exp_avg_sq``. Element ``i`` of such a tensor is element ``i`` of the
bucket, whose global size is the bucket's unpadded numel (the end padding to a multiple of the
DP size is left out, so DP may change). Beside them, objects
``...dp_group_idx_<m>.per_bucket_numel`` and ``...per_bucket_numel_unpadded`` (a list over
buffers of ``{(param dtype, grad dtype): [numel per bucket]}``) and ``...optimizer`` (the inner
optimizer's ``param_groups``, each with the step).

The layout of a buffer (:func:`buffer_layout`), as megatron-core's ``_ParamAndGradBuffer``
builds it with the distributed optimizer: the buffer's parameters are taken in reverse
registration order; each starts at a multiple of 64 elements of the buffer; a bucket closes once
it holds ``bucket_size`` elements or more (no limit when megatron-core runs without
``--overlap-grad-reduce``, on pipeline stages after the first and on model chunks after the
first) and is padded at its end to a multiple of lcm(DP size, 128); a parameter marked
``shared_embedding`` (tied embeddings split over pipeline stages) gets a bucket of its own.

Which order megatron-core registers a GPT's parameters in (:func:`registration_order`) is known
here for its dense layers only (local spec; the TE spec's fused ``layer_norm_*`` names by TE's
source, unproven against a TE checkpoint); other models are refused by the caller.
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .mapping import ShardedObject, ShardedTensor, replicated
from .safe_objects import load_object

PREFIX = "optimizer.distributed."
DP_RESHARDABLE = "dp_reshardable"
PARAM_START_ALIGNMENT = 64
"""Every parameter starts at a multiple of this many elements of its buffer."""
BUCKET_END_ALIGNMENT = 128
"""A bucket's end is padded to a multiple of lcm(DP size, this)."""


class UnmappableLayout(ValueError):
    """The buffer layout megatron-core would use for this model cannot be reproduced here."""


@dataclass(frozen=True)
class ParamSlot:
    """Where a parameter's elements sit in its bucket."""

    name: str
    """The parameter's name (as given to :func:`buffer_layout`)."""
    start: int
    """First element, counted from the bucket's start."""
    numel: int
    """Number of elements."""

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class BucketLayout:
    """One bucket of a megatron-core grad buffer."""

    params: Tuple[ParamSlot, ...]
    """Its parameters in buffer order (reverse registration order)."""
    numel_unpadded: int
    """Elements up to the end of its last parameter: the size of its checkpoint tensors."""
    numel: int
    """Elements with the end padding to a multiple of lcm(DP size, 128)."""


def _round_up(value: int, divisor: int) -> int:
    return int(math.ceil(value / divisor) * divisor)


def buffer_layout(
    params: Sequence[Tuple[str, int]],
    dp_size: int,
    bucket_size: Optional[int] = None,
    own_bucket: Sequence[str] = (),
) -> List[BucketLayout]:
    """The buckets megatron-core's distributed optimizer lays the buffer of ``params`` out in.

    ``params``: (name, numel) of the buffer's parameters in megatron-core's registration order;
    ``bucket_size``: elements after which a bucket closes (None: one bucket);
    ``own_bucket``: names of parameters that get a bucket of their own (``shared_embedding``).
    """
    if dp_size < 1:
        raise ValueError(f"the data-parallel size must be >= 1, got {dp_size}")
    end_divisor = math.lcm(dp_size, BUCKET_END_ALIGNMENT)
    buckets: List[BucketLayout] = []
    slots: List[ParamSlot] = []
    bucket_start = 0
    position = 0  # in the whole buffer

    def close(end: int) -> int:
        nonlocal slots, bucket_start
        padded_end = _round_up(end, end_divisor)
        buckets.append(BucketLayout(tuple(slots), end - bucket_start, padded_end - bucket_start))
        slots, bucket_start = [], padded_end
        return padded_end

    for name, numel in reversed(list(params)):
        alone = name in own_bucket
        position = _round_up(position, PARAM_START_ALIGNMENT)
        if alone and slots:
            position = close(position)
        slots.append(ParamSlot(name, position - bucket_start, numel))
        end = position + numel
        if alone or (bucket_size is not None and end - bucket_start >= bucket_size):
            position = close(end)
        else:
            position = end
    if slots:
        close(position)
    return buckets


# The order megatron-core's GPT (local spec, dense layers) registers its parameters in.
_TOP_LEVEL = (
    "embedding.word_embeddings.",
    "embedding.position_embeddings.",
    "decoder.layers.",
    "decoder.final_layernorm.",
    "output_layer.",
)
_IN_LAYER = (
    "input_layernorm.",
    # Attention builds linear_proj before SelfAttention adds linear_qkv and the q/k norms.
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    # MLASelfAttention's projections, then its latent norms.
    "self_attention.linear_q_proj.",
    "self_attention.linear_q_down_proj.",
    "self_attention.linear_q_up_proj.",
    "self_attention.linear_kv_down_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "self_attention.kv_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
)
# Within a module: weight before bias. Transformer Engine's fused LayerNormLinear (megatron-core's
# TELayerNormColumnParallelLinear: linear_qkv / linear_fc1 of its TE spec) registers
# layer_norm_weight, then layer_norm_bias (LayerNorm only), then weight, then bias; without a
# bias, ``bias`` is a plain empty tensor, not a parameter, so it is not in the grad buffer
# (TransformerEngine transformer_engine/pytorch/module/layernorm_linear.py, LayerNormLinear
# .__init__, as of its 1.x releases). Not checked against a checkpoint written with TE.
_LEAVES = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def _order_key(name: str) -> Tuple[int, int, int, int]:
    """(top-level module, layer number, module within the layer, weight/bias)."""
    match = _LAYER.fullmatch(name)
    if match:
        top, layer, rest = _TOP_LEVEL.index("decoder.layers."), int(match.group(1)), match.group(2)
        for index, prefix in enumerate(_IN_LAYER):
            if rest.startswith(prefix) and rest[len(prefix) :] in _LEAVES:
                return (top, layer, index, _LEAVES.index(rest[len(prefix) :]))
    else:
        for top, prefix in enumerate(_TOP_LEVEL):
            if name.startswith(prefix) and name[len(prefix) :] in _LEAVES:
                return (top, 0, 0, _LEAVES.index(name[len(prefix) :]))
    raise UnmappableLayout(
        f"megatron-core's registration order of parameter {name} is not known here "
        "(only a GPT's dense layers of its local spec)"
    )


def registration_order(names: Sequence[str]) -> List[str]:
    """``names`` (a model chunk's parameter names, local layer numbers) in the order
    megatron-core's GPT registers them; :class:`UnmappableLayout` for a name it does not know."""
    return sorted(names, key=_order_key)


def bucket_key(mp_index: int, gbuf_index: int, dtypes, bucket_index: int, name: str) -> str:
    """The checkpoint key of one state tensor of one bucket (``dtypes``: (param, grad) dtype)."""
    return (
        f"{PREFIX}dp_group_idx_{mp_index}.gbuf_idx_{gbuf_index}.dtype_{tuple(dtypes)}"
        f".bucket_idx_{bucket_index}.{name}"
    )


def object_key(mp_index: int, name: str) -> str:
    """The key of a per-model-parallel-rank object (``optimizer``, ``per_bucket_numel``...)."""
    return f"{PREFIX}dp_group_idx_{mp_index}.{name}"


def holds_dp_reshardable(keys) -> bool:
    """Whether a checkpoint's keys hold megatron-core's dp_reshardable optimizer state."""
    return any(k.startswith(PREFIX) and ".gbuf_idx_" in k for k in keys)


def read_object(directory: str, metadata, key: str):
    """The object saved under ``<key>/shard_0_1`` (megatron-core's ShardedObject of shape (1,)),
    read as every saved object is (:func:`.safe_objects.load_object`); None when the checkpoint does
    not hold it."""
    fqn = f"{key}/shard_0_1"
    for index, info in metadata.storage_data.items():
        if index.fqn != fqn:
            continue
        if getattr(info, "transform_descriptors", None):
            raise UnmappableLayout(f"{fqn} is stored with transforms this code base cannot read")
        with open(os.path.join(directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        return load_object(io.BytesIO(data), fqn)
    return None


# ---------------------------------------------------------------------------------- a model's
@dataclass
class MegatronCoreBuffer:
    """One of megatron-core's grad buffers for a model chunk of this run."""

    dtypes: Tuple[torch.dtype, torch.dtype]
    """(param dtype, grad dtype)."""
    buckets: List[BucketLayout]
    params: Dict[str, torch.nn.Parameter]
    """The buffer's parameters by name."""

    def numel_unpadded(self) -> List[int]:
        return [bucket.numel_unpadded for bucket in self.buckets]


def megatron_core_buffers(
    chunks: Sequence[Tuple[torch.nn.Module, Optional[int]]],
    dtypes_of,
    dp_size: int,
) -> List[MegatronCoreBuffer]:
    """The grad buffers megatron-core's DDP would build for these model chunks (each with the
    bucket size it would use: None for one bucket), in its gbuf order: chunk by chunk, within a
    chunk one buffer per (param dtype, grad dtype) = ``dtypes_of(param)`` in order of first
    appearance. Expert parameters (megatron-core's second optimizer) are refused."""
    out = []
    for module, bucket_size in chunks:
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        groups: Dict[Tuple[torch.dtype, torch.dtype], List[str]] = {}
        for name in registration_order(list(named)):
            if not getattr(named[name], "allreduce", True):
                raise UnmappableLayout(f"{name} is an expert parameter (MoE)")
            groups.setdefault(tuple(dtypes_of(named[name])), []).append(name)
        for dtypes, names in groups.items():
            own = [n for n in names if getattr(named[n], "shared_embedding", False)]
            buckets = buffer_layout(
                [(n, named[n].numel()) for n in names], dp_size, bucket_size, own_bucket=own
            )
            out.append(MegatronCoreBuffer(dtypes, buckets, {n: named[n] for n in names}))
    return out


def numel_summary(per_buffer) -> List[Tuple[Tuple[str, str], List[int]]]:
    """``per_bucket_numel_unpadded`` (megatron-core's list of ``{(dtype, dtype): [numel]}``) as
    comparable ``[((dtype name, dtype name), [numel per bucket])]``."""
    out = []
    for entry in per_buffer:
        for dtypes, numels in entry.items():
            out.append((tuple(str(d) for d in dtypes), [int(n) for n in numels]))
    return out


class BucketStateLoad:
    """Targets for the flat per-bucket state of ``buffers`` (megatron-core's keys of
    model-parallel rank ``mp_index``) and, once loaded, each parameter's piece of it."""

    def __init__(self, buffers: Sequence[MegatronCoreBuffer], mp_index: int, names, reads: bool):
        self.buffers = list(buffers)
        self.names = tuple(names)
        self.targets = {}
        self._flats: Dict[Tuple[int, int, str], torch.Tensor] = {}
        if not reads:
            return
        for g, buffer in enumerate(self.buffers):
            for b, bucket in enumerate(buffer.buckets):
                for name in self.names:
                    flat = torch.zeros(
                        bucket.numel_unpadded,
                        dtype=torch.float32,
                        device="cpu",  # host: staging for loaded values
                    )
                    self._flats[(g, b, name)] = flat
                    entry = replicated(bucket_key(mp_index, g, buffer.dtypes, b, name), flat)
                    self.targets[entry.name] = entry

    def values(self) -> Dict[Tuple[int, str], torch.Tensor]:
        """``{(id(param), name): the parameter's loaded state, shaped like it}``."""
        out = {}
        for (g, b, name), flat in self._flats.items():
            buffer = self.buffers[g]
            for slot in buffer.buckets[b].params:
                param = buffer.params[slot.name]
                out[(id(param), name)] = flat[slot.start : slot.end].view(param.shape)
        return out


def bucket_state_entries(
    buffers: Sequence[MegatronCoreBuffer],
    mp_index: int,
    by_param: Dict[Tuple[int, str], torch.Tensor],
    names: Sequence[str],
) -> Dict[str, ShardedTensor]:
    """The flat per-bucket tensors megatron-core's dp_reshardable type holds, whole (one rank
    writes them; padding between parameters is zeros), from each parameter's state
    ``by_param[(id(param), name)]``."""
    out = {}
    for g, buffer in enumerate(buffers):
        for b, bucket in enumerate(buffer.buckets):
            for name in names:
                flat = torch.zeros(
                    bucket.numel_unpadded,
                    dtype=torch.float32,
                    device="cpu",  # host: staging for the checkpoint
                )
                for slot in bucket.params:
                    value = by_param[(id(buffer.params[slot.name]), name)]
                    flat[slot.start : slot.end].copy_(value.reshape(-1))
                entry = replicated(bucket_key(mp_index, g, buffer.dtypes, b, name), flat)
                out[entry.name] = entry
    return out


def layout_objects(
    buffers: Sequence[MegatronCoreBuffer], mp_index: int, replica: bool
) -> Dict[str, ShardedObject]:
    """megatron-core's ``per_bucket_numel`` (padded at the DP size the buffers were laid out
    for) and ``per_bucket_numel_unpadded`` objects of model-parallel rank ``mp_index``."""
    padded = [{b.dtypes: [k.numel for k in b.buckets]} for b in buffers]
    unpadded = [{b.dtypes: b.numel_unpadded()} for b in buffers]
    out = {}
    for name, value in (("per_bucket_numel", padded), ("per_bucket_numel_unpadded", unpadded)):
        entry = ShardedObject(object_key(mp_index, name), value, (1,), (0,), replica=replica)
        out[entry.name] = entry
    return out
