"""Our ``torch_dist`` checkpoints read offline, on one process, as full tensors by global name.

A ``torch_dist`` directory (``iter_XXXXXXX/`` with ``metadata.json``, DCP's ``.metadata``,
``__<rank>_0.distcp`` and ``common.pt``) already stores every model tensor under its global name
as chunks of the global tensor, so no TP/PP merge is needed: each tensor is read whole into a
buffer allocated from the ``.metadata`` shape. Reading goes through
``megatron.core.dist_checkpointing.load_shards`` (its ``.metadata`` unpickler only admits DCP's
metadata classes; ``common.pt`` is read with ``weights_only=True``); optimizer entries are never
read.
The reader has the same interface as :class:`.torch_format.TorchCheckpointReader`.
"""

from __future__ import annotations

import argparse
from typing import List

import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.megatron_layout import unstack

from .errors import ConversionError
from .layout import find_iteration_dir


class DistCheckpointReader:
    """Every model tensor of one torch_dist checkpoint, loaded full-size into CPU memory."""

    def __init__(self, load_dir: str):
        self.iteration_dir, self.iteration, self.release = find_iteration_dir(load_dir)
        d = self.iteration_dir
        try:
            dc.check_complete(d)
            common = dc.load_common(d, safe_globals=[argparse.Namespace])
            shapes = dc.tensor_shapes(dc.read_dcp_metadata(d))
        except dc.CheckpointingError as exc:
            raise ConversionError(str(exc)) from None
        self.args = common.get("args")
        if self.args is None:
            raise ConversionError(
                f"{d}/{dc.COMMON_FILE} holds no 'args'; cannot tell the model shape"
            )
        self.checkpoint_iteration = common.get("iteration", self.iteration)
        # The layout it was trained at (informational only: the tensors are layout-free).
        self.tp = getattr(self.args, "tensor_model_parallel_size", 1) or 1
        self.pp = getattr(self.args, "pipeline_model_parallel_size", 1) or 1
        entries = {}
        for key, (shape, dtype) in shapes.items():
            if key.startswith("optimizer.") or key.endswith("_extra_state"):
                continue
            buffer = torch.empty(shape, dtype=dtype, device="cpu")  # host: an offline converter
            entries[key] = dc.replicated(key, buffer)
        if not entries:
            raise ConversionError(f"{d}: the checkpoint holds no model tensors")
        try:
            dc.load_shards(entries, d)
        except dc.CheckpointingError as exc:
            raise ConversionError(str(exc)) from None
        # Megatron's layout (stacked layers, TE norm names) back to one tensor per layer.
        self._tensors = unstack({k: e.data for k, e in entries.items()})

    def names(self) -> List[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ConversionError(f"{self.iteration_dir}: no tensor '{name}' in the checkpoint")
        return self._tensors[name]
