"""Model families: everything the trainer, the tools and the dry run need to know about a kind
of model, in one :class:`TrainSpec` per family.

The training loop never names a model. A pretrain script names its family's spec and hands its
parts to ``pretrain(...)``: the model builder, the forward step with its loss, the datasets, and
(``model_family=``) the FLOPs of an iteration (``--log-throughput``), the parameter count and
activations of the theoretical memory report and the dry run, the flags a checkpoint must share
with the run that loads it, the argument defaults of the script, the flags only this model reads
and the converter of its checkpoints.

Each family is one package of this one, ``<name>/``, whose ``__init__`` defines ``SPEC`` from its
modules (``model.py``, ``step.py``, ``data.py``, ``cost.py``); ``get_model_family("gpt")`` finds
GPT's. A new model adds its package (or passes a spec of its own to ``pretrain``) and edits no
loop. What several families share lives beside them: :mod:`.losses`, :mod:`.masked_lm`.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.core.enums import ModelType


def _no_checks(args) -> None:
    return None


@dataclass(frozen=True)
class TrainSpec:
    """One model family: its Megatron entry points (the signatures Megatron's pretrain scripts
    define) and the model-specific hooks of the trainer, the dry run, the memory report and the
    checkpoint converter."""

    name: str
    """Short name: the package ``megatron/training/model_families/<name>/``; its script is
    ``pretrain_<name>.py``."""
    model_type: ModelType
    """What ``pretrain`` gets as ``model_type``."""
    args_defaults: Mapping[str, Any]
    """Defaults the pretrain script passes to ``pretrain`` (applied where a flag is unset)."""
    model_provider: Callable[..., Any]
    """Megatron's ``model_provider(pre_process=True, post_process=True, vp_stage=None)``: this
    rank's model chunk, built from the flags."""
    forward_step: Callable[..., Any]
    """Megatron's ``forward_step(data_iterator, model) -> (output, loss_func)``."""
    train_valid_test_datasets_provider: Callable[..., Any]
    """Megatron's ``(train_val_test_num_samples) -> (train, valid, test)`` datasets."""
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
    reads_flags: Tuple[str, ...] = ()
    """Dests of the model-specific flags this family reads. Every family refuses a flag that only
    other known families read when it is given away from its default (see :meth:`check_args`)."""
    check_own_args: Callable[[Any], None] = _no_checks
    """(validated args) -> None, or ArgumentValidationError naming what this model cannot honour
    (a parallelism it refuses, a flag it needs); run after the model-specific flags' check."""
    checkpoint_converter: Optional[str] = None
    """How ``tools/checkpoint/convert.py --model-type <NAME>`` (the name in capitals) converts
    this family's checkpoints: ``"plugins"`` (the loader/saver plugins over the queue), or the
    name of a module of tools/checkpoint with ``add_arguments(parser)`` and ``convert(args)``;
    None: not converted there."""

    def check_args(self, args) -> None:
        """ArgumentValidationError for a flag only other families read (the first one given, in
        the order of :func:`model_specific_flags`), then the family's own checks; run by
        ``pretrain`` and the dry run on validated args."""
        refuse_other_models_flags(args, self)
        self.check_own_args(args)


ModelFamily = TrainSpec  # the name before the spec carried the entry points


def model_family_names() -> List[str]:
    """The families of this package, e.g. ['bert', 'gpt', 't5'] (packages are not imported)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if info.ispkg)


def get_model_family(name: str) -> TrainSpec:
    """The spec defined by ``model_families/<name>/``; ValueError naming the known ones."""
    if name not in model_family_names():
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(model_family_names())}")
    spec = importlib.import_module(f"{__name__}.{name}").SPEC
    if not isinstance(spec, TrainSpec) or spec.name != name:
        raise ValueError(f"{__name__}.{name}.SPEC is not the TrainSpec {name!r}")
    return spec


def model_specific_flags() -> Dict[str, Tuple[str, ...]]:
    """{dest: the known families reading it} of every family's ``reads_flags``, in the order
    the families (by name) list them."""
    readers: Dict[str, Tuple[str, ...]] = {}
    for name in model_family_names():
        for dest in get_model_family(name).reads_flags:
            readers[dest] = readers.get(dest, ()) + (name,)
    return readers


def refuse_other_models_flags(args, family: TrainSpec) -> None:
    """ArgumentValidationError for the first model-specific flag given (away from Megatron's
    default) that ``family`` does not read."""
    from megatron.training.flag_errors import ArgumentValidationError
    from megatron.training.flag_policy import megatron_actions

    actions = megatron_actions()
    for dest, families in model_specific_flags().items():
        if dest in family.reads_flags or not hasattr(args, dest):
            continue
        if getattr(args, dest) != actions[dest].default:
            scripts = " / ".join(f"pretrain_{name}.py" for name in families)
            raise ArgumentValidationError(
                f"{actions[dest].option_strings[0]} is read by {scripts} only; the "
                f"{family.name} model would ignore it"
            )
