"""Model families: what the trainer needs to know about a kind of model besides its provider.

The training loop never names a model. Its model-specific figures come from the
:class:`ModelFamily` the pretrain script hands to ``pretrain(..., model_family=...)``: the FLOPs
of an iteration (``--log-throughput``), the parameter count and activations of the theoretical
memory report and the dry run, the flags a checkpoint must share with the run that loads it, and
the argument defaults of the pretrain script (also used by the dry run).

Each family is one module of this package, ``<name>.py``, defining ``MODEL_FAMILY``; a new model
adds its module here and edits no loop. ``get_model_family("gpt")`` finds GPT's.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple


@dataclass(frozen=True)
class ModelFamily:
    """The model-specific hooks of the trainer, the dry run and the memory report."""

    name: str
    """Short name: the module ``megatron/training/model_families/<name>.py``."""
    args_defaults: Mapping[str, Any]
    """Defaults the pretrain script passes to ``pretrain`` (applied where a flag is unset)."""
    num_floating_point_operations: Callable[[Any, int], float]
    """(validated args, samples in the iteration) -> FLOPs of forward and backward."""
    count_parameters: Callable[[Any, Optional[int]], Any]
    """(validated args, padded vocab size or None) -> a ``theoretical_memory.ParameterCount``."""
    activation_components: Callable[[Any, int, int, int], Dict[str, float]]
    """(validated args, micro-batches, pipeline rank, layers on that rank) -> activation bytes
    held at the peak, by component."""
    checkpoint_model_args: Tuple[str, ...]
    """Flags whose values a checkpoint must share with the run loading it (the model's shape)."""


def model_family_names() -> List[str]:
    """The families of this package, e.g. ['gpt']."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.ispkg)


def get_model_family(name: str) -> ModelFamily:
    """The family defined by ``model_families/<name>.py``; ValueError naming the known ones."""
    if name not in model_family_names():
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(model_family_names())}")
    family = importlib.import_module(f"{__name__}.{name}").MODEL_FAMILY
    if not isinstance(family, ModelFamily) or family.name != name:
        raise ValueError(f"{__name__}.{name}.MODEL_FAMILY is not the ModelFamily {name!r}")
    return family
