"""Distributed (``torch_dist``) checkpoints: sharded state dicts saved and loaded through
torch.distributed.checkpoint, readable at any parallel layout.

* :mod:`.mapping` -- :class:`ShardedTensor`: a rank's pieces of one global tensor;
* :mod:`.model_state` -- a model chunk's entries under global names (PP offsets, TP shards);
* :mod:`.optimizer_state` -- optimizer state keyed and sharded like the parameters;
* :mod:`.serialization` -- megatron-core's ``save`` / ``load`` of a (model's) sharded state
  dict, over ``save_shards`` / ``load_shards`` (the trainer's: explicit process group and
  strictness, in-place loading) and the checks of the checkpoint directory;
* :mod:`.async_save` -- writing in a background thread.
"""

from .mapping import (
    Chunk,
    PlainObject,
    ShardedObject,
    ShardedTensor,
    replicated,
    tensor_parallel_sharded,
)
from .model_state import model_sharded_state_dict, spread_writes
from .optimizer_state import (
    OptimizerLoad,
    UnreadableOptimizerState,
    content_metadata,
    is_layer_wise,
    optimizer_common_state,
    optimizer_sharded_state_dict,
)

# The serialization names load on first use (PEP 562): serialization imports
# torch.distributed.checkpoint and DTensor (with sympy), about a second of start-up for every
# process, which a run that reads and writes no torch_dist checkpoint never needs.
_SERIALIZATION_NAMES = frozenset(
    (
        "COMMON_FILE",
        "METADATA_FILE",
        "CheckpointingError",
        "LoadResult",
        "StrictHandling",
        "check_complete",
        "is_distributed_checkpoint",
        "load",
        "load_common",
        "load_shards",
        "read_dcp_metadata",
        "save",
        "save_common",
        "save_shards",
        "tensor_shapes",
        "write_metadata_json",
    )
)


def __getattr__(name):
    if name in _SERIALIZATION_NAMES:
        from . import serialization

        return getattr(serialization, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Chunk",
    "PlainObject",
    "ShardedObject",
    "ShardedTensor",
    "replicated",
    "tensor_parallel_sharded",
    "model_sharded_state_dict",
    "spread_writes",
    "OptimizerLoad",
    "UnreadableOptimizerState",
    "content_metadata",
    "is_layer_wise",
    "optimizer_common_state",
    "optimizer_sharded_state_dict",
    *sorted(_SERIALIZATION_NAMES),
]
