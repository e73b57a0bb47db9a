"""Megatron-LM's ``fsdp_dtensor`` checkpoint layout: its key names, DCP's flattening of the
non-tensor state, and the offline conversion of a ``torch_dist`` checkpoint into it (Megatron-LM's
``tools/checkpoint/checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor``).

The layout (see megatron/training/checkpointing_fsdp_dtensor.py, which writes and reads it in
training): one bare torch.distributed.checkpoint directory per iteration whose keys are
``model.module.<param>`` (one key per layer and per expert, global indices),
``optimizer.state.module.module.module.<param>.<exp_avg|exp_avg_sq>``, plain objects (``args``,
``iteration``, ``checkpoint_version``, ``num_floating_point_operations_so_far``,
``opt_param_scheduler.<field>``, ``optimizer.<...>`` hyperparameters) and
``rng_state.(<pp>, <tp>).<i>.<field>``.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, Mapping

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from .errors import ConversionError
from .layout import FSDP_DTENSOR_MODEL_PREFIX, TRACKER_FILENAME

MODEL_PREFIX = FSDP_DTENSOR_MODEL_PREFIX
# Megatron-LM's converter default (--output-optimizer-state-prefix): the optimizer names its
# parameters by the wrapped model's (adapter, MegatronFSDP, Float16Module) named_parameters.
OPTIMIZER_STATE_PREFIX = "optimizer.state.module.module.module."
RNG_PREFIX = "rng_state"
# torch_dist's optimizer state: optimizer.state.<name>.<param key>; the fp32 main weights.
TORCH_DIST_STATE_PREFIX = "optimizer.state."
MASTER_NAMES = ("param", "fp32_param")
# The per-parameter tensors (and Megatron-LM's per-parameter group copies) and the RNG states;
# the rest (args, iteration, scheduler, the optimizer's groups and step) is common to all ranks.
NOT_COMMON = (MODEL_PREFIX, OPTIMIZER_STATE_PREFIX, "optimizer.param_to_group_meta.", "rng_state.")


def model_key(key: str) -> str:
    return MODEL_PREFIX + key


def optimizer_state_key(name: str, key: str) -> str:
    return f"{OPTIMIZER_STATE_PREFIX}{key}.{name}"


def rng_prefix(pp_rank: int, tp_rank: int) -> str:
    # Megatron-LM's get_rng_state for fsdp_dtensor: {f"({pp_rank}, {tp_rank})": [states]}.
    return f"{RNG_PREFIX}.({pp_rank}, {tp_rank})"


def split_state_key(key: str):
    """``optimizer.state.<name>.<param key>`` (torch_dist's) -> (name, param key)."""
    name, param_key = key[len(TORCH_DIST_STATE_PREFIX) :].split(".", 1)
    return name, param_key


# ------------------------------------------------------------------ DCP's flattening of a dict
def _is_leaf(value) -> bool:
    """torch.distributed.checkpoint's rule (``_traverse.traverse_state_dict``): a mapping is
    always traversed; a list only when it holds tensors or traversed containers."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(
        torch.is_tensor(v) or (isinstance(v, (Mapping, list)) and not _is_leaf(v)) for v in value
    )


def flatten(prefix: str, value, out: dict) -> dict:
    """``out`` with the leaves of ``value`` under DCP's dotted keys below ``prefix``."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            flatten(f"{prefix}.{k}", v, out)
    elif not _is_leaf(value):
        for i, v in enumerate(value):
            flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value
    return out


def unflatten(flat: Dict[str, object], prefix: str):
    """The inverse of :func:`flatten` for the keys below ``prefix`` (dicts whose keys are
    0..n-1 were lists)."""
    root: dict = {}
    for key, value in flat.items():
        if key == prefix:
            return value
        parts = key[len(prefix) + 1 :].split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node) and sorted(map(int, node)) == list(range(len(node))):
        return [node[str(i)] for i in range(len(node))]
    return node


def under(prefix: str):
    return lambda key: key == prefix or key.startswith(prefix + ".")


def object_entries(flat: Dict[str, object], replica: bool) -> dict:
    """Entries writing ``flat``'s leaves: tensors whole, other values as plain objects."""
    from megatron.core import dist_checkpointing as dc

    out = {}
    for key, value in flat.items():
        if torch.is_tensor(value):
            out[key] = dc.replicated(key, value.detach().cpu(), replica)
        else:
            out[key] = dc.PlainObject(key, value, replica)
    return out


def requests(metadata, wanted) -> dict:
    """Entries reading back every checkpoint item whose key ``wanted(key)`` accepts, whole."""
    from megatron.core import dist_checkpointing as dc

    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if not wanted(key):
            continue
        if isinstance(item, BytesStorageMetadata):
            out[key] = dc.PlainObject(key, None, read_back=True)
        else:
            # host: the whole tensor is read into a CPU buffer, then each rank takes its part
            shape, dtype = tuple(item.size), item.properties.dtype
            empty = torch.empty(shape, dtype=dtype, device="cpu")  # host: read whole, then split
            out[key] = dc.replicated(key, empty)
    return out


