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
    activation_components: Callable[..., Dict[str, float]]
    """(validated args, micro-batches, pipeline rank, layers on that rank, device_type=) ->
    activation bytes held at the peak, by component (``device_type`` decides the attention path
    of ``--attention-backend auto``)."""
    checkpoint_model_args: Tuple[str, ...]
    """Flags whose values a checkpoint must share with the run loading it (the model's shape)."""
    check_args: Callable[[Any], None] = lambda args: None
    """(validated args) -> None, or ArgumentValidationError naming the flags this model cannot
    honour (another model's flags, a parallelism it refuses); run by pretrain and the dry run."""


# Flags only some pretrain scripts read: a script that does not read one refuses it when given.
MODEL_SPECIFIC_FLAGS = {
    "bert_binary_head": ("--bert-no-binary-head", ("bert",)),
    "mask_prob": ("--mask-prob", ("bert", "t5")),
    "short_seq_prob": ("--short-seq-prob", ("bert", "t5")),
    "decoder_num_layers": ("--decoder-num-layers", ("t5",)),
    "decoder_seq_length": ("--decoder-seq-length", ("t5",)),
}


def refuse_other_models_flags(args, family_name: str) -> None:
    """ArgumentValidationError for the first flag of MODEL_SPECIFIC_FLAGS given (away from
    Megatron's default) that the ``family_name`` model does not read."""
    from megatron.training.flag_errors import ArgumentValidationError
    from megatron.training.flag_policy import megatron_actions

    actions = megatron_actions()
    for dest, (flag, families) in MODEL_SPECIFIC_FLAGS.items():
        if family_name in families or not hasattr(args, dest):
            continue
        if getattr(args, dest) != actions[dest].default:
            scripts = " / ".join(f"pretrain_{name}.py" for name in families)
            raise ArgumentValidationError(
                f"{flag} is read by {scripts} only; the {family_name} model would ignore it"
            )


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
