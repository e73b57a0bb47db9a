"""Module specs: a model's parts described as data, so that a model family chooses its layers
(which attention, which MLP, which norms) without editing the code that assembles them.

A :class:`ModuleSpec` names what to build (``module``: a class or a function returning a
module, or a ``(module path, name)`` pair to import), keyword arguments the spec fixes
(``params``) and, for a composite module, the specs of its parts (``submodules``: a dataclass
such as ``TransformerLayerSubmodules``, handed to the module as ``submodules=``).
:func:`build_module` builds one, adding the arguments only the caller knows (config, layer
number, process groups).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Tuple, Union

import torch


@dataclass
class ModuleSpec:
    """What to build and with which fixed arguments (Megatron Core's ``ModuleSpec``)."""

    module: Union[Callable[..., torch.nn.Module], Tuple[str, str]]
    """A module class (or a function returning a module), or ``(module path, name)``."""
    params: dict = field(default_factory=dict)
    """Keyword arguments fixed by the spec, e.g. ``{"attn_mask_type": AttnMaskType.causal}``."""
    submodules: Any = None
    """Specs of the module's parts (a dataclass), passed as ``submodules=`` when not None."""


class IdentityOp(torch.nn.Module):
    """A slot left empty: returns its first input unchanged (e.g. a layer without an input norm).
    Accepts and ignores whatever arguments the slot's module would be built with."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


def import_module(module_path: Tuple[str, str]) -> Any:
    """The object ``name`` of the Python module ``path`` for ``(path, name)``; ImportError with a
    message naming both when either does not exist."""
    if not isinstance(module_path, (tuple, list)) or len(module_path) != 2:
        raise ImportError(f"a module path is (module, name), got {module_path!r}")
    path, name = module_path
    try:
        module = importlib.import_module(path)
    except ImportError as exc:
        raise ImportError(f"cannot import module {path!r}: {exc}") from None
    if not hasattr(module, name):
        raise ImportError(f"module {path!r} has no {name!r}")
    return getattr(module, name)


def import_spec(module_path: Tuple[str, str]):
    """The spec ``(module path, name)`` names (``--spec <module> <name>``): a ModuleSpec (or a
    block's per-layer specs), or a function returning one when called without arguments, like
    ``get_gpt_layer_local_spec``. ImportError / TypeError with a message naming it otherwise."""
    found = import_module(module_path)
    spec = found() if callable(found) and not isinstance(found, type) else found
    if not isinstance(spec, ModuleSpec) and not hasattr(spec, "layer_specs"):
        raise TypeError(
            f"{module_path[0]}.{module_path[1]} is not a layer spec: expected a ModuleSpec, "
            f"a TransformerBlockSubmodules or a function returning one, got {type(spec).__name__}"
        )
    return spec


def build_module(
    spec_or_module: Union[ModuleSpec, Callable[..., torch.nn.Module]], *args, **kwargs
):
    """Build the module a spec describes: ``module(*args, **params, **kwargs)`` (plus
    ``submodules=``). A bare class or function is called with ``args`` and ``kwargs`` only.

    A keyword given both by the spec and by the caller is an error (TypeError naming it), so a
    spec can never silently override what the model passes, nor be overridden.
    """
    if isinstance(spec_or_module, ModuleSpec):
        spec = spec_or_module
        target = spec.module
        if isinstance(target, (tuple, list)):
            target = import_module(target)
        clash = sorted(set(spec.params) & set(kwargs))
        if clash:
            raise TypeError(
                f"building {getattr(target, '__name__', target)}: {clash} given both by the "
                "spec's params and by the caller"
            )
        kwargs = {**spec.params, **kwargs}
        if spec.submodules is not None:
            kwargs["submodules"] = spec.submodules
    else:
        target = spec_or_module
    if not callable(target):
        raise TypeError(f"a module spec must name a class or a function, got {target!r}")
    return target(*args, **kwargs)