def values(entries: dict) -> dict:
    return {k: e.data for k, e in entries.items()}


def common_state(flat: Dict[str, object]) -> dict:
    """The top-level entries (``args``, ``optimizer``, ...) of flattened common items."""
    names = {k.split(".", 1)[0] for k in flat}
    return {
        name: unflatten({k: v for k, v in flat.items() if under(name)(k)}, name) for name in names
    }


# ------------------------------------------------------------------ torch_dist -> fsdp_dtensor
def convert_torch_dist_to_fsdp_dtensor(input_dir: str, output_dir: str, optimizer: bool = True):
    """Write the torch_dist checkpoint ``input_dir`` (an ``iter_XXXXXXX`` directory) as the
    fsdp_dtensor checkpoint ``output_dir`` (one process, CPU). Layers and experts are unstacked
    (``megatron_layout.unstack``), the fp32 main weights become the model weights, the RNG state
    objects become Megatron-LM's ``rng_state.(pp, tp)`` items. When ``output_dir`` is named
    ``iter_XXXXXXX`` the tracker next to it is written too (Megatron-LM's tool leaves that to
    the user)."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import dp_reshardable as dpr
    from megatron.core.dist_checkpointing.megatron_layout import unstack

    try:
        dc.check_complete(input_dir)
        common = dc.load_common(input_dir, safe_globals=[argparse.Namespace])
        metadata = dc.read_dcp_metadata(input_dir)
    except dc.CheckpointingError as exc:
        raise ConversionError(str(exc)) from None
    keys = set(metadata.state_dict_metadata)
    if optimizer and dpr.holds_dp_reshardable(keys):
        raise ConversionError(
            f"{input_dir} holds the distributed optimizer's state in megatron-core's "
            "dp_reshardable layout (flat buckets of the run that saved it): save it with "
            "--dist-ckpt-optim-fully-reshardable, or convert the model only (--no-optimizer)"
        )
    tensors = requests(
        metadata,
        lambda k: (
            not k.endswith("_extra_state")
            and not isinstance(metadata.state_dict_metadata[k], BytesStorageMetadata)
            and (optimizer or not k.startswith("optimizer."))
        ),
    )
    rng = {
        k: dc.ShardedObject(RNG_PREFIX, None, grid, offset, read_back=True)
        for k, grid, offset in _rng_objects(keys)
    }
    try:
        dc.load_shards({**tensors, **rng}, input_dir)
    except dc.CheckpointingError as exc:
        raise ConversionError(str(exc)) from None

    by_name: Dict[str, Dict[str, torch.Tensor]] = {}
    model = {}
    for key, entry in tensors.items():
        if key.startswith(TORCH_DIST_STATE_PREFIX):
            name, param_key = split_state_key(key)
            by_name.setdefault(name, {})[param_key] = entry.data
        elif not key.startswith("optimizer."):
            model[key] = entry.data
    out = {model_key(k): v for k, v in unstack(model).items()}
    for name, state in by_name.items():
        for key, value in unstack(state).items():
            if name in MASTER_NAMES:  # Megatron-FSDP's model weights are the fp32 main weights
                out[model_key(key)] = value
            else:
                out[optimizer_state_key(name, key)] = value
    flat: dict = {}
    for name in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far"):
        if name in common:
            flatten(name, common[name], flat)
    if optimizer:
        for name in ("optimizer", "opt_param_scheduler"):
            if name in common:
                flatten(name, common[name], flat)
    for entry in rng.values():
        if entry.data is not None:
            flatten(rng_prefix(*entry.global_offset), entry.data, flat)
    entries = {k: dc.replicated(k, v.contiguous()) for k, v in out.items()}
    entries.update(object_entries(flat, replica=False))
    try:
        dc.save_shards(entries, output_dir)
    except dc.CheckpointingError as exc:
        raise ConversionError(str(exc)) from None
    parent, name = os.path.split(os.path.abspath(output_dir))
    if name.startswith("iter_") and name[len("iter_") :].isdigit():
        with open(os.path.join(parent, TRACKER_FILENAME), "w") as f:
            f.write(str(int(name[len("iter_") :])))
    return sorted(entries)


def _rng_objects(keys):
    """(key, grid, offset) of torch_dist's ``rng_state/shard_<pp>.<tp>_<PP>.<TP>`` objects."""
    out = []
    for key in keys:
        head, sep, shard = key.partition("/shard_")
        if head != RNG_PREFIX or not sep:
            continue
        offset, _, grid = shard.partition("_")
        out.append(
            (key, tuple(int(v) for v in grid.split(".")), tuple(int(v) for v in offset.split(".")))
        )
    return out
